"""Scheduling ahead with output placeholders (LLMEngine.step, engine/core/placeholders.py): step N+1
is scheduled, prepared and submitted while step N runs, with a placeholder row for each token N
samples, filled on the forward thread. Every row must compute the token it stands for, greedy
tokens must equal transformers' under chunking and preemption (a sequence preempted while in
flight included), seeded runs must equal the synchronous engine's even when the commit is slow
(N+1's sampling waits for it), and finishes, aborts, arrivals and failures between N and N+1
must leave the right outputs and every KV block free."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from hf_oracle import assert_matches
from engine import LLM, SamplingParams
from engine.core.sequence import SequenceStatus
from engine.sampling.structured_outputs import StructuredOutputsParams
# The tiny model, its transformers reference for this file's prompts, the demo checkpoint and
# the seeded mixed batch are test_async_scheduling's (a fixture resolves `prompts` here).
from test_async_scheduling import (GEN, GREEDY, demo_dir, mixed_requests, model_dir,  # noqa: F401
                                   reference, run)
from test_engine import StressRunner


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(17)
    return [rng.integers(0, 500, n).tolist() for n in (9, 70, 23, 41, 3, 55, 31, 12)]


def record_rows(engine) -> list:
    """Each forward's (sequences, token ids, positions, sampled rows), as the forward saw them
    (placeholders filled)."""
    steps = []
    execute = engine.runner.execute

    def recording(sched, batch):
        steps.append((list(sched.seqs), list(sched.num_new_tokens), batch.token_ids.copy(),
                      batch.positions.copy(), sum(sched.sample)))
        return execute(sched, batch)
    engine.runner.execute = recording
    return steps


def assert_rows_hold_their_tokens(steps):
    """Row by row: the token a forward computed is the sequence's token at that position (a
    finished sequence's row past its end, computed and dropped, holds a token it sampled)."""
    checked = 0
    for seqs, ns, token_ids, positions, _ in steps:
        row = 0
        for seq, n in zip(seqs, ns):
            for p, t in zip(positions[row:row + n].tolist(), token_ids[row:row + n].tolist()):
                if p < seq.num_tokens:
                    assert t == seq.token_ids[p], (seq, p)
                    checked += 1
            row += n
    return checked


def count_in_flight_preemptions(engine) -> list:
    """Sequences preempted by a schedule made ahead of the step they are in."""
    sched = engine.scheduler
    ahead_of, preempted = set(), []
    advance, schedule, preempt = sched.advance, sched.schedule, sched._preempt

    def advancing(out):
        ahead_of.update(seq.seq_id for seq in out.seqs)
        advance(out)

    def scheduling():
        try:
            return schedule()
        finally:
            ahead_of.clear()

    def preempting(seq):
        if seq.seq_id in ahead_of:
            preempted.append(seq.seq_id)
        preempt(seq)
    sched.advance, sched.schedule, sched._preempt = advancing, scheduling, preempting
    return preempted


def test_greedy_with_chunks_and_in_flight_preemption_equals_transformers(model_dir, prompts,
                                                                         reference):
    # 20 blocks of 8 tokens cannot hold the eight sequences: the schedule made ahead of a step
    # preempts sequences of that step, whose tokens must survive.
    llm = LLM(model_dir, block_size=8, num_kv_blocks=20, prefill_chunk_size=16,
              max_num_batched_tokens=48, enable_prefix_caching=False, max_num_seqs=8)
    engine = llm.engine
    engine.block_pool.shuffle_free_blocks(random.Random(2))
    StressRunner(engine.runner, engine.block_pool)     # stray block reads poison the logits
    steps = record_rows(engine)
    preempted = count_in_flight_preemptions(engine)
    outs = llm.generate(prompts, GREEDY)
    for out, ref in zip(outs, reference):
        assert_matches(out.token_ids, ref)
    assert preempted, "no sequence was preempted while its step was in flight"
    # Each token is sampled once: a sequence preempted in flight keeps the token its step
    # sampled, and is not sampled at that position again after its recompute.
    assert sum(step[4] for step in steps) == sum(len(out.token_ids) for out in outs)
    assert engine.num_placeholder_rows > 0
    assert assert_rows_hold_their_tokens(steps) == engine.runner.num_forward_tokens
    assert engine.block_pool.num_free_blocks == 20


def test_seeded_outputs_identical_with_a_slow_commit(demo_dir):
    """N+1's forward runs while N is committed; its sampling must wait for that commit (the
    penalties, min_tokens and the seed's position read N's token). A slow commit makes a
    sampler that does not wait read the history without it."""
    on = LLM(demo_dir, kv_cache_memory_mb=16, batch_invariant=True)
    off = LLM(demo_dir, kv_cache_memory_mb=16, batch_invariant=True, async_scheduling=False)
    commit = on.engine._commit

    def slow_commit(*args):
        time.sleep(0.02)
        return commit(*args)
    on.engine._commit = slow_commit
    expected = run(off, mixed_requests())
    assert run(on, mixed_requests()) == expected
    assert on.engine.num_placeholder_rows > 0
    assert on.engine.block_pool.num_free_blocks == on.engine.block_pool.num_blocks


