"""Preemption at high concurrency (issue 13, item 4): 32 requests at once, in chunks of 8 tokens,
on a KV pool that holds a few of them, so sequences are preempted again and again, including
decodes already scheduled in the step that a prefill chunk then needs the blocks of; every
request's greedy tokens must still equal transformers'."""
import random

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from engine import LLM, SamplingParams
from engine.core.scheduler import SchedulerOutput
from hf_oracle import assert_matches, hf_greedy, load_hf
from test_engine import StressRunner

GEN = 12
NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(13)
    return [rng.integers(0, 500, int(n)).tolist() for n in rng.integers(1, 64, NUM_REQUESTS)]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    model = load_hf(model_dir)
    return [hf_greedy(model, p, GEN) for p in prompts]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_32_requests_on_a_tiny_pool_equal_transformers(model_dir, prompts, reference,
                                                       prefix_caching, monkeypatch):
    # 24 blocks of 8 tokens (192): a few of the 32 sequences (up to 75 tokens each) fit.
    llm = LLM(model_dir, block_size=8, num_kv_blocks=24, max_num_seqs=NUM_REQUESTS,
              max_num_batched_tokens=64, prefill_chunk_size=8,
              enable_prefix_caching=prefix_caching)
    llm.engine.block_pool.shuffle_free_blocks(random.Random(11))
    stress = StressRunner(llm.engine.runner, llm.engine.block_pool)
    taken_out = []          # sequences preempted after they were scheduled in the same step
    remove = SchedulerOutput._remove
    monkeypatch.setattr(SchedulerOutput, "_remove",
                        lambda out, seq: taken_out.append(seq) or remove(out, seq))

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert_matches(out.token_ids, ref, label=f"request {i}")
    assert llm.engine.scheduler.num_preemptions >= NUM_REQUESTS
    assert taken_out
    assert max(rows for rows, *_ in stress.steps) >= 5
    assert llm.engine.block_pool.num_free_blocks == 24
