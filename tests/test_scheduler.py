"""Scheduler: budget splitting, chunked prefill mixed with decode, preemption, abort, admission.

Each test drives fake model steps: schedule(), update(), then "sample" one token for every
sequence whose computed tokens caught up with its tokens.
"""
from engine.core.block_pool import BlockPool
from engine.config import EngineConfig
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.sequence import Sequence, SequenceStatus

SAMPLED = 7


def make(num_blocks, block_size=16, prefix_caching=False, **cfg) -> Scheduler:
    config = EngineConfig(model="unused", block_size=block_size, **cfg)
    return Scheduler(config, BlockPool(num_blocks, block_size, prefix_caching))


def seq(n: int, start: int = 0, request_id: str | None = None) -> Sequence:
    return Sequence(list(range(start, start + n)), request_id=request_id)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out)
    for s in out.seqs:
        if s.status == SequenceStatus.RUNNING and s.num_computed_tokens == s.num_tokens:
            s.append_token(SAMPLED)
    return out


def ids(seqs) -> list[str]:
    return [s.request_id for s in seqs]


def test_budget_split_with_chunk_size():
    sched = make(100, max_num_batched_tokens=40, prefill_chunk_size=16)
    a, b, c = seq(40, 1000, "a"), seq(20, 2000, "b"), seq(30, 3000, "c")
    for s in (a, b, c):
        sched.add(s)

    out = step(sched)
    assert ids(out.seqs) == ["a", "b", "c"] and out.num_new_tokens == [16, 16, 8]
    assert out.sample == [False, False, False] and out.num_prefills == 3
    assert out.total_num_tokens == 40
    assert sched.num_running == 3 and sched.num_waiting == 0

    out = step(sched)
    assert ids(out.seqs) == ["a", "b", "c"] and out.num_new_tokens == [16, 4, 16]
    assert out.sample == [False, True, False]

    out = step(sched)       # b decodes first, ahead of the older a's prefill chunk
    assert ids(out.seqs) == ["b", "a", "c"] and out.num_new_tokens == [1, 8, 6]
    assert out.is_decode == [True, False, False] and out.sample == [True, True, True]

    out = step(sched)
    assert out.num_new_tokens == [1, 1, 1] and out.is_decode == [True, True, True]
    assert a.block_table == [0, 3, 6] and b.block_table == [1, 4] and c.block_table == [2, 5]
    assert [a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens] == [41, 22, 31]


def test_budget_without_chunk_size():
    sched = make(100, max_num_batched_tokens=50)
    a, b, c = seq(30, 0, "a"), seq(30, 100, "b"), seq(5, 200, "c")
    for s in (a, b, c):
        sched.add(s)
    out = step(sched)
    assert ids(out.seqs) == ["a", "b"] and out.num_new_tokens == [30, 20]
    assert sched.num_waiting == 1              # budget spent: c waits
    out = step(sched)
    assert ids(out.seqs) == ["a", "b", "c"] and out.num_new_tokens == [1, 10, 5]


def test_decode_and_prefill_chunk_in_one_step():
    sched = make(100, max_num_batched_tokens=64, prefill_chunk_size=16)
    a = seq(10, 0, "a")
    sched.add(a)
    out = step(sched)
    assert out.num_new_tokens == [10] and out.sample == [True]
    b = seq(40, 500, "b")
    sched.add(b)
    out = step(sched)
    assert ids(out.seqs) == ["a", "b"] and out.num_new_tokens == [1, 16]
    assert out.is_decode == [True, False] and out.sample == [True, False]
    assert (out.num_decodes, out.num_prefills, out.total_num_tokens) == (1, 1, 17)
    assert a.num_tokens == 12 and b.num_computed_tokens == 16


def test_max_num_seqs():
    sched = make(100, max_num_seqs=2)
    a, b, c = seq(4, 0, "a"), seq(4, 100, "b"), seq(4, 200, "c")
    for s in (a, b, c):
        sched.add(s)
    out = step(sched)
    assert ids(out.seqs) == ["a", "b"] and sched.num_waiting == 1
    out = step(sched)
    assert ids(out.seqs) == ["a", "b"] and c.status == SequenceStatus.WAITING
    sched.finish(a, "stop")
    assert a.status == SequenceStatus.FINISHED and a.finish_reason == "stop"
    assert a.block_table == []
    out = step(sched)
    assert ids(out.seqs) == ["b", "c"] and out.num_new_tokens == [1, 4]


