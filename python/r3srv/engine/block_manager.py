"""Paged KV-cache blocks: allocation, reference counts and prefix caching over full blocks.

A block's slots are `block_id * block_size + offset`. Both the model's KV cache and
the routed-experts row buffer are indexed by slot, so a block that the prefix cache
hands to a new sequence brings its KV *and* its rows; a block's slots are rewritten
only after it is reallocated as a fresh block.

Prefix caching: a full block is found by a chain hash of (previous block's hash, its
token ids), registered once its tokens have been computed. The hash only finds a
candidate: a hit also needs the block's own token ids and its parent (the registered
block, by id and allocation generation, holding the exact prefix before it) to match,
so two prompts share a block only when every token before it is the same, whatever
the hash does (Python's tuple hash is not collision-resistant). Freed blocks keep their
hash and contents and sit in LRU order in the free pool until a fresh allocation
evicts them.

Extra keys: a sequence's first block chains from its `cache_key` (its hash and its recorded
parent): the cache salt (vLLM's cache_salt, SGLang's extra_key) and the LoRA adapter with its
version, so prompts with different salts or adapters, or one with and one without, never share
a block, even on a hash collision. Every registered block remembers the key its chain started
from (`root`), so the blocks of a replaced or unloaded adapter are dropped at once
(`drop_extra_key`).
Images: a block holding image placeholders is keyed by its token ids and each image's content
hash and offset (Sequence.block_key), so equal placeholders of different images never share a
block.

Hybrid models (Gated DeltaNet layers) also hold one fixed-size state per sequence: an
admitted sequence takes a state slot with its blocks and gives it back with them, so a
finished, aborted or preempted sequence frees both in one place. Their KV blocks alone
cannot resume a prefix, so a block serves prefix hits only while it carries a state
snapshot taken right after its last token (engine/state_pool.py): a hit stops at the last
such block, and the admitted sequence restores that snapshot into its slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from r3srv.engine.block_table import BlockTable
from r3srv.engine.sequence import Sequence
from r3srv.engine.state_pool import StatePool


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "generation", "parent", "snapshot", "root")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple = ()  # its key: the token ids (and images) it holds (Sequence.block_key)
        self.generation = 0  # bumped at every fresh allocation: (block_id, generation) names one content
        # (block_id, generation) of the block before it; a first block: its cache salt (or None)
        self.parent: tuple[int, int] | str | None = None
        self.snapshot: int | None = None  # hybrids: state entry holding the states after its last token
        self.root: Hashable = None  # the extra keys its chain started from (the sequence's cache_key)

    @property
    def identity(self) -> tuple[int, int]:
        return (self.block_id, self.generation)


def chain_hash(prev_hash: int | str | None, token_ids: tuple[int, ...]) -> int:
    # Stable within the process (str hashes vary only between processes); crafted collisions
    # are harmless because a hit is verified by token ids and parent identity. A first block
    # chains from its cache salt.
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_state_slots: int = 0,
        num_state_snapshots: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        # hybrids' linear-attention states: a slot per admitted sequence (the scheduler admits
        # at most max_num_seqs, the engine allocates that many) and snapshots for prefix hits
        self.states = StatePool(num_state_slots, num_state_snapshots) if num_state_slots else None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (oldest first); an ordered set with O(1) removal.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found

    # -- accounting ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_state_slots(self) -> int:
        return self.states.num_slots if self.states else 0

    @property
    def num_used_state_slots(self) -> int:
        return self.states.num_used_slots if self.states else 0

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so that its table covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache -------------------------------------------------------------------
    def match_sequence(self, seq: Sequence) -> list[int]:
        """match_prefix for `seq`: within its cache salt, and none while it still needs prompt
        logprobs (the cache has no logits: vLLM also recomputes such prompts)."""
        if seq.next_prompt_logprob_position is not None:
            return []
        return self.match_prefix(seq.token_ids, seq.cache_key, None if seq.multimodal is None else seq.block_key)

    def match_prefix(self, token_ids: list[int], salt: str | None = None, block_key=None) -> list[int]:
        """Cached blocks holding a prefix of `token_ids` (under `salt`), leaving at least one
        token to compute (the step that samples the next token needs the last token's logits).
        block_key(i, block_size): block i's key when more than its token ids tell it apart
        (Sequence.block_key: the images it holds)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        prev: int | str | None = salt
        parent: tuple[int, int] | str | None = salt
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs]) if block_key is None else block_key(i, bs)
            prev = chain_hash(prev, chunk)
            block_id = self._hash_to_block.get(prev)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != chunk or block.parent != parent:
                break
            hits.append(block_id)
            parent = block.identity
        if self.states is not None:  # a hybrid resumes only where a state snapshot was taken
            while hits and self.blocks[hits[-1]].snapshot is None:
                hits.pop()
        return hits

    def admission_cost(self, seq: Sequence, cached: list[int], num_tokens: int) -> int:
        """Free blocks taken by admitting `seq` with `cached` hits and a first chunk up to `num_tokens`."""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        fresh = max(0, -(-num_tokens // self.block_size) - len(cached))
        return revived + fresh

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give `seq` (with an empty table) the cached prefix blocks; its computed tokens start after them."""
        assert not seq.block_table, "admit() needs a sequence without blocks"
        if self.states is not None:
            seq.state_slot = self.states.take_slot()
            if cached:  # match_prefix ended the hit on a block with a snapshot: resume from it
                seq.restore_from = self.blocks[cached[-1]].snapshot
                self.states.touch(seq.restore_from)
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.block_hashes = [self.blocks[b].hash for b in cached]
        seq.block_prefix_ids = [self.blocks[b].identity for b in cached]
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed_tokens

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (after a weight update their KV and rows are stale).

        Blocks in use stay with their sequences; a running sequence keeps chaining its own
        later blocks, but no new prompt can reach them, since a hit walks from the first
        block and none is registered any more. Returns how many blocks were forgotten.
        """
        forgotten = len(self._hash_to_block)
        self._hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids, block.parent = None, (), None
            if block.snapshot is not None:
                if self.states is not None:
                    self.states.drop(block.snapshot)  # unowned: free; owned: its sequence frees it
                block.snapshot = None
        return forgotten

    def drop_extra_key(self, part: Hashable) -> int:
        """Forget the cached prefixes whose chain started from a key holding `part` (an adapter's
        `("lora", id, version)`): none can be reached again. Returns how many blocks."""
        dropped = 0
        for block in self.blocks:
            root = block.root
            if block.hash is None or not (root == part or isinstance(root, tuple) and part in root):
                continue
            if self._hash_to_block.get(block.hash) == block.block_id:
                del self._hash_to_block[block.hash]
            block.hash, block.token_ids, block.parent, block.root = None, (), None, None
            if block.snapshot is not None and self.states is not None:
                self.states.drop(block.snapshot)
                block.snapshot = None
            dropped += 1
        return dropped

    # -- allocation ---------------------------------------------------------------------
    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append fresh blocks so that `seq`'s table covers `num_tokens` tokens."""
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {needed}, {len(self._free)} free")
        for _ in range(needed):
            seq.block_table.append(self._take_fresh())

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            # Evict: its KV and rows are about to be overwritten.
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash = None
            block.token_ids = ()
            block.parent = None
        if block.snapshot is not None:  # its snapshot describes the evicted content
            self.states.drop(block.snapshot)
            block.snapshot = None
        block.generation += 1  # blocks that named this one as parent no longer match
        block.ref_count = 1
        return block_id

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks (tail first, so a shared prefix outlives its tails in the LRU)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = BlockTable()
        seq.block_hashes = []
        seq.block_prefix_ids = []
        seq.num_computed_tokens = 0
        if seq.state_slot >= 0:
            self.states.give_back_slot(seq.state_slot)
            seq.state_slot = -1
        if seq.snapshot >= 0:  # kept for later hits while its block still names it
            on_block = seq.snapshot_block is not None and self.blocks[seq.snapshot_block].snapshot == seq.snapshot
            self.states.disown(seq.snapshot, seq.snapshot_block if on_block else None)
        for _, entry in seq.snapshot_plan:  # planned for a step that never committed
            if entry != seq.snapshot:
                self.states.disown(entry, None)
        seq.snapshot, seq.snapshot_block, seq.snapshot_plan, seq.restore_from = -1, None, [], -1

    def plan_snapshots(self, seq: Sequence) -> None:
        """Before a step of a hybrid with prefix caching: the block boundaries inside the step's
        tokens where the model copies `seq`'s states (added to seq.snapshot_plan, attached to
        their blocks by commit_full_blocks; an overlapped step's plan may still hold the points
        of the step before it, not booked yet). Two are worth keeping: the last boundary before
        the prompt's final token (what a repeated prompt or an n > 1 sibling resumes from), left
        in the pool for hits at once; and the latest one, in the snapshot the sequence owns
        and moves along (what the next turn of a conversation, or a preempted sequence, resumes
        from, once the sequence ends)."""
        if self.states is None or not self.states.num_snapshots or not self.enable_prefix_caching:
            return
        bs = self.block_size
        start = seq.num_computed_tokens
        end = start + seq.num_scheduled_tokens
        prompt_point = (seq.num_prompt_tokens - 1) // bs * bs
        latest = end // bs * bs
        if start < prompt_point <= end:
            entry = self._take_snapshot()
            if entry is not None:
                seq.snapshot_plan.append((prompt_point, entry))
        if start < latest <= end and latest != prompt_point:
            if seq.snapshot < 0:
                seq.snapshot = self._take_snapshot()
                if seq.snapshot is None:
                    seq.snapshot = -1
                    return
            elif seq.snapshot_block is not None:  # about to be overwritten: its block loses it
                if self.blocks[seq.snapshot_block].snapshot == seq.snapshot:
                    self.blocks[seq.snapshot_block].snapshot = None
                seq.snapshot_block = None
            # a point of a queued step in the snapshot this step overwrites never reaches a block
            seq.snapshot_plan = [point for point in seq.snapshot_plan if point[1] != seq.snapshot]
            seq.snapshot_plan.append((latest, seq.snapshot))

    def _take_snapshot(self) -> int | None:
        taken = self.states.take_snapshot()
        if taken is None:  # every snapshot belongs to a running sequence
            return None
        entry, evicted_from = taken
        if evicted_from is not None:
            self.blocks[evicted_from].snapshot = None
        return entry

    def _attach_snapshots(self, seq: Sequence) -> None:
        """Hang the planned snapshots of computed tokens on the registered blocks of their
        prefixes (a twin computed first, if any: the block later prompts' hits reach). Attached
        when the step that plans them is booked, or (overlapped) the step before it: the device
        runs the steps in order, so no later step reads a snapshot before it is written."""
        pending = [point for point in seq.snapshot_plan if point[0] > seq.num_computed_tokens]
        for position, entry in seq.snapshot_plan:
            if position > seq.num_computed_tokens:
                continue
            block_id, generation = seq.block_prefix_ids[position // self.block_size - 1]
            block = self.blocks[block_id]
            owned = entry == seq.snapshot
            if block.generation != generation or (block.snapshot is not None and block.snapshot != entry):
                if not owned:  # unreachable, or the prefix already has one
                    self.states.disown(entry, None)
                continue
            block.snapshot = entry
            if owned:
                seq.snapshot_block = block_id
            else:
                self.states.disown(entry, block_id)
        seq.snapshot_plan = pending

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` whose tokens are now all computed, for later prefix hits
        (and, for a hybrid, attach the snapshots this step took)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes, prefix_ids = seq.block_hashes, seq.block_prefix_ids
        salt = seq.cache_key
        for i in range(len(hashes), seq.num_computed_tokens // bs):
            chunk = seq.block_key(i, bs)
            h = chain_hash(hashes[-1] if hashes else salt, chunk)
            parent = prefix_ids[-1] if prefix_ids else salt
            block = self.blocks[seq.block_table[i]]
            block.hash, block.token_ids, block.parent, block.root = h, chunk, parent, salt
            registered = self._hash_to_block.get(h)
            twin = self.blocks[registered] if registered is not None else None
            if twin is not None and twin.token_ids == chunk and twin.parent == parent:
                # The same prefix computed twice (e.g. two prompts admitted in one step): keep
                # the registered copy as the one later blocks chain to, so hits keep following it.
                prefix_ids.append(twin.identity)
            else:
                self._hash_to_block[h] = block.block_id
                prefix_ids.append(block.identity)
            hashes.append(h)
        if seq.snapshot_plan:
            self._attach_snapshots(seq)
