"""The CPU's mla_decode_attention (pyx/mla_kernels.c): every query head against the one cached
latent head, the heads as vector lanes. Against the float64 reference (tests/reference.py's
paged_attention with the cache as both K and V) and the backend's own paged_attention, the path
it replaced, for every ISA: head counts on and off its 16-head chunks, context lengths on and off
its 4-row groups and the block size, several sequences with scattered blocks, more threads than
work. Bad input gets a ValueError naming the op."""
from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from pyx.cpu_backend import CpuBackend, isa_supported

ISAS = ["scalar", "avx2", "avx512"]


def backend_for(isa, threads=1):
    if not isa_supported(isa):
        pytest.skip(f"this CPU lacks {isa}")
    return CpuBackend(isa=isa, num_threads=threads)


def case(rng, Hq, D, Dv, BS, seq_lens, NB=40):
    """q (B, Hq, D), cache (NB, BS, 1, D), block tables of distinct shuffled blocks per row."""
    B = len(seq_lens)
    MB = max((s + BS - 1) // BS for s in seq_lens) + 1        # a spare column: unread
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    cache = rng.standard_normal((NB, BS, 1, D)).astype(np.float32)
    tables = rng.permutation(NB)[:B * MB].reshape(B, MB).astype(np.int32)
    return q, cache, tables, np.asarray(seq_lens, np.int32)


def reference(q, cache, tables, lens, scale, Dv):
    B = q.shape[0]
    full = ref.paged_attention(q, cache, cache, tables, lens, np.arange(B + 1, dtype=np.int32),
                               scale, 0)
    return full[:, :, :Dv]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("Hq,D,Dv,BS,seq_lens", [
    (16, 72, 64, 16, [150]),            # the bench model's layer: one full head chunk
    (16, 72, 64, 16, [1, 2, 3, 4, 5]),  # contexts shorter than a 4-row group
    (5, 40, 32, 8, [7, 33, 64]),        # fewer heads than a chunk, a tail of each kind
    (20, 24, 24, 4, [9, 30]),           # a chunk and a part, Dv = D
    (128, 96, 80, 16, [61]),            # many chunks (DeepSeek-V3's head count)
])
def test_matches_reference(isa, Hq, D, Dv, BS, seq_lens):
    b = backend_for(isa)
    rng = np.random.default_rng(Hq * 1000 + D + len(seq_lens))
    q, cache, tables, lens = case(rng, Hq, D, Dv, BS, seq_lens)
    out = np.full((len(seq_lens), Hq, Dv), np.nan, np.float32)
    b.mla_decode_attention(out, q, cache, tables, lens, 0.3)
    np.testing.assert_allclose(out, reference(q, cache, tables, lens, 0.3, Dv),
                               rtol=1e-4, atol=1e-5)
    # the path it replaced: paged_attention with the cache as K and V, the first Dv values kept
    full = np.empty_like(q)
    b.paged_attention(full, q, cache, cache, tables, lens,
                      np.arange(len(seq_lens) + 1, dtype=np.int32), 0.3, 0)
    np.testing.assert_allclose(out, full[:, :, :Dv], rtol=1e-4, atol=1e-5)


def test_threads_do_not_change_the_numbers():
    rng = np.random.default_rng(3)
    q, cache, tables, lens = case(rng, 40, 72, 64, 16, [17, 150, 3])
    outs = []
    for threads in (1, 3, 8):
        out = np.empty((3, 40, 64), np.float32)
        CpuBackend(num_threads=threads).mla_decode_attention(out, q, cache, tables, lens, 0.2)
        outs.append(out)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("bad", ["empty context", "too long", "block id", "table dtype",
                                 "Dv > D"])
def test_bad_input_names_the_op(bad):
    rng = np.random.default_rng(4)
    q, cache, tables, lens = case(rng, 4, 24, 16, 4, [5, 9])
    out = np.empty((2, 4, 16), np.float32)
    if bad == "empty context":
        lens[1] = 0
    elif bad == "too long":
        lens[1] = tables.shape[1] * 4 + 1
    elif bad == "block id":
        tables[0, 1] = cache.shape[0]
    elif bad == "table dtype":
        tables = tables.astype(np.int64)
    else:
        out = np.empty((2, 4, 25), np.float32)
    with pytest.raises(ValueError, match="mla_decode_attention"):
        CpuBackend().mla_decode_attention(out, q, cache, tables, lens, 0.1)
