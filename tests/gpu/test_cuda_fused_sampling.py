"""The one-launch sampler (kernels sampling=fused, issue 12 item 5): engine/sampling/sampler.py on the
CUDA backend with `fused_sampling` on, against the same Sampler on the CPU backend
(pyx/cpu_sampling.py, pyx/cpu_kernels.c) with the same seeds and positions.

The fused kernel draws with the CPU's counter-based RNG, so the tokens must be the CPU's, on both
of its paths (the filtered row's candidates compacted into shared memory, or, when they do not
fit or the row holds a NaN, the filter's passes over the whole row): greedy
rows bit for bit always, sampled rows except where a filter threshold or the top two Gumbel values
tie within float rounding (filter_ambiguous, as test_cuda_ops' filter tests). Batches mix greedy
rows (temperature 0 and top_k 1), every filter, logit_bias, min_tokens, repetition, presence and
frequency penalties, and the structured-output token mask; the references are shown to move when
a penalty or the seed is switched off or changed, so a kernel that skipped them would fail.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.sampling.sampler import Sampler, apply_filters, apply_penalties
from engine.sampling.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from test_cuda_ops import filter_ambiguous, gumbel_values, to_dev, to_host

EOS = {2}

PARAMS = [  # one row each, repeated over the batch with fresh seeds
    dict(temperature=0.0),                                    # greedy
    dict(temperature=0.8, top_k=1),                           # greedy by top_k 1
    dict(temperature=1.0, seed=0),                            # plain Gumbel-max
    dict(temperature=0.7, top_k=50),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=1.2, min_p=0.05),
    dict(temperature=0.6, top_k=40, top_p=0.8, min_p=0.02),
    dict(temperature=0.0, logit_bias={7: 100.0}),             # greedy, forced by a bias
    dict(temperature=0.9, top_k=20, repetition_penalty=1.5),
    dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5, top_p=0.95),
    dict(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0),
    dict(temperature=0.8, min_tokens=10, logit_bias={2: 30.0}),  # EOS masked despite its bias
    dict(temperature=1.0, top_k=6000),                        # more candidates than fit
    dict(temperature=1.1, top_p=0.5, min_p=0.1),              # top-p bound, min-p after it
    dict(temperature=0.9, top_k=3000, min_p=0.2),             # min-p bound above the k-th
]


def make_seqs(rng, B, V, with_params=True):
    """B sequences with prompts and some output tokens (the penalties' counts), seeded."""
    seqs = []
    for i in range(B):
        kw = dict(PARAMS[i % len(PARAMS)]) if with_params else {}
        kw.setdefault("seed", int(rng.integers(0, 2**62)))
        prompt = rng.integers(0, V, 12).tolist()
        seq = Sequence(prompt, SamplingParams(**kw))
        for t in rng.integers(0, min(V, 64), 3 + i % 4):   # repeats: frequency counts > 1
            seq.append_token(int(t))
        seqs.append(seq)
    return seqs


def fused_sample(b, logits, seqs, token_bitmask=None):
    saved = b.fused_sampling
    b.fused_sampling = True
    try:
        dev = to_dev(b, logits)
        tokens = Sampler(b).sample(dev, seqs, EOS, token_bitmask=token_bitmask)
        np.testing.assert_array_equal(to_host(b, dev), logits)   # the caller's logits untouched
        return tokens
    finally:
        b.fused_sampling = saved


def row_params(seqs):
    ps = [s.sampling_params for s in seqs]
    return (np.array([p.temperature for p in ps], np.float32),
            np.array([p.top_k for p in ps], np.int32),
            np.array([p.top_p for p in ps], np.float32),
            np.array([p.min_p for p in ps], np.float32))


def assert_cpu_tokens(got, want, logits, seqs, max_differ=2):
    """got == want on every greedy row; a sampled row may differ only where one of the two tokens
    sits at a threshold tie (the penalised logits' filter_ambiguous) or at a Gumbel near-tie
    between the two (of the CPU's filtered logits). `logits`: the sampler's input after any
    token mask."""
    greedy = np.array([s.sampling_params.greedy for s in seqs])
    np.testing.assert_array_equal(got[greedy], want[greedy])
    differ = np.flatnonzero(got != want)
    if not differ.size:
        return
    penalised = apply_penalties(logits, seqs, EOS)
    t, k, p, m = row_params(seqs)
    t = np.where(greedy, np.float32(1), t)
    amb = filter_ambiguous(penalised, t, k, p, m)
    seeds = np.array([s.seed for s in seqs], np.uint64)
    positions = np.array([s.num_output_tokens for s in seqs], np.int64)
    vals = gumbel_values(apply_filters(penalised, t, k, p, m), seeds, positions)
    for r in differ:
        top2 = np.argsort(vals[r])[-2:]
        gap = vals[r, top2[1]] - vals[r, top2[0]]
        # a token kept on one side only can win only there, so it is one of the two
        assert amb[r, got[r]] or amb[r, want[r]] or (gap < 1e-9 and got[r] in top2), (
            f"row {r} ({seqs[r].sampling_params}): cuda {got[r]}, cpu {want[r]}")
    assert len(differ) <= max_differ, f"{len(differ)} of {len(got)} tokens differ"


@pytest.mark.parametrize("spread", [0.5, 4.0, 30.0])
@pytest.mark.parametrize("B,V", [(15, 1000), (45, 32000), (30, 128256), (2, 128256)])
def test_fused_sampler_matches_cpu(cuda_f32, cpu, B, V, spread):
    """Flat rows (spread 0.5: top-p and min-p keep too many tokens to compact, so the kernel
    falls back to passes over the row), typical ones (4) and peaked ones (30: a few candidates)."""
    rng = np.random.default_rng(B * V + int(spread * 10))
    logits = (rng.standard_normal((B, V)) * spread).astype(np.float32)
    seqs = make_seqs(rng, B, V)
    want = Sampler(cpu).sample(logits, seqs, EOS)
    got = fused_sample(cuda_f32, logits, seqs)
    assert_cpu_tokens(got, want, logits, seqs)
    # The reference moves when the penalties are switched off: row 7 (logit_bias 100 on token 7)
    # samples 7 only with them. Not on the peaked rows: at spread 30 a row's top logits reach
    # 100 and more by themselves, so the bias does not decide there (the 2026-11-28 H200 run).
    if B > 11 and spread < 30:
        assert want[7] == 7 and int(np.argmax(logits[7])) != 7
        assert want[11] != 2   # min_tokens masks EOS whatever its bias


def test_fused_sampler_seeds_and_positions(cuda_f32, cpu):
    """Unfiltered rows at V = 128k over many seeds and three positions each: each the CPU's
    Gumbel-max draw; new seeds move most of the draws."""
    rng = np.random.default_rng(5)
    B, V = 64, 128256
    logits = (rng.standard_normal((B, V)) * 2).astype(np.float32)
    seqs = make_seqs(rng, B, V, with_params=False)
    for _ in range(3):
        want = Sampler(cpu).sample(logits, seqs, EOS)
        got = fused_sample(cuda_f32, logits, seqs)
        assert_cpu_tokens(got, want, logits, seqs)
        for s in seqs:
            s.append_token(int(rng.integers(0, V)))
    reseeded = make_seqs(np.random.default_rng(6), B, V, with_params=False)
    other = Sampler(cpu).sample(logits, reseeded, EOS)
    assert (other != Sampler(cpu).sample(logits, seqs, EOS)).sum() > B // 2


def test_fused_sampler_edge_rows(cuda_f32, cpu):
    """NaN, +inf and all -inf rows, greedy and sampled: the CPU's documented answers."""
    rng = np.random.default_rng(3)
    V = 5000
    logits = rng.standard_normal((6, V)).astype(np.float32)
    logits[0, 17] = np.nan                   # greedy: NaN never wins
    logits[1, :] = -np.inf                   # sampled, nothing left: token 0
    logits[2, 3] = np.inf                    # greedy: the +inf
    logits[3, 3] = np.inf                    # sampled with top-k: the +inf's token
    logits[4, ::2] = -np.inf                 # sampled: only odd tokens
    logits[5, :] = -np.inf                   # greedy: all -inf gives 0
    kws = [dict(temperature=0), dict(temperature=1.0, top_p=0.5), dict(temperature=0),
           dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_k=100, min_p=0.1),
           dict(temperature=0)]
    seqs = [Sequence([1, 2, 3], SamplingParams(seed=i, **kw)) for i, kw in enumerate(kws)]
    want = Sampler(cpu).sample(logits, seqs, EOS)
    got = fused_sample(cuda_f32, logits, seqs)
    np.testing.assert_array_equal(got, want)
    assert want.tolist()[:4] == [int(np.nanargmax(logits[0])), 0, 3, 3]
    assert want[4] % 2 == 1 and want[5] == 0


