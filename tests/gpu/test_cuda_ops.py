"""Every CudaBackend op against the CPU backend (f32) and the float64 oracle (tests/reference.py).

Inputs are fresh random values rounded to the activation dtype (f32, bf16, f16); the references
run on exactly those values widened to f32 / f64, so the tolerance covers only the GPU's own
rounding: ||out - ref|| / ||ref|| under 1e-4 (f32), 1e-2 (f16), 2e-2 (bf16), and no row worse
than 4x that. Outputs are poisoned first (NaN, or a sentinel for integers and FP8 codes) so an
unwritten element fails. Copy-like results (embedding rows, cache writes, FP8 codes, token ids)
must be exact.

Attention runs on paged caches whose unused slots and blocks hold large finite garbage (a kernel
that reads past a sequence changes the answer), with block tables padded with a garbage block;
a separate test puts NaN there. Shapes: the tiny-256 head_dim 64 and every compiled head size
(64/80/96/128/256), GQA groups 1/2/4/8, block sizes 16 and 32, sliding window and soft-cap on and
off, float and FP8 caches, long decode contexts (2k-8k) with split-K off and on, mixed
prefill + decode batches whose prefill rows are fewer than the context (prefix-cache hits).
Prefill batches run the default kernel (prefill=fa3, fa2 off compute capability 9.0) where it
applies and the simple one elsewhere; test_cuda_prefill_fa2.py covers fa2 and fa3 in depth, and
the NaN test here also runs the simple kernel on a batch the default would take.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import reference as ref

ACT = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
TOL = {"f32": 1e-4, "bf16": 2e-2, "f16": 1e-2}
DTYPES = list(ACT)
HEAD_SIZES = [64, 80, 96, 128, 256]
GROUPS = [1, 2, 4, 8]


# ---- helpers: host <-> device, poisoned outputs, comparisons


def dtype_name(b) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[np.dtype(b.act_dtype).name]


def to_dev(b, a):
    """A device copy of host array `a` (same dtype), ordered on the backend's stream."""
    with b.stream:
        return b.asarray(np.ascontiguousarray(a))


def to_host(b, a) -> np.ndarray:
    b.synchronize()
    return np.asarray(b.to_host(a))


def rand(rng, shape, dt, scale=1.0) -> np.ndarray:
    """Random normal values rounded to the activation dtype `dt`."""
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(ACT[dt])


def nan_dev(b, shape, dtype):
    return to_dev(b, np.full(shape, np.nan, dtype))


def assert_close(out, want, tol, what=""):
    """||out - want|| / ||want|| < tol, each row (last axis) under 4 * tol, nothing non-finite."""
    out, want = ref.to_f64(out), ref.to_f64(want)
    assert out.shape == want.shape, f"{what}: shape {out.shape} vs {want.shape}"
    bad = ~np.isfinite(out)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {out.size} elements not finite "
                           f"(unwritten?), first at {np.argwhere(bad)[:3].tolist()}")
    norm = np.linalg.norm(want)
    err = np.linalg.norm(out - want) / max(norm, 1e-30)
    assert err < tol, f"{what}: ||out - ref|| / ||ref|| = {err:.3g}, tolerance {tol:g}"
    if out.ndim >= 2 and out.size:
        o, w = out.reshape(-1, out.shape[-1]), want.reshape(-1, want.shape[-1])
        typical = norm / np.sqrt(len(w))
        rows = np.linalg.norm(o - w, axis=1) / np.maximum(np.linalg.norm(w, axis=1), 0.1 * typical)
        worst = int(rows.argmax())
        assert rows[worst] < 4 * tol, (f"{what}: row {worst} of {len(rows)} has relative error "
                                       f"{rows[worst]:.3g}, tolerance {4 * tol:g}")


