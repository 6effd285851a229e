"""Block manager: allocation and reference counts, prefix caching over full blocks, eviction."""

import numpy as np
import pytest

from r3srv.engine.block_manager import BlockManager
from r3srv.engine.sequence import Sequence
from r3srv.lora.manager import LoraRef
from r3srv.sampling_params import SamplingParams
from r3srv.vision.inputs import ImageInput, MultiModalPrompt
from r3srv.vision.positions import ImageSpan, mrope_positions

BS = 4


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), max_tokens=8, generator=None)


def compute(bm: BlockManager, seq: Sequence, upto: int | None = None) -> None:
    """Pretend a step computed the sequence's tokens up to `upto` (all but the last by default)."""
    upto = seq.num_tokens if upto is None else upto
    bm.grow(seq, upto)
    seq.num_computed_tokens = upto
    bm.commit_full_blocks(seq)


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seqs = [make_seq(list(range(10 * i, 10 * i + 9))) for i in range(2)]
    for s in seqs:
        bm.admit(s, bm.match_prefix(s.token_ids))
        compute(bm, s)
        assert len(s.block_table) == 3  # 9 tokens in blocks of 4
    assert bm.num_used_blocks == 6 and bm.num_free_blocks == 2
    assert not bm.can_grow(seqs[0], 9 + 3 * BS)
    for s in seqs:
        bm.free(s)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8


def test_prefix_hit_shares_full_blocks_and_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(8)))  # exactly two full blocks
    bm.admit(a, [])
    compute(bm, a)
    b = make_seq(list(range(8)))
    hits = bm.match_prefix(b.token_ids)
    # Two full blocks are cached, but the last token must be recomputed for its logits.
    assert hits == a.block_table[:1]
    c = make_seq(list(range(9)))
    assert bm.match_prefix(c.token_ids) == a.block_table[:2]
    bm.admit(c, bm.match_prefix(c.token_ids))
    assert c.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_cache_hits == 8 and bm.prefix_cache_queries == 8 + 9  # a looked up too


