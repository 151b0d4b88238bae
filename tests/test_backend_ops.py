"""Every CpuBackend op against the float64 oracle in tests/reference.py.

`linear` runs on each ISA path this CPU has (scalar, avx2, avx512), for f32, bf16 and f16 weights,
including odd K/N and T on both sides of the GEMV/GEMM switch. 16-bit weights are compared with
the oracle on the same 16-bit values, so the tolerance only covers f32 accumulation.
The KV cache ops run on f32 caches and on FP8 ones (uint8 e4m3 codes with per-KV-head scales),
whose codes must equal the reference's exactly. Outputs start as NaN (poisoned) so that an
element the op forgets to write fails the comparison.
"""
import ml_dtypes
import numpy as np
import pytest

from pyx.cpu_backend import CpuBackend, isa_supported, philox4x32_10
from pyx.kernel_config import KernelConfig
import reference as ref

ISAS = ["scalar", "avx2", "avx512"]
WDTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
RTOL = ATOL = 1e-4


def backend_for(isa):
    if not isa_supported(isa):
        pytest.skip(f"this CPU lacks {isa}")
    return CpuBackend(isa=isa)


@pytest.fixture(scope="module")
def be():
    return CpuBackend()


# ---- backend construction


def test_isa_choice_and_kernel_config(monkeypatch):
    """The isa argument, else the KernelConfig's cpu_isa, else (auto) the best this CPU runs;
    the environment is not read (TAPER_CPU_ISA is retired)."""
    assert CpuBackend().name == "cpu"
    assert CpuBackend(isa="scalar").isa == "scalar"
    assert CpuBackend(kernels="cpu_isa=scalar").isa == "scalar"
    assert CpuBackend(kernels=KernelConfig(cpu_isa="scalar")).isa == "scalar"
    assert CpuBackend(isa="scalar", kernels="cpu_isa=auto").isa == "scalar"
    with pytest.raises(ValueError, match=r"cpu_isa='sse9' is not a choice; cpu_isa takes auto \| "
                                         r"scalar \| avx2 \| avx512"):
        CpuBackend(kernels="cpu_isa=sse9")
    with pytest.raises(ValueError, match="sse9"):
        CpuBackend(isa="sse9")
    best = CpuBackend().isa
    assert isa_supported(best)
    assert best == [i for i in ISAS if isa_supported(i)][-1]
    assert CpuBackend(kernels="cpu_isa=auto").isa == best
    monkeypatch.setenv("TAPER_CPU_ISA", "scalar")
    assert CpuBackend().isa == best
    if best != "scalar":
        assert CpuBackend(kernels=f"cpu_isa={best}").isa == best


def test_unsupported_isa_names_it():
    missing = [i for i in ISAS if not isa_supported(i)]
    if not missing:
        pytest.skip("this CPU runs every ISA path")
    with pytest.raises(ValueError, match=f"isa '{missing[0]}' is not supported by this CPU"):
        CpuBackend(kernels={"cpu_isa": missing[0]})


def test_num_threads():
    b = CpuBackend(num_threads=1)
    assert b.num_threads == 1
    b.num_threads = 3
    assert b.num_threads == 3
    with pytest.raises(ValueError):
        b.num_threads = 0


# ---- linear


LINEAR_SHAPES = [  # (T, K, N)
    (1, 37, 13), (3, 37, 13), (17, 37, 13), (64, 37, 13),
    (1, 64, 32), (4, 64, 33), (5, 64, 33), (17, 300, 70), (64, 600, 47),
    (1, 1000, 130), (200, 80, 40),
    # AVX-512 small-M kernel: every token-block width (R x NT tiles) below 8 tokens, row tails,
    # K tails; from 8 to 32 tokens its 4 x 4 tiles: T padded (9, 13, 30), K chunks (10x4200)
    (1, 31, 200), (2, 45, 19), (7, 100, 21), (8, 1600, 67), (9, 77, 35), (12, 130, 70),
    (13, 250, 66), (16, 33, 9), (16, 1000, 75), (20, 300, 65), (32, 64, 129), (24, 2100, 17),
    (30, 96, 70), (10, 4200, 37), (33, 100, 20),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("wdt", list(WDTYPES))
@pytest.mark.parametrize("T,K,N", LINEAR_SHAPES)
def test_linear(isa, wdt, T, K, N):
    b = backend_for(isa)
    rng = np.random.default_rng(T * 1000 + K * 10 + N)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(WDTYPES[wdt])
    bias = rng.standard_normal(N).astype(np.float32) if (T + N) % 2 else None
    out = np.full((T, N), np.nan, np.float32)
    b.linear(x, w, bias, out)
    np.testing.assert_allclose(out, ref.linear(x, w, bias), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("isa", ISAS)
def test_linear_single_thread_matches(isa):
    b = backend_for(isa)
    b.num_threads = 1
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 130)).astype(np.float32)
    w = rng.standard_normal((70, 130)).astype(ml_dtypes.bfloat16)
    out = np.empty((9, 70), np.float32)
    b.linear(x, w, None, out)
    np.testing.assert_allclose(out, ref.linear(x, w), rtol=RTOL, atol=1e-3)


