"""Async scheduling (LLMEngine.step): step N+1 is scheduled (ahead of step N's tokens, with output
placeholders: tests/test_schedule_ahead.py) and launched on the forward thread before step N's
outputs are processed. Greedy tokens must still equal transformers', seeded runs
must be identical with the switch on and off, and a sequence finished or aborted while the next
step is in flight must be dropped from that step with its KV blocks freed."""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from hf_oracle import assert_matches, hf_greedy, load_hf
from engine import LLM, SamplingParams
from engine.runner.input_buffers import BlockTables

GEN = 12
GREEDY = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(0, 500, n).tolist() for n in (9, 70, 23, 41, 3, 55)]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    model = load_hf(model_dir)
    return [hf_greedy(model, p, GEN) for p in prompts]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


def count_launches(engine) -> list:
    """Records each step left running on the forward thread when step() returned."""
    launched = []
    can_overlap = engine._can_overlap

    def counting(sched):
        overlap = can_overlap(sched)
        if overlap:
            launched.append(sched.num_seqs)
        return overlap
    engine._can_overlap = counting
    return launched


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_with_chunks_and_preemption_equals_transformers(model_dir, prompts, reference,
                                                               async_scheduling):
    # 20 blocks of 8 tokens cannot hold the six sequences: preemption happens mid-run (the
    # automatic max_num_seqs would admit one sequence at a time into so small a pool).
    llm = LLM(model_dir, block_size=8, num_kv_blocks=20, prefill_chunk_size=16,
              max_num_batched_tokens=48, enable_prefix_caching=False, max_num_seqs=8,
              async_scheduling=async_scheduling)
    engine = llm.engine
    engine.block_pool.shuffle_free_blocks(random.Random(1))
    launched = count_launches(engine)
    outs = llm.generate(prompts, GREEDY)
    for out, ref in zip(outs, reference):
        assert_matches(out.token_ids, ref)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_pool.num_free_blocks == 20
    assert len(launched) == engine.runner.num_forward_calls if async_scheduling else not launched


def mixed_requests():
    """Seeded sampling with every per-token feature the overlap must keep in order: penalties
    (they read the output history), min_tokens, logit_bias, logprobs, prompt logprobs, n > 1,
    stop strings."""
    base = dict(temperature=0.9, top_p=0.95, max_tokens=24, seed=5)
    return [
        ("The quick brown fox", SamplingParams(**base, presence_penalty=0.8,
                                               frequency_penalty=0.6, logprobs=3)),
        ("Once upon a time", SamplingParams(**{**base, "seed": 9}, repetition_penalty=1.3,
                                            prompt_logprobs=2, min_tokens=6)),
        ("Hello there", SamplingParams(**{**base, "seed": 3}, n=2, top_k=20,
                                       logit_bias={17: 2.0})),
        ("A list of numbers:", SamplingParams(**{**base, "seed": 1}, stop=["qu", "zz"],
                                              logprobs=1)),
        ("Plain greedy", SamplingParams(temperature=0, max_tokens=20)),
    ]


def run(llm, requests, shift_at: int | None = None):
    """Final outputs as comparable tuples. shift_at: the sampler's token for the first row of
    that sampling call is replaced by the next id (a deliberately wrong token)."""
    if shift_at is not None:
        sampler = llm.engine.sampler
        sample = sampler.sample_with_logprobs
        calls = []

        def shifted(*args, **kwargs):
            tokens, logprobs = sample(*args, **kwargs)
            calls.append(1)
            if len(calls) == shift_at:
                tokens = tokens.copy()
                tokens[0] = (tokens[0] + 1) % llm.engine.model_config.vocab_size
            return tokens, logprobs
        sampler.sample_with_logprobs = shifted
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests])
    if shift_at is not None:
        del sampler.sample_with_logprobs
    flat = [o for out in outs for o in (out if isinstance(out, list) else [out])]

    def lps(entries):
        return [None if e is None else (e.token_id, round(e.logprob, 5), e.top_ids, e.text_offset)
                for e in entries or []]
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason, lps(o.logprobs),
             lps(o.prompt_logprobs)) for o in flat]