def test_preempt_newest_until_it_fits():
    # 4 blocks of 8: a (chunked, 2 blocks), b and c (1 block each) fill the pool
    sched = make(4, block_size=8, max_num_batched_tokens=64, prefill_chunk_size=16)
    a, b, c = seq(31, 0, "a"), seq(8, 100, "b"), seq(8, 200, "c")
    for s in (a, b, c):
        sched.add(s)
    out = step(sched)
    assert out.num_new_tokens == [16, 8, 8]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2], [3])
    assert sched.block_pool.num_free_blocks == 0

    out = step(sched)       # a needs 2 more blocks: c goes, still short, then b goes
    assert ids(out.seqs) == ["a"] and out.num_new_tokens == [15]
    assert ids(out.preempted) == ["c", "b"] and out.num_preempted == 2
    assert sched.num_preemptions == 2
    assert a.block_table == [0, 1, 3, 2]
    assert ids(sched.waiting) == ["b", "c"]     # at the front, in arrival order
    for s in (b, c):
        assert s.status == SequenceStatus.WAITING
        assert s.num_computed_tokens == 0 and s.block_table == []
        assert s.num_tokens == 9 and s.output_token_ids == [SAMPLED]  # output kept

    out = step(sched)       # a decodes (fits its last block); nothing free for b
    assert ids(out.seqs) == ["a"] and out.num_new_tokens == [1]
    sched.finish(a, "length")
    assert sched.block_pool.num_free_blocks == 4
    out = step(sched)       # b and c recompute prompt + output from 0
    assert ids(out.seqs) == ["b", "c"] and out.num_new_tokens == [9, 9]
    assert out.sample == [True, True] and out.num_preempted == 0
    assert b.block_table == [2, 3] and c.block_table == [1, 0]
    assert sched.num_preemptions == 2


def test_preempt_self_when_newest():
    sched = make(3, block_size=8, max_num_batched_tokens=64)
    a, b = seq(12, 0, "a"), seq(8, 100, "b")
    sched.add(a)
    sched.add(b)
    step(sched)
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    out = step(sched)       # a's 13th token fits; b's 9th needs a block and b is the newest
    assert ids(out.seqs) == ["a"] and ids(out.preempted) == ["b"]
    assert sched.num_preemptions == 1
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["b"]
    assert b.num_computed_tokens == 0 and b.block_table == [] and sched.block_pool.num_free_blocks == 1


def test_preempted_seq_reuses_its_cached_prefix():
    sched = make(3, block_size=8, prefix_caching=True, max_num_batched_tokens=64)
    a, b = seq(12, 0, "a"), seq(8, 100, "b")
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)             # b preempted; its full block 2 is still cached, in the free queue
    assert ids(sched.waiting) == ["b"] and sched.block_pool.blocks[2].block_hash is not None
    sched.finish(a, "stop")
    out = step(sched)
    assert ids(out.seqs) == ["b"] and out.num_new_tokens == [1]   # 8 cached, 1 to compute
    assert b.block_table[0] == 2 and b.num_cached_tokens == 0     # first admission had no hit
    assert b.num_computed_tokens == 9


def test_no_admission_in_a_step_that_preempted():
    sched = make(4, block_size=8, max_num_batched_tokens=64, prefill_chunk_size=8)
    a, b = seq(9, 0, "a"), seq(16, 100, "b")
    sched.add(a)
    sched.add(b)
    assert step(sched).num_new_tokens == [8, 8]
    assert step(sched).num_new_tokens == [1, 8]
    assert (a.block_table, b.block_table) == ([0, 2], [1, 3])
    out = step(sched)       # a's decode fits; b's needs a block: b, the newest, preempts itself
    assert ids(out.seqs) == ["a"] and ids(out.preempted) == ["b"]
    # b's first 8-token chunk would fit the 2 freed blocks, but not in this step
    assert ids(sched.waiting) == ["b"] and sched.block_pool.num_free_blocks == 2
    out = step(sched)
    assert ids(out.seqs) == ["a", "b"] and out.num_new_tokens == [1, 8]


