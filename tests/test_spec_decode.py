"""Speculative decoding with n-gram (prompt lookup) proposals, through the engine on a tiny random
checkpoint: greedy output token-identical with and without speculation (verify rows mixed with
prefill chunks and plain decodes in one forward), rollback of rejected drafts under preemption and
prefix caching (blocks never cached with rejected tokens, KV outside a step's tables poisoned),
seeded sampling with every option identical to the non-speculative engine (n-gram drafts are point
masses: engine/spec/rejection_sampler.py), the scheduler's and block pool's parts, and the
config's errors."""
from __future__ import annotations

import random

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from engine import LLM, SamplingParams
from engine.core.block_pool import BlockPool
from engine.core.sequence import Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.ngram import TokenBuffer, propose_ngram
from test_engine import StressRunner

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def free_drafts(request, monkeypatch):
    """The cost model (engine/spec/costs.py) follows this machine's step times; tests that
    count drafts make them free, so that acceptance alone decides how many are proposed."""
    if request.node.originalname not in ("test_step_cost_fit_and_worth_threshold", "test_measured_costs_turn_speculation_down"):
        from engine.spec.costs import StepCost
        monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# repetition_penalty < 1 favours the tokens seen so far: the random model's output falls into
# loops, which prompt lookup predicts several tokens at a time.
LOOPY = dict(temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=0.2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    base = rng.integers(3, 500, 7).tolist()
    return [base * 5, rng.integers(3, 500, 40).tolist(), rng.integers(3, 500, 3).tolist(),
            base[:3] * 9 + rng.integers(3, 500, 12).tolist(), rng.integers(3, 500, 70).tolist()]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    return LLM(model_dir).generate(prompts, SamplingParams(**LOOPY, logprobs=2))


# ---- the proposer

def test_ngram_takes_the_longest_then_latest_match():
    t = np.array
    # suffix [7, 8]: [7, 8] recurs at 0 and 4; [6, 7, 8] only at 3 -> what followed it, 9 1
    assert propose_ngram(t([7, 8, 1, 6, 7, 8, 9, 1, 2, 6, 7, 8]), 2, 1, 3) == [9, 1]
    # without the 3-gram ([5, 7, 8] at the end), the latest 2-gram match wins: 9, 1, 2
    assert propose_ngram(t([7, 8, 1, 6, 7, 8, 9, 1, 2, 5, 7, 8]), 3, 1, 3) == [9, 1, 2]
    # min 3: no 3-gram recurs
    assert propose_ngram(t([7, 8, 1, 6, 7, 8, 9, 1, 2, 5, 7, 8]), 3, 3, 3) == []
    # the match may overlap the suffix; the draft stops at the end of the context
    assert propose_ngram(t([4, 4, 4, 4]), 5, 1, 2) == [4]
    assert propose_ngram(t([1, 2, 3]), 2, 1, 3) == [] and propose_ngram(t([5]), 2, 1, 1) == []
    buf = TokenBuffer()
    ids = list(range(100))
    assert buf.sync(ids[:3]).tolist() == [0, 1, 2]
    assert buf.sync(ids).tolist() == ids            # grown past its first 64
    assert buf.sync(ids[:50]).tolist() == ids[:50]  # cut by a stop string: read again


def test_config_names_the_bad_key():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (2, 5, 8)
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)     # vLLM: one sets the other
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    c = SpeculativeConfig.parse(None, draft_model="/d")
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/d", 4)
    for bad, message in [
            ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
            ('{"method": "eagle3", "num_speculative_tokens": 2}', "eagle3 needs \"model\""),
            ('{"method": "ngram"}', "'num_speculative_tokens' is required"),
            ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must"),
            ('{"method": "ngram", "num_speculative_tokens": 2, "k": 1}', "unknown key 'k'"),
            ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
             '"prompt_lookup_max": 2}', "prompt_lookup_min \\(4\\) is larger"),
            ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
            ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}',
             "disable_by_batch_size must"),
            ("{not json", "not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="disagree"):
        SpeculativeConfig.parse('{"model": "/a", "num_speculative_tokens": 2}', draft_model="/b")


# ---- greedy: the same tokens, fewer forwards

def run_recorded(llm: LLM, prompts, params):
    """Generate, recording per step (verify rows, plain decodes, prefill chunks)."""
    engine, steps = llm.engine, []
    execute = engine.runner.execute

    def recording(sched, *batch):
        drafts = sum(1 for d in sched.num_drafts if d)
        plain = sum(1 for d, dec in zip(sched.num_drafts, sched.is_decode) if dec and not d)
        prefill = sum(1 for s, a in zip(sched.seqs, sched.num_computed) if a < s.num_prompt_tokens)
        steps.append((drafts, plain, prefill))
        return execute(sched, *batch)

    engine.runner.execute = recording
    return llm.generate(prompts, params), steps


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_is_token_identical_and_takes_fewer_forwards(model_dir, prompts, reference,
                                                            async_scheduling):
    # a 2-gram at least: some sequences find none some steps, and decode plainly
    llm = LLM(model_dir, speculative_config={**NGRAM, "prompt_lookup_min": 2},
              async_scheduling=async_scheduling, prefill_chunk_size=16,
              max_num_batched_tokens=64)
    outs, steps = run_recorded(llm, prompts, SamplingParams(**LOOPY, logprobs=2))
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
        assert out.num_output_tokens == len(ref.token_ids) == 48
        np.testing.assert_allclose([lp.logprob for lp in out.logprobs],
                                   [lp.logprob for lp in ref.logprobs], atol=1e-5)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 40 and stats.accepted_per_position[2] > 0, stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens     # some drafts were rejected
    # verify rows share steps with plain decodes and prefill chunks
    assert any(d and plain and prefill for d, plain, prefill in steps), steps
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
    # alone, the repetitive prompt's 48 tokens take far fewer than 48 forwards
    calls = llm.engine.runner.num_forward_calls
    out = llm.generate([prompts[0]], SamplingParams(**LOOPY))[0]
    assert out.token_ids == reference[0].token_ids
    assert llm.engine.runner.num_forward_calls - calls < 36


def test_quantized_weights_are_token_identical_under_batch_invariance(model_dir, prompts):
    """Q4_0 weights (quantized at load): their decode loop rounds activations to 8 bits for a few
    rows and takes float32 ones for more, so verify steps of 1 + 6 rows compute other logits
    than one-token decodes; --batch-invariant gives every row count one kernel."""
    params = SamplingParams(**{**LOOPY, "max_tokens": 40}, logprobs=0)
    ref = LLM(model_dir, isq="q4_0", batch_invariant=True).generate(prompts, params)
    llm = LLM(model_dir, isq="q4_0", batch_invariant=True,
              speculative_config={**NGRAM, "num_speculative_tokens": 6})
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    # the same logits bit for bit (without the switch they differ)
    assert [[lp.logprob for lp in o.logprobs] for o in outs] == \
        [[lp.logprob for lp in r.logprobs] for r in ref]
    assert llm.engine.speculator.stats.accepted_per_position[3] > 0


def test_without_a_match_nothing_is_drafted(model_dir):
    llm = LLM(model_dir, speculative_config={**NGRAM, "prompt_lookup_min": 3})
    prompt = list(range(3, 40))              # no 3-gram recurs, nor (greedy, short) in the output
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0]
    ref = LLM(model_dir).generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0]
    assert out.token_ids == ref.token_ids
    assert llm.engine.speculator.stats.num_draft_tokens == 0