@pytest.mark.parametrize("wdt", list(WDTYPES))
@pytest.mark.parametrize("T,K,N", [(1, 100, 45), (1, 1000, 70), (3, 576, 50), (16, 1600, 40)])
def test_linear_gemv_prefetch_variants(wdt, T, K, N):
    """kernels gemv_prefetch (the small-M kernel's prefetch into L1 or L2): each variant, on
    tiles either side of auto's L1 threshold, gives the oracle's result and auto's bits."""
    if not isa_supported("avx512"):
        pytest.skip("the prefetch variants are the AVX-512 small-M kernel's")
    rng = np.random.default_rng(K + N)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(WDTYPES[wdt])
    outs = {}
    for pf in ("auto", "l1", "l2"):
        outs[pf] = np.full((T, N), np.nan, np.float32)
        CpuBackend(isa="avx512", kernels=f"gemv_prefetch={pf}").linear(x, w, None, outs[pf])
        np.testing.assert_allclose(outs[pf], ref.linear(x, w), rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(outs[pf], outs["auto"])


def test_linear_rejects_bad_shapes(be):
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match=r"linear.*weight \(4, 7\)"):
        be.linear(x, np.zeros((4, 7), np.float32), None, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="linear"):
        be.linear(x, np.zeros((4, 8), np.float32), None, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="linear.*dtype"):
        be.linear(x, np.zeros((4, 8), np.float64), None, np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="linear.*contiguous"):
        be.linear(np.zeros((8, 2), np.float32).T, np.zeros((4, 8), np.float32), None,
                  np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="linear.*bias"):
        be.linear(x, np.zeros((4, 8), np.float32), np.zeros(3, np.float32),
                  np.zeros((2, 4), np.float32))


# ---- embedding, norms, activation


@pytest.mark.parametrize("wdt", list(WDTYPES))
def test_embedding(be, wdt):
    rng = np.random.default_rng(1)
    table = rng.standard_normal((50, 24)).astype(WDTYPES[wdt])
    ids = np.array([0, 49, 7, 7, 3], np.int32)
    out = np.empty((5, 24), np.float32)
    be.embedding(ids, table, out)
    np.testing.assert_array_equal(out, ref.embedding(ids, table))
    with pytest.raises(ValueError, match="embedding"):
        be.embedding(np.array([50], np.int32), table, np.empty((1, 24), np.float32))
    with pytest.raises(ValueError, match="embedding"):
        be.embedding(ids, table, np.empty((5, 23), np.float32))


@pytest.mark.parametrize("T,H", [(1, 96), (7, 37), (33, 896)])
def test_rms_norm(be, T, H):
    rng = np.random.default_rng(T + H)
    x = (rng.standard_normal((T, H)) * 3).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    out = np.empty_like(x)
    be.rms_norm(x, w, 1e-6, out)
    np.testing.assert_allclose(out, ref.rms_norm(x, w, 1e-6), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="rms_norm"):
        be.rms_norm(x, w[:-1], 1e-6, out)


