"""CpuBackend.lora_linear, the segmented LoRA product (pyx/backend.pyx), against the float64
oracle in tests/reference.py on each ISA path, with float32 and bf16 slots: several slots of
different ranks (zero included), odd ranks and sizes, parts of a fused output, an empty segment,
rows in any order, and rows outside every segment left bit for bit as they were."""
import ml_dtypes
import numpy as np
import pytest

from pyx.cpu_backend import CpuBackend, isa_supported
import reference as ref

ISAS = ["scalar", "avx2", "avx512"]


def make_case(seed=0, T=13, K=40, part_sizes=(24, 8, 8), R=6, S=3, dtype=np.float32):
    """Slots with zeros past each part's rank (the op's contract), rows split into segments."""
    rng = np.random.default_rng(seed)
    P = len(part_sizes)
    parts = np.concatenate([[0], np.cumsum(part_sizes)]).astype(np.int32)
    N = int(parts[-1])
    ranks = rng.integers(0, R + 1, size=(S, P)).astype(np.int32)
    ranks[0] = R                       # one full-rank slot
    ranks[1, 0] = 0                    # a part the adapter does not target
    a = np.zeros((S, P * R, K), np.float32)
    b = np.zeros((S, R, N), np.float32)
    for s in range(S):
        for p in range(P):
            r = ranks[s, p]
            a[s, p * R:p * R + r] = rng.standard_normal((r, K))
            b[s, :r, parts[p]:parts[p + 1]] = rng.standard_normal((r, part_sizes[p]))
    x = rng.standard_normal((T, K)).astype(np.float32)
    out = rng.standard_normal((T, N)).astype(np.float32)
    # rows 1, 4 and 11 run no adapter; slot 2's segment is empty; slot 0's rows out of order
    rows = np.array([9, 0, 5, 12, 2, 3, 6, 7, 8, 10], np.int32)
    seg_offsets = np.array([0, 4, 4, 10], np.int32)
    seg_slots = np.array([0, 2, 1], np.int32)
    return x, a.astype(dtype), b.astype(dtype), ranks, parts, rows, seg_offsets, seg_slots, out


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(T=20, K=83, part_sizes=(130, 64, 67), R=7)])
@pytest.mark.parametrize("isa", ISAS)
def test_lora_linear_matches_reference(isa, shape, dtype):
    if not isa_supported(isa):
        pytest.skip(f"this CPU lacks {isa}")
    be = CpuBackend(isa=isa, num_threads=2)
    x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out = make_case(dtype=dtype, **shape)
    want = ref.lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out)
    before = out.copy()
    be.lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    untouched = np.setdiff1d(np.arange(len(out)), rows)
    assert (out[untouched] == before[untouched]).all()
    assert not np.allclose(out[rows], before[rows])     # the deltas are not nothing


def test_lora_linear_row_is_batch_invariant():
    """A row's delta has the same bits alone as among many rows, across thread counts."""
    x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out = make_case(seed=1, T=64, K=96,
                                                                          part_sizes=(64, 32))
    rows = np.arange(64, dtype=np.int32)
    seg_offsets = np.array([0, 40, 64], np.int32)
    seg_slots = np.array([0, 1], np.int32)
    many = out.copy()
    CpuBackend(num_threads=2).lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots,
                                          many)
    alone = out.copy()
    CpuBackend(num_threads=1).lora_linear(x, a, b, ranks, parts, np.array([50], np.int32),
                                          np.array([0, 1], np.int32), np.array([1], np.int32),
                                          alone)
    assert (alone[50] == many[50]).all()


def test_lora_linear_large_parallel_case():
    """Enough work for the parallel region: each row still gets its own slot's delta."""
    be = CpuBackend(num_threads=2)
    x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out = make_case(
        seed=2, T=200, K=256, part_sizes=(256, 64, 64), R=16, S=2)
    rows = np.random.default_rng(3).permutation(200)[:150].astype(np.int32)
    seg_offsets = np.array([0, 70, 150], np.int32)
    seg_slots = np.array([1, 0], np.int32)
    want = ref.lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out)
    be.lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-3)


def test_lora_linear_refuses_bad_input():
    be = CpuBackend()
    x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out = make_case()
    with pytest.raises(ValueError, match="lora_linear: a row, slot, rank, part or segment"):
        be.lora_linear(x, a, b, ranks, parts, np.where(rows == 9, 13, rows).astype(np.int32),
                       seg_offsets, seg_slots, out)
    with pytest.raises(ValueError, match="lora_linear: a row, slot"):
        be.lora_linear(x, a, b, ranks, parts, rows, seg_offsets,
                       np.array([0, 3, 1], np.int32), out)
    with pytest.raises(ValueError, match="lora_linear: a row, slot"):
        be.lora_linear(x, a, b, ranks + 7, parts, rows, seg_offsets, seg_slots, out)
    with pytest.raises(ValueError, match=r"lora_linear: need x \(T, K\), lora_a"):
        be.lora_linear(x, a, b[:, :3].copy(), ranks, parts, rows, seg_offsets, seg_slots, out)
    with pytest.raises(ValueError, match="ending at len"):
        be.lora_linear(x, a, b, ranks, parts, rows[:-1], seg_offsets, seg_slots, out)
    with pytest.raises(ValueError, match="must not overlap"):
        be.lora_linear(out, a, b, ranks, parts, rows, seg_offsets, seg_slots, out)