# ---- rollback: preemption, prefix caching, stale KV

def test_rollback_with_preemption_and_prefix_caching(model_dir, prompts):
    """A pool too small for every sequence (preemption), prompts sharing blocks, then prompts
    that extend earlier outputs: their prefix-cache hits cover blocks that verify steps filled
    (with rejections). KV outside each step's tables is NaN: a rejected slot read before it is
    rewritten, or a block cached with a rejected token, changes the tokens."""
    shared = [prompts[1][:16] + p for p in prompts]
    params = SamplingParams(**LOOPY)
    ref_llm = LLM(model_dir, enable_prefix_caching=False)
    reference = ref_llm.generate(shared, params)
    llm = LLM(model_dir, speculative_config=NGRAM, block_size=8, num_kv_blocks=40,
              prefill_chunk_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    llm.engine.block_pool.shuffle_free_blocks(random.Random(3))
    StressRunner(llm.engine.runner, llm.engine.block_pool)
    outs = llm.generate(shared, params)
    for out, ref in zip(outs, reference):
        assert out.token_ids == ref.token_ids
    engine = llm.engine
    stats = engine.speculator.stats
    assert engine.scheduler.num_preemptions > 0 and engine.block_pool.prefix_cache_hits > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0
    assert engine.block_pool.num_free_blocks == 40
    # Second round: each prompt is an earlier prompt plus most of its output.
    extended = [p + out.token_ids[:37] for p, out in zip(shared, outs)]
    hits = engine.block_pool.prefix_cache_hits
    second = llm.generate(extended, SamplingParams(**{**LOOPY, "max_tokens": 16}))
    assert engine.block_pool.prefix_cache_hits - hits > 8 * len(extended)
    for out, ref in zip(second, ref_llm.generate(extended,
                                                 SamplingParams(**{**LOOPY, "max_tokens": 16}))):
        assert out.token_ids == ref.token_ids
    assert engine.block_pool.num_free_blocks == 40


def test_blocks_filled_by_verify_steps_are_cached_with_their_tokens(model_dir, prompts):
    """Every full block of a sequence decoded by verify steps (with rejections) is found by a
    later prompt made of its tokens, and gives the same continuation."""
    llm = LLM(model_dir, speculative_config=NGRAM, block_size=8)
    StressRunner(llm.engine.runner, llm.engine.block_pool)
    params = SamplingParams(**{**LOOPY, "max_tokens": 16})
    for prompt in prompts[:3]:
        first = llm.generate([prompt], SamplingParams(**LOOPY))[0]
        extended = prompt + first.token_ids[:41]
        out = llm.generate([extended], params)[0]
        assert out.num_cached_tokens == (len(extended) - 1) // 8 * 8
        assert out.token_ids == LLM(model_dir).generate([extended], params)[0].token_ids
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0


def test_rejected_drafts_are_uncomputed_and_their_blocks_freed(model_dir):
    """One verify step by hand: the drafts' slots are allocated, only the accepted rows count as
    computed, the blocks past the sequence's tokens go back to the head of the free queue, and
    only blocks full of accepted tokens are cached."""
    llm = LLM(model_dir, speculative_config={**NGRAM, "num_speculative_tokens": 8},
              block_size=8, num_kv_blocks=16, async_scheduling=False)
    engine, pool = llm.engine, llm.engine.block_pool
    prompt = [5, 6, 7, 8] * 3                  # 12 tokens: the lookup proposes 5 6 7 8 ...
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=20,
                                                   ignore_eos=True))
    engine.step()                              # the prompt, the first token sampled
    seq = engine.requests["r"].seqs[0]
    first = seq.output_token_ids[0]
    assert (seq.num_computed_tokens, len(seq.block_table)) == (12, 2)
    engine.speculator.plan = lambda s, m: (8, [6, 7, 8, 5, 6, 7, 8, 5])   # a known draft
    sched = engine.scheduler.schedule()
    assert sched.num_new_tokens == [9] and sched.num_drafts == [8]
    assert len(seq.block_table) == 3           # slots for positions 12..20: one more block
    tail = seq.block_table[2]
    result = engine._run_step(sched, engine.runner.prepare(sched))
    verified = result[-1]
    accepted = verified.num_accepted[0]
    engine._commit(sched, result)
    emitted = verified.tokens[0]
    assert emitted[:accepted] == [6, 7, 8, 5, 6, 7, 8, 5][:accepted]
    assert seq.output_token_ids == [first] + emitted
    assert seq.num_computed_tokens == 13 + accepted == seq.num_tokens - 1
    kept = pool.num_blocks_for(seq.num_tokens)
    assert len(seq.block_table) == kept
    if kept < 3:                               # the tail block held only rejected rows: freed
        assert next(iter(pool.free_queue)) == tail
    full = seq.num_computed_tokens // 8
    cached = {b.block_id for b in pool.cached_blocks.values()}
    assert cached == set(seq.block_table[:full])