def test_seeded_outputs_identical_with_overlap_on_and_off(demo_dir):
    """Batch-invariant kernels, so the one extra (dropped) row a stop string leaves in the
    overlapped step cannot change the other rows' bits; everything else is the same schedule."""
    on = LLM(demo_dir, kv_cache_memory_mb=16, batch_invariant=True)
    off = LLM(demo_dir, kv_cache_memory_mb=16, batch_invariant=True, async_scheduling=False)
    launched = count_launches(on.engine)
    expected = run(off, mixed_requests())
    assert run(on, mixed_requests()) == expected
    assert launched, "the overlapped engine never launched a step on its forward thread"
    assert on.engine.num_placeholder_rows > 0, "no step was scheduled ahead with placeholders"
    assert any(o[2] == "stop" and isinstance(o[3], str) for o in expected)  # a stop string hit
    # The comparison notices a single wrong token (the kind an off-by-one step would make).
    assert run(on, mixed_requests(), shift_at=5) != expected
    for engine in (on.engine, off.engine):
        assert not engine.has_unfinished()
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_stop_string_hit_while_next_step_runs_drops_that_row(demo_dir):
    """The stop string is found while the next step, which already holds the sequence, runs:
    its row there is computed and dropped (one forward token more than the synchronous engine),
    the output is the same and its blocks come back."""
    params = SamplingParams(temperature=0, max_tokens=40, stop=["e"])
    other = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    results = {}
    for mode in (True, False):
        llm = LLM(demo_dir, kv_cache_memory_mb=16, enable_prefix_caching=False,
                  async_scheduling=mode)
        outs = llm.generate(["Once upon a time there", "Count: one two"], [params, other])
        engine = llm.engine
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        results[mode] = ([(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in outs],
                         engine.runner.num_forward_tokens)
        assert (engine.num_placeholder_rows > 0) == mode
    (outs_on, tokens_on), (outs_off, tokens_off) = results[True], results[False]
    assert outs_on == outs_off
    assert outs_on[0][2:] == ("stop", "e")
    assert tokens_on == tokens_off + 1


def test_abort_while_a_step_is_in_flight(model_dir, prompts, reference):
    llm = LLM(model_dir, block_size=8, num_kv_blocks=64, max_num_seqs=8)
    engine = llm.engine
    engine.add_request("a", prompts[1], GREEDY)
    engine.add_request("b", prompts[2], GREEDY)
    seen = {"a": [], "b": []}
    while len(seen["a"]) < 3:
        for out in engine.step():
            seen[out.request_id] += out.new_token_ids
    assert engine._inflight is not None          # a's next token is being computed
    a = engine.requests["a"].seqs[0]
    assert a in engine._inflight.sched.seqs and a.num_output_placeholders == 0   # resolved
    assert engine.abort("a") == [0]
    after_abort = []
    while engine.has_unfinished():
        for out in engine.step():
            after_abort.append(out.request_id)
            seen[out.request_id] += out.new_token_ids
    assert "a" not in after_abort
    assert_matches(seen["b"], reference[2])
    assert engine.block_pool.num_free_blocks == 64
    # The engine keeps serving: the aborted prompt again, alone.
    assert_matches(llm.generate([prompts[1]], GREEDY)[0].token_ids, reference[1])


def test_failure_in_an_overlapped_step_fails_only_its_requests(model_dir, prompts, reference):
    llm = LLM(model_dir)
    engine = llm.engine
    execute = engine.runner.execute

    def broken(sched, *batch):
        engine.runner.execute = execute
        raise RuntimeError("kernel exploded")
    engine.runner.execute = broken
    engine.add_request("victim", prompts[0], GREEDY)
    assert engine.step() == []                      # launched; it fails on the forward thread
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("victim", "error")]
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert_matches(llm.generate([prompts[0]], GREEDY)[0].token_ids, reference[0])


def test_beam_search_steps_run_synchronously(model_dir, prompts):
    params = SamplingParams(use_beam_search=True, n=2, max_tokens=6, ignore_eos=True)
    on, off = LLM(model_dir), LLM(model_dir, async_scheduling=False)
    launched = count_launches(on.engine)
    got = [o.token_ids for o in on.generate([prompts[2]], params)[0]]
    assert got == [o.token_ids for o in off.generate([prompts[2]], params)[0]]
    assert launched == []


