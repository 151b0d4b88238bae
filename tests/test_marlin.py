"""The Marlin layout (pyx/weights/marlin.py) on the CPU: repack from GPTQ, AWQ and
compressed-tensors checkpoints is lossless (unpack equals Int4Weight's own dequantization bit for
bit), the layout's invariants hold, and NumPy emulations of cuda/marlin.cu's repack kernel (word by
word) and GEMM kernel (lane by lane, fragment by fragment) read the layout the way unpack_marlin
does.

Fixtures: GPTQ and AWQ layers come from the reference packers of tests/test_int4_formats.py;
compressed-tensors layers are packed by the compressed-tensors library's own pack_to_int32.
"""
import numpy as np
import pytest
import torch

from engine.loader.quant_formats import convert_quantized
from pyx.weights.int4 import Int4Part, Int4Weight
from pyx.weights.marlin import MarlinWeight, pack_marlin, repack_int4, to_int4, unpack_marlin
from test_int4_formats import awq_config, ct_config, gptq_config, quantized_layer, rtn

# ---- fixtures


def gptq_awq_weight(method, sym, g, fmt, n, k, seed):
    rng = np.random.default_rng(seed)
    tensors, _ = quantized_layer(rng, method, n, k, g, sym, fmt)
    convert_quantized(tensors, gptq_config(sym, g, fmt) if method == "gptq" else awq_config(g))
    return tensors["l.weight"]