def test_freed_blocks_stay_cached_until_reallocated():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq(list(range(9)))
    bm.admit(a, [])
    compute(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 3
    b = make_seq(list(range(9)))
    assert bm.match_prefix(b.token_ids) == table[:2]  # still cached after free
    # A different sequence takes all three blocks: the cached ones are evicted.
    other = make_seq([100 + t for t in range(9)])
    bm.admit(other, [])
    compute(bm, other)
    assert bm.match_prefix(b.token_ids) == []


def test_prefix_differing_in_an_earlier_block_misses():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(list(range(9)))
    bm.admit(a, [])
    compute(bm, a)
    # Same second block, different first block: the chain hash differs.
    b = make_seq([99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.match_prefix(b.token_ids) == []


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    bm.admit(a, [])
    compute(bm, a)
    assert bm.match_prefix(list(range(9))) == []


def test_admission_cost_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(list(range(9)))
    bm.admit(a, [])
    compute(bm, a)
    bm.free(a)
    b = make_seq(list(range(13)))
    hits = bm.match_prefix(b.token_ids)
    assert len(hits) == 2
    # two cached-but-free blocks come back from the free pool, plus two fresh ones for tokens 8..12
    assert bm.admission_cost(b, hits, 13) == 4


def test_grow_beyond_the_pool_raises():
    bm = BlockManager(num_blocks=2, block_size=BS)
    s = make_seq(list(range(5)))
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(s, 12)


def _colliding_chunk(chunk: tuple[int, ...]) -> tuple[int, ...]:
    """Another chunk whose Python tuple hash equals `chunk`'s (CPython's xxHash-style tuplehash,
    whose steps are invertible mod 2**64): anyone can craft such token ids."""
    p1, p2, p5, mask = 11400714785074694791, 14029467366897019727, 2870177450012600261, (1 << 64) - 1

    def acc_after(items) -> int:
        acc = p5
        for x in items:
            acc = (acc + hash(x) * p2) & mask
            acc = ((acc << 31) | (acc >> 33)) & mask
            acc = (acc * p1) & mask
        return acc

    head, last = chunk[:-1], chunk[-1]
    for bump in range(1, 1000):
        other_head = (*head[:-1], head[-1] + bump)
        diff = (acc_after(head) - acc_after(other_head)) & mask
        other_last = (last + diff * pow(p2, -1, 1 << 64)) & mask
        if other_last < (1 << 61) - 1:  # an int that hashes to itself
            other = (*other_head, other_last)
            assert other != chunk and hash(other) == hash(chunk)
            return other
    raise AssertionError("no colliding chunk found")


def test_a_hash_collision_in_an_earlier_block_never_shares_a_later_one():
    """The chain hash only finds candidates: a block is reused only when the whole prefix
    before it is the same blocks, so crafted colliding ids cannot read another prompt's KV and rows."""
    bm = BlockManager(num_blocks=8, block_size=BS)
    victim_first = (1, 2, 3, 4)
    attacker_first = _colliding_chunk(victim_first)
    second = [5, 6, 7, 8]
    attacker = make_seq([*attacker_first, *second, 9])
    bm.admit(attacker, bm.match_prefix(attacker.token_ids))
    compute(bm, attacker)
    victim = make_seq([*victim_first, 10])
    bm.admit(victim, bm.match_prefix(victim.token_ids))
    compute(bm, victim)
    # The victim's next prompt extends its first block with the attacker's second chunk.
    hits = bm.match_prefix([*victim_first, *second, 11])
    assert hits == victim.block_table[:1]  # not the attacker's second block, computed after other tokens


def test_a_prefix_computed_twice_in_lockstep_stays_one_reusable_chain():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(list(range(9))), make_seq(list(range(9)))
    for s in (a, b):  # both admitted before either has computed anything: both miss
        bm.admit(s, bm.match_prefix(s.token_ids))
    compute(bm, a, 4)
    compute(bm, b, 8)  # b's second block follows a's registered first block
    compute(bm, a, 8)
    assert a.block_table[:2] != b.block_table[:2]
    hits = bm.match_prefix(list(range(9)))
    assert len(hits) == 2 and hits[0] == a.block_table[0] and hits[1] == b.block_table[1]


def _image_prompt(tokens: list[int], image_hash: str):
    """A prompt whose tokens 4..7 (its second block) are one image's placeholders (a 1x4x4 grid merged 2x2)."""
    span = ImageSpan(start=4, grid=(1, 4, 4))
    positions, delta = mrope_positions(len(tokens), [span], 2)
    return MultiModalPrompt((ImageInput(span, np.zeros((16, 1), np.float32), image_hash),), positions, delta, 2)


def test_image_blocks_are_keyed_by_image_and_adapter_together():
    """A block of image placeholders is shared only by the same image under the same adapter
    (and version): the image keys (Sequence.block_key) and the adapter's extra key
    (Sequence.cache_key) both reach the chain; dropping the adapter drops its image blocks."""
    tokens = [1, 2, 3, 4, 9, 9, 9, 9, 5]
    lora, lora_v2 = LoraRef("a", 1, 1), LoraRef("a", 1, 2)

    def seq(image_hash: str, adapter: LoraRef | None) -> Sequence:
        return Sequence("r", 0, tokens, SamplingParams(), 8, None, _image_prompt(tokens, image_hash), adapter)

    bm = BlockManager(num_blocks=16, block_size=BS)
    first = seq("cat", lora)
    bm.admit(first, bm.match_sequence(first))
    compute(bm, first)
    assert bm.match_sequence(seq("cat", lora)) == first.block_table[:2]
    assert bm.match_sequence(seq("dog", lora)) == first.block_table[:1]  # same ids, another image: block 1 differs
    assert bm.match_sequence(seq("cat", None)) == []  # the base model
    assert bm.match_sequence(seq("cat", lora_v2)) == []  # the adapter replaced
    assert bm.drop_extra_key(lora.cache_key) == 2
    assert bm.match_sequence(seq("cat", lora)) == []