def test_trim_frees_only_uncached_unshared_tail_blocks():
    pool = BlockPool(6, 4)
    seq = Sequence(list(range(10)))
    assert pool.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10
    pool.cache_full_blocks(seq)                  # blocks 0, 1 full and cached
    assert pool.allocate_slots(seq, 6)           # 16 slots: 4 blocks
    ids = list(seq.block_table)
    pool.trim(seq, 11)                           # 11 tokens need 3 blocks
    assert seq.block_table == ids[:3] and seq.trimmed_to == 3
    assert list(pool.free_queue)[0] == ids[3] and pool.num_free_blocks == 3
    pool.trim(seq, 11)                           # nothing more to free
    assert seq.block_table == ids[:3]
    seq.block_table.append(ids[1])               # a cached block may never be trimmed
    pool.blocks[ids[1]].ref_count += 1
    with pytest.raises(AssertionError, match="trimmed while shared or cached"):
        pool.trim(seq, 11)


# ---- sampling: the non-speculative engine's tokens for the same seed

SAMPLED = [
    dict(temperature=0.9, seed=1),
    dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=2),
    dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.4,
         repetition_penalty=0.3, seed=3),
    dict(temperature=0.8, logit_bias={7: 4.0, 9: 3.0, 2: 5.0}, min_tokens=20, seed=4),
    dict(temperature=0, repetition_penalty=0.3, logprobs=3, seed=5),
    dict(temperature=0.6, repetition_penalty=0.3, logprobs=2, n=2, seed=6),
    # counts matter (each occurrence moves the logit): a row must count the drafts before it
    dict(temperature=0, presence_penalty=-1.0, frequency_penalty=-0.3, seed=7),
]