@pytest.mark.parametrize("T,H", [(1, 96), (7, 37), (33, 896)])
def test_fused_add_rms_norm(be, T, H):
    rng = np.random.default_rng(T * H)
    x = rng.standard_normal((T, H)).astype(np.float32)
    r = rng.standard_normal((T, H)).astype(np.float32)
    w = rng.standard_normal(H).astype(np.float32)
    want_x, want_r = ref.fused_add_rms_norm(x, r, w, 1e-5)
    be.fused_add_rms_norm(x, r, w, 1e-5)
    np.testing.assert_allclose(r, want_r, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(x, want_x, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("T,H", [(1, 96), (7, 37), (33, 896)])
def test_layer_norm(be, T, H, with_bias):
    rng = np.random.default_rng(T + H)
    x = (rng.standard_normal((T, H)) * 3 + 5).astype(np.float32)    # a mean far from 0
    w = rng.standard_normal(H).astype(np.float32)
    bias = rng.standard_normal(H).astype(np.float32) if with_bias else None
    out = np.empty_like(x)
    be.layer_norm(x, w, bias, 1e-5, out)
    np.testing.assert_allclose(out, ref.layer_norm(x, w, bias, 1e-5), rtol=RTOL, atol=ATOL)
    assert np.abs(out - ref.rms_norm(x, w, 1e-5)).max() > 0.1       # not an RMSNorm
    with pytest.raises(ValueError, match="layer_norm"):
        be.layer_norm(x, w[:-1], bias, 1e-5, out)
    with pytest.raises(ValueError, match="layer_norm"):
        be.layer_norm(x, w, w[:-1], 1e-5, out)

    r = rng.standard_normal((T, H)).astype(np.float32)
    want_x, want_r = ref.fused_add_layer_norm(x, r, w, bias, 1e-5)
    be.fused_add_layer_norm(x, r, w, bias, 1e-5)
    np.testing.assert_allclose(r, want_r, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(x, want_x, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,inter", [(1, 13), (9, 128), (40, 700)])
def test_silu_and_mul(isa, T, inter):
    be = backend_for(isa)
    rng = np.random.default_rng(inter)
    x = (rng.standard_normal((T, 2 * inter)) * 4).astype(np.float32)
    out = np.empty((T, inter), np.float32)
    be.silu_and_mul(x, out)
    np.testing.assert_allclose(out, ref.silu_and_mul(x), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="silu_and_mul"):
        be.silu_and_mul(x, np.empty((T, inter + 1), np.float32))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,inter", [(1, 13), (9, 128), (40, 700)])
def test_gelu_tanh_and_mul(isa, T, inter):
    be = backend_for(isa)
    rng = np.random.default_rng(inter + 1)
    x = (rng.standard_normal((T, 2 * inter)) * 4).astype(np.float32)
    x[0, :6] = [-30.0, 30.0, 1e-6, -1e-6, 0.0, -12.0]   # saturated tails and near 0
    out = np.full((T, inter), np.nan, np.float32)
    be.gelu_tanh_and_mul(x, out)
    want = ref.gelu_tanh_and_mul(x)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)
    # not silu: the two gates differ by more than the tolerance
    assert not np.allclose(want, ref.silu_and_mul(x), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="gelu_tanh_and_mul"):
        be.gelu_tanh_and_mul(x, np.empty((T, inter + 1), np.float32))
    with pytest.raises(ValueError, match="gelu_tanh_and_mul"):
        be.gelu_tanh_and_mul(x.astype(np.float64), out)


@pytest.mark.parametrize("T,N", [(1, 7), (5, 96), (9, 4000)])
def test_scale(be, T, N):
    """x * s rounded once to float32: the exact product of float64 rounded, as transformers'
    float32 embedding times its float32 sqrt(hidden)."""
    rng = np.random.default_rng(N)
    x = rng.standard_normal((T, N)).astype(np.float32)
    s = float(np.float32(np.sqrt(2304.0)))
    want = ref.scale(x, s).astype(np.float32)
    be.scale(x, s)
    np.testing.assert_array_equal(x, want)
    with pytest.raises(ValueError, match="scale"):
        be.scale(x, np.nan)
    with pytest.raises(ValueError, match="scale"):
        be.scale(x.astype(np.float64), s)
    with pytest.raises(ValueError, match="scale"):
        be.scale(x[:, ::2], s)                          # not contiguous


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("T,N,cap", [(1, 7, 30.0), (3, 5000, 50.0), (4, 33_000, 0.5)])
def test_softcap(isa, T, N, cap):
    be = backend_for(isa)
    rng = np.random.default_rng(N)
    x = (rng.standard_normal((T, N)) * 3 * cap).astype(np.float32)
    x[0, :7] = [0.0, 1e-3 * cap, -0.2 * cap, 0.3 * cap, 1e4 * cap, np.inf, -np.inf][:N]
    want = ref.softcap(x, cap)
    be.softcap(x, cap)
    np.testing.assert_allclose(x, want, rtol=1e-6, atol=1e-6 * cap)
    assert np.abs(x).max() <= cap
    for bad in (0.0, -1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="softcap"):
            be.softcap(x, bad)
    with pytest.raises(ValueError, match="softcap"):
        be.softcap(x[:, ::2], cap)                      # not contiguous


# ---- rotary


def rope_cache(max_pos, rot_dim, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rot_dim, 2) / rot_dim)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("D,rot_dim", [(16, 16), (32, 16), (64, 64), (24, 12)])
def test_rotary_embedding(be, is_neox, D, rot_dim):
    rng = np.random.default_rng(D + rot_dim + is_neox)
    T, Hq, Hkv = 6, 4, 2
    pos = np.array([0, 5, 99, 1, 63, 7], np.int32)
    q = rng.standard_normal((T, Hq * D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv * D)).astype(np.float32)
    cache = rope_cache(100, rot_dim)
    q0 = q.copy()
    want_q, want_k = ref.rotary_embedding(pos, q, k, cache, D, is_neox)
    be.rotary_embedding(pos, q, k, cache, D, is_neox)
    np.testing.assert_allclose(q, want_q, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(k, want_k, rtol=RTOL, atol=ATOL)
    heads, heads0 = q.reshape(T, Hq, D), q0.reshape(T, Hq, D)
    np.testing.assert_array_equal(heads[..., rot_dim:], heads0[..., rot_dim:])  # untouched
    assert not np.allclose(heads[1:, :, :rot_dim], heads0[1:, :, :rot_dim])  # rotated


def test_rotary_styles_differ_and_bad_input(be):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 16)).astype(np.float32)
    k = rng.standard_normal((2, 16)).astype(np.float32)
    cache = rope_cache(10, 16)
    pos = np.array([3, 4], np.int32)
    a = ref.rotary_embedding(pos, q, k, cache, 16, True)[0]
    b = ref.rotary_embedding(pos, q, k, cache, 16, False)[0]
    assert not np.allclose(a, b)
    with pytest.raises(ValueError, match="rotary_embedding"):
        be.rotary_embedding(pos, q, k, cache, 12, True)  # 16 % 12 != 0
    with pytest.raises(ValueError, match="rotary_embedding"):
        be.rotary_embedding(np.array([3, 10], np.int32), q, k, cache, 16, True)  # pos >= max_pos


# ---- KV cache and paged attention


def test_reshape_and_cache_skips_minus_one(be):
    rng = np.random.default_rng(5)
    NB, BS, Hkv, D, T = 4, 8, 2, 16, 5
    k = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv, D)).astype(np.float32)
    kc = np.full((NB, BS, Hkv, D), np.nan, np.float32)
    vc = np.full((NB, BS, Hkv, D), np.nan, np.float32)
    slots = np.array([3, -1, 31, 8, -1], np.int32)
    want_k, want_v = ref.reshape_and_cache(k, v, kc, vc, slots)
    be.reshape_and_cache(k, v, kc, vc, slots)
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)
    assert np.isnan(kc).sum() == (NB * BS - 3) * Hkv * D
    with pytest.raises(ValueError, match="reshape_and_cache"):
        be.reshape_and_cache(k, v, kc, vc, np.array([0, 1, 2, 3, 32], np.int32))
    with pytest.raises(ValueError, match="reshape_and_cache"):
        be.reshape_and_cache(k, v[:, :1], kc, vc, slots)


