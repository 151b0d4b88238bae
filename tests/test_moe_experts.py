"""The CPU's moe_experts (pyx/moe_kernels.c): a MoE layer's routed experts in one call.

Against the float64 formula (tests/reference.py), and bit for bit against the loop over experts
it replaces (each expert's rows through `linear` and the activation op, then the weighted sum in
slot order: pyx/cpu_moe.py's moe_experts and the MoE block's own loop), for float and ggml-block
experts, decode and prefill row counts, one thread and more threads than cores."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference as ref
from pyx import cpu_moe
from pyx.cpu_backend import CpuBackend, dequantize_weight, quantize_weight
from pyx.layers import Workspace
from pyx.moe import MoE
from pyx.weights.fp8 import Fp8Weight
from pyx.weights.ggml import QuantizedWeight
from pyx.weights.int4 import Int4Part, Int4Weight

E, H, I, TOP_K = 8, 256, 64, 3
Q8_0, Q4_0, Q4_K = 8, 2, 12


def float_experts(rng, dtype=np.float32):
    gate_up = [(rng.standard_normal((2 * I, H)) * 0.1).astype(dtype) for _ in range(E)]
    down = [(rng.standard_normal((H, I)) * 0.1).astype(dtype) for _ in range(E)]
    return gate_up, down


def experts_of(kind: str, rng):
    """(gate_up list, down list, their float forms for the float64 reference)."""
    if kind in ("f32", "bf16", "f16"):
        dtype = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[kind]
        gate_up, down = float_experts(rng, dtype)
        return gate_up, down, gate_up, down
    gate_up, down = float_experts(rng)
    if kind == "q8_0":
        gate_up = [quantize_weight(w, Q8_0) for w in gate_up]
        down = [quantize_weight(w, Q8_0) for w in down]
    else:   # "mixed": gate Q4_K and up Q8_0 (two parts, as GGUF files mix), down Q4_0
        gate_up = [QuantizedWeight.concat([quantize_weight(w[:I], Q4_K),
                                           quantize_weight(w[I:], Q8_0)]) for w in gate_up]
        down = [quantize_weight(w, Q4_0) for w in down]
        assert [t for t, _ in gate_up[0].quant_parts] == [Q4_K, Q8_0]
    return gate_up, down, [dequantize_weight(w) for w in gate_up], [dequantize_weight(w) for w in down]


def routing(rng, T, k=TOP_K):
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    weights = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    return ids, weights


def run(backend, x, gate_up, down, ids, weights, activation="silu"):
    out = np.full(x.shape, np.nan, np.float32)
    backend.moe_experts(x, backend.stack_experts(gate_up), backend.stack_experts(down), ids,
                        weights, activation, out)
    return out


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16", "q8_0", "mixed"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("T", [1, 9, 70])
def test_equals_the_float64_formula(kind, activation, T):
    rng = np.random.default_rng(T)
    gate_up, down, gate_up_f, down_f = experts_of(kind, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, weights = routing(rng, T)
    got = run(CpuBackend(), x, gate_up, down, ids, weights, activation)
    want = ref.moe_experts(x, gate_up_f, down_f, ids, weights, activation)
    # float weights: float32 sums; ggml blocks: the decode path rounds activations to 8 bits
    tol = 2e-5 if kind in ("f32", "bf16", "f16") else 3e-2
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0", "mixed"])
@pytest.mark.parametrize("T", [1, 5, 40, 300])
@pytest.mark.parametrize("threads", [1, 3])
def test_bit_for_bit_the_loop_over_experts(kind, T, threads):
    """Same rows per expert through the same kernels: the same bits, on any thread count
    (3 threads on this 2-core machine: the experts side by side, each on one thread)."""
    rng = np.random.default_rng(100 + T)
    gate_up, down, _, _ = experts_of(kind, rng)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids, weights = routing(rng, T)
    backend = CpuBackend(num_threads=threads)
    got = run(backend, x, gate_up, down, ids, weights)
    want = np.empty_like(got)
    cpu_moe.moe_experts(backend, x, backend.stack_experts(gate_up), backend.stack_experts(down),
                        ids, weights, "silu", want)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("T", [1, 33])
def test_the_block_gives_what_its_loop_over_experts_gave(T):
    """MoE.forward on the CPU (moe_experts) against the same block's loop over experts, the path
    it ran before the kernel (and the one CUDA's simple path runs)."""
    rng = np.random.default_rng(7)
    gate_up, down = float_experts(rng)
    router = rng.standard_normal((E, H)).astype(np.float32)
    backend = CpuBackend()
    block = MoE(backend, router, gate_up, down, TOP_K, True)
    assert block.one_call
    x = rng.standard_normal((T, H)).astype(np.float32)
    got = np.empty((T, H), np.float32)
    block.forward(x, got, Workspace(np))
    block.one_call, block.gate_up, block.down = False, gate_up, down
    want = np.empty((T, H), np.float32)
    block.forward(x, want, Workspace(np))
    np.testing.assert_array_equal(got, want)


def test_only_the_routed_experts_are_read():
    """Experts no token chose hold NaN and change nothing; ids outside [0, E) add nothing."""
    rng = np.random.default_rng(3)
    gate_up, down = float_experts(rng)
    T = 6
    ids = np.array([[1, 4, -1]] * 3 + [[4, E, 1]] * 3, np.int64)
    weights = rng.uniform(0.1, 1.0, (T, TOP_K)).astype(np.float32)
    for e in set(range(E)) - {1, 4}:
        gate_up[e][:] = np.nan
        down[e][:] = np.nan
    x = rng.standard_normal((T, H)).astype(np.float32)
    got = run(CpuBackend(num_threads=3), x, gate_up, down, ids, weights)
    want = ref.moe_experts(x, gate_up, down, ids, weights, "silu")
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_batch_invariant_rows_do_not_depend_on_the_batch():
    """With batch_invariant a token's row is the same alone and among 40 tokens sharing its
    experts (the kernels' batch-invariant paths, whatever each expert's row count)."""
    rng = np.random.default_rng(4)
    gate_up, down = float_experts(rng)
    x = rng.standard_normal((40, H)).astype(np.float32)
    ids, weights = routing(rng, 40)
    backend = CpuBackend(batch_invariant=True)
    batch = run(backend, x, gate_up, down, ids, weights)
    alone = run(backend, x[5:6].copy(), gate_up, down, ids[5:6].copy(), weights[5:6].copy())
    np.testing.assert_array_equal(alone[0], batch[5])


def test_int4_and_fp8_experts_run_expert_by_expert():
    """Formats whose kernels live in other extensions have no part table: moe_experts takes
    them through linear, one expert at a time, with the same result."""
    rng = np.random.default_rng(5)
    backend = CpuBackend()

    def int4(n, k):
        codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
        return Int4Weight([Int4Part.from_codes(codes, rng.uniform(0.001, 0.002, (n, 1)),
                                               np.full((n, 1), 8.0), k)], k)

    def fp8(n, k):
        return Fp8Weight(rng.integers(0, 0x7f, (n, k)).astype(np.uint8),
                         rng.uniform(0.001, 0.002, (1, 1)), (n, k))
    for make in (int4, fp8):
        gate_up = [make(2 * I, H) for _ in range(E)]
        down = [make(H, I) for _ in range(E)]
        assert backend.stack_experts(gate_up).data is None
        x = rng.standard_normal((4, H)).astype(np.float32)
        ids, weights = routing(rng, 4)
        got = run(backend, x, gate_up, down, ids, weights)
        want = ref.moe_experts(x, [w.dequantize() for w in gate_up],
                               [w.dequantize() for w in down], ids, weights, "silu")
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def test_bad_input_names_the_op_and_the_problem():
    rng = np.random.default_rng(6)
    gate_up, down = float_experts(rng)
    backend = CpuBackend()
    g, d = backend.stack_experts(gate_up), backend.stack_experts(down)
    x = rng.standard_normal((2, H)).astype(np.float32)
    ids, weights = routing(rng, 2)
    out = np.empty((2, H), np.float32)
    with pytest.raises(ValueError, match="moe_experts: topk_ids must be a C-contiguous 2-D int64"):
        backend.moe_experts(x, g, d, ids.astype(np.int32), weights, "silu", out)
    with pytest.raises(ValueError, match="moe_experts: activation must be silu or gelu_tanh"):
        backend.moe_experts(x, g, d, ids, weights, "relu", out)
    with pytest.raises(ValueError, match=r"moe_experts: need gate_up \(E, 2I, H\) and down"):
        backend.moe_experts(x, g, g, ids, weights, "silu", out)
    with pytest.raises(ValueError, match=r"moe_experts: need x and out \(T, 256\)"):
        backend.moe_experts(x, g, d, ids[:1].copy(), weights, "silu", out)
    with pytest.raises(ValueError, match="stack_experts: experts of shapes"):
        backend.stack_experts(gate_up[:2] + [down[0]])