@pytest.mark.parametrize("logprobs_mode", ["raw", "processed"])
def test_seeded_sampling_equals_the_non_speculative_engine(model_dir, prompts, logprobs_mode):
    """n-gram drafts are point masses: a draft is accepted when it equals the token the target
    draws at that position with the position's own noise, so every option (penalties counting
    the drafts before it, min_tokens, logit_bias, filters, the seed's counter) gives the same
    tokens and logprobs as one token at a time."""
    params = [SamplingParams(max_tokens=40, **kw, **({} if kw.get("min_tokens") else
                                                      {"ignore_eos": True}))
              for kw in SAMPLED for _ in range(2)]
    ps = [prompts[i % 2] for i in range(len(params))]    # a repetitive and a random prompt
    ref = LLM(model_dir, logprobs_mode=logprobs_mode).generate(ps, params)
    llm = LLM(model_dir, logprobs_mode=logprobs_mode,
              speculative_config={**NGRAM, "disable_by_batch_size": None})
    outs = llm.generate(ps, params)
    for out, r, p in zip(outs, ref, params):
        for o, rr in zip(out if isinstance(out, list) else [out], r if isinstance(r, list) else [r]):
            assert o.token_ids == rr.token_ids, p
            assert o.finish_reason == rr.finish_reason
            if p.logprobs is not None:
                np.testing.assert_allclose([lp.logprob for lp in o.logprobs],
                                           [lp.logprob for lp in rr.logprobs], atol=1e-4)
                assert [lp.top_ids for lp in o.logprobs] == [lp.top_ids for lp in rr.logprobs]
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 20 and stats.num_draft_tokens > stats.num_accepted_tokens


