"""The CPU backend's fused-MoE ops (pyx/backend.pyx moe_align, moe_grouped_linear, moe_combine):
NumPy code, the reference the CUDA kernels of cuda/moe.cu are tested against; and moe_experts
expert by expert through the backend's ops, for the expert formats the one-call kernel
(pyx/moe_kernels.c) does not read (FP8, int4) and as that kernel's reference.

moe_align keeps pair order inside each expert's run (a stable sort), so its output is exact;
moe_grouped_linear runs each expert's routed rows through the backend's own `linear`, so every
weight format the CPU backend multiplies (float, ggml blocks, int4, FP8) is a reference.
Shape and dtype errors are ValueErrors naming the op and the arrays, as every op's.
"""
from __future__ import annotations

import numpy as np

from pyx.moe import moe_align_capacity

_I32, _I64, _F32 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.float32)


def _fail(op: str, msg: str, arrays: dict):
    desc = ", ".join(f"{n} {tuple(a.shape)} {a.dtype}" if hasattr(a, "dtype") else f"{n} {a!r}"
                     for n, a in arrays.items())
    raise ValueError(f"{op}: {msg} [{desc}]")


def _need(op: str, arrays: dict, name: str, dtype, shape: tuple):
    a = arrays[name]
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape:
        _fail(op, f"{name} must be a {dtype} NumPy array of shape {shape}", arrays)
    if not a.flags.c_contiguous or not a.flags.writeable:
        _fail(op, f"{name} must be C-contiguous and writable", arrays)


