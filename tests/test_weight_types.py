"""The packed weight types (pyx/weights/) below the backends: each imports first in a fresh
interpreter without pulling in a backend or the engine (no import cycle, no upward import), the
backends recognise them with isinstance (a look-alike is refused, a subclass taken), and every
backend has the members and ops the engine calls (pyx/backend.pyx), so nothing probes with
getattr."""
import subprocess
import sys

import numpy as np
import pytest

from pyx.backend import Backend
from pyx.cpu_backend import CpuBackend, dequantize_weight, quantize_weight
from pyx.weights.fp8 import Fp8Weight
from pyx.weights.ggml import QuantizedWeight
from pyx.weights.int4 import Int4Part, Int4Weight
from pyx.weights.marlin import repack_int4, unpack_marlin

PURE = ["pyx.kernel_config", "pyx.weights", "pyx.weights.ggml", "pyx.weights.fp8",
        "pyx.weights.int4", "pyx.weights.marlin"]


def loaded_after(module: str) -> set[str]:
    """The Taper modules a fresh interpreter holds after importing `module` first."""
    code = (f"import sys, {module}\n"
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('engine', 'pyx', "
            "'server')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return set(out.split())


@pytest.mark.parametrize("module", PURE)
def test_weight_modules_import_first_without_a_backend(module):
    loaded = loaded_after(module)
    assert module in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("engine", "server")}, loaded
    assert not loaded & {"pyx.cpu_backend", "pyx.cuda_backend", "pyx.layers"}, loaded


@pytest.mark.parametrize("module", ["pyx.cpu_backend", "pyx.layers", "pyx.moe", "pyx.cpu_int4"])
def test_the_pyx_layer_never_imports_the_engine(module):
    loaded = loaded_after(module)
    assert module in loaded and not [m for m in loaded if m.startswith(("engine", "server"))]


# ---- isinstance, not duck typing

def test_cpu_linear_takes_the_types_and_refuses_look_alikes():
    rng = np.random.default_rng(0)
    K, N = 64, 32
    x = rng.standard_normal((2, K)).astype(np.float32)
    q = quantize_weight(rng.standard_normal((N, K)).astype(np.float32), 8)   # Q8_0
    be = CpuBackend(isa="scalar")
    want = np.empty((2, N), np.float32)
    be.linear(x, q, None, want)
    ref = x.astype(np.float64) @ dequantize_weight(q).astype(np.float64).T
    assert np.linalg.norm(want - ref) < 0.01 * np.linalg.norm(ref)   # Q8 activations

    class LookAlike:     # every attribute the backend used to probe for, but not the type
        quant_parts, k, shape = q.quant_parts, q.k, q.shape
    with pytest.raises(ValueError, match="weight must be a numpy array, got LookAlike"):
        be.linear(x, LookAlike(), None, np.empty((2, N), np.float32))

    class Tagged(QuantizedWeight):
        __slots__ = ()
    got = np.empty((2, N), np.float32)
    be.linear(x, Tagged(q.quant_parts, q.k), None, got)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="expected a QuantizedWeight, got Int4Weight"):
        dequantize_weight(Int4Weight([], K))


def test_cpu_linear_on_int4_and_fp8():
    rng = np.random.default_rng(1)
    K, N = 128, 64
    x = rng.standard_normal((3, K)).astype(np.float32)
    codes = rng.integers(0, 16, (N, K)).astype(np.uint8)
    int4 = Int4Weight([Int4Part.from_codes(codes, rng.uniform(0.01, 0.02, (N, 1)),
                                           np.full((N, 1), 8.0), K)], K)
    fp8 = Fp8Weight(rng.integers(0, 0x7f, (N, K)).astype(np.uint8),
                    rng.uniform(0.01, 0.02, (1, 1)), (N, K))
    be = CpuBackend()
    for w in (int4, fp8):
        out = np.empty((3, N), np.float32)
        be.linear(x, w, None, out)
        ref = x.astype(np.float64) @ w.dequantize().astype(np.float64).T
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # the Marlin layout is a view of the same int4 weight (the CUDA backend's repack)
    np.testing.assert_array_equal(unpack_marlin(repack_int4(int4)), int4.dequantize())


# ---- the members every backend has

def test_every_backend_member_is_in_the_base():
    be = CpuBackend()
    assert isinstance(be, Backend)
    assert (be.xp, be.act_dtype, be.batch_invariant, be.fused_moe, be.fused_sampling) == (
        np, np.float32, False, False, False)
    for op in ("place_weight", "kv_cache_dtype", "bind_thread", "synchronize", "sample_fused",
               "memory_info", "new_graph_pool", "use_graph_pool", "capture_graph",
               "pinned_empty", "copy_to_device_async", "silu_and_mul", "gelu_tanh_and_mul",
               "stack_experts", "moe_align", "moe_grouped_linear", "moe_combine"):
        assert op in vars(Backend), op
    with pytest.raises(NotImplementedError, match="the cpu backend has no fused sampler"):
        be.sample_fused(*[None] * 9)
    with pytest.raises(NotImplementedError, match="the cpu backend has no device memory"):
        be.memory_info()
