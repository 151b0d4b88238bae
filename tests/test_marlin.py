"""The Marlin layout (engine/marlin.py) on the CPU: repack from GPTQ, AWQ and compressed-tensors
checkpoints is lossless (unpack equals Int4Weight's own dequantization bit for bit), the layout's
invariants hold, and NumPy emulations of cuda/marlin.cu's repack kernel (word by word) and GEMM
kernel (lane by lane, fragment by fragment) read the layout the way unpack_marlin does.

Fixtures: GPTQ and AWQ layers come from the reference packers of tests/test_int4_formats.py;
compressed-tensors layers are packed by the compressed-tensors library's own pack_to_int32.
"""
import numpy as np
import pytest
import torch

from engine.loader.quant_formats import convert_quantized
from engine.marlin import MarlinWeight, pack_marlin, repack_int4, to_int4, unpack_marlin
from engine.quant_int4 import Int4Part, Int4Weight
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
    """The formula of engine/marlin.py's docstring, pinned on single codes."""
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