def make_paged_batch(rng, seqs, BS, Hq, Hkv, D, extra_blocks=5):
    """seqs: list of (seq_len, q_len). Returns q, caches (NaN outside written slots), tables..."""
    nblocks = [(s + BS - 1) // BS for s, _ in seqs]
    NB = sum(nblocks) + extra_blocks
    ids = rng.permutation(NB).astype(np.int32)
    MB = max(nblocks) + 1
    tables = np.full((len(seqs), MB), -7, np.int32)  # junk past each sequence's blocks
    kc = np.full((NB, BS, Hkv, D), np.nan, np.float32)
    vc = np.full((NB, BS, Hkv, D), np.nan, np.float32)
    used = 0
    for b, (s, _) in enumerate(seqs):
        tables[b, :nblocks[b]] = ids[used:used + nblocks[b]]
        used += nblocks[b]
        for j in range(s):
            blk, off = tables[b, j // BS], j % BS
            kc[blk, off] = rng.standard_normal((Hkv, D))
            vc[blk, off] = rng.standard_normal((Hkv, D))
    qsl = np.concatenate([[0], np.cumsum([ql for _, ql in seqs])]).astype(np.int32)
    T = int(qsl[-1])
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    seq_lens = np.array([s for s, _ in seqs], np.int32)
    return q, kc, vc, tables, seq_lens, qsl


@pytest.mark.parametrize("BS", [8, 16])
@pytest.mark.parametrize("window", [0, 7, 16])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 16), (4, 4, 32), (6, 1, 24), (6, 2, 48)])
@pytest.mark.parametrize("isa", ISAS)
def test_paged_attention(isa, BS, window, Hq, Hkv, D):
    be = backend_for(isa)
    rng = np.random.default_rng(BS * 100 + window * 10 + Hq + D)
    # decode at the first position, decode deep in, prefill chunk mid-sequence, full prefill
    seqs = [(1, 1), (37, 1), (50, 13), (20, 20), (70, 2)]
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, seqs, BS, Hq, Hkv, D)
    out = np.full_like(q, np.nan)
    scale = 1.0 / np.sqrt(D)
    be.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, scale, window)
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, window)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)
    if window:  # the window changes the answer, so this test can tell it was applied
        assert not np.allclose(want, ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, 0))


def test_paged_attention_long_context_and_bad_input(be):
    rng = np.random.default_rng(11)
    seqs = [(300, 1), (150, 64)]
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, seqs, 16, 8, 2, 64)
    q *= 4  # peaky softmax exercises the running-max rescale
    out = np.empty_like(q)
    be.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 0.125, 0)
    np.testing.assert_allclose(out, ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, 0.125, 0),
                               rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="paged_attention"):
        be.paged_attention(out[:, :4], q, kc, vc, tables, seq_lens, qsl, 0.125, 0)
    with pytest.raises(ValueError, match="paged_attention"):  # Hq not a multiple of Hkv
        be.paged_attention(out[:, :3].copy(), q[:, :3].copy(), kc, vc, tables, seq_lens, qsl, 0.125, 0)
    bad = seq_lens.copy()
    bad[0] = 10_000  # beyond the block table
    with pytest.raises(ValueError, match="paged_attention"):
        be.paged_attention(out, q, kc, vc, tables, bad, qsl, 0.125, 0)


