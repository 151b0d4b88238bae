"""The CPU's batched_linear (MLA's per-head absorbed projections): each group through linear's
kernel from one C loop, so bit for bit G linear calls, and the float64 formula."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference as ref
from pyx.cpu_backend import CpuBackend


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("T", [1, 5, 40])
def test_each_group_is_its_linear(dtype, T):
    rng = np.random.default_rng(T)
    G, K, N = 16, 48, 24
    x = rng.standard_normal((G, T, K)).astype(np.float32)
    w = rng.standard_normal((G, N, K)).astype(dtype)
    backend = CpuBackend(num_threads=3)
    got = np.full((G, T, N), np.nan, np.float32)
    backend.batched_linear(x, w, got)
    for g in range(G):
        want = np.empty((T, N), np.float32)
        backend.linear(x[g], w[g], None, want)
        np.testing.assert_array_equal(got[g], want)
        f64 = ref.linear(x[g], w[g])
        np.testing.assert_allclose(got[g], f64, rtol=1e-5, atol=1e-5 * np.abs(f64).max())


def test_bad_shapes_name_the_op():
    backend = CpuBackend()
    x = np.zeros((2, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"batched_linear: need x \(G, T, K\)"):
        backend.batched_linear(x, np.zeros((3, 5, 4), np.float32), np.zeros((2, 3, 5), np.float32))