def rel_diff(a, b) -> float:
    a, b = ref.to_f64(a), ref.to_f64(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- backend basics


def test_backend_basics(cuda):
    import cupy

    dt = dtype_name(cuda)
    assert cuda.name == "cuda"
    assert cuda.xp is cupy
    assert np.dtype(cuda.act_dtype) == np.dtype(ACT[dt])
    assert np.dtype(cuda.kv_cache_dtype("auto")) == np.dtype(ACT[dt])
    assert np.dtype(cuda.kv_cache_dtype("fp8")) == np.uint8
    assert isinstance(cuda.stream, cupy.cuda.Stream)
    rng = np.random.default_rng(0)
    a = rand(rng, (5, 7), dt)
    d = to_dev(cuda, a)
    assert isinstance(d, cupy.ndarray) and d.dtype == a.dtype
    back = to_host(cuda, d)
    assert back.dtype == a.dtype and np.array_equal(back.view(np.uint8), a.view(np.uint8))
    w = cuda.place_weight(rng.standard_normal((6, 4)).astype(np.float32))
    assert isinstance(w, cupy.ndarray) and np.dtype(w.dtype) == np.dtype(ACT[dt])


def test_bad_shapes_raise_naming_the_op(cuda_bf16):
    b = cuda_bf16
    act = ACT["bf16"]
    x = to_dev(b, np.zeros((2, 8), act))
    with pytest.raises(ValueError, match="linear"):
        b.linear(x, to_dev(b, np.zeros((4, 7), act)), None, to_dev(b, np.zeros((2, 4), act)))
    with pytest.raises(ValueError, match="rms_norm"):
        b.rms_norm(x, to_dev(b, np.ones(7, np.float32)), 1e-6, to_dev(b, np.zeros((2, 8), act)))
    with pytest.raises(ValueError, match="silu_and_mul"):
        b.silu_and_mul(x, to_dev(b, np.zeros((2, 5), act)))


# ---- embedding, linear, norms, activations


@pytest.mark.parametrize("V,H,T", [(512, 256, 9), (1000, 4096, 3), (50, 96, 64), (77, 100, 5)])
def test_embedding(cuda, V, H, T):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(V + H)
    table = rand(rng, (V, H), dt)
    ids = rng.integers(0, V, T).astype(np.int32)
    ids[0], ids[-1] = V - 1, 0
    out = nan_dev(cuda, (T, H), ACT[dt])
    cuda.embedding(to_dev(cuda, ids), to_dev(cuda, table), out)
    np.testing.assert_array_equal(ref.to_f64(to_host(cuda, out)), ref.embedding(ids, table))


@pytest.mark.parametrize("M", [1, 7, 64, 513])
@pytest.mark.parametrize("K,N", [(256, 768), (1024, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_f32", [True, False])
def test_linear(cuda, M, K, N, with_bias, out_f32):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(M * 7 + K + N + with_bias)
    x = rand(rng, (M, K), dt)
    w = rand(rng, (N, K), dt, 1 / np.sqrt(K))
    bias = rng.standard_normal(N).astype(np.float32) if with_bias else None
    out_dtype = np.float32 if out_f32 else ACT[dt]
    out = nan_dev(cuda, (M, N), out_dtype)
    cuda.linear(to_dev(cuda, x), to_dev(cuda, w), None if bias is None else to_dev(cuda, bias), out)
    got = to_host(cuda, out)
    assert got.dtype == np.dtype(out_dtype)
    # f32 activations must be true f32 GEMMs: a TF32 path would miss the f32 tolerance
    assert_close(got, ref.linear(x, w, bias), TOL[dt],
                 f"linear {dt} M={M} K={K} N={N} bias={with_bias} out={np.dtype(out_dtype).name}")


@pytest.mark.parametrize("T,H", [(1, 256), (7, 4096), (64, 96), (5, 100)])
def test_rms_norm(cuda, T, H):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(T + H)
    x = rand(rng, (T, H), dt, 3.0)
    w = rng.standard_normal(H).astype(np.float32)
    out = nan_dev(cuda, (T, H), ACT[dt])
    cuda.rms_norm(to_dev(cuda, x), to_dev(cuda, w), 1e-5, out)
    assert_close(to_host(cuda, out), ref.rms_norm(x, w, 1e-5), TOL[dt], f"rms_norm {dt}")


@pytest.mark.parametrize("T,H", [(1, 256), (7, 4096), (64, 96), (5, 100)])
def test_fused_add_rms_norm(cuda, T, H):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(T * H)
    x = rand(rng, (T, H), dt)
    r = rand(rng, (T, H), dt, 2.0)
    w = rng.standard_normal(H).astype(np.float32)
    want_x, want_r = ref.fused_add_rms_norm(x, r, w, 1e-5)
    xd, rd = to_dev(cuda, x), to_dev(cuda, r)
    cuda.fused_add_rms_norm(xd, rd, to_dev(cuda, w), 1e-5)
    got_r = to_host(cuda, rd)
    assert got_r.dtype == np.dtype(ACT[dt])  # the residual stays in the activation dtype
    assert_close(got_r, want_r, TOL[dt], f"fused_add_rms_norm residual {dt}")
    assert_close(to_host(cuda, xd), want_x, TOL[dt], f"fused_add_rms_norm x {dt}")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("T,H", [(1, 256), (7, 4096), (64, 96), (5, 100)])
def test_layer_norm(cuda, cpu, T, H, with_bias):
    """LayerNorm and its fused residual add against the reference and the CPU backend."""
    dt = dtype_name(cuda)
    rng = np.random.default_rng(T * H)
    x = rand(rng, (T, H), dt, 3.0)
    r = rand(rng, (T, H), dt, 2.0)
    w = rng.standard_normal(H).astype(np.float32)
    b = rng.standard_normal(H).astype(np.float32) if with_bias else None
    db = None if b is None else to_dev(cuda, b)
    out = nan_dev(cuda, (T, H), ACT[dt])
    cuda.layer_norm(to_dev(cuda, x), to_dev(cuda, w), db, 1e-5, out)
    assert_close(to_host(cuda, out), ref.layer_norm(x, w, b, 1e-5), TOL[dt], f"layer_norm {dt}")
    want_x, want_r = ref.fused_add_layer_norm(x, r, w, b, 1e-5)
    xd, rd = to_dev(cuda, x), to_dev(cuda, r)
    cuda.fused_add_layer_norm(xd, rd, to_dev(cuda, w), db, 1e-5)
    got_r = to_host(cuda, rd)
    assert got_r.dtype == np.dtype(ACT[dt])
    assert_close(got_r, want_r, TOL[dt], f"fused_add_layer_norm residual {dt}")
    assert_close(to_host(cuda, xd), want_x, TOL[dt], f"fused_add_layer_norm x {dt}")
    on_cpu = np.empty((T, H), np.float32)
    cpu.layer_norm(x.astype(np.float32), w, b, 1e-5, on_cpu)
    assert_close(to_host(cuda, out), on_cpu, TOL[dt], "layer_norm vs CPU")


def rope_cache(max_pos, rot_dim, base=10000.0):
    inv = 1.0 / base ** (np.arange(0, rot_dim, 2) / rot_dim)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("D,rot_dim", [(64, 64), (128, 128), (128, 64), (80, 80), (256, 64)])
def test_rotary_embedding(cuda, is_neox, D, rot_dim):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(D + rot_dim + is_neox)
    T, Hq, Hkv, max_pos = 9, 4, 2, 300
    pos = rng.integers(0, max_pos, T).astype(np.int32)
    pos[0], pos[1] = 0, max_pos - 1
    q = rand(rng, (T, Hq * D), dt)
    k = rand(rng, (T, Hkv * D), dt)
    cache = rope_cache(max_pos, rot_dim)
    want_q, want_k = ref.rotary_embedding(pos, q, k, cache, D, is_neox)
    qd, kd = to_dev(cuda, q), to_dev(cuda, k)
    cuda.rotary_embedding(to_dev(cuda, pos), qd, kd, to_dev(cuda, cache), D, is_neox)
    got_q, got_k = to_host(cuda, qd), to_host(cuda, kd)
    assert_close(got_q, want_q, TOL[dt], f"rotary q {dt}")
    assert_close(got_k, want_k, TOL[dt], f"rotary k {dt}")
    # the dims past rot_dim are untouched, bit for bit
    np.testing.assert_array_equal(ref.to_f64(got_q).reshape(T, Hq, D)[..., rot_dim:],
                                  ref.to_f64(q).reshape(T, Hq, D)[..., rot_dim:])
    np.testing.assert_array_equal(ref.to_f64(got_k).reshape(T, Hkv, D)[..., rot_dim:],
                                  ref.to_f64(k).reshape(T, Hkv, D)[..., rot_dim:])


@pytest.mark.parametrize("T,inter", [(1, 768), (9, 2048), (64, 37)])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation(cuda, T, inter, act):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(T + inter)
    x = rand(rng, (T, 2 * inter), dt, 3.0)
    out = nan_dev(cuda, (T, inter), ACT[dt])
    getattr(cuda, f"{act}_and_mul")(to_dev(cuda, x), out)
    want = ref.silu_and_mul(x) if act == "silu" else ref.gelu_tanh_and_mul(x)
    assert_close(to_host(cuda, out), want, TOL[dt], f"{act}_and_mul {dt}")


def test_gated_activation_matches_cpu(cuda_f32, cpu):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((17, 2 * 300)) * 4).astype(np.float32)
    for op in ("silu_and_mul", "gelu_tanh_and_mul"):
        out = nan_dev(cuda_f32, (17, 300), np.float32)
        getattr(cuda_f32, op)(to_dev(cuda_f32, x), out)
        want = np.full((17, 300), np.nan, np.float32)
        getattr(cpu, op)(x, want)
        assert_close(to_host(cuda_f32, out), want, 1e-5, op)


@pytest.mark.parametrize("logits", [True, False])
def test_softcap(cuda, cpu, logits):
    """In place cap * tanh(x / cap): on f32 logits (any backend dtype) and on activations."""
    dt = dtype_name(cuda)
    rng = np.random.default_rng(int(logits))
    if logits:
        x, cap, tol = (rng.standard_normal((3, 1000)) * 50).astype(np.float32), 30.0, 1e-5
    else:
        x, cap, tol = rand(rng, (9, 256), dt, 8.0), 5.0, TOL[dt]
    xd = to_dev(cuda, x)
    cuda.softcap(xd, cap)
    got = to_host(cuda, xd)
    assert got.dtype == x.dtype
    want = ref.softcap(x, cap)
    assert rel_diff(want, x) > 0.1  # the cap matters for these values
    assert_close(got, want, tol, f"softcap {dt} logits={logits}")
    if logits:
        on_cpu = x.copy()
        cpu.softcap(on_cpu, cap)
        assert_close(got, on_cpu, 1e-5, "softcap vs CPU")


def test_scale(cuda, cpu):
    """x * s with s already in the activation dtype (Gemma's sqrt(hidden)): the product of two
    bf16/f16 values is exact in float, so one rounding gives exactly the reference."""
    dt = dtype_name(cuda)
    rng = np.random.default_rng(7)
    x = rand(rng, (9, 2304), dt)
    s = float(np.asarray(np.sqrt(2304.0), ACT[dt]))
    xd = to_dev(cuda, x)
    cuda.scale(xd, s)
    got = to_host(cuda, xd)
    np.testing.assert_array_equal(got, ref.scale(x, s).astype(np.float32).astype(ACT[dt]))
    on_cpu = x.astype(np.float32)
    cpu.scale(on_cpu, s)
    np.testing.assert_array_equal(got.astype(np.float32), on_cpu.astype(ACT[dt]).astype(np.float32))


# ---- KV cache writes


@pytest.mark.parametrize("BS", [16, 32])
@pytest.mark.parametrize("D", [64, 128])
def test_reshape_and_cache(cuda, BS, D):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(BS + D)
    NB, Hkv, T = 5, 2, 7
    k, v = rand(rng, (T, Hkv, D), dt), rand(rng, (T, Hkv, D), dt)
    slots = np.array([3, -1, NB * BS - 1, BS, -1, 2 * BS + 5, 0], np.int32)
    kc = nan_dev(cuda, (NB, BS, Hkv, D), ACT[dt])
    vc = nan_dev(cuda, (NB, BS, Hkv, D), ACT[dt])
    cuda.reshape_and_cache(to_dev(cuda, k), to_dev(cuda, v), kc, vc, to_dev(cuda, slots))
    init = np.full((NB, BS, Hkv, D), np.nan, ACT[dt])
    want_k, want_v = ref.reshape_and_cache(k, v, init, init.copy(), slots)
    got_k, got_v = ref.to_f64(to_host(cuda, kc)), ref.to_f64(to_host(cuda, vc))
    np.testing.assert_array_equal(got_k, ref.to_f64(want_k))  # NaN where unwritten, both sides
    np.testing.assert_array_equal(got_v, ref.to_f64(want_v))
    assert np.isnan(got_k).sum() == (NB * BS - 5) * Hkv * D


def fp8_scales(rng, Hkv):
    return (rng.uniform(0.005, 0.03, Hkv).astype(np.float32),
            rng.uniform(0.005, 0.03, Hkv).astype(np.float32))


@pytest.mark.parametrize("BS", [16, 32])
@pytest.mark.parametrize("D", [64, 128])
def test_reshape_and_cache_fp8(cuda, cpu, BS, D):
    """e4m3 codes of x / scale[h]: exactly the oracle's (and, with f32 activations, the CPU
    backend's) for the same activation values, saturation and subnormals included."""
    dt = dtype_name(cuda)
    rng = np.random.default_rng(BS * D)
    NB, Hkv, T = 4, 2, 6
    k = rand(rng, (T, Hkv, D), dt, 4.0)
    v = rand(rng, (T, Hkv, D), dt, 4.0)
    with np.errstate(over="ignore"):  # 1e6 is inf in f16: saturated all the same
        k[0, 0, :5] = np.array([1e6, -1e6, np.inf, 2e-5, -3e-6], np.float32).astype(ACT[dt])
    k_scale, v_scale = fp8_scales(rng, Hkv)
    k_scale[1] = 1.0
    slots = np.array([3, -1, NB * BS - 1, 8, -1, 9], np.int32)
    init = np.full((NB, BS, Hkv, D), 0x7F, np.uint8)
    kc, vc = to_dev(cuda, init), to_dev(cuda, init)
    cuda.reshape_and_cache(to_dev(cuda, k), to_dev(cuda, v), kc, vc, to_dev(cuda, slots),
                           to_dev(cuda, k_scale), to_dev(cuda, v_scale))
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    want_k, want_v = ref.reshape_and_cache_fp8(k32, v32, init, init.copy(), slots, k_scale,
                                               v_scale)
    got_k, got_v = to_host(cuda, kc), to_host(cuda, vc)
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)
    assert (got_k == 0x7F).sum() == (NB * BS - 4) * Hkv * D
    if dt == "f32":
        ck, cv = init.copy(), init.copy()
        cpu.reshape_and_cache(k32, v32, ck, cv, slots, k_scale, v_scale)
        np.testing.assert_array_equal(got_k, ck)
        np.testing.assert_array_equal(got_v, cv)


# ---- paged attention


class Paged:
    """A paged batch on the host: q, caches (act dtype or FP8 codes), tables, lengths."""


def paged_batch(rng, seqs, BS, Hq, Hkv, D, dt, fp8=False, garbage="finite", q_scale=3.0):
    """seqs: (seq_len, q_len) per sequence. Unused slots (past each sequence's length, and 3
    whole blocks) hold garbage: large finite values (or codes), or NaN; block tables are padded
    with a garbage block's id."""
    act = ACT[dt]
    nblocks = [-(-s // BS) for s, _ in seqs]
    NB = sum(nblocks) + 3
    ids = rng.permutation(NB).astype(np.int32)
    MB = max(nblocks) + 2
    tables = np.full((len(seqs), MB), ids[-1], np.int32)
    shape = (NB, BS, Hkv, D)
    p = Paged()
    if fp8:
        p.k_scale, p.v_scale = fp8_scales(rng, Hkv)
        if garbage == "nan":
            kc, vc = np.full(shape, 0x7F, np.uint8), np.full(shape, 0xFF, np.uint8)
        else:  # any code but the two NaNs (0x7f, 0xff)
            kc = (rng.integers(0, 0x7F, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)
            vc = (rng.integers(0, 0x7F, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)
    else:
        p.k_scale = p.v_scale = None
        if garbage == "nan":
            kc, vc = np.full(shape, np.nan, act), np.full(shape, np.nan, act)
        else:
            kc, vc = rand(rng, shape, dt, 30.0), rand(rng, shape, dt, 30.0)
    kf, vf = kc.reshape(NB * BS, Hkv, D), vc.reshape(NB * BS, Hkv, D)
    used = 0
    for b, (s, _) in enumerate(seqs):
        tables[b, :nblocks[b]] = ids[used:used + nblocks[b]]
        used += nblocks[b]
        j = np.arange(s)
        slots = tables[b, j // BS] * BS + j % BS
        kv = rng.standard_normal((2, s, Hkv, D)).astype(np.float32)
        if fp8:  # data only (the cache-write test checks encoding): ml_dtypes' codes, faster
            kf[slots] = fp8_codes(kv[0] / p.k_scale[:, None])
            vf[slots] = fp8_codes(kv[1] / p.v_scale[:, None])
        else:
            kf[slots] = kv[0].astype(act)
            vf[slots] = kv[1].astype(act)
    p.qsl = np.concatenate([[0], np.cumsum([ql for _, ql in seqs])]).astype(np.int32)
    p.q = rand(rng, (int(p.qsl[-1]), Hq, D), dt, q_scale)
    p.kc, p.vc, p.tables = kc, vc, tables
    p.seq_lens = np.array([s for s, _ in seqs], np.int32)
    p.scale = 1.0 / np.sqrt(D)
    return p


def fp8_codes(x):
    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def cast(p, dt):
    """The same batch with q (and float caches) rounded to activation dtype `dt`."""
    c = Paged()
    c.__dict__.update(p.__dict__)
    c.q = p.q.astype(ACT[dt])
    if p.k_scale is None:
        c.kc, c.vc = p.kc.astype(ACT[dt]), p.vc.astype(ACT[dt])
    return c


def cpu_attention(cpu, p, window, softcap):
    """The CPU backend (f32) on the same values: q widened, float caches widened, FP8 codes as
    they are."""
    out = np.full(p.q.shape, np.nan, np.float32)
    kc = p.kc if p.k_scale is not None else p.kc.astype(np.float32)
    vc = p.vc if p.v_scale is not None else p.vc.astype(np.float32)
    cpu.paged_attention(out, p.q.astype(np.float32), kc, vc, p.tables, p.seq_lens, p.qsl,
                        p.scale, window, p.k_scale, p.v_scale, softcap=softcap)
    return out


def cuda_attention(b, p, window, softcap):
    dt = dtype_name(b)
    out = nan_dev(b, p.q.shape, ACT[dt])
    opt = lambda a: None if a is None else to_dev(b, a)  # noqa: E731
    b.paged_attention(out, to_dev(b, p.q), to_dev(b, p.kc), to_dev(b, p.vc), to_dev(b, p.tables),
                      to_dev(b, p.seq_lens), to_dev(b, p.qsl), p.scale, window, opt(p.k_scale),
                      opt(p.v_scale), softcap=softcap)
    return to_host(b, out)


def check_attention(b, cpu, p, window, softcap, what, tol=None):
    dt = dtype_name(b)
    want = cpu_attention(cpu, p, window, softcap)
    assert np.isfinite(want).all()
    got = cuda_attention(b, p, window, softcap)
    assert got.dtype == np.dtype(ACT[dt])
    tol = tol or TOL[dt]
    assert_close(got, want, tol, f"{what} {dt} window={window} softcap={softcap}")
    # each feature changes the answer, so a kernel that ignored it would fail above
    if window:
        assert rel_diff(cpu_attention(cpu, p, 0, softcap), want) > 5 * tol, "window has no effect"
    if softcap:
        assert rel_diff(cpu_attention(cpu, p, window, 0.0), want) > 5 * tol, "softcap no effect"


DECODE_SEQS = [(1, 1), (17, 1), (64, 1), (300, 1), (129, 1)]
# decode rows, a chunk mid-sequence (13 rows of a 50-token context), a whole prompt, rows of a
# long context (prefix-cache hit: 64 rows of 200)
MIXED_SEQS = [(1, 1), (37, 1), (50, 13), (20, 20), (70, 2), (200, 64)]
BLOCK_FOR_GROUP = {1: 16, 2: 32, 4: 16, 8: 32}
# (sliding_window, softcap) per head size, so every feature meets several sizes and dtypes
FEATURES_FOR_D = {64: (0, 0.0), 80: (40, 0.0), 96: (0, 5.0), 128: (40, 5.0), 256: (0, 0.0)}


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("D", HEAD_SIZES)
def test_paged_attention_decode(cuda, cpu, D, group):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(D * 10 + group)
    window, softcap = FEATURES_FOR_D[D]
    p = paged_batch(rng, DECODE_SEQS, BLOCK_FOR_GROUP[group], 2 * group, 2, D, dt)
    check_attention(cuda, cpu, p, window, softcap, f"decode D={D} group={group}")


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("D", HEAD_SIZES)
def test_paged_attention_prefill(cuda, cpu, D, group):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(D * 100 + group)
    window, softcap = FEATURES_FOR_D[D]
    p = paged_batch(rng, MIXED_SEQS, BLOCK_FOR_GROUP[group], 2 * group, 2, D, dt)
    check_attention(cuda, cpu, p, window, softcap, f"mixed prefill D={D} group={group}")


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (16, 0.0), (0, 5.0), (16, 5.0)])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("BS", [16, 32])
def test_paged_attention_tiny256_features(cuda, cpu, window, softcap, mixed, BS):
    """The tiny-256 shape (4 heads of 64, 2 KV heads) with each feature on and off."""
    dt = dtype_name(cuda)
    rng = np.random.default_rng(window + int(softcap) + 2 * mixed + BS)
    p = paged_batch(rng, MIXED_SEQS if mixed else DECODE_SEQS, BS, 4, 2, 64, dt)
    check_attention(cuda, cpu, p, window, softcap, f"tiny256 mixed={mixed} BS={BS}")


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("window", [0, 1000])
@pytest.mark.parametrize("split_k", [False, True])
def test_paged_attention_decode_long_context(make_cuda, cpu, split_k, window, fp8):
    """Decode over 2k-8k keys (Llama-3-8B heads: 32 query heads over 8 KV heads, D 128), with the
    one-pass kernel and with split-K partitions merged by the reduction pass."""
    seqs = [(2048, 1), (8192, 1), (5003, 1), (1, 1)]
    rng = np.random.default_rng(int(split_k) + window + 7 * fp8)
    p32 = paged_batch(rng, seqs, 16, 32, 8, 128, "f32", fp8=fp8)
    for dt in DTYPES:
        b = make_cuda(dt, "decode=split" if split_k else "decode=simple")
        assert bool(b.split_k) == split_k
        check_attention(b, cpu, cast(p32, dt), window, 0.0,
                        f"long decode split_k={split_k} fp8={fp8}")


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("D", [64, 128])
def test_paged_attention_fp8(cuda, cpu, D, mixed):
    dt = dtype_name(cuda)
    rng = np.random.default_rng(D + mixed)
    p = paged_batch(rng, MIXED_SEQS if mixed else DECODE_SEQS, 16, 8, 2, D, dt, fp8=True)
    check_attention(cuda, cpu, p, 0, 0.0, f"fp8 D={D} mixed={mixed}")
    check_attention(cuda, cpu, p, 40, 5.0, f"fp8 D={D} mixed={mixed}")
    # the scales are applied per KV head: swapped scales change the answer
    want = cpu_attention(cpu, p, 0, 0.0)
    p.k_scale, p.v_scale = p.k_scale[::-1].copy() * 3, p.v_scale[::-1].copy() * 3
    assert rel_diff(cpu_attention(cpu, p, 0, 0.0), want) > 0.1


@pytest.mark.parametrize("kernel", ["decode", "prefill", "simple-prefill", "fp8-decode",
                                    "fp8-prefill"])
def test_paged_attention_nan_in_unused_slots(make_cuda, cpu, kernel):
    """Cache memory the sequences do not own may hold anything, NaN included (a fresh pool, a
    freed block's stale FP8 codes): masked-off keys must not leak into the output (0 * NaN)."""
    dt = "bf16"
    b = make_cuda(dt, "prefill=simple" if kernel == "simple-prefill" else "")
    rng = np.random.default_rng(len(kernel))
    seqs = DECODE_SEQS if kernel.endswith("decode") else MIXED_SEQS
    p = paged_batch(rng, seqs, 16, 8, 2, 128 if kernel == "simple-prefill" else 64, dt,
                    fp8=kernel.startswith("fp8"), garbage="nan")
    check_attention(b, cpu, p, 0, 0.0, f"NaN garbage, {kernel}")


def test_paged_attention_rejects_bad_input(cuda_bf16):
    b = cuda_bf16
    rng = np.random.default_rng(0)
    p = paged_batch(rng, DECODE_SEQS, 16, 4, 2, 64, "bf16")
    good = [to_dev(b, a) for a in (p.q, p.kc, p.vc, p.tables, p.seq_lens, p.qsl)]
    out = nan_dev(b, p.q.shape, ACT["bf16"])
    with pytest.raises(ValueError, match="paged_attention"):  # out of the wrong shape
        b.paged_attention(nan_dev(b, (5, 4, 32), ACT["bf16"]), *good, p.scale, 0)
    with pytest.raises(ValueError, match="paged_attention"):  # Hq not a multiple of Hkv
        q3 = to_dev(b, p.q[:, :3].copy())
        b.paged_attention(nan_dev(b, q3.shape, ACT["bf16"]), q3, *good[1:], p.scale, 0)
    with pytest.raises(ValueError, match="paged_attention"):  # FP8 cache without scales
        codes = to_dev(b, np.zeros(p.kc.shape, np.uint8))
        b.paged_attention(out, good[0], codes, codes, *good[3:], p.scale, 0)


# ---- sampling


def gumbel_values(logits, seeds, positions):
    """(B, V) float64 Gumbel-max values as the oracle draws them; -inf where logits are -inf."""
    vals = np.empty(logits.shape)
    for b in range(logits.shape[0]):
        row = logits[b].astype(np.float64)
        vals[b] = row + ref.gumbel_noise(seeds[b], positions[b], row.shape[0])
        vals[b][row == -np.inf] = -np.inf
    return vals


@pytest.mark.parametrize("B,V", [(1, 128256), (3, 1000), (64, 50000), (5, 10)])
def test_argmax(cuda_f32, cpu, B, V):
    b = cuda_f32
    rng = np.random.default_rng(B + V)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    logits[0, V // 3] = logits[0, V - 1] = 9.0       # tie: the lowest index wins
    if B > 1:
        logits[1, :] = -np.inf
        logits[1, V - 1] = -1.0
    if B > 2:
        logits[2, :] = 0.5                            # all equal: index 0
    out = to_dev(b, np.full(B, -5, np.int64))
    b.argmax(to_dev(b, logits), out)
    got = to_host(b, out)
    want = np.full(B, -5, np.int64)
    cpu.argmax(logits, want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, ref.argmax(logits))
    assert got[0] == V // 3


@pytest.mark.parametrize("spread", [2.0, 40.0])
@pytest.mark.parametrize("B,V", [(4, 1000), (1, 128256), (64, 32000)])
def test_gumbel_sample(cuda_f32, cpu, B, V, spread):
    """The CPU's tokens exactly, for the same seeds and positions, except where the top two
    Gumbel-max values are within 1e-9 (then either of the two)."""
    b = cuda_f32
    rng = np.random.default_rng(B * V + int(spread))
    logits = (rng.standard_normal((B, V)) * spread).astype(np.float32)
    if B > 2:
        logits[2, rng.choice(V, V - 5, replace=False)] = -np.inf    # 5 tokens allowed
    seeds = np.array(([0, 2**64 - 1, 2**40 + 17, 12345] * B)[:B], np.uint64)
    seeds[4:] = rng.integers(0, 2**63, max(0, B - 4), dtype=np.int64).astype(np.uint64)
    for pos0 in [0, 7, 2**33 + 5]:
        positions = np.arange(pos0, pos0 + B, dtype=np.int64)
        out = to_dev(b, np.full(B, -5, np.int64))
        b.gumbel_sample(to_dev(b, logits), to_dev(b, seeds), to_dev(b, positions), out)
        got = to_host(b, out)
        want = np.full(B, -5, np.int64)
        cpu.gumbel_sample(logits, seeds, positions, want)
        differ = np.flatnonzero(got != want)
        vals = gumbel_values(logits, seeds, positions) if differ.size else None
        for r in differ:
            top2 = np.argsort(vals[r])[-2:]
            gap = vals[r, top2[1]] - vals[r, top2[0]]
            assert gap < 1e-9 and got[r] in top2, (
                f"row {r} (pos {positions[r]}): cuda {got[r]}, cpu {want[r]}, gap {gap:.3g}")
        assert np.isfinite(logits[np.arange(B), got]).all()   # -inf never wins


def test_gumbel_sample_spreads(cuda_f32):
    """Uniform logits: 200 seeds pick many different tokens (the noise is really random)."""
    b = cuda_f32
    B, V = 200, 64
    out = to_dev(b, np.full(B, -5, np.int64))
    b.gumbel_sample(to_dev(b, np.zeros((B, V), np.float32)),
                    to_dev(b, np.arange(B, dtype=np.uint64)), to_dev(b, np.zeros(B, np.int64)),
                    out)
    got = to_host(b, out)
    assert len(set(got.tolist())) > 30 and got.min() >= 0 and got.max() < V


@pytest.mark.parametrize("B,V,N", [(4, 1000, 37), (64, 50000, 3000), (1, 128256, 1)])
def test_apply_penalties(cuda_f32, cpu, B, V, N):
    """In place on N distinct (row, col) entries; every other logit untouched, bit for bit."""
    b = cuda_f32
    rng = np.random.default_rng(B + N)
    logits = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    keys = rng.choice(B * V, N, replace=False)
    rows, cols = (keys // V).astype(np.int32), (keys % V).astype(np.int32)
    bias = np.where(rng.random(N) < 0.3, rng.standard_normal(N), 0.0).astype(np.float32)
    bias[rng.random(N) < 0.1] = -np.inf                      # min_tokens masks
    rep = rng.choice(np.float32([1.0, 1.3, 0.8]), N).astype(np.float32)
    pres_freq = np.where(rng.random(N) < 0.5, 0.5 + 0.2 * rng.integers(0, 5, N), 0.0
                         ).astype(np.float32)
    ld = to_dev(b, logits)
    args = (rows, cols, bias, rep, pres_freq)
    b.apply_penalties(ld, *(to_dev(b, a) for a in args))
    got = to_host(b, ld)
    on_cpu = logits.copy()
    cpu.apply_penalties(on_cpu, *args)
    want = ref.apply_penalties(logits, *args)
    touched = np.zeros((B, V), bool)
    touched[rows, cols] = True
    np.testing.assert_array_equal(got[~touched], logits[~touched])
    for other, name in ((on_cpu, "cpu"), (want, "oracle")):
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(other), err_msg=name)
        fin = np.isfinite(other)
        np.testing.assert_allclose(got[fin], other[fin], rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("B,V,rows", [(1, 151936, [0]), (8, 32000, [0, 2, 3, 7]),
                                      (5, 33, [4, 1]), (64, 128256, list(range(0, 64, 3))),
                                      (3, 1000, [])])
def test_apply_token_bitmask(cuda_f32, cpu, B, V, rows):
    """Structured outputs' mask equals the CPU op bit for bit (and the oracle); rows not listed
    and allowed tokens are untouched."""
    b = cuda_f32
    rng = np.random.default_rng(B + V)
    logits = rng.standard_normal((B, V)).astype(np.float32)
    W = (V + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, size=(B, W), dtype=np.int64).astype(np.int32)
    bitmask[:, :W // 4] = -1                           # stretches of all-allowed words
    bitmask[:, -1] = 1                                 # only the first id of the last word
    rows = np.array(rows, dtype=np.int32)
    ld = to_dev(b, logits)
    b.apply_token_bitmask(ld, to_dev(b, bitmask), to_dev(b, rows))
    got = to_host(b, ld)
    want = logits.copy()
    cpu.apply_token_bitmask(want, bitmask, rows)
    assert got.tobytes() == want.tobytes()
    if V <= 40000:
        np.testing.assert_array_equal(got.astype(np.float64),
                                      ref.apply_token_bitmask(logits, bitmask, rows))


def test_apply_token_bitmask_rejects_bad_shapes(cuda_f32):
    b = cuda_f32
    with pytest.raises(ValueError, match="apply_token_bitmask"):
        b.apply_token_bitmask(to_dev(b, np.zeros((2, 40), np.float32)),
                              to_dev(b, np.zeros((2, 1), np.int32)),
                              to_dev(b, np.zeros(1, np.int32)))


FILTER_ROWS = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),        # nothing: the row is left as it is
    (0.7, 50, 1.0, 0.0),       # top-k
    (1.3, 0, 0.9, 0.0),        # top-p
    (1.0, 0, 1.0, 0.1),        # min-p
    (0.8, 100, 0.8, 0.05),     # all of them
    (1.0, 10**7, 0.5, 0.0),    # top_k >= V is off
    (0.5, 1, 1.0, 0.0),        # top-1
    (2.0, 0, 0.999, 0.0),      # wide top-p
]


def filter_ambiguous(logits, temperature, top_k, top_p, min_p):
    """(B, V) bool: tokens whose kept / dropped fate is within float rounding of a threshold (a
    value tie with the k-th value or the min-p bound, or a top-p cut where the mass before it is
    within 1e-5 of top_p). Only these may differ between the GPU, the CPU and the oracle."""
    B, V = logits.shape
    amb = np.zeros((B, V), bool)
    for b in range(B):
        x = logits[b]
        t = float(temperature[b])
        if t != 1.0:
            x = x / np.float32(max(t, 1e-5))
        x = x.astype(np.float64)

        def near(v):
            return np.abs(x - v) <= 1e-6 * max(1.0, abs(v))

        thr = -np.inf
        k = int(top_k[b])
        if 0 < k < V:
            thr = np.sort(x)[::-1][k - 1]
            amb[b] |= near(thr)
        if float(top_p[b]) < 1.0:
            kept = np.sort(x[x >= thr])[::-1]
            probs = np.exp(kept - kept[0])
            probs /= probs.sum()
            before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
            for v in kept[np.abs(before - float(top_p[b])) < 1e-5]:
                amb[b] |= near(v)
        if float(min_p[b]) > 0.0:
            amb[b] |= near(x.max() + np.log(float(min_p[b])))
    return amb


@pytest.mark.parametrize("spread", [3.0, 10.0])
@pytest.mark.parametrize("B,V", [(8, 1000), (16, 50000), (8, 128256)])
def test_filter_logits(cuda_f32, cpu, B, V, spread):
    b = cuda_f32
    rng = np.random.default_rng(B + V + int(spread))
    logits = (rng.standard_normal((B, V)) * spread).astype(np.float32)
    logits[3, rng.choice(V, V // 10, replace=False)] = -np.inf    # already masked tokens
    rows = [FILTER_ROWS[i % len(FILTER_ROWS)] for i in range(B)]
    t, k, p, m = (np.array(c, dt) for c, dt in zip(zip(*rows), (np.float32, np.int32,
                                                                 np.float32, np.float32)))
    ld = to_dev(b, logits)
    b.filter_logits(ld, *(to_dev(b, a) for a in (t, k, p, m)))
    got = to_host(b, ld)
    on_cpu = logits.copy()
    cpu.filter_logits(on_cpu, t, k, p, m)
    want = ref.filter_logits(logits, t, k, p, m)
    amb = filter_ambiguous(logits, t, k, p, m)
    noop = np.array([r == FILTER_ROWS[0] for r in rows])
    np.testing.assert_array_equal(got[noop], logits[noop])          # no-op rows, bit for bit
    kept = np.isfinite(got)
    for other, name in ((on_cpu, "cpu"), (want, "oracle")):
        differ = (kept != np.isfinite(other)) & ~amb
        assert not differ.any(), (f"{name}: kept sets differ at {np.argwhere(differ)[:5].tolist()}"
                                  f" ({int(differ.sum())} tokens, not threshold ties)")
    both = kept & np.isfinite(want)
    np.testing.assert_allclose(got[both], want[both], rtol=1e-6, atol=1e-6)
    assert (kept.sum(axis=1)[~noop] < V).all()   # every filtering row dropped something