@pytest.mark.parametrize("nt", [1, 2, 3])
@pytest.mark.parametrize("window", [0, 700])
@pytest.mark.parametrize("Hq,Hkv,D,seqs", [
    (7, 1, 64, [(2100, 1)]),             # one long decode: keys split across threads, then merged
    (8, 2, 24, [(1500, 5)]),             # portable kernel (D % 16 != 0), 5-row prefill chunk split
    (4, 1, 32, [(1200, 9), (40, 1)]),    # 8-row tile (queries-in-lanes kernel), causal-partial pieces
    (14, 2, 64, [(2100, 1)]),            # decode row over all KV heads at once (group 7, padded)
    (6, 3, 24, [(1500, 1), (900, 1)]),   # the same on the portable kernel
])
@pytest.mark.parametrize("isa", ISAS)
def test_paged_attention_split_keys(isa, nt, window, Hq, Hkv, D, seqs):
    backend_for(isa)
    rng = np.random.default_rng(nt * 1000 + window + D)
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, seqs, 16, Hq, Hkv, D)
    q *= 3
    out = np.full_like(q, np.nan)
    scale = 1.0 / np.sqrt(D)
    CpuBackend(isa=isa, num_threads=nt).paged_attention(out, q, kc, vc, tables, seq_lens, qsl, scale,
                                                         window)
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, window)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("nt", [1, 3])
@pytest.mark.parametrize("Hq,Hkv,D,seqs", [
    (4, 2, 16, [(1, 1), (37, 1), (50, 13), (20, 20), (70, 2)]),   # AVX-512 kernels, D 16
    (6, 2, 24, [(37, 1), (50, 13), (33, 33)]),                     # portable kernel
    (4, 1, 32, [(1200, 9), (40, 1)]),      # queries-in-lanes kernel, keys split across threads
    (8, 2, 64, [(2100, 1)]),               # one long decode over all KV heads, split and merged
])
def test_paged_attention_softcap(isa, nt, Hq, Hkv, D, seqs):
    backend_for(isa)
    be = CpuBackend(isa=isa, num_threads=nt)
    rng = np.random.default_rng(Hq * 100 + D + nt)
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, seqs, 16, Hq, Hkv, D)
    q *= 4                                             # large scores: the cap matters
    scale, cap = 1.0 / np.sqrt(D), 5.0
    out = np.full_like(q, np.nan)
    be.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, scale, 7, softcap=cap)
    want = ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, 7, softcap=cap)
    np.testing.assert_allclose(out, want, rtol=RTOL, atol=ATOL)
    # the cap changes the answer, and 0 switches it off exactly
    assert not np.allclose(want, ref.paged_attention(q, kc, vc, tables, seq_lens, qsl, scale, 7),
                           atol=1e-3)
    plain, off = np.full_like(q, np.nan), np.full_like(q, np.nan)
    be.paged_attention(plain, q, kc, vc, tables, seq_lens, qsl, scale, 7)
    be.paged_attention(off, q, kc, vc, tables, seq_lens, qsl, scale, 7, softcap=0.0)
    np.testing.assert_array_equal(off, plain)


def test_paged_attention_rejects_bad_softcap(be):
    rng = np.random.default_rng(2)
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, [(5, 2)], 8, 2, 1, 16)
    out = np.empty_like(q)
    for bad in (-1.0, np.nan, np.inf):
        with pytest.raises(ValueError, match="paged_attention.*softcap"):
            be.paged_attention(out, q, kc, vc, tables, seq_lens, qsl, 0.25, 0, softcap=bad)


# ---- FP8 KV cache (uint8 e4m3 codes, per-KV-head scales)


def fp8_cache_batch(rng, seqs, BS, Hq, Hkv, D):
    """make-paged-batch for FP8 caches: codes of random K/V in the used slots, NaN codes elsewhere."""
    q, kc, vc, tables, seq_lens, qsl = make_paged_batch(rng, seqs, BS, Hq, Hkv, D)
    k_scale = rng.uniform(0.005, 0.03, Hkv).astype(np.float32)  # |K| ~ 4 reaches the saturation
    v_scale = rng.uniform(0.005, 0.03, Hkv).astype(np.float32)
    k8 = ref.e4m3_encode(ref.fp8_quotient(kc, k_scale[:, None]))  # NaN slots stay NaN codes
    v8 = ref.e4m3_encode(ref.fp8_quotient(vc, v_scale[:, None]))
    return q, k8, v8, k_scale, v_scale, tables, seq_lens, qsl