def test_fifo_admission_stops_at_first_misfit():
    sched = make(4, block_size=8, max_num_batched_tokens=64)
    a, b, c = seq(24, 0, "a"), seq(16, 100, "b"), seq(8, 200, "c")
    for s in (a, b, c):
        sched.add(s)
    out = step(sched)
    assert ids(out.seqs) == ["a"] and a.block_table == [0, 1, 2]
    assert ids(sched.waiting) == ["b", "c"]     # c would fit, but b is first
    assert sched.block_pool.num_free_blocks == 1


def test_abort_waiting_and_running_frees_everything():
    sched = make(10, max_num_seqs=1)
    a, b = seq(20, 0, "a"), seq(20, 100, "b")
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.num_running == 1 and sched.num_waiting == 1
    assert sched.block_pool.num_free_blocks == 8
    assert sched.abort("b") is True
    assert b.status == SequenceStatus.FINISHED and b.finish_reason == "abort"
    assert sched.num_waiting == 0
    assert sched.abort("a") is True
    assert a.finish_reason == "abort" and a.block_table == []
    assert sched.block_pool.num_free_blocks == 10 and sched.block_pool.usage == 0.0
    assert sched.abort("a") is False and sched.abort("missing") is False
    assert not sched.has_unfinished()


def test_abort_between_schedule_and_update():
    sched = make(10)
    a = seq(20, 0, "a")
    sched.add(a)
    out = sched.schedule()
    assert sched.abort("a") is True
    sched.update(out)
    assert a.num_computed_tokens == 0 and sched.block_pool.num_free_blocks == 10
    assert sched.schedule().is_empty


def test_prefix_hit_through_scheduler():
    sched = make(20, prefix_caching=True, max_num_batched_tokens=256)
    a = seq(40, 0, "a")
    sched.add(a)
    step(sched)
    assert a.block_table == [0, 1, 2]
    b = Sequence(list(range(32)) + list(range(900, 908)), request_id="b")
    sched.add(b)
    out = sched.schedule()
    assert ids(out.seqs) == ["a", "b"] and out.num_new_tokens == [1, 8]
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 32 and b.num_cached_tokens == 32
    assert [sched.block_pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    pool = sched.block_pool
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (80, 32)


def test_one_token_prompt_remainder_is_not_a_decode():
    sched = make(20, prefix_caching=True, max_num_batched_tokens=256)
    sched.add(seq(40, 0, "a"))
    step(sched)
    c = seq(33, 0, "c")                         # 32 tokens cached: one prompt token to compute
    sched.add(c)
    out = sched.schedule()
    assert ids(out.seqs) == ["a", "c"] and out.num_new_tokens == [1, 1]
    assert out.is_decode == [True, False] and out.sample == [True, True]
    assert (out.num_decodes, out.num_prefills) == (1, 1)


def test_a_sequence_waiting_for_room_is_counted_once_in_prefix_stats():
    sched = make(3, prefix_caching=True)          # 48 token slots
    a, b = seq(40, 0, "a"), seq(20, 500, "b")
    sched.add(a)
    sched.add(b)
    for _ in range(3):                            # b does not fit while a runs
        out = step(sched)
        assert ids(out.seqs) == ["a"]
    pool = sched.block_pool
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (40, 0)
    sched.finish(a, "stop")
    assert ids(step(sched).seqs) == ["b"]
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (60, 0)


def test_preempting_a_decode_scheduled_earlier_in_the_step_takes_it_out():
    sched = make(4, block_size=8, max_num_batched_tokens=64, prefill_chunk_size=8)
    p, d = seq(24, 0, "p"), seq(7, 100, "d")
    sched.add(p)
    sched.add(d)
    assert step(sched).num_new_tokens == [8, 7]
    out = step(sched)                   # d's 8th token fits its block; p takes block 2
    assert ids(out.seqs) == ["d", "p"] and out.num_new_tokens == [1, 8]
    assert (p.block_table, d.block_table) == ([0, 2], [1])
    out = step(sched)   # d (decode, first) takes the last block; p then needs one: d is newest
    assert ids(out.seqs) == ["p"] and out.num_new_tokens == [8] and ids(out.preempted) == ["d"]
    assert out.is_decode == [False] and out.sample == [True] and out.total_num_tokens == 8
    assert p.block_table == [0, 2, 3] and d.block_table == [] and ids(sched.waiting) == ["d"]
    assert d.num_computed_tokens == 0 and d.output_token_ids == [SAMPLED, SAMPLED]


def run_to_decoding(sched, seqs):
    for s in seqs:
        sched.add(s)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        step(sched)


def test_256_decodes_are_not_stalled_by_an_older_long_prefill():
    # Two long prompts arrive first (chunks of 768), then 254 short ones: every step after the
    # short ones' prefill decodes all of them beside both long prompts' chunks, so each short
    # sequence gets one token per step (its TPOT is one step) while the long prompts prefill.
    sched = make(4096, max_num_seqs=256, max_num_batched_tokens=2048, prefill_chunk_size=768)
    longs = [seq(6000, 0, "L1"), seq(6000, 6000, "L2")]
    short = [seq(2, 20_000 + 2 * i, f"s{i}") for i in range(254)]
    for s in longs + short:
        sched.add(s)
    out = step(sched)               # 768 + 768 + 256 short prompts of 2 tokens: 254 fit
    assert out.total_num_tokens == 2044 and out.num_seqs == 256
    steps = 1
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in longs):
        out = step(sched)
        steps += 1
        assert out.num_decodes == 254 and out.is_decode[:254] == [True] * 254
        assert out.num_new_tokens[254:] == ([768, 768] if steps < 8 else [624, 624])
    assert steps == 8                   # ceil(6000 / 768) chunks each
    assert all(s.num_output_tokens == steps for s in short)


