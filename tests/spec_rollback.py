"""A check shared by the head proposers' tests (EAGLE-3, MTP): rollback leaves nothing behind.
After verify steps with rejections, preemption and prefix-cache hits, a head's first draft logits
for a context equal those of a fresh engine that prefills that context: every row the head reads
was rewritten after its rejected draft."""
from __future__ import annotations

import random

import numpy as np

from engine import LLM, SamplingParams
from test_engine import StressRunner


def assert_drafts_depend_only_on_the_context(target: str, spec: dict, one_draft: dict,
                                             prompts: list[list[int]], stress=None,
                                             tolerance: float = 1e-4) -> None:
    """spec: the speculative config under test (adaptivity off); one_draft: the same with one
    draft token, for the fresh engines. Prompts share 19 tokens: they part inside a block.
    stress: wraps the engine's runner (StressRunner unless given: a hybrid model's caches need
    their own). tolerance: rtol and atol of the logits (a hybrid target's features differ in
    rounding between its chunked and token-by-token recurrences)."""
    shared = [prompts[1][:19] + p for p in prompts]
    llm = LLM(target, speculative_config=spec, block_size=8, num_kv_blocks=28,
              prefill_chunk_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    engine = llm.engine
    engine.block_pool.shuffle_free_blocks(random.Random(3))
    if stress is None:
        StressRunner(engine.runner, engine.block_pool)
    else:
        stress(engine)
    proposer = engine.speculator.draft_model
    step_logits, seen = proposer._step_logits, []

    def spy(batch, tables, plans, live, rows, tokens, step):
        out = step_logits(batch, tables, plans, live, rows, tokens, step)
        if step == 0:
            for j, i in enumerate(live):
                seen.append((list(plans[i][1].token_ids), np.array(out[j], np.float64)))
        return out

    proposer._step_logits = spy
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(shared, params)
    want = LLM(target).generate(shared, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    stats = engine.speculator.stats
    assert engine.scheduler.num_preemptions > 0 and engine.block_pool.prefix_cache_hits > 0
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    late = [s for s in seen if len(s[0]) - len(shared[0]) > 10][::3][:6]
    assert len(late) >= 4
    for context, logits in late:
        fresh = LLM(target, speculative_config=one_draft)
        got = []
        fresh_proposer = fresh.engine.speculator.draft_model
        fresh_logits = fresh_proposer._step_logits

        def first_only(batch, tables, plans, live, rows, tokens, step):
            out = fresh_logits(batch, tables, plans, live, rows, tokens, step)
            got.append(np.array(out[0], np.float64))
            return out

        fresh_proposer._step_logits = first_only
        # the context's last token is the target's greedy choice: a prefill of the rest
        # samples it, and the next step drafts from the same context
        fresh.generate([context[:-1]], SamplingParams(temperature=0, max_tokens=3,
                                                      ignore_eos=True))
        finite = np.isfinite(logits)    # -inf outside a head's draft vocabulary
        np.testing.assert_allclose(got[0][finite], logits[finite], rtol=tolerance,
                                   atol=tolerance)