def test_eos_and_max_tokens_inside_an_accepted_run(model_dir, prompts):
    """A run of accepted tokens stops at the first stop token or at max_tokens: the tokens after
    it are dropped, as one token at a time never draws them."""
    base = dict(temperature=0, repetition_penalty=0.2)
    ref_llm, llm = LLM(model_dir), LLM(model_dir, speculative_config=NGRAM)
    free = ref_llm.generate([prompts[0]], SamplingParams(**base, max_tokens=40,
                                                         ignore_eos=True))[0].token_ids
    stop = free[25]                                   # a token of the loop, as a stop token
    for params in (SamplingParams(**base, max_tokens=40, stop_token_ids=[stop]),
                   SamplingParams(**base, max_tokens=23, ignore_eos=True),
                   SamplingParams(**base, max_tokens=40, ignore_eos=True,
                                  stop_token_ids=[stop], min_tokens=30)):
        ref = ref_llm.generate([prompts[0]], params)[0]
        out = llm.generate([prompts[0]], params)[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == (
            ref.token_ids, ref.finish_reason, ref.stop_reason)
        assert out.num_output_tokens == len(ref.token_ids)
    assert llm.engine.speculator.stats.accepted_per_position[1] > 0


def test_beams_and_prompt_logprobs_share_steps_with_verify_rows(model_dir, prompts):
    """A beam search (never speculates) and a request asking for prompt logprobs run beside
    speculating sequences: their logits rows sit among the verify rows."""
    beam = SamplingParams(use_beam_search=True, n=2, best_of=3, max_tokens=12, ignore_eos=True,
                          temperature=0)
    plp = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, ignore_eos=True)
    loopy = SamplingParams(**{**LOOPY, "max_tokens": 30})
    ps = [prompts[0], prompts[1], prompts[4], prompts[3]]
    params = [loopy, beam, plp, loopy]
    ref = LLM(model_dir).generate(ps, params)
    llm = LLM(model_dir, speculative_config=NGRAM, prefill_chunk_size=16,
              max_num_batched_tokens=64)
    outs, steps = run_recorded(llm, ps, params)
    assert [o.token_ids for o in outs[1]] == [r.token_ids for r in ref[1]]
    for i in (0, 2, 3):
        assert outs[i].token_ids == ref[i].token_ids
    np.testing.assert_allclose([e.logprob for e in outs[2].prompt_logprobs[1:]],
                               [e.logprob for e in ref[2].prompt_logprobs[1:]], atol=1e-5)
    assert any(d and prefill for d, _, prefill in steps)       # verify rows beside the prefill
    assert llm.engine.speculator.stats.num_accepted_tokens > 5


def test_draft_length_follows_the_acceptance_estimate():
    from engine.spec.adaptive import PAUSE_STEPS, SpecState
    st = SpecState()
    assert st.acceptance == 0.75 and st.num_drafts_wanted(4, 0.1, 0) == 4   # 0.75^4 = 0.32
    assert st.num_drafts_wanted(16, 0.1, 0) == 8                            # 0.75^8 = 0.10
    assert st.num_drafts_wanted(16, 0.0, 0) == 16                           # drafts are free
    for _ in range(3):
        st.observe(4, 4)
    assert st.acceptance > 0.9 and st.num_drafts_wanted(16, 0.1, 1) == 16
    for _ in range(4):                  # one draft in two accepted: a ~ 0.5
        st.observe(2, 1)
    a = st.acceptance
    assert 0.5 < a < 0.75 and st.num_drafts_wanted(8, 0.1, 2) == int(np.log(0.1) / np.log(a))
    assert st.num_drafts_wanted(8, 0.25, 2) < st.num_drafts_wanted(8, 0.1, 2)
    for _ in range(12):                 # nothing accepted: a -> 0, the sequence pauses
        st.observe(1, 0)
    assert st.num_drafts_wanted(4, 0.1, 10) == 0 and st.paused_until == 10 + PAUSE_STEPS
    assert st.resting(10 + PAUSE_STEPS - 2) and not st.resting(10 + PAUSE_STEPS - 1)
    wanted = [st.num_drafts_wanted(4, 0.1, step) for step in range(11, 11 + PAUSE_STEPS)]
    assert wanted == [0] * (PAUSE_STEPS - 1) + [1]          # then a one-draft probe
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (19, 32, 16)
    # a draft that costs as much as a decoded token is never worth it
    st = SpecState()
    assert st.num_drafts_wanted(4, 1.0, 0) == 0 and st.paused_until == PAUSE_STEPS