def test_eos_in_the_middle_of_a_batch(model_dir, prompts, reference):
    """A sequence ends on EOS while the others go on: its row in the step scheduled ahead is
    computed and dropped (one forward token more than the synchronous engine), once."""
    results = {}
    for mode in (True, False):
        llm = LLM(model_dir, enable_prefix_caching=False, async_scheduling=mode)
        eos = min(llm.engine.eos_token_ids)
        # min_tokens holds EOS back for 3 tokens; the bias makes it the 4th.
        ending = SamplingParams(temperature=0, max_tokens=GEN, min_tokens=3,
                                logit_bias={eos: 100.0})
        outs = llm.generate(prompts[:4], [GREEDY, ending, GREEDY, GREEDY])
        engine = llm.engine
        assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        results[mode] = ([(o.token_ids, o.finish_reason) for o in outs],
                         engine.runner.num_forward_tokens, engine.num_placeholder_rows)
    (on, tokens_on, rows_on), (off, tokens_off, _) = results[True], results[False]
    assert on == off
    assert on[1][1] == "stop" and len(on[1][0]) == 4 and on[1][0][-1] == eos
    for (tokens, _), ref in zip(on[:1] + on[2:], reference[:1] + reference[2:4]):
        assert_matches(tokens, ref)
    assert tokens_on == tokens_off + 1 and rows_on > 0


def test_request_arriving_while_a_step_is_in_flight(model_dir, prompts, reference):
    llm = LLM(model_dir, block_size=8, num_kv_blocks=64, max_num_seqs=8)
    engine = llm.engine
    engine.add_request("a", prompts[1], GREEDY)
    seen = {"a": [], "b": []}
    while len(seen["a"]) < 3:
        for out in engine.step():
            seen[out.request_id] += out.new_token_ids
    assert engine._inflight is not None and engine.num_placeholder_rows > 0
    engine.add_request("b", prompts[2], GREEDY)
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id] += out.new_token_ids
        # Between calls every placeholder is resolved: the commit in the call that scheduled
        # ahead appended its token.
        assert all(s.num_output_placeholders == 0 for request in engine.requests.values()
                   for s in request.seqs)
    assert_matches(seen["a"], reference[1])
    assert_matches(seen["b"], reference[2])
    assert engine.block_pool.num_free_blocks == 64 and engine._inflight is None


@pytest.mark.parametrize("ahead", [True, False])
def test_schedule_ahead_config_switch(model_dir, prompts, reference, ahead):
    """EngineConfig.schedule_ahead (--no-schedule-ahead) decides whether steps are scheduled
    ahead; the tokens are transformers' either way."""
    llm = LLM(model_dir, block_size=8, num_kv_blocks=64, max_num_seqs=8, schedule_ahead=ahead)
    outs = llm.generate([prompts[1], prompts[2]], GREEDY)
    for out, ref in zip(outs, reference[1:3]):
        assert_matches(out.token_ids, ref)
    assert (llm.engine.num_scheduled_ahead > 0) == ahead


def test_failed_step_fails_its_requests_and_the_step_behind_it_goes_on(model_dir, prompts,
                                                                       reference):
    """Step 2 fails while step 3, scheduled ahead of it, holds a placeholder for "a" (filled with
    token 0, its row dropped) and the first chunk of "b", which must finish normally."""
    llm = LLM(model_dir, block_size=8)
    engine = llm.engine
    execute, calls = engine.runner.execute, []

    def failing_second(sched, batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("kernel exploded")
        return execute(sched, batch)
    engine.runner.execute = failing_second
    engine.add_request("a", prompts[0], GREEDY)
    assert engine.step() == []                 # step 1 launched: a's prompt
    outs = engine.step()                       # step 2 scheduled ahead; step 1 committed
    assert [o.request_id for o in outs] == ["a"]
    engine.add_request("b", prompts[2], GREEDY)
    rows = engine.num_placeholder_rows
    outs = engine.step()                       # step 3 (a's placeholder, b); step 2 failed
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    assert engine.num_placeholder_rows == rows + 1
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert_matches(tokens, reference[2])
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_step_sampling_a_grammar_falls_back_to_scheduling_after_the_commit(demo_dir):
    """The grammar's matcher takes N's token at N's commit: a step after one that sampled a
    constrained sequence is scheduled only then. Outputs equal the synchronous engine's."""
    constrained = SamplingParams(temperature=1.0, seed=4, max_tokens=30,
                                 structured_outputs=StructuredOutputsParams("regex",
                                                                            "[a-z]{3,9}-[0-9]{2}"))
    free = SamplingParams(temperature=0.8, seed=2, max_tokens=30, ignore_eos=True)
    requests = [("Code:", constrained), ("Once upon a time", free)]
    on = LLM(demo_dir, kv_cache_memory_mb=16, batch_invariant=True)
    off = LLM(demo_dir, kv_cache_memory_mb=16, batch_invariant=True, async_scheduling=False)
    decisions = []
    can = on.engine._can_schedule_ahead

    def recording(prev):
        ahead = can(prev)
        decisions.append((ahead, any(seq.grammar is not None and s
                                     for seq, s in zip(prev.sched.seqs, prev.sched.sample))))
        return ahead
    on.engine._can_schedule_ahead = recording
    expected = run(off, requests)
    assert run(on, requests) == expected
    assert expected[0][2] == "stop"                  # the grammar ended the constrained one
    assert (False, True) in decisions and (True, False) in decisions
    assert not any(ahead and grammar for ahead, grammar in decisions)


def test_beam_search_beside_a_plain_request_equals_the_synchronous_engine(model_dir, prompts):
    beams = SamplingParams(use_beam_search=True, n=2, max_tokens=6, ignore_eos=True)
    outs = {}
    for mode in (True, False):
        llm = LLM(model_dir, async_scheduling=mode)
        got = llm.generate([prompts[2], prompts[3]], [GREEDY, beams])
        outs[mode] = (got[0].token_ids, [o.token_ids for o in got[1]])
        assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
    assert outs[True] == outs[False]