def ct_weight(symmetric, strategy, n, k, seed, g=128):
    """One pack-quantized layer packed by compressed-tensors' pack_to_int32 (signed values)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    rng = np.random.default_rng(seed)
    gg = k if strategy == "channel" else g
    codes, scales, zeros = rtn(rng.standard_normal((n, k)), gg, symmetric)
    tensors = {
        "l.weight_packed": pack_to_int32(torch.from_numpy(codes.astype(np.int8) - 8), 4).numpy(),
        "l.weight_scale": scales.astype(np.float32),
        "l.weight_shape": np.array([n, k])}
    if not symmetric:
        zp = torch.from_numpy(zeros.astype(np.int8) - 8)
        tensors["l.weight_zero_point"] = pack_to_int32(zp, 4, packed_dim=0).numpy()
    convert_quantized(tensors, ct_config(symmetric=symmetric, strategy=strategy, group_size=g))
    return tensors["l.weight"]


CASES = {
    "gptq-sym-g128": lambda n, k, s: gptq_awq_weight("gptq", True, 128, "gptq", n, k, s),
    "gptq-v1-asym-g64": lambda n, k, s: gptq_awq_weight("gptq", False, 64, "gptq", n, k, s),
    "gptq-v2-asym-g32": lambda n, k, s: gptq_awq_weight("gptq", False, 32, "gptq_v2", n, k, s),
    "gptq-sym-channel": lambda n, k, s: gptq_awq_weight("gptq", True, -1, "gptq", n, k, s),
    "awq-g128": lambda n, k, s: gptq_awq_weight("awq", False, 128, None, n, k, s),
    "awq-channel": lambda n, k, s: gptq_awq_weight("awq", False, -1, None, n, k, s),
    "ct-sym-group": lambda n, k, s: ct_weight(True, "group", n, k, s),
    "ct-asym-group": lambda n, k, s: ct_weight(False, "group", n, k, s),
    "ct-sym-channel": lambda n, k, s: ct_weight(True, "channel", n, k, s),
    "ct-asym-channel": lambda n, k, s: ct_weight(False, "channel", n, k, s),
}


def random_int4(rng, n, k, g, zero_max=16):
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = rng.standard_normal((n, k // g)).astype(np.float32)
    zeros = rng.integers(0, zero_max + 1, (n, k // g)).astype(np.float32)  # 16: a GPTQ v1 zero
    return Int4Weight([Int4Part.from_codes(codes, scales, zeros, g)], k)


# ---- repack round trips

@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n,k", [(64, 256), (48, 384), (200, 512)])
def test_repack_round_trips_exactly(case, n, k):
    w = CASES[case](n, k, n + k)
    m = repack_int4(w)
    assert m.shape == w.shape == (n, k)
    np.testing.assert_array_equal(unpack_marlin(m), w.dequantize())
    sym = case.startswith(("gptq-sym", "ct-sym"))
    assert (m.zeros is None) == sym
    assert m.group_size == (k if "channel" in case else w.parts[0].group_size)
    # and back to an Int4Weight for the CPU backend
    np.testing.assert_array_equal(to_int4(m).dequantize(), w.dequantize())


def test_gptq_v1_zero_16_survives():
    rng = np.random.default_rng(1)
    w = random_int4(rng, 64, 128, 32)
    w.parts[0].zeros[:] = 16
    m = repack_int4(w)
    assert m.zeros is not None and (m.zeros == 16).all()
    np.testing.assert_array_equal(unpack_marlin(m), w.dequantize())


def test_non_integer_zeros_are_refused():
    rng = np.random.default_rng(2)
    w = random_int4(rng, 64, 128, 32)
    w.parts[0].zeros[0, 0] = 3.5
    with pytest.raises(ValueError, match="integer zero"):
        repack_int4(w)


def test_fused_parts_with_different_group_sizes():
    # q/k/v quantized with group 128, 64 and per channel (256): fused, then repacked at gcd 64.
    rng = np.random.default_rng(3)
    ws = [random_int4(rng, 64, 256, 128), random_int4(rng, 32, 256, 64),
          random_int4(rng, 40, 256, 256)]
    fused = Int4Weight.concat(ws)
    m = repack_int4(fused)
    assert m.group_size == 64 and m.shape == (136, 256)
    np.testing.assert_array_equal(unpack_marlin(m), fused.dequantize())
    # MarlinWeight.concat of the repacked parts gives the same layout
    mc = MarlinWeight.concat([repack_int4(w) for w in ws])
    for a, b in ((mc.qweight, m.qweight), (mc.scales, m.scales), (mc.zeros, m.zeros)):
        np.testing.assert_array_equal(a, b)
    # symmetric with asymmetric: zeros materialized as 8
    sym = Int4Weight([Int4Part.from_codes(rng.integers(0, 16, (64, 256), dtype=np.uint8),
                                          np.ones((64, 2), np.float32),
                                          np.full((64, 2), 8, np.float32), 128)], 256)
    assert repack_int4(sym).zeros is None
    both = MarlinWeight.concat([repack_int4(sym), repack_int4(ws[0])])
    np.testing.assert_array_equal(unpack_marlin(both), Int4Weight.concat([sym, ws[0]]).dequantize())


# ---- layout invariants

def test_layout_shapes_dtypes_and_padding():
    rng = np.random.default_rng(4)
    w = random_int4(rng, 100, 256, 64)
    m = repack_int4(w)
    assert m.qweight.dtype == np.uint32 and m.qweight.shape == (256 // 16, 128 * 2)
    assert m.scales.dtype == np.float32 and m.scales.shape == (4, 128)
    assert m.zeros.dtype == np.uint8 and m.zeros.shape == (4, 128)
    assert m.n_padded == 128 and m.qweight.nbytes == 128 * 256 // 2
    for a in (m.qweight, m.scales, m.zeros):
        assert a.flags.c_contiguous
    # padding: the 100-row weight's layout is the 128-row one with codes 8, scales 0, zeros 8
    (p,) = w.parts
    codes = np.full((128, 256), 8, np.uint8)
    codes[:100] = p.codes()
    scales = np.zeros((128, 4), np.float32)
    scales[:100] = p.scales
    zeros = np.full((128, 4), 8, np.uint8)
    zeros[:100] = p.zeros
    full = pack_marlin(codes, scales, zeros, 64)
    for a, b in ((full.qweight, m.qweight), (full.scales, m.scales), (full.zeros, m.zeros)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n,k", [(0, 0), (5, 9), (64, 16), (70, 33), (127, 255)])
def test_one_code_lands_at_its_documented_nibble(n, k):
    """The formula of pyx/weights/marlin.py's docstring, pinned on single codes."""
    N, K = 128, 256
    codes = np.zeros((N, K), np.uint8)
    codes[n, k] = 9
    m = pack_marlin(codes, np.ones((N, K // 16), np.float32), None, 16)
    kt, kr = divmod(k, 16)
    nt, nr = divmod(n, 64)
    blk, c = divmod(nr, 8)
    j, b = divmod(blk, 2)
    h, rem = divmod(kr, 8)
    t, e = divmod(rem, 2)
    lane, i = 4 * c + t, 4 * e + 2 * b + h
    expect = np.zeros_like(m.qweight)
    expect[kt, nt * 128 + lane * 4 + j] = 9 << (4 * i)
    np.testing.assert_array_equal(m.qweight, expect)


def test_scale_permutation():
    # column n of group g sits at 64 nt + 8 c + blk with n = 64 nt + 8 blk + c
    N, K = 128, 64
    scales = np.arange(N, dtype=np.float32)[:, None] + 1000 * np.arange(2, dtype=np.float32)
    m = pack_marlin(np.zeros((N, K), np.uint8), scales, None, 32)
    for g in range(2):
        for n in range(N):
            nt, r = divmod(n, 64)
            blk, c = divmod(r, 8)
            assert m.scales[g, 64 * nt + 8 * c + blk] == n + 1000 * g


# ---- the device kernels, emulated

def emulate_device_repack(qs, scales, zeros, n, k, g):
    """cuda/marlin.cu's repack kernels, index for index, vectorised over every output word."""
    np_ = -(-n // 64) * 64
    w = np.arange(k // 16 * np_ * 2, dtype=np.int64)
    kt, rem = w // (np_ * 2), w % (np_ * 2)
    nt, lane, j = rem >> 7, (rem >> 2) & 31, rem & 3
    c, t = lane >> 2, lane & 3
    word = np.zeros(w.shape, np.uint32)
    for i in range(8):
        e, b, h = i >> 2, (i >> 1) & 1, i & 1
        kk = kt * 16 + 2 * t + 8 * h + e
        nn = nt * 64 + 8 * (2 * j + b) + c
        safe = np.minimum(nn, n - 1)
        byte = qs[safe, (kk >> 5) * 16 + (kk & 15)]
        code = np.where((kk & 31) < 16, byte & 15, byte >> 4).astype(np.uint32)
        code = np.where(nn < n, code, 8).astype(np.uint32)
        word |= code << np.uint32(4 * i)
    ng = k // g
    idx = np.arange(ng * np_, dtype=np.int64)
    gg, pos = idx // np_, idx % np_
    r = pos & 63
    col = (pos - r) + 8 * (r & 7) + (r >> 3)
    safe = np.minimum(col, n - 1)
    ms = np.where(col < n, scales[safe, gg], 0).astype(np.float32)
    mz = None if zeros is None else np.where(col < n, np.rint(zeros[safe, gg]), 8).astype(np.uint8)
    return word.reshape(k // 16, np_ * 2), ms.reshape(ng, np_), (None if mz is None
                                                                  else mz.reshape(ng, np_))


@pytest.mark.parametrize("case", ["gptq-v1-asym-g64", "awq-g128", "ct-sym-channel",
                                  "ct-asym-group"])
def test_device_repack_emulation_is_bit_identical(case):
    w = CASES[case](136, 256, 7)
    (p,) = w.parts
    m = repack_int4(w)
    q, s, z = emulate_device_repack(p.qs, p.scales, None if m.zeros is None else p.zeros,
                                    136, 256, p.group_size)
    np.testing.assert_array_equal(q, m.qweight)
    np.testing.assert_array_equal(s.view(np.uint32), m.scales.view(np.uint32))
    if m.zeros is None:
        assert z is None
    else:
        np.testing.assert_array_equal(z, m.zeros)


def emulate_device_gemm(x, m: MarlinWeight, warps=8):
    """cuda/marlin.cu variant 0, lane by lane: each (m-tile, n-tile) block's warps take k-steps
    w, w + warps, ...; A, B and C fragments of mma.m16n8k16 as the kernel builds and reads them.
    B values are the kernel's float (code - zero) * scale (rounding to 16 bits is left out: the
    layout is what is checked). Also checks each B fragment against unpack_marlin."""
    M, K = x.shape
    N, np_, G = m.n, m.n_padded, m.group_size
    ref_w = unpack_marlin(m)
    out = np.zeros((M, N))
    lane = np.arange(32)
    c, t = lane >> 2, lane & 3
    qw = m.qweight.reshape(K // 16, np_ // 64, 32, 4)
    xp = np.zeros((-(-M // 16) * 16, K))
    xp[:M] = x
    for mt in range(-(-M // 16)):
        r0, r1 = mt * 16 + c, mt * 16 + c + 8
        ok0, ok1 = r0 < M, r1 < M
        for nt in range(np_ // 64):
            acc = np.zeros((8, 4, 32))      # [blk][c0..c3][lane]
            for warp in range(warps):
                for kt in range(warp, K // 16, warps):
                    k0, g = kt * 16, kt * 16 // G
                    at = g * np_ + nt * 64 + 8 * c
                    s = m.scales.reshape(-1)[at[:, None] + np.arange(8)]     # (32, 8) [lane][blk]
                    z = (np.full((32, 8), 8.0) if m.zeros is None
                         else m.zeros.reshape(-1)[at[:, None] + np.arange(8)].astype(np.float64))
                    # A registers: (row, k pair)
                    a = np.stack([np.stack([xp[r, k0 + kk], xp[r, k0 + kk + 1]], -1)
                                  for r, kk in ((r0, 2 * t), (r1, 2 * t), (r0, 2 * t + 8),
                                                (r1, 2 * t + 8))])           # (4, 32, 2)
                    a[[0, 2]] *= ok0[None, :, None]
                    a[[1, 3]] *= ok1[None, :, None]
                    words = qw[kt, nt]                                        # (32, 4)
                    for blk in range(8):
                        j, b = divmod(blk, 2)
                        breg = np.zeros((2, 32, 2))                           # [h][lane][e]
                        for h in range(2):
                            p = 2 * b + h
                            lo = (words[:, j] >> (4 * p)) & 15
                            hi = (words[:, j] >> (4 * p + 16)) & 15
                            breg[h, :, 0] = (lo - z[:, blk]) * s[:, blk]
                            breg[h, :, 1] = (hi - z[:, blk]) * s[:, blk]
                            # what the lane holds is W[n, k] at the fragment's (k, n)
                            n_idx = nt * 64 + blk * 8 + c
                            live = n_idx < N
                            for e in range(2):
                                kk = k0 + 2 * t + 8 * h + e
                                np.testing.assert_array_equal(
                                    breg[h, live, e].astype(np.float32),
                                    ref_w[n_idx[live], kk[live]])
                        acc[blk] += mma_16816(a, breg)
            for blk in range(8):
                col = nt * 64 + blk * 8 + 2 * t
                for i in range(2):
                    for rows, ok, reg in ((r0, ok0, i), (r1, ok1, 2 + i)):
                        sel = ok & (col + i < N)
                        out[rows[sel], col[sel] + i] = acc[blk, reg, sel]
    return out


def mma_16816(a, b):
    """One m16n8k16 from per-lane fragments: a (4 regs, 32 lanes, 2), b (2 regs, 32 lanes, 2) ->
    the C fragment (4, 32), via the PTX ISA's fragment maps (c = lane / 4, t = lane % 4)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        c, t = lane >> 2, lane & 3
        for e in range(2):
            A[c, 2 * t + e], A[c + 8, 2 * t + e] = a[0, lane, e], a[1, lane, e]
            A[c, 2 * t + 8 + e], A[c + 8, 2 * t + 8 + e] = a[2, lane, e], a[3, lane, e]
            B[2 * t + e, c], B[2 * t + 8 + e, c] = b[0, lane, e], b[1, lane, e]
    C = A @ B
    out = np.zeros((4, 32))
    for lane in range(32):
        c, t = lane >> 2, lane & 3
        out[:, lane] = C[c, 2 * t], C[c, 2 * t + 1], C[c + 8, 2 * t], C[c + 8, 2 * t + 1]
    return out


@pytest.mark.parametrize("case,M,n,k", [("awq-g128", 5, 72, 256), ("gptq-sym-g128", 16, 64, 128),
                                        ("ct-asym-group", 17, 130, 128),
                                        ("gptq-v2-asym-g32", 3, 64, 160)])
def test_device_gemm_emulation_matches_unpack(case, M, n, k):
    w = CASES[case](n, k, 11)
    m = repack_int4(w)
    x = np.random.default_rng(5).standard_normal((M, k))
    got = emulate_device_gemm(x, m)
    ref = x @ w.dequantize().astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-10)


# ---- offline conversion and the Marlin checkpoint loader

@pytest.mark.parametrize("case", ["gptq-v1-asym-g64", "awq-g128", "ct-asym-group",
                                  "ct-sym-channel"])
def test_convert_then_load_round_trip(tmp_path, case):
    """A layer checkpoint in each source format converted with the command, then loaded through
    convert_quantized: the same dequantized weights, the Marlin tensors kept as the source."""
    import json
    from safetensors.numpy import save_file
    from engine.loader.safetensors import load_safetensors
    from engine.tools.convert_marlin import main

    rng = np.random.default_rng(9)
    method, n, k = case.split("-")[0], 136, 256
    if method in ("gptq", "awq"):
        sym, g, fmt = False, 64 if method == "gptq" else 128, "gptq" if method == "gptq" else None
        tensors, _ = quantized_layer(rng, method, n, k, g, sym, fmt)
        qc = gptq_config(sym, g, fmt) if method == "gptq" else awq_config(g)
    else:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
        symmetric, strategy = case == "ct-sym-channel", case.split("-")[2]
        codes, scales, zeros = rtn(rng.standard_normal((n, k)), k if strategy == "channel"
                                   else 128, symmetric)
        tensors = {"l.weight_packed": pack_to_int32(torch.from_numpy(codes.astype(np.int8) - 8),
                                                    4).numpy(),
                   "l.weight_scale": scales, "l.weight_shape": np.array([n, k])}
        if not symmetric:
            tensors["l.weight_zero_point"] = pack_to_int32(
                torch.from_numpy(zeros.astype(np.int8) - 8), 4, packed_dim=0).numpy()
        qc = ct_config(symmetric=symmetric, strategy=strategy)
    tensors["norm.weight"] = np.linspace(0.5, 1.5, 8).astype(np.float32)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    (src / "config.json").write_text(json.dumps({"quantization_config": qc}))
    (src / "tokenizer.json").write_text("{}")
    expect = dict(tensors)
    convert_quantized(expect, qc)

    assert main([str(src), str(dst)]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "marlin"
    assert (dst / "tokenizer.json").exists()
    loaded = load_safetensors(str(dst), dtype="bf16", progress=False, quantized=True)
    assert loaded["l.scales"].dtype == np.float32          # kept whatever the load dtype
    convert_quantized(loaded, config["quantization_config"])
    assert sorted(loaded) == ["l.weight", "norm.weight"]
    w = loaded["l.weight"]
    np.testing.assert_array_equal(w.dequantize(), expect["l.weight"].dequantize())
    (source,) = w.sources
    assert source.format == "marlin" and source.shape == (n, k)
    from engine.loader.quant_marlin import marlin_weight
    m = marlin_weight("l", source.tensors)
    ref = repack_int4(expect["l.weight"])
    np.testing.assert_array_equal(m.qweight, ref.qweight)
    np.testing.assert_array_equal(m.scales, ref.scales)
    assert (m.zeros is None) == (ref.zeros is None)


def test_marlin_checkpoint_errors():
    from engine.loader.quant_marlin import convert_marlin
    with pytest.raises(ValueError, match="layout"):
        convert_marlin({}, {"quant_method": "marlin", "layout": "other"})
    with pytest.raises(ValueError, match="no .marlin_qweight"):
        convert_marlin({"x": np.zeros(1)}, {"quant_method": "marlin"})
    bad = {"l.marlin_qweight": np.zeros((4, 64), np.uint32), "l.scales": np.zeros((1, 64),
                                                                                   np.float32),
           "l.marlin_shape": np.array([64, 64, 64])}
    with pytest.raises(ValueError, match="marlin_qweight is"):
        convert_marlin(bad, {"quant_method": "marlin"})


# ---- cuda/marlin.cu variant 1, emulated: tile mapping, shared-memory ring, magic-number
# dequantization and the global-reduce order

V1_CONFIGS = [(1, 4, 1), (4, 2, 2), (8, 2, 4)]   # (MB, NB, WM): 16x256, 64x128, 128x128 tiles
V1_STAGES = 4


def v1_plan(M, N, K, sms):
    """v1_plan of cuda/marlin.cu: (config, grid x, grid y, k-slices S, workspace bytes)."""
    cfg = 0 if M <= 16 else 1 if M <= 64 else 2
    mb, nb, _ = V1_CONFIGS[cfg]
    gx, gy = -(-(-(-N // 64)) // nb), -(-M // (16 * mb))
    s = max(1, min(-(-sms // (gx * gy)), K // 64 // 4, 16)) if cfg == 0 else 1
    ws = 0 if s == 1 else -(-gx * gy * 4 // 256) * 256 + gx * gy * s * mb * 16 * nb * 64 * 4
    return cfg, gx, gy, s, ws


def _bf16_round(f):
    b = np.asarray(f, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def _round16(v, dtype):
    return (np.asarray(v, np.float32).astype(np.float16).astype(np.float32) if dtype == "f16"
            else _bf16_round(v))


def v1_b_reg(word, p, s, z, dtype):
    """Dequant<T>::b_reg for 32 lanes: word (32,) uint32, scale and zero (32,) float32 ->
    (32, 2) float32 (the low half, the lower k, first)."""
    u = (word >> np.uint32(4 * p)) & np.uint32(0x000F000F)
    halves = np.stack([u & np.uint32(0xFFFF), u >> np.uint32(16)], -1)
    if dtype == "f16":
        h = (halves | np.uint32(0x6400)).astype(np.uint16).view(np.float16)   # 1024 + code
        d = h - np.float16(1024) - z.astype(np.float16)[:, None]               # exact
        return (d * s.astype(np.float16)[:, None]).astype(np.float32)          # one rounding
    h = ((halves | np.uint32(0x4300)) << np.uint32(16)).view(np.float32)       # 128 + code
    d = (h - np.float32(128)) - _bf16_round(z)[:, None]                        # exact
    return _bf16_round(d * _bf16_round(s)[:, None])


def emulate_device_gemm_v1(x, m: MarlinWeight, dtype, sms=132, arrival_seed=0):
    """Variant 1 block by block (blocks of a tile arrive in a random order): the ring of
    V1_STAGES shared-memory stages indexed as the kernel does, B registers checked against the
    layout, partial tiles in the workspace at the kernel's offsets, the last block's sum in
    slice order in float32. Returns (out, the dtype-rounded weight, counters, S)."""
    from pyx.weights.marlin import canonical
    M, K = x.shape
    N, np_, G = m.n, m.n_padded, m.group_size
    cfg, gx, gy, S, ws = v1_plan(M, N, K, sms)
    MB, NB, WM = V1_CONFIGS[cfg]
    MW, THREADS, TF = MB // WM, 32 * WM * NB, MB * 16 * NB * 64
    ntiles, KTt = np_ // 64, K // 64
    codes, scales, zeros = canonical(m)
    zfull = np.full(scales.shape, 8.0, np.float32) if zeros is None else zeros.astype(np.float32)
    s16 = _round16(np.repeat(scales, G, 1), dtype)  # what the kernel multiplies by
    w_eff = _round16(s16 * (codes.astype(np.float32) - np.repeat(zfull, G, 1)), dtype)
    qw4 = m.qweight.reshape(-1, 4)
    sc = m.scales.reshape(-1)
    zf = None if m.zeros is None else m.zeros.reshape(-1)
    counters = np.zeros(gx * gy, np.int64)
    partials = np.full(gx * gy * S * TF, np.nan, np.float32)
    touched = np.zeros(partials.shape, bool)
    out = np.full((M, N), np.nan)
    lane = np.arange(32)
    c, t = lane >> 2, lane & 3
    blocks = [(bx, by, z) for by in range(gy) for bx in range(gx) for z in range(S)]
    np.random.default_rng(arrival_seed).shuffle(blocks)
    for bx, by, z in blocks:
        nt0, m0 = bx * NB, by * MB * 16
        kb, ke = KTt * z // S, KTt * (z + 1) // S
        nk = ke - kb
        assert nk >= 1
        ring = [None] * V1_STAGES

        def load(st, kt):
            sA = np.full((MB * 16, 72), np.nan)
            for r in range(MB * 16):
                sA[r, :64] = x[m0 + r, kt * 64:kt * 64 + 64] if m0 + r < M else 0.0
            sB = np.zeros((4 * NB * 32, 4), np.uint32)
            for i in range(4 * NB * 32):
                ks, rem = divmod(i, NB * 32)
                if nt0 + rem // 32 < ntiles:
                    sB[i] = qw4[((kt * 4 + ks) * ntiles + nt0) * 32 + rem]
            gofs = (kt * 64 // G) * np_ + nt0 * 64
            sS = np.full(NB * 64, np.nan, np.float32)
            sZ = np.full(NB * 64, 255, np.uint8)
            for i in range(NB * 16):
                if nt0 + i // 16 < ntiles:
                    sS[4 * i:4 * i + 4] = sc[gofs + 4 * i:gofs + 4 * i + 4]
            if zf is not None:
                for i in range(NB * 4):
                    if nt0 + i // 4 < ntiles:
                        sZ[16 * i:16 * i + 16] = zf[gofs + 16 * i:gofs + 16 * i + 16]
            ring[st] = (sA, sB, sS, sZ, kt)

        acc = np.zeros((WM * NB, MW, 8, 4, 32))
        for st in range(V1_STAGES - 1):
            if st < nk:
                load(st, kb + st)
        for i in range(nk):
            if i + V1_STAGES - 1 < nk:
                load((i + V1_STAGES - 1) % V1_STAGES, kb + i + V1_STAGES - 1)
            sA, sB, sS, sZ, kt = ring[i % V1_STAGES]
            assert kt == kb + i  # the ring hands iteration i its own k-tile
            for warp in range(WM * NB):
                wn, wm = warp % NB, warp // NB
                if nt0 + wn >= ntiles:
                    continue
                at = wn * 64 + 8 * c[:, None] + np.arange(8)
                s = sS[at]
                zz = np.full((32, 8), 8.0, np.float32) if zf is None else sZ[at].astype(np.float32)
                for ks in range(4):
                    q = sB[(ks * NB + wn) * 32 + lane]
                    breg = np.zeros((8, 2, 32, 2))
                    for blk in range(8):
                        j, b = divmod(blk, 2)
                        n_idx = (nt0 + wn) * 64 + blk * 8 + c
                        live = n_idx < N
                        for h in range(2):
                            breg[blk, h] = v1_b_reg(q[:, j], 2 * b + h, s[:, blk], zz[:, blk],
                                                    dtype)
                            for e in range(2):
                                kk = kt * 64 + ks * 16 + 2 * t + 8 * h + e
                                np.testing.assert_array_equal(
                                    breg[blk, h, live, e].astype(np.float32),
                                    w_eff[n_idx[live], kk[live]])
                    for mi in range(MW):
                        r = (wm * MW + mi) * 16 + c
                        kc = ks * 16 + 2 * t
                        a = np.stack([np.stack([sA[rr, kk], sA[rr, kk + 1]], -1) for rr, kk in
                                      ((r, kc), (r + 8, kc), (r, kc + 8), (r + 8, kc + 8))])
                        for blk in range(8):
                            acc[warp, mi, blk] += mma_16816(a, breg[blk])
        acc = acc.astype(np.float32)  # the kernel's f32 accumulators
        if S > 1:
            tile = by * gx + bx
            base = tile * S * TF
            idx = (base + z * TF + ((np.arange(MW)[:, None, None] * 8 + np.arange(8)[:, None])
                                    * 4 + np.arange(4))[None, ..., None] * THREADS
                   + (np.arange(WM * NB)[:, None, None, None, None] * 32 + lane))
            assert not touched[idx].any()
            partials[idx], touched[idx] = acc, True
            counters[tile] += 1
            if counters[tile] != S:
                continue
            counters[tile] = 0
            total = np.zeros_like(acc)
            for sl in range(S):
                total += acc if sl == z else partials[base + sl * TF + (idx - base - z * TF)]
            acc = total
        for warp in range(WM * NB):
            wn, wm = warp % NB, warp // NB
            if nt0 + wn >= ntiles:
                continue
            for mi in range(MW):
                r0 = m0 + (wm * MW + mi) * 16 + c
                for blk in range(8):
                    col = (nt0 + wn) * 64 + blk * 8 + 2 * t
                    for e in range(2):
                        for rows, reg in ((r0, e), (r0 + 8, 2 + e)):
                            sel = (rows < M) & (col + e < N)
                            assert np.isnan(out[rows[sel], col[sel] + e]).all()  # written once
                            out[rows[sel], col[sel] + e] = acc[warp, mi, blk, reg, sel]
    assert ws == (0 if S == 1 else -(-gx * gy * 4 // 256) * 256 + partials.size * 4)
    return out, w_eff, counters, S


@pytest.mark.parametrize("case,M,n,k,dtype,S", [
    ("awq-g128", 5, 136, 1024, "f16", 4),            # 16 x 256, a missing 4th n-tile, split K
    ("ct-sym-channel", 1, 200, 512, "bf16", 2),      # per channel, zeros None
    ("gptq-v1-asym-g64", 16, 64, 256, "bf16", 1),    # zero 16; 4 k-tiles: no split
    ("ct-asym-group", 40, 136, 256, "f16", 1),       # 64 x 128, second block half missing
    ("gptq-sym-g128", 70, 72, 128, "bf16", 1),       # 128 x 128
])
def test_device_gemm_v1_emulation(case, M, n, k, dtype, S):
    w = CASES[case](n, k, 13)
    m = repack_int4(w)
    x = _round16(np.random.default_rng(3).standard_normal((M, k)), dtype).astype(np.float64)
    got, w_eff, counters, s = emulate_device_gemm_v1(x, m, dtype)
    assert s == S and not counters.any()  # the last blocks left the counters at zero
    ref = x @ w_eff.astype(np.float64).T
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    if S > 1:  # whichever block of a tile comes last, the sum is bit for bit the same
        again, _, _, _ = emulate_device_gemm_v1(x, m, dtype, arrival_seed=7)
        np.testing.assert_array_equal(got, again)