def test_step_cost_fit_and_worth_threshold():
    from engine.spec.costs import StepCost
    memory_bound, compute_bound = StepCost(), StepCost()
    assert memory_bound.min_use(1) == 0.0                   # nothing measured: speculate
    rng = np.random.default_rng(0)
    for rows in rng.integers(1, 6, 60):
        noise = 1 + 0.05 * rng.standard_normal()
        memory_bound.observe(int(rows), (10e-3 + 0.2e-3 * rows) * noise)
        compute_bound.observe(int(rows), (1e-3 + 4e-3 * rows) * noise)
    fixed, per_row = memory_bound.theta
    assert abs(fixed - 10e-3) < 1e-3 and abs(per_row - 0.2e-3) < 0.2e-3
    assert memory_bound.min_use(1) < 0.05                   # a verify row ~2% of a token
    assert compute_bound.min_use(1) > 0.7                   # ~80%: one draft barely pays
    assert compute_bound.min_use(8) > compute_bound.min_use(1)  # bigger batches: worse
    memory_bound.observe_draft(6e-3, 2)                     # a draft model's 3 ms per draft
    assert 0.3 < memory_bound.min_use(1) < 0.35
    # one row count only: the ratio prior splits the time (per row = 5% of the fixed part)
    one = StepCost()
    for _ in range(10):
        one.observe(1, 21e-3)
    assert abs(one.theta[0] - 20e-3) < 1e-4 and abs(one.theta[1] - 1e-3) < 1e-4


def test_measured_costs_turn_speculation_down(model_dir, prompts, monkeypatch):
    """The engine feeds its step times to the cost model, and plan() follows its threshold:
    step times that grow with the rows as fast as decoded tokens do stop the drafting."""
    from engine.spec.costs import StepCost
    observe = StepCost.observe

    def run(per_row: float) -> int:
        monkeypatch.setattr(StepCost, "observe", lambda self, rows, seconds: observe(
            self, rows, 1e-3 + per_row * rows))
        llm = LLM(model_dir, speculative_config=NGRAM)
        out = llm.generate(prompts[:1], SamplingParams(**{**LOOPY, "max_tokens": 64}))[0]
        assert out.token_ids == LLM(model_dir).generate(
            prompts[:1], SamplingParams(**{**LOOPY, "max_tokens": 64}))[0].token_ids
        return llm.engine.speculator.stats.num_draft_tokens, llm.engine.num_scheduled_ahead

    # costly: drafts until the first steps are measured (and a one-draft probe now and then);
    # while the sequence rests, steps are scheduled ahead again (async scheduling)
    (cheap, cheap_ahead), (costly, costly_ahead) = run(0.01e-3), run(5e-3)
    assert cheap > 3 * costly and costly < 25, (cheap, costly)
    assert costly_ahead > 20 and cheap_ahead < costly_ahead, (cheap_ahead, costly_ahead)


def test_stats_and_outputs_count_drafts(model_dir, prompts):
    llm = LLM(model_dir, speculative_config=NGRAM)
    outs = llm.generate(prompts[:2], SamplingParams(**LOOPY))
    stats, spec = llm.engine.stats(), llm.engine.speculator.stats
    assert stats.spec_method == "ngram"
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) \
        == (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    assert stats.spec_accepted_per_position[0] >= stats.spec_accepted_per_position[1] > 0
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert stats.spec_acceptance_rate == spec.num_accepted_tokens / spec.num_draft_tokens
    assert stats.spec_mean_accepted_length == 1 + spec.num_accepted_tokens / spec.num_drafts
    counts = [o.spec_decode for o in outs]
    assert sum(c.num_draft_tokens for c in counts) == spec.num_draft_tokens
    assert sum(c.num_accepted_tokens for c in counts) == spec.num_accepted_tokens
    assert LLM(model_dir).generate(prompts[:1], SamplingParams(**LOOPY))[0].spec_decode is None
    assert LLM(model_dir).engine.stats().spec_method is None


def test_batch_gate_turns_speculation_off_for_large_steps(model_dir, prompts):
    llm = LLM(model_dir, speculative_config={**NGRAM, "disable_by_batch_size": 2})
    outs, steps = run_recorded(llm, prompts[:4], SamplingParams(**{**LOOPY, "max_tokens": 24}))
    # While more than two sequences run, no step verifies a draft; they all finish together,
    # so none ever does.
    assert all(d == 0 for d, _, _ in steps)
    one, steps = run_recorded(llm, prompts[:1], SamplingParams(**{**LOOPY, "max_tokens": 24}))
    assert any(d for d, _, _ in steps)
    ref = LLM(model_dir).generate(prompts[:4], SamplingParams(**{**LOOPY, "max_tokens": 24}))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