def test_the_forward_releases_the_gil(model_dir):
    """What makes the overlap real on the CPU: while a forward runs on another thread, this
    thread keeps running Python. The control, a C call that holds the GIL (sorting a list), shows
    the measurement sees a held GIL."""
    llm = LLM(model_dir)
    backend = llm.engine.backend
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 1024), dtype=np.float32)
    w = backend.place_weight(rng.standard_normal((2048, 1024), dtype=np.float32))
    out = np.empty((512, 2048), np.float32)
    big = rng.integers(0, 10**9, 2_000_000).tolist()

    def progress_during(fn) -> float:
        """Python loop iterations per ms this thread makes while fn runs on another (the worker
        reads the counter and the clock right before and after the call; at most a switch
        interval or two around the call can count without the GIL being released)."""
        counter, seen = [0], []

        def worker():
            before, t0 = counter[0], time.perf_counter()
            fn()
            seen.append((counter[0] - before) / (1e3 * (time.perf_counter() - t0)))
        t = threading.Thread(target=worker)
        t.start()
        while t.is_alive():
            counter[0] += 1
        t.join()
        return seen[0]

    def forward():
        for _ in range(8):
            backend.linear(x, w, None, out)
    held = progress_during(lambda: sorted(big))
    free = progress_during(forward)
    assert free > 10 * held, (free, held)


class FakeSeq:
    def __init__(self, seq_id):
        self.seq_id, self.block_table, self.num_preemptions, self.is_finished = seq_id, [], 0, False
        self.trimmed_to = None


def test_block_tables_write_only_new_blocks_and_rewrite_after_preemption():
    tables = BlockTables(num_rows=2, width=2)
    a, b, c = FakeSeq(0), FakeSeq(1), FakeSeq(2)
    a.block_table, b.block_table = [7], [3, 4]
    assert tables.rows_for([a, b]).tolist() == [0, 1]
    a.block_table.append(9)
    tables.table[0, 0] = -1          # a row is not rewritten: only the new block is written
    rows = tables.rows_for([b, a])
    assert tables.table[rows].tolist() == [[3, 4], [-1, 9]]
    a.block_table[:] = [5, 6, 8]     # preempted, then given new blocks: rewritten, wider table
    a.num_preemptions = 1
    rows = tables.rows_for([a])
    assert tables.table[rows].tolist() == [[5, 6, 8, 0]]
    b.is_finished = True             # its row is reused once the free rows run out
    c.block_table = [1]
    assert tables.rows_for([c]).tolist() == [1]
    assert tables.table[1].tolist() == [1, 0, 0, 0]
    d = FakeSeq(3)
    d.block_table = [2]
    assert tables.rows_for([d]).tolist() == [2]  # none finished: the table grows
    assert tables.table.shape == (4, 4)


def test_prepare_matches_the_sequences(model_dir, prompts):
    """The batch arrays against the sequences they come from, by their definitions (DESIGN.md
    section 5), over chunked prefills and decodes."""
    llm = LLM(model_dir, block_size=8, prefill_chunk_size=16, max_num_batched_tokens=40,
              async_scheduling=False)
    engine = llm.engine
    engine.runner.block_tables = BlockTables(num_rows=2, width=1)   # it must grow, twice
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, GREEDY)
    checked = 0
    while engine.has_unfinished():
        sched = engine.scheduler.schedule()
        batch = engine.runner.prepare(sched)
        row = 0
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_new_tokens)):
            start = seq.num_computed_tokens
            assert batch.token_ids[row:row + n].tolist() == seq.token_ids[start:start + n]
            assert batch.positions[row:row + n].tolist() == list(range(start, start + n))
            assert batch.slot_mapping[row:row + n].tolist() == [
                seq.block_table[p // 8] * 8 + p % 8 for p in range(start, start + n)]
            k = len(seq.block_table)
            assert batch.block_tables[i, :k].tolist() == seq.block_table
            assert not batch.block_tables[i, k:].any()
            assert batch.seq_lens[i] == start + n and batch.query_start_loc[i] == row
            row += n
        checked += 1
        _, pending = engine._commit(sched, engine._run_step(sched, batch))  # as step() does
        for p in pending:
            engine._append(*p)
    assert checked > 5


def test_server_flag_turns_it_off():
    from server.__main__ import build_parser, engine_config
    p = build_parser()
    assert engine_config(p.parse_args(["--w", "/m", "--cpu"])).async_scheduling
    assert not engine_config(p.parse_args(["--w", "/m", "--cpu",
                                           "--no-async-scheduling"])).async_scheduling