def test_reshape_and_cache_fp8_matches_reference():
    be = CpuBackend()
    rng = np.random.default_rng(5)
    NB, BS, Hkv, D, T = 4, 8, 2, 40, 6
    k = (rng.standard_normal((T, Hkv, D)) * 4).astype(np.float32)
    v = (rng.standard_normal((T, Hkv, D)) * 4).astype(np.float32)
    k[0, 0, :4] = [1e6, -1e6, np.inf, 2e-5]  # saturation and subnormals
    k_scale, v_scale = np.float32([0.01, 0.3]), np.float32([1.0, 0.007])
    kc = np.full((NB, BS, Hkv, D), 0x7f, np.uint8)
    vc = kc.copy()
    slots = np.array([3, -1, 31, 8, -1, 9], np.int32)
    want_k, want_v = ref.reshape_and_cache_fp8(k, v, kc, vc, slots, k_scale, v_scale)
    be.reshape_and_cache(k, v, kc, vc, slots, k_scale, v_scale)
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)
    assert (kc == 0x7f).sum() == (NB * BS - 4) * Hkv * D  # only the 4 real slots written
    assert kc.reshape(-1, Hkv, D)[3, 0, :2].tolist() == [0x7e, 0xfe]
    # the codes are ml_dtypes' of the clipped quotient
    q = np.clip(k[2] / k_scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    np.testing.assert_array_equal(kc.reshape(-1, Hkv, D)[31], q)
    with pytest.raises(ValueError, match="needs k_scale"):
        be.reshape_and_cache(k, v, kc, vc, slots)
    with pytest.raises(ValueError, match=r"k_scale must be \(Hkv,\)"):
        be.reshape_and_cache(k, v, kc, vc, slots, np.ones(3, np.float32), v_scale)
    with pytest.raises(ValueError, match="reshape_and_cache"):  # float cache with scales
        f32 = np.zeros((NB, BS, Hkv, D), np.float32)
        be.reshape_and_cache(k, v, f32, f32.copy(), slots, k_scale, v_scale)
    with pytest.raises(ValueError, match="reshape_and_cache"):
        be.reshape_and_cache(k, v, kc, vc, np.array([0, 1, 2, 3, 32, 0], np.int32), k_scale, v_scale)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("Hq,Hkv,D,window", [(4, 2, 64, 0), (6, 2, 24, 7), (8, 1, 32, 0)])
def test_paged_attention_fp8_matches_reference(isa, Hq, Hkv, D, window):
    be = backend_for(isa)
    rng = np.random.default_rng(Hq * 10 + D)
    seqs = [(1, 1), (37, 1), (50, 13), (20, 20), (70, 2)]
    q, k8, v8, ks, vs, tables, seq_lens, qsl = fp8_cache_batch(rng, seqs, 16, Hq, Hkv, D)
    out = np.full_like(q, np.nan)
    scale = 1.0 / np.sqrt(D)
    be.paged_attention(out, q, k8, v8, tables, seq_lens, qsl, scale, window, ks, vs)
    want = ref.paged_attention_fp8(q, k8, v8, ks, vs, tables, seq_lens, qsl, scale, window)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    # the scales are applied per KV head: swapping them changes the answer
    swapped = ref.paged_attention_fp8(q, k8, v8, ks[::-1] * 3, vs[::-1] * 3, tables, seq_lens, qsl,
                                      scale, window)
    assert not np.allclose(want, swapped, atol=1e-3)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("Hq,Hkv,D,seqs", [
    (8, 2, 64, [(1500, 1)]),            # one decode over all KV heads, keys split across threads
    (4, 1, 32, [(900, 9), (40, 1)]),    # prefill tile (queries-in-lanes kernel) + a decode row
    (6, 3, 24, [(700, 1), (300, 1)]),   # portable kernel
])
def test_paged_attention_fp8_split_keys(isa, Hq, Hkv, D, seqs):
    backend_for(isa)
    be = CpuBackend(isa=isa, num_threads=3)
    rng = np.random.default_rng(D)
    q, k8, v8, ks, vs, tables, seq_lens, qsl = fp8_cache_batch(rng, seqs, 16, Hq, Hkv, D)
    q *= 3
    out = np.full_like(q, np.nan)
    be.paged_attention(out, q, k8, v8, tables, seq_lens, qsl, 0.2, 0, ks, vs)
    want = ref.paged_attention_fp8(q, k8, v8, ks, vs, tables, seq_lens, qsl, 0.2, 0)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("Hq,Hkv,D,seqs", [
    (4, 2, 64, [(1, 1), (50, 13), (20, 20), (900, 1)]),   # AVX-512 kernels
    (6, 3, 24, [(700, 1), (300, 5)]),                       # portable kernel
])
def test_paged_attention_fp8_softcap(isa, Hq, Hkv, D, seqs):
    backend_for(isa)
    be = CpuBackend(isa=isa, num_threads=3)
    rng = np.random.default_rng(D + 3)
    q, k8, v8, ks, vs, tables, seq_lens, qsl = fp8_cache_batch(rng, seqs, 16, Hq, Hkv, D)
    q *= 4
    out = np.full_like(q, np.nan)
    be.paged_attention(out, q, k8, v8, tables, seq_lens, qsl, 0.2, 0, ks, vs, softcap=3.0)
    want = ref.paged_attention_fp8(q, k8, v8, ks, vs, tables, seq_lens, qsl, 0.2, 0, softcap=3.0)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(want, ref.paged_attention_fp8(q, k8, v8, ks, vs, tables, seq_lens, qsl,
                                                         0.2, 0), atol=1e-3)


# ---- argmax and Gumbel sampling


def test_philox_known_answers():
    """Random123 kat_vectors for philox4x32_10, on the NumPy oracle and on the C kernel."""
    kats = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for ctr, key, want in kats:
        assert tuple(int(w) for w in ref.philox4x32_10(ctr, key)) == want
        assert philox4x32_10(ctr, key) == want


@pytest.mark.parametrize("B,V", [(3, 10), (2, 1000), (1, 50_000), (5, 20_000)])
def test_argmax(be, B, V):
    rng = np.random.default_rng(V)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    logits[0, V // 3] = logits[0, V - 1] = 9.0  # tie: lowest index wins (across chunks too)
    if B > 1:
        logits[1, :] = -np.inf
        logits[1, V - 1] = -1.0
    out = np.full(B, -5, np.int64)
    be.argmax(logits, out)
    np.testing.assert_array_equal(out, ref.argmax(logits))
    assert out[0] == V // 3
    with pytest.raises(ValueError, match="argmax"):
        be.argmax(logits, np.empty(B, np.int32))


@pytest.mark.parametrize("spread", [2.0, 40.0])  # 40: most tokens fall below best - max(Gumbel)
@pytest.mark.parametrize("B,V", [(4, 1000), (1, 50_000), (3, 20_000)])
def test_gumbel_sample_matches_reference(be, B, V, spread):
    rng = np.random.default_rng(B + V)
    logits = (rng.standard_normal((B, V)) * spread).astype(np.float32)
    seeds = np.array([0, 1, 2**40 + 17, 2**64 - 1][:B] + [12345] * max(0, B - 4), np.uint64)
    for pos0 in [0, 7, 2**33 + 5]:
        positions = np.arange(pos0, pos0 + B, dtype=np.int64)
        out = np.full(B, -5, np.int64)
        be.gumbel_sample(logits, seeds, positions, out)
        np.testing.assert_array_equal(out, ref.gumbel_sample(logits, seeds, positions))


def test_gumbel_sample_is_random_and_masked(be):
    rng = np.random.default_rng(0)
    V = 64
    logits = np.zeros((200, V), np.float32)  # uniform: samples must spread over tokens
    seeds = np.arange(200, dtype=np.uint64)
    out = np.empty(200, np.int64)
    be.gumbel_sample(logits, seeds, np.zeros(200, np.int64), out)
    np.testing.assert_array_equal(out, ref.gumbel_sample(logits, seeds, np.zeros(200, np.int64)))
    assert len(set(out.tolist())) > 30
    masked = np.full((200, V), -np.inf, np.float32)
    allowed = rng.choice(V, 5, replace=False)
    masked[:, allowed] = rng.standard_normal(5) * 10
    be.gumbel_sample(masked, seeds, np.zeros(200, np.int64), out)
    assert set(out.tolist()) <= set(allowed.tolist())
    np.testing.assert_array_equal(out, ref.gumbel_sample(masked, seeds, np.zeros(200, np.int64)))
    with pytest.raises(ValueError, match="gumbel_sample"):
        be.gumbel_sample(masked, seeds.astype(np.int64), np.zeros(200, np.int64), out)


# ---- logits processing: penalties and filters


def random_entries(rng, B, V, N):
    """N distinct (row, col) entries with bias (some -inf, some -0.0), rep (some 1), pres_freq."""
    keys = rng.choice(B * V, N, replace=False)
    rows, cols = (keys // V).astype(np.int32), (keys % V).astype(np.int32)
    bias = rng.choice([-np.inf, -0.0, -1.5, 0.25, 3.0], N).astype(np.float32)
    rep = rng.choice([1.0, 0.8, 1.3, 2.0], N).astype(np.float32)
    pres_freq = rng.choice([0.0, 0.5, -0.75, 1.25], N).astype(np.float32)
    return rows, cols, bias, rep, pres_freq


@pytest.mark.parametrize("B,V,N", [(1, 10, 0), (1, 10, 10), (3, 1000, 200), (8, 5000, 3000)])
def test_apply_penalties(be, B, V, N):
    rng = np.random.default_rng(B * V + N)
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    before = logits.copy()
    entries = random_entries(rng, B, V, N)
    want = ref.apply_penalties(logits, *entries)
    be.apply_penalties(logits, *entries)
    np.testing.assert_array_equal(np.isneginf(logits), np.isneginf(want))
    np.testing.assert_allclose(logits, want, rtol=1e-6, atol=1e-6)
    touched = np.zeros((B, V), bool)
    touched[entries[0], entries[1]] = True
    np.testing.assert_array_equal(logits[~touched], before[~touched])   # others bit-identical
    if N:
        assert not np.allclose(logits[touched], before[touched])


def test_apply_penalties_order_and_bad_input(be):
    logits = np.array([[2.0, -1.0, 0.5, 4.0]], np.float32)
    one = lambda *v: np.array(v, np.float32)                       # noqa: E731
    rows, cols = np.zeros(3, np.int32), np.array([0, 1, 3], np.int32)
    # (2 - 4) * 2 - 1 = -5; (-1 + 2) / 2 - 0 = 0.5; 4 + -inf = -inf
    be.apply_penalties(logits, rows, cols, one(-4.0, 2.0, -np.inf), one(2.0, 2.0, 1.0),
                       one(1.0, 0.0, 0.5))
    np.testing.assert_array_equal(logits, [[-5.0, 0.5, 0.5, -np.inf]])
    e = np.zeros(1, np.float32)
    for r, c in [(1, 0), (-1, 0), (0, 4), (0, -1)]:
        with pytest.raises(ValueError, match="apply_penalties"):
            be.apply_penalties(logits, np.array([r], np.int32), np.array([c], np.int32), e, e + 1, e)
    with pytest.raises(ValueError, match="apply_penalties.*distinct"):
        be.apply_penalties(logits, np.zeros(2, np.int32), np.array([2, 2], np.int32),
                           one(1, 1), one(1, 1), one(0, 0))
    with pytest.raises(ValueError, match="apply_penalties"):
        be.apply_penalties(logits, rows.astype(np.int64), cols, e, e, e)
    with pytest.raises(ValueError, match="apply_penalties"):
        be.apply_penalties(logits, rows, cols, e, e, e)             # (N,) lengths differ


def filter_params(rng, B, V):
    temperature = rng.choice([1.0, 0.6, 1.7, 0.0], B).astype(np.float32)
    top_k = rng.choice([0, 1, 3, 40, V, V + 5], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.6, 0.2], B).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.02, 0.4], B).astype(np.float32)
    return temperature, top_k, top_p, min_p