def check_align(op, topk_ids, num_experts, block_m, sorted_ids, block_expert, expert_offsets,
                num_padded, need=_need):
    """The sizes moe_align's buffers must have (shared with the CUDA backend)."""
    arrays = {"topk_ids": topk_ids, "sorted_ids": sorted_ids, "block_expert": block_expert,
              "expert_offsets": expert_offsets, "num_padded": num_padded}
    if getattr(topk_ids, "ndim", 0) != 2 or topk_ids.dtype != _I64:
        _fail(op, "topk_ids must be (T, top_k) int64", arrays)
    if not 1 <= int(num_experts) <= 4096 or int(block_m) not in (16, 64):
        _fail(op, f"need 1 <= num_experts <= 4096 and block_m 16 or 64, got {num_experts}, "
                  f"{block_m}", arrays)
    P = topk_ids.size
    capacity = moe_align_capacity(P, int(num_experts), int(block_m))
    need(op, arrays, "sorted_ids", _I32, (capacity,))
    need(op, arrays, "block_expert", _I32, (capacity // int(block_m),))
    need(op, arrays, "expert_offsets", _I32, (int(num_experts) + 1,))
    need(op, arrays, "num_padded", _I32, (1,))


def moe_align(topk_ids, num_experts, block_m, sorted_ids, block_expert, expert_offsets,
              num_padded):
    check_align("moe_align", topk_ids, num_experts, block_m, sorted_ids, block_expert,
                expert_offsets, num_padded)
    E, bm = int(num_experts), int(block_m)
    flat = topk_ids.reshape(-1)
    P = flat.size
    routed = (flat >= 0) & (flat < E)
    counts = np.bincount(flat[routed], minlength=E)
    starts = np.zeros(E + 1, np.int64)
    np.cumsum(-(-counts // bm) * bm, out=starts[1:])
    sorted_ids[:] = P
    block_expert[:] = -1
    pairs = np.flatnonzero(routed)
    pairs = pairs[np.argsort(flat[pairs], kind="stable")]   # by expert, pair order kept
    experts = flat[pairs]
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))   # each expert's first in `pairs`
    sorted_ids[starts[experts] + np.arange(pairs.size) - first[experts]] = pairs
    for e in np.flatnonzero(counts):
        block_expert[starts[e] // bm:starts[e + 1] // bm] = e
    expert_offsets[:] = starts
    num_padded[0] = starts[-1]


def check_grouped(op, x, weights, sorted_ids, block_expert, num_padded, x_div, block_m, out,
                  act_dtypes):
    """Shapes of moe_grouped_linear (shared with the CUDA backend); returns (P, E, N, K)."""
    arrays = {"x": x, "weights": weights, "sorted_ids": sorted_ids,
              "block_expert": block_expert, "num_padded": num_padded, "out": out}
    for name in ("x", "out"):
        a = arrays[name]
        if getattr(a, "ndim", 0) != 2 or a.dtype not in act_dtypes or not a.flags.c_contiguous:
            _fail(op, f"{name} must be a C-contiguous 2-D array of {[str(d) for d in act_dtypes]}",
                  arrays)
    E, N, K = weights.shape
    P = out.shape[0]
    if x.shape[1] != K or out.shape[1] != N:
        _fail(op, f"need x (rows, {K}) and out (P, {N}) for experts of shape {(E, N, K)}", arrays)
    if int(x_div) < 1 or x.shape[0] * int(x_div) != P:
        _fail(op, f"x has {x.shape[0]} rows; out's P = {P} pair rows need P / x_div of them "
                  f"(x_div {x_div})", arrays)
    if int(block_m) not in (16, 64):
        _fail(op, f"block_m must be 16 or 64, got {block_m}", arrays)
    capacity = moe_align_capacity(P, E, int(block_m))
    for name, size in (("sorted_ids", capacity), ("block_expert", capacity // int(block_m)),
                       ("num_padded", 1)):
        a = arrays[name]
        if a.dtype != _I32 or a.shape != (size,):
            _fail(op, f"{name} must be ({size},) int32, as moe_align wrote it", arrays)
    return P, E, N, K


def moe_grouped_linear(linear, x, weights, sorted_ids, block_expert, num_padded, x_div, block_m,
                       out):
    """out[p] = x[p // x_div] @ W[e].T for every pair row p of each expert e's run."""
    P, E, N, K = check_grouped("moe_grouped_linear", x, weights, sorted_ids, block_expert,
                               num_padded, x_div, block_m, out, (_F32,))
    bm, total = int(block_m), int(num_padded[0])
    runs = block_expert[:total // bm]
    b = 0
    while b < runs.size:
        e = int(runs[b])
        end = b
        while end < runs.size and runs[end] == e:
            end += 1
        rows = sorted_ids[b * bm:end * bm]
        rows = rows[rows < P]
        if rows.size:
            tmp = np.empty((rows.size, N), np.float32)
            linear(np.ascontiguousarray(x[rows // int(x_div)]), weights.experts[e], None, tmp)
            out[rows] = tmp
        b = end


def check_combine(op, y, topk_weights, topk_ids, num_experts, out, act_dtypes):
    arrays = {"y": y, "topk_weights": topk_weights, "topk_ids": topk_ids, "out": out}
    if getattr(topk_ids, "ndim", 0) != 2 or topk_ids.dtype != _I64:
        _fail(op, "topk_ids must be (T, top_k) int64", arrays)
    T, k = topk_ids.shape
    if topk_weights.shape != (T, k) or topk_weights.dtype != _F32:
        _fail(op, "topk_weights must be (T, top_k) float32", arrays)
    if y.ndim != 2 or y.shape[0] != T * k or out.shape != (T, y.shape[1]):
        _fail(op, "need y (T * top_k, H) and out (T, H)", arrays)
    if y.dtype not in act_dtypes or out.dtype not in act_dtypes or int(num_experts) < 1:
        _fail(op, f"y and out must be {[str(d) for d in act_dtypes]}, num_experts >= 1", arrays)
    for a in (y, topk_weights, topk_ids, out):
        if not a.flags.c_contiguous:
            _fail(op, "arrays must be C-contiguous", arrays)
    return T, k, y.shape[1]


def moe_combine(y, topk_weights, topk_ids, num_experts, out):
    """out[t] = sum_j w[t, j] y[t k + j] in float32, slot order; unrouted pairs add nothing."""
    T, k, H = check_combine("moe_combine", y, topk_weights, topk_ids, num_experts, out, (_F32,))
    routed = (topk_ids >= 0) & (topk_ids < int(num_experts))
    w = np.where(routed, topk_weights, np.float32(0))
    y3 = y.reshape(T, k, H)
    out[:] = 0
    for j in range(k):   # in slot order, as the kernel sums
        out += w[:, j:j + 1] * np.where(routed[:, j:j + 1], y3[:, j], np.float32(0))


def check_experts(op, x, gate_up, down, topk_ids, topk_weights, activation, out):
    """Shapes of moe_experts; returns (T, H, I, top_k, E)."""
    arrays = {"x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "out": out}
    for name, dtype in (("x", _F32), ("topk_ids", _I64), ("topk_weights", _F32), ("out", _F32)):
        a = arrays[name]
        if (not isinstance(a, np.ndarray) or a.ndim != 2 or a.dtype != dtype
                or not a.flags.c_contiguous):
            _fail(op, f"{name} must be a C-contiguous 2-D {dtype} array", arrays)
    if not out.flags.writeable or np.may_share_memory(x, out):
        _fail(op, "out must be writable and apart from x", arrays)
    if activation not in ("silu", "gelu_tanh"):
        _fail(op, f"activation must be silu or gelu_tanh, got {activation!r}", arrays)
    E, two_i, H = gate_up.shape
    if two_i % 2 or down.shape != (E, H, two_i // 2):
        _fail(op, f"need gate_up (E, 2I, H) and down (E, H, I) stacks, got {gate_up.shape} and "
                  f"{down.shape}", arrays)
    T, k = topk_ids.shape
    if x.shape != (T, H) or out.shape != (T, H) or topk_weights.shape != (T, k):
        _fail(op, f"need x and out (T, {H}), topk_ids and topk_weights (T, top_k)", arrays)
    return T, H, two_i // 2, k, E


def moe_experts(backend, x, gate_up, down, topk_ids, topk_weights, activation, out):
    """out[t] = sum over slots j, in order, of topk_weights[t, j] * down[e] @ act(gate_up[e] @ x[t])
    for e = topk_ids[t, j] (ids outside [0, E) add nothing): each expert once, on its pairs'
    tokens in pair order, through backend.linear and the activation op."""
    T, H, I, k, E = check_experts("moe_experts", x, gate_up, down, topk_ids, topk_weights,
                                  activation, out)
    act = backend.silu_and_mul if activation == "silu" else backend.gelu_tanh_and_mul
    flat = topk_ids.reshape(-1)
    routed = np.flatnonzero((flat >= 0) & (flat < E))
    pairs = routed[np.argsort(flat[routed], kind="stable")]   # by expert, pair order kept
    y = np.zeros((T * k, H), np.float32)
    for e in np.unique(flat[pairs]):
        rows = pairs[flat[pairs] == e]
        g = np.empty((rows.size, 2 * I), np.float32)
        a = np.empty((rows.size, I), np.float32)
        backend.linear(np.ascontiguousarray(x[rows // k]), gate_up.experts[e], None, g)
        act(g, a)
        tmp = np.empty((rows.size, H), np.float32)
        backend.linear(a, down.experts[e], None, tmp)
        y[rows] = tmp
    moe_combine(y, topk_weights, topk_ids, E, out)
