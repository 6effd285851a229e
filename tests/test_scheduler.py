"""Scheduler: token budget, chunked prefill, sequence cap, preemption by recompute."""

from r3srv.engine.block_manager import BlockManager
from r3srv.engine.scheduler import Scheduler
from r3srv.engine.sequence import Sequence, SequenceStatus
from r3srv.sampling_params import SamplingParams


def make_seq(n_prompt: int, base: int = 0) -> Sequence:
    return Sequence("r", 0, [base + i for i in range(n_prompt)], SamplingParams(), max_tokens=64, generator=None)


def run_step(sched: Scheduler, sample_token: int = 7):
    """Apply a schedule as the engine core does (mark_computed), sampling `sample_token` where it samples."""
    out = sched.schedule()
    out.sizes = [s.num_scheduled_tokens for s in out.seqs]
    out.total = out.num_tokens
    sched.mark_computed(out)
    for i in out.sample_indices:
        out.seqs[i].token_ids.append(sample_token)
    return out


def test_prefill_is_chunked_by_the_token_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    seq = make_seq(25)
    sched.add(seq)
    sizes = []
    for _ in range(3):
        out = run_step(sched)
        sizes.append(out.total)
    assert sizes == [10, 10, 5]
    assert seq.num_output_tokens == 1  # sampled only once the whole prompt was computed
    assert run_step(sched).total == 1  # then decodes


def test_decodes_and_new_prefills_share_a_step():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(5), make_seq(6, base=50)
    sched.add(a)
    run_step(sched)
    sched.add(b)
    out = run_step(sched)
    assert out.seqs == [a, b] and out.sizes == [1, 6]


def test_max_num_seqs_caps_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(3, base=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert len(out.seqs) == 2 and len(sched.waiting) == 1


def test_preemption_frees_the_newest_and_recomputes_it_later():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = make_seq(8), make_seq(8, base=100)  # two blocks each: the pool is full
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert bm.num_free_blocks == 0 and a.num_tokens == 9 and b.num_tokens == 9
    # a's 9th token needs a third block: b (the newest) is preempted.
    out = run_step(sched)
    assert out.num_preempted == 1 and sched.num_preemptions == 1
    assert out.seqs == [a]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b]
    # Once a finishes, b is readmitted and recomputes its 9 tokens (prompt + its sampled one),
    # except its first block, which a's new block did not evict from the prefix cache.
    sched.finish(a)
    hits_before = bm.prefix_cache_hits
    out = run_step(sched)
    assert out.seqs == [b] and out.total == 9 - 4
    assert bm.prefix_cache_hits - hits_before == 4
    assert bm.num_used_blocks == len(b.block_table)


def test_finish_removes_from_either_queue_and_frees():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    a, b = make_seq(5), make_seq(5, base=9)
    sched.add(a)
    sched.add(b)
    run_step(sched)
    sched.finish(b)  # still waiting
    sched.finish(a)  # running
    assert not sched.has_unfinished() and bm.num_used_blocks == 0