def test_a_prefill_moves_on_beside_255_decodes():
    # 255 sequences decoding and one new 4000-token prompt: the decodes take 255 tokens of each
    # step's 2048, the prompt the other 1793, so its first token comes on the third step.
    sched = make(4096, max_num_seqs=256, max_num_batched_tokens=2048)
    decoding = [seq(4, 4 * i, f"d{i}") for i in range(255)]
    run_to_decoding(sched, decoding)
    prompt = seq(4000, 50_000, "p")
    sched.add(prompt)
    chunks = []
    while prompt.num_output_tokens == 0:
        out = step(sched)
        assert out.num_decodes == 255 and out.total_num_tokens <= 2048
        chunks.append(out.num_new_tokens[out.seqs.index(prompt)])
    assert chunks == [1793, 1793, 414]


def test_scheduling_ahead_counts_a_placeholder_for_each_sampled_token():
    """advance() counts the step in flight as computed, with a placeholder for the token it
    samples: the next schedule decodes that token (its slot allocated: a third block once the
    position crosses into it) and does not schedule a sequence the token ends by length."""
    from engine.sampling.sampling_params import SamplingParams
    config = EngineConfig(model="unused", block_size=8)
    sched = Scheduler(config, BlockPool(10, 8, False), max_model_len=21)
    a = Sequence(list(range(16)), request_id="a")                               # 2 full blocks
    b = Sequence(list(range(5)), SamplingParams(max_tokens=2), request_id="b")
    c = Sequence(list(range(20)), request_id="c")                               # 20 + 1 = 21
    for s in (a, b, c):
        sched.add(s)
    first = sched.schedule()
    assert first.num_new_tokens == [16, 5, 20] and first.sample == [True, True, True]
    sched.advance(first)
    assert [s.num_computed_tokens for s in (a, b, c)] == [16, 5, 20]
    assert [s.num_output_placeholders for s in (a, b, c)] == [1, 1, 1]
    ahead = sched.schedule()       # c's token reaches the maximum model length: not scheduled
    assert ids(ahead.seqs) == ["a", "b"] and ahead.num_new_tokens == [1, 1]
    assert ahead.num_computed == [16, 5] and ahead.is_decode == [True, True]
    assert ahead.sample == [True, True]
    assert len(a.block_table) == 3 and len(b.block_table) == 1  # position 16: a third block
    sched.update(first, advanced=True)                # step 1 ran: nothing moves again
    assert [s.num_computed_tokens for s in (a, b, c)] == [16, 5, 20]
    for s in (a, b, c):                               # the engine's commit of step 1
        s.num_output_placeholders -= 1
        s.append_token(SAMPLED)
    sched.finish(c, "length")
    sched.advance(ahead)
    assert ids(sched.schedule().seqs) == ["a"]        # b's second token is its max_tokens
    assert b.num_output_placeholders == 1 and c.num_output_placeholders == 0