def test_fused_sampler_with_token_bitmask(cuda_f32, cpu):
    """The structured-output mask runs first: every row's token is one the mask allows."""
    rng = np.random.default_rng(4)
    B, V = 12, 4096
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    seqs = make_seqs(rng, B, V)
    bits = rng.integers(0, 2**32, (B, (V + 31) // 32), dtype=np.uint64).astype(np.uint32)
    mask = (bits.view(np.int32), np.arange(B, dtype=np.int32))
    want = Sampler(cpu).sample(logits, seqs, EOS, token_bitmask=mask)
    got = fused_sample(cuda_f32, logits, seqs, token_bitmask=mask)
    col = np.arange(V)
    allowed = ((bits[:, col // 32] >> (col % 32).astype(np.uint32)) & 1).astype(bool)
    assert_cpu_tokens(got, want, np.where(allowed, logits, -np.inf).astype(np.float32), seqs)
    assert allowed[np.arange(B), want].all()
    assert not allowed[np.arange(B), Sampler(cpu).sample(logits, seqs, EOS)].all()


def test_sample_fused_rejects_bad_arrays(cuda_f32):
    b = cuda_f32
    B, V = 2, 100
    logits = to_dev(b, np.zeros((B, V), np.float32))
    args = [to_dev(b, a) for a in (np.zeros(B, np.uint8), np.ones(B, np.float32),
                                    np.zeros(B, np.int32), np.ones(B, np.float32),
                                    np.zeros(B, np.float32), np.zeros(B, np.uint64),
                                    np.zeros(B, np.int64))]
    out = to_dev(b, np.zeros(B, np.int64))
    with pytest.raises(ValueError, match="sample_fused: greedy has dtype"):
        b.sample_fused(logits, to_dev(b, np.zeros(B, np.int32)), *args[1:], out)
    with pytest.raises(ValueError, match="sample_fused: need logits"):
        b.sample_fused(logits, *args[:-1], to_dev(b, np.zeros(B + 1, np.int64)), out)
    with pytest.raises(ValueError, match="sample_fused: rows, cols"):
        b.sample_fused(logits, *args, out, penalties=(
            to_dev(b, np.zeros(2, np.int32)), to_dev(b, np.zeros(2, np.int32)),
            to_dev(b, np.zeros(2, np.float32)), to_dev(b, np.ones(2, np.float32)),
            to_dev(b, np.zeros(1, np.float32))))
