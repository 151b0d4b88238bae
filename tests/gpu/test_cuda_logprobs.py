"""The logprobs gather on CUDA (engine/sampling/logprobs.py on CuPy arrays) against the CPU backend and a
float64 NumPy reference: chosen logprobs, ranks, top-k ids (ties by id) and values, over a real
vocabulary size, with filtered (-inf) rows as processed logprobs have; and the sampler's
logprobs, raw and processed, equal on both backends for the same logits."""
from __future__ import annotations

import numpy as np
import pytest

from engine.sampling.logprobs import gather_logprobs
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_params import SamplingParams
from engine.core.sequence import Sequence


def log_softmax64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("V, k", [(512, 5), (151936, 20), (32000, 0)])
def test_gather_logprobs_cuda_matches_cpu(cuda_f32, cpu, V, k):
    rng = np.random.default_rng(V)
    logits = rng.normal(0, 4, (7, V)).astype(np.float32)
    logits[1, [11, 3, 400]] = 30.0                     # a tie for first: ranked by id
    logits[2, V // 2:] = -np.inf                       # a filtered row
    tokens = rng.integers(0, V // 2, 7)
    got = gather_logprobs(cuda_f32, cuda_f32.asarray(logits), tokens, k)
    want = gather_logprobs(cpu, logits, tokens, k)
    assert all(isinstance(a, np.ndarray) for a in got)   # small host arrays come back
    np.testing.assert_allclose(got[0], want[0], atol=2e-5)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[3], want[3], atol=2e-5)
    ref = log_softmax64(logits)
    np.testing.assert_allclose(got[0], ref[np.arange(7), tokens], atol=2e-5)
    if k:
        assert got[2][1, :3].tolist() == [3, 11, 400]


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_sampler_logprobs_cuda_match_cpu(cuda_f32, cpu, mode):
    rng = np.random.default_rng(1)
    V = 4096
    logits = rng.normal(0, 3, (4, V)).astype(np.float32)

    def seqs():
        params = [SamplingParams(temperature=0, logprobs=5),
                  SamplingParams(temperature=0.8, top_k=50, seed=3, logprobs=2),
                  SamplingParams(temperature=1.0, top_p=0.9, seed=4),
                  SamplingParams(temperature=0.7, seed=5, logprobs=0, logit_bias={7: 5.0},
                                 repetition_penalty=1.3)]
        return [Sequence([1, 7, 9], p) for p in params]

    t_gpu, lp_gpu = Sampler(cuda_f32).sample_with_logprobs(cuda_f32.asarray(logits), seqs(),
                                                           {0}, mode)
    t_cpu, lp_cpu = Sampler(cpu).sample_with_logprobs(logits, seqs(), {0}, mode)
    assert t_gpu.tolist() == t_cpu.tolist()
    assert lp_gpu[2] is None and lp_cpu[2] is None
    for g, c in zip(lp_gpu, lp_cpu):
        if c is None:
            continue
        assert (g.token_id, g.top_ids, g.rank) == (c.token_id, c.top_ids, c.rank)
        np.testing.assert_allclose([g.logprob, *g.top_logprobs], [c.logprob, *c.top_logprobs],
                                   atol=2e-5)
