"""Flash-decoding (kernels decode=split, issue 12 item 1) against the CPU backend's paged attention.

Decode batches of 1, 4 and 16 sequences over 1k-32k keys, block sizes 16 to 128, GQA groups 1 to
8, sliding window on and off, bf16/f16 activations over a cache of the same type or FP8 e4m3, with
the split count the engine's rule (pyx/decode_splits.py) picks on this device, with forced counts
(2, 7, 64: uneven and empty partitions), and with the count chosen for a longer context than the
batch holds (the engine passes max_model_len; each sequence's partitions shrink at run time).
Every case first checks that it really splits (more than one partition), so the merge kernel runs.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from test_cuda_ops import cast, check_attention, dtype_name, paged_batch

# (B, Hq, Hkv, D, BS, contexts): Llama-3-8B's heads at batch 1 and 4; smaller heads where 16
# long sequences would make the CPU reference's f32 cache too large.
LAYOUTS = {
    "B1-32k": (1, 32, 8, 128, 16, [32768]),
    "B1-8k-BS128": (1, 32, 8, 128, 128, [8192 + 5]),
    "B4-1k-32k": (4, 32, 8, 128, 32, [1024, 4099, 16384, 32768]),
    "B4-mha": (4, 8, 8, 64, 16, [1500, 3000, 6000, 12000]),
    "B16-G4": (16, 8, 2, 128, 16, "log-uniform"),
    "B16-G8-BS64": (16, 16, 2, 64, 64, "log-uniform"),
}


@functools.lru_cache(maxsize=2 * len(LAYOUTS))   # ~3 GB of host memory at most
def batch(name: str, fp8: bool):
    """The f32 batch of a layout (cast per dtype by the tests), made once per session."""
    B, Hq, Hkv, D, BS, ctx = LAYOUTS[name]
    rng = np.random.default_rng(sum(map(ord, name)) + 7 * fp8)
    if ctx == "log-uniform":
        ctx = np.exp(rng.uniform(np.log(1024), np.log(32768), B)).astype(int).tolist()
        ctx[0] = 32768
    return paged_batch(rng, [(c, 1) for c in ctx], BS, Hq, Hkv, D, "f32", fp8=fp8)


def split_backend(make_cuda, dt):
    b = make_cuda(dt, "decode=split")
    assert b.split_k
    return b


def chosen_splits(b, p) -> int:
    """The count paged_attention gives this batch."""
    B, MB = p.tables.shape
    NB, BS, Hkv, D = p.kc.shape
    return b.decode_split_count(B, p.q.shape[1], Hkv, D, BS, MB, p.k_scale is not None)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window", [0, 4096])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_flash_decode_matches_cpu(make_cuda, cpu, dt, layout, window, fp8):
    b = split_backend(make_cuda, dt)
    p = cast(batch(layout, fp8), dt)
    check_attention(b, cpu, p, window, 0.0, f"flash-decode {layout} fp8={fp8}")
    assert_splits(b, p)


def test_flash_decode_f32_and_softcap(make_cuda, cpu):
    """The f32 path (one tile buffer) and the soft-cap through the partitions and the merge."""
    b = split_backend(make_cuda, "f32")
    p = batch("B4-1k-32k", False)
    check_attention(b, cpu, p, 0, 5.0, "flash-decode f32 softcap")
    assert_splits(b, p)


@pytest.mark.parametrize("splits", [2, 7, 64])
@pytest.mark.parametrize("window", [0, 1000])
def test_flash_decode_forced_split_counts(make_cuda, cpu, splits, window):
    """Any count 1..64 is valid: uneven partitions, and with a window (or 64 partitions of a
    1k-key sequence) partitions with no keys, which the merge must weigh 0."""
    b = split_backend(make_cuda, "bf16")
    try:
        b.decode_splits = splits
        for layout in ("B4-1k-32k", "B16-G8-BS64"):
            p = cast(batch(layout, False), "bf16")
            check_attention(b, cpu, p, window, 0.0, f"{layout} forced splits={splits}")
    finally:
        b.decode_splits = 0


def test_flash_decode_count_for_a_longer_max_context(make_cuda, cpu):
    """The engine picks the count for max_model_len; a step whose sequences are much shorter
    still gets the right answer (partitions of a few blocks, many of them)."""
    b = split_backend(make_cuda, "bf16")
    rng = np.random.default_rng(3)
    p = paged_batch(rng, [(1024, 1), (77, 1), (1, 1), (3000, 1)], 16, 32, 8, 128, "bf16")
    try:
        b.max_context = 131072
        assert chosen_splits(b, p) > 8
        check_attention(b, cpu, p, 0, 0.0, "max_context 128k")
        check_attention(b, cpu, p, 500, 0.0, "max_context 128k")
    finally:
        b.max_context = 0


def test_decode_occupancy(make_cuda):
    """The occupancy the rule is fed: the kernel's __launch_bounds__ asks for 4 blocks per SM,
    which the Llama-3 shape's ~40 KB of shared memory allows on sm_80 and sm_90."""
    from pyx.cuda_backend import decode_blocks_per_sm
    b = make_cuda("bf16")
    f32, bf16, fp8 = 0, 1, 3    # TAPER_DT_* of cuda/taper_cuda.h
    assert decode_blocks_per_sm(32, 8, 128, bf16, bf16) >= 4
    assert decode_blocks_per_sm(32, 8, 128, bf16, fp8) >= 4
    big = decode_blocks_per_sm(16, 1, 256, f32, f32)   # 4-byte rows, D 256, 16 heads per KV head
    assert 1 <= big < decode_blocks_per_sm(32, 8, 128, bf16, bf16)
    assert b.num_sms > 0


def assert_splits(b, p):
    assert chosen_splits(b, p) > 1, "this case runs the one-pass kernel: it tests no merge"
