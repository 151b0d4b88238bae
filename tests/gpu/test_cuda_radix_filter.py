"""The radix-select logits filter (kernels filter=radix, issue 12 item 5 / brief item 3)
against the CPU sampler (pyx/cpu_sampling.py through the CPU backend), the float64 oracle
(tests/reference.py) and the bisection kernel it replaces.

top-k / top-p / min-p / temperature rows of the vocabulary sizes that matter (1k, 50k, 128k),
rows full of ties, rows holding NaN or +inf (top-p then bisects), and sampled tokens: the radix
filter then the Gumbel-max kernel give the CPU's tokens for many seeds and parameter mixes,
except where a threshold or the top two Gumbel values tie within rounding.
"""
from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from test_cuda_ops import FILTER_ROWS, filter_ambiguous, gumbel_values, to_dev, to_host


def params(rows):
    return tuple(np.array(c, dt) for c, dt in zip(zip(*rows), (np.float32, np.int32, np.float32,
                                                                np.float32)))


def gpu_filter(b, logits, t, k, p, m, radix):
    saved = b.radix_filter
    b.radix_filter = radix
    try:
        ld = to_dev(b, logits)
        b.filter_logits(ld, *(to_dev(b, a) for a in (t, k, p, m)))
        return to_host(b, ld)
    finally:
        b.radix_filter = saved


@pytest.mark.parametrize("spread", [3.0, 10.0])
@pytest.mark.parametrize("B,V", [(8, 1000), (16, 50000), (8, 128256)])
def test_radix_filter_matches_cpu(cuda_f32, cpu, B, V, spread):
    b = cuda_f32
    rng = np.random.default_rng(B + V + int(spread) + 1)
    logits = (rng.standard_normal((B, V)) * spread).astype(np.float32)
    logits[3, rng.choice(V, V // 10, replace=False)] = -np.inf
    rows = [FILTER_ROWS[i % len(FILTER_ROWS)] for i in range(B)]
    t, k, p, m = params(rows)
    got = gpu_filter(b, logits, t, k, p, m, radix=True)
    on_cpu = logits.copy()
    cpu.filter_logits(on_cpu, t, k, p, m)
    want = ref.filter_logits(logits, t, k, p, m)
    amb = filter_ambiguous(logits, t, k, p, m)
    kept = np.isfinite(got)
    for other, name in ((on_cpu, "cpu"), (want, "oracle")):
        differ = (kept != np.isfinite(other)) & ~amb
        assert not differ.any(), f"{name}: kept sets differ at {np.argwhere(differ)[:5].tolist()}"
    both = kept & np.isfinite(want)
    np.testing.assert_allclose(got[both], want[both], rtol=1e-6, atol=1e-6)
    # top-k alone is exact integer counting in both kernels: bit for bit the bisection's rows
    bis = gpu_filter(b, logits, t, k, p, m, radix=False)
    topk_only = (k > 0) & (p >= 1.0) & (m <= 0.0)
    np.testing.assert_array_equal(got[topk_only].view(np.uint32), bis[topk_only].view(np.uint32))


@pytest.mark.parametrize("k", [1, 2, 7, 100, 999])
def test_radix_top_k_with_ties(cuda_f32, cpu, k):
    """Logits on a coarse grid (many equal values; negative, zero, -0.0): the k-th largest and
    its whole tie group, as the bisection and the CPU keep them."""
    b = cuda_f32
    rng = np.random.default_rng(k)
    logits = np.round(rng.standard_normal((4, 1000)) * 2).astype(np.float32)
    logits[1] = -0.0
    logits[1, :3] = 0.0
    logits[2, ::2] = -np.inf
    t, kk, p, m = params([(1.0, k, 1.0, 0.0)] * 4)
    got = gpu_filter(b, logits, t, kk, p, m, radix=True)
    on_cpu = logits.copy()
    cpu.filter_logits(on_cpu, t, kk, p, m)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(on_cpu))
    bis = gpu_filter(b, logits, t, kk, p, m, radix=False)
    np.testing.assert_array_equal(got.view(np.uint32), bis.view(np.uint32))


def test_radix_filter_nan_and_inf_rows(cuda_f32):
    """Rows with NaN or +inf take the bisection for top-p (their masses are not in [0, 1]); the
    result equals the bisection kernel's bit for bit."""
    b = cuda_f32
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((4, 5000)).astype(np.float32)
    logits[0, 17] = np.nan
    logits[1, 3] = np.inf
    logits[2, :] = -np.inf
    logits[2, 10] = 1.0
    logits[3, [5, 6]] = np.nan
    t, k, p, m = params([(1.0, 0, 0.9, 0.0), (0.7, 20, 0.8, 0.0), (1.0, 0, 0.5, 0.1),
                         (1.0, 3, 1.0, 0.0)])
    got = gpu_filter(b, logits, t, k, p, m, radix=True)
    bis = gpu_filter(b, logits, t, k, p, m, radix=False)
    np.testing.assert_array_equal(got.view(np.uint32), bis.view(np.uint32))


MIXES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.9, 40, 0.95, 0.0),
    (1.2, 0, 1.0, 0.05), (0.6, 20, 0.8, 0.02), (1.0, 1, 1.0, 0.0), (1.5, 0, 0.5, 0.0),
]


@pytest.mark.parametrize("V", [32000, 128256])
def test_sampled_tokens_match_cpu(cuda_f32, cpu, V):
    """Filter, then Gumbel-max with each row's seed and position: the CPU's token for 8 mixes x 16
    seeds x 3 positions, except at a threshold tie or a Gumbel near-tie."""
    b = cuda_f32
    rng = np.random.default_rng(V)
    B = 16 * len(MIXES)
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    t, k, p, m = params([MIXES[i % len(MIXES)] for i in range(B)])
    seeds = rng.integers(0, 2**63, B, dtype=np.int64).astype(np.uint64)
    amb = filter_ambiguous(logits, t, k, p, m)
    saved = b.radix_filter
    b.radix_filter = True
    try:
        for pos0 in (0, 5, 2**33 + 1):
            positions = np.arange(pos0, pos0 + B, dtype=np.int64)
            ld = to_dev(b, logits)
            b.filter_logits(ld, *(to_dev(b, a) for a in (t, k, p, m)))
            out = to_dev(b, np.full(B, -5, np.int64))
            b.gumbel_sample(ld, to_dev(b, seeds), to_dev(b, positions), out)
            got = to_host(b, out)
            filtered = logits.copy()
            cpu.filter_logits(filtered, t, k, p, m)
            want = np.full(B, -5, np.int64)
            cpu.gumbel_sample(filtered, seeds, positions, want)
            differ = np.flatnonzero(got != want)
            vals = gumbel_values(filtered, seeds, positions) if differ.size else None
            for r in differ:
                top2 = np.argsort(vals[r])[-2:]
                gap = vals[r, top2[1]] - vals[r, top2[0]]
                assert amb[r].any() or (gap < 1e-9 and got[r] in top2), (
                    f"row {r} mix {MIXES[r % len(MIXES)]} pos {positions[r]}: cuda {got[r]}, "
                    f"cpu {want[r]}")
            assert len(differ) <= 2, f"{len(differ)} of {B} tokens differ"
    finally:
        b.radix_filter = saved