@pytest.mark.parametrize("B,V", [(1, 5), (6, 300), (16, 20_000), (3, 150_000)])
def test_filter_logits(be, B, V):
    rng = np.random.default_rng(B + V)
    logits = (rng.standard_normal((B, V)) * rng.choice([0.3, 2.0, 10.0], B)[:, None]).astype(np.float32)
    if B > 1:
        logits[1, : V // 2] = logits[1].max()                     # ties at the top
    params = filter_params(rng, B, V)
    want = ref.filter_logits(logits, *params)
    be.filter_logits(logits, *params)
    np.testing.assert_array_equal(np.isneginf(logits), np.isneginf(want))
    kept = np.isfinite(want)
    np.testing.assert_allclose(logits[kept], want[kept], rtol=1e-6)
    assert kept.any(axis=1).all()                                 # every row keeps a token


def test_filter_logits_each_filter_alone(be):
    probs = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = np.tile(np.log(probs).astype(np.float32), (5, 1))
    f32 = lambda *v: np.array(v, np.float32)                       # noqa: E731
    be.filter_logits(logits, f32(1, 1, 1, 1, 2), np.array([2, 0, 0, 0, 0], np.int32),
                     f32(1, 0.65, 1, 1, 1), f32(0, 0, 0.5, 0, 0), )
    assert [set(np.flatnonzero(np.isfinite(r)).tolist()) for r in logits] == \
        [{1, 3}, {1, 3}, {1, 3}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}]
    np.testing.assert_allclose(logits[4], np.log(probs) / 2, rtol=1e-6)


def test_filter_logits_rejects_bad_input(be):
    logits = np.zeros((2, 10), np.float32)
    ok = dict(temperature=np.ones(2, np.float32), top_k=np.zeros(2, np.int32),
              top_p=np.ones(2, np.float32), min_p=np.zeros(2, np.float32))
    bad = [("temperature", np.float32([1, -1])), ("temperature", np.float32([np.nan, 1])),
           ("top_k", np.int32([0, -1])), ("top_p", np.float32([0, 1])),
           ("top_p", np.float32([1.5, 1])), ("min_p", np.float32([0, 2])),
           ("top_k", np.zeros(2, np.int64)), ("top_p", np.ones(3, np.float32))]
    for name, value in bad:
        with pytest.raises(ValueError, match="filter_logits"):
            be.filter_logits(logits, **(ok | {name: value}))
