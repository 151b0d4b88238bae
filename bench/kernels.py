"""Kernel microbenchmarks for the CUDA backend (issue 4, item 7).

    python -m bench.kernels [op ...] [--shape k=v[,v...] ...] [--dtype bf16] [--quick]
                            [--runs 50] [--warmup 5] [--json out.json]

Each op runs alone on the backend's stream, timed with CUDA events around every launch: warm-up
launches first, then the median of `--runs` (>= 50 by default) timed launches. Before each timed
launch a 512 MiB memset flushes the L2 cache (and keeps the GPU busy while Python enqueues the
launch, so host overhead is not timed), and launches rotate over 4 input sets (separate buffers;
decode attention over one large KV pool uses a different block permutation per set).

Per op and shape it prints the time (us), the bytes the op must move (each input read once, each
output written once), achieved GB/s and its % of the device-to-device copy bandwidth measured in
the same run (a 2 GiB copy, counting read + write), and for GEMMs and prefill attention TFLOP/s and
% of a cuBLAS 8192^3 bf16 GEMM measured in the same run through `CudaBackend.linear`.

Default shapes are Llama-3-8B's (H 4096, 32 query heads over 8 KV heads of 128, I 14336,
V 128256): the fused element-wise ops at T 1, 64, 4096 tokens; decode attention at batch 1, 16,
64 x context 1k, 8k, 32k over a bf16 and an FP8 cache with split-K off and on (the variant names
the split count pyx/decode_splits.py picks, "split-K x57"; --shape splits=2,8,64 adds rows with
those counts forced, to compare the rule's pick with the best); prefill attention (the simple
kernel, and the tensor-core ones of kernels prefill=fa2 and =fa3, fa3 on compute capability 9.0
only; causal, FLOPs over the triangle) at 1 x 4096 and 8 x 512 tokens; linear at M 1, 16, 64,
4096 for the qkv (6144 x 4096), o (4096 x 4096), gate_up (28672 x 4096) and down (4096 x 14336)
projections; argmax, Gumbel
sampling, the top-k/top-p/min-p filter, the one-launch sampler of sampling=fused (sample_fused:
penalties + filters + Gumbel draw, and greedy, against the op-by-op path as baseline) and
structured outputs' token bitmask (every row masked, about half the tokens allowed) at batch 1
and 64 over the vocabulary.

qgemm (issue 6, item 7): the quantized GEMMs through `CudaBackend.linear` on the same four
projections at M (QM) 1, 4, 16, 64, 4096 -- bf16 dense (cuBLAS, the reference), GGUF Q4_K and Q8_0
(host `pyx.cpu_backend.quantize_weight` of random f32, cached per shape), int4 W4A16 through the
Marlin kernel (random codes and f32 scales, group 128, symmetric: `Int4Part.from_codes`, repacked
once per shape), FP8 block-wise (128 x 128 scales) through the CUTLASS GEMM (sm_90 only; skipped
with a note elsewhere), and the one-time cost of the default FP8 path, which dequantizes at load and
then IS the bf16 GEMM (so only that dequantize is timed). Each format rotates 2 input sets (separate
weight copies and activations). Its row gives TFLOP/s (and % of the cuBLAS peak), the WEIGHT bytes
read over the time in GB/s (and % of the copy peak: decode at small M is bound by them), and the
speed-up over bf16 dense at the same shape and M. FP8 rows also give % of an estimated FP8 dense
peak, twice the measured bf16 cuBLAS figure (Hopper's tensor-core ratio; cuBLAS FP8 is not reachable
through this backend's GemmEx handle). fp8-gemv rows (M <= 64): the FP8 GEMV kernel of kernels
fp8_gemv=on on the e4m3 codes, any sm80+ device; the weight bytes over its time is its ratio to the
copy ceiling. --shape QM=1,16 and qlayers=gate_up,down select.

moe (issue 16, kernels moe=fused): the fused MoE grouped GEMM (cuda/moe.cu) for the gate_up
and down projections of Qwen3-30B-A3B (H 2048, experts of 768, top-8 of 128) and Mixtral-8x7B
(H 4096, experts of 14336, top-2 of 8) at MT (default 1, 16, 64, 512, 4096) tokens routed
uniformly at random, bf16 and GGUF Q8_0 experts (random codes, one valid fp16 scale): one launch
over all experts after moe_align (not timed). Its bytes are the ACTIVE experts' weights (those
holding a token) plus activations and output, so GB/s against the copy peak says how close a
decode step is to its bandwidth bound; "per-expert" rows (the baseline) time the unfused path's
GEMMs, one linear per active expert on its rows.

--shape overrides a dimension: T, B, ctx, M, SB (sampling batch), splits take lists (T=1,64),
prefill takes NxL items, or NxL+P for chunks of L rows after P cached tokens (prefill=1x4096,
1x1024+3072), H Hq Hkv D I V BS take one value.
--quick runs a small subset (well under a minute). Without a CUDA device it says so and exits 2.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

OPS = ["embedding", "scale", "rms_norm", "fused_add_rms_norm", "layer_norm",
       "fused_add_layer_norm", "rotary_embedding", "silu_and_mul",
       "reshape_and_cache", "decode_attention", "prefill_attention", "linear", "argmax",
       "gumbel_sample", "filter_logits", "sample_fused", "apply_token_bitmask", "qgemm", "moe"]

DEFAULT = dict(H=4096, Hq=32, Hkv=8, D=128, I=14336, V=128256, BS=16,
               T=[1, 64, 4096], B=[1, 16, 64], ctx=[1024, 8192, 32768],
               prefill=[(1, 4096, 0), (8, 512, 0)], M=[1, 16, 64, 4096], SB=[1, 64],
               QM=[1, 4, 16, 64, 4096], qlayers=["qkv", "o", "gate_up", "down"], splits=[],
               MT=[1, 16, 64, 512, 4096])
QUICK = dict(T=[1, 4096], B=[1, 64], ctx=[8192], prefill=[(1, 4096, 0)], M=[1, 4096], SB=[64],
             QM=[1, 4096], qlayers=["gate_up"], MT=[1, 512])
LIST_KEYS = ("T", "B", "ctx", "M", "SB", "QM", "splits", "MT")
MOE_MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
QGEMM_SETS = 2          # weight copies + activations per quantized format (weights are large)
QGEMM_GROUP = 128       # int4 group size
FP8_BLOCK = (128, 128)
FP8_GEMV_MAX_M = 64     # the FP8 GEMV kernel's largest M (cuda/fp8_gemv.cu)

N_SETS = 4
FLUSH_BYTES = 512 << 20
GEMM_PEAK_N = 8192


@dataclass
class Case:
    op: str
    shape: str
    variant: str
    nbytes: int                 # bytes the op must move: inputs read once, outputs written once
    flops: int                  # 0 where the op is memory-bound
    sets: list                  # one callable per input set: launches the op once
    prepare: list | None = None  # per set, enqueued before the timed region (restores inputs)
    stream: object = None       # the stream the op runs on (its backend's); None: the default
    baseline: bool = False      # its time is the reference for other variants of (op, shape)
    compare: bool = False       # report its speed-up over the (op, shape) baseline
    extra: dict = field(default_factory=dict)   # more fields for its row


@dataclass
class Bench:
    """Everything the cases share: CuPy, the backends, the stream, timing settings."""
    cp: object
    dtype: str
    runs: int
    warmup: int
    backends: dict = field(default_factory=dict)
    flush_buf: object = None
    notes: list = field(default_factory=list)   # skipped cases and why

    def backend(self, split_k: bool = False, prefill: str = "simple", dtype: str | None = None):
        """A CudaBackend built with these kernel choices (the others at their defaults)."""
        from pyx.cuda_backend import CudaBackend
        from pyx.kernel_config import KernelConfig

        key = (dtype or self.dtype, split_k, prefill)
        if key not in self.backends:
            kernels = KernelConfig(decode="split" if split_k else "simple", prefill=prefill)
            self.backends[key] = CudaBackend(dtype=key[0], device=0, kernels=kernels)
        self.backends[key].bind_thread()   # CuPy's allocations and copies go to its stream
        return self.backends[key]

    @property
    def b(self):
        return self.backend()

    @property
    def stream(self):
        return self.b.stream

    # ---- device arrays, all made on the benchmark stream

    def rand(self, shape, dtype, scale: float = 1.0):
        """Random normal values (never zeros: they can run faster than real data), made in
        float32 chunks and rounded to `dtype`."""
        cp = self.cp
        n = int(np.prod(shape))
        with self.stream:
            out = cp.empty(n, dtype=dtype)
            chunk = 1 << 26
            for i in range(0, n, chunk):
                m = min(chunk, n - i)
                x = cp.random.standard_normal(m, dtype=cp.float32)
                x *= scale
                out[i:i + m] = to_dtype(cp, x, dtype)
            return out.reshape(shape)

    def dev(self, host_array):
        with self.stream:
            return self.cp.asarray(np.ascontiguousarray(host_array))

    def flush(self, stream):
        """Overwrite the L2 cache (and give the host time to enqueue the next launch)."""
        cp = self.cp
        if self.flush_buf is None:
            with self.stream:
                self.flush_buf = cp.empty(FLUSH_BYTES, dtype=cp.uint8)
            self.stream.synchronize()
        cp.cuda.runtime.memsetAsync(self.flush_buf.data.ptr, 1, FLUSH_BYTES, stream.ptr)

    def copy_async(self, dst, src, stream=None):
        self.cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, 3,
                                         (stream or self.stream).ptr)  # 3: device to device

    def free(self):
        self.stream.synchronize()
        self.cp.get_default_memory_pool().free_all_blocks()

    # ---- timing

    def time_us(self, case: Case) -> float:
        cp, s = self.cp, case.stream or self.stream
        self.stream.synchronize()  # the inputs, made on the default stream, are ready
        n = len(case.sets)
        for i in range(self.warmup):
            if case.prepare:
                case.prepare[i % n]()
            case.sets[i % n]()
        s.synchronize()
        events = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(self.runs)]
        for i, (start, stop) in enumerate(events):
            self.flush(s)
            if case.prepare:
                case.prepare[i % n]()
            start.record(s)
            case.sets[i % n]()
            stop.record(s)
        s.synchronize()
        return 1000.0 * statistics.median(cp.cuda.get_elapsed_time(a, b) for a, b in events)


def to_dtype(cp, x32, dtype):
    """float32 CuPy array -> dtype; bf16 through its bits if CuPy cannot cast to it."""
    try:
        return x32.astype(dtype)
    except Exception:
        if np.dtype(dtype).name != "bfloat16":
            raise
        bits = x32.view(cp.uint32)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        return bits.astype(cp.uint16).view(dtype)


# ---- peaks measured in the same run


def copy_peak(bench: Bench, nbytes: int) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + bytes written."""
    cp = bench.cp
    with bench.stream:
        src = cp.random.random(nbytes // 4, dtype=cp.float32)
        dst = cp.empty_like(src)
    case = Case("copy", f"{nbytes >> 20} MiB", "", 2 * nbytes, 0,
                [lambda: bench.copy_async(dst, src)])
    return 2 * nbytes / bench.time_us(case) / 1e3


def gemm_peak(bench: Bench) -> float:
    """TFLOP/s of a cuBLAS bf16 GEMM 8192^3 through CudaBackend.linear (random data)."""
    b = bench.backend(dtype="bf16")
    n = GEMM_PEAK_N
    act = b.act_dtype
    x, w = bench.rand((n, n), act), bench.rand((n, n), act, 0.01)
    with bench.stream:
        out = bench.cp.empty((n, n), dtype=act)
    case = Case("gemm", f"{n}^3", "", 0, 2 * n ** 3, [lambda: b.linear(x, w, None, out)],
                stream=b.stream)
    return 2 * n ** 3 / bench.time_us(case) / 1e6


# ---- cases


def esize(dtype) -> int:
    return np.dtype(dtype).itemsize


def cases_embedding(bench, c):
    b, act = bench.b, bench.b.act_dtype
    for T in c["T"]:
        H, V = c["H"], c["V"]
        table = bench.rand((V, H), act)
        sets = []
        for i in range(N_SETS):
            ids = bench.dev(np.random.default_rng(i).integers(0, V, T).astype(np.int32))
            with bench.stream:
                out = bench.cp.empty((T, H), dtype=act)
            sets.append(lambda ids=ids, out=out: b.embedding(ids, table, out))
        yield Case("embedding", f"T={T} H={H}", "", T * 4 + 2 * T * H * esize(act), 0, sets)


def _norm_sets(bench, T, H, fused: bool, plain, fused_add):
    """N_SETS calls of a norm on fresh (T, H) rows: fused_add(x, r) in place, or plain(x, out)."""
    act = bench.b.act_dtype
    sets = []
    for _ in range(N_SETS):
        x = bench.rand((T, H), act)
        if fused:
            r = bench.rand((T, H), act)
            sets.append(lambda x=x, r=r: fused_add(x, r))
        else:
            with bench.stream:
                out = bench.cp.empty((T, H), dtype=act)
            sets.append(lambda x=x, out=out: plain(x, out))
    return sets


def cases_rms_norm(bench, c, fused: bool):
    b, act = bench.b, bench.b.act_dtype
    H = c["H"]
    w = bench.rand((H,), np.float32)
    for T in c["T"]:
        sets = _norm_sets(bench, T, H, fused, lambda x, out: b.rms_norm(x, w, 1e-5, out),
                          lambda x, r: b.fused_add_rms_norm(x, r, w, 1e-5))
        e = esize(act)
        moved = (4 if fused else 2) * T * H * e + 4 * H
        yield Case("fused_add_rms_norm" if fused else "rms_norm", f"T={T} H={H}", "", moved, 0,
                   sets)


def cases_scale(bench, c):
    """Gemma's embedding times sqrt(hidden), in place."""
    b, act = bench.b, bench.b.act_dtype
    H = c["H"]
    for T in c["T"]:
        sets = [lambda x=bench.rand((T, H), act): b.scale(x, 64.0) for _ in range(N_SETS)]
        yield Case("scale", f"T={T} H={H}", "", 2 * T * H * esize(act), 0, sets)


def cases_layer_norm(bench, c, fused: bool):
    """StableLM's LayerNorm with weight and bias (three reads of each row: two hit the cache)."""
    b, act = bench.b, bench.b.act_dtype
    H = c["H"]
    w, bias = bench.rand((H,), np.float32), bench.rand((H,), np.float32)
    for T in c["T"]:
        sets = _norm_sets(bench, T, H, fused, lambda x, out: b.layer_norm(x, w, bias, 1e-5, out),
                          lambda x, r: b.fused_add_layer_norm(x, r, w, bias, 1e-5))
        moved = (4 if fused else 2) * T * H * esize(act) + 8 * H
        yield Case("fused_add_layer_norm" if fused else "layer_norm", f"T={T} H={H}", "bias",
                   moved, 0, sets)


def cases_rotary(bench, c):
    b, act = bench.b, bench.b.act_dtype
    Hq, Hkv, D = c["Hq"], c["Hkv"], c["D"]
    max_pos = 8192
    inv = 1.0 / 500000.0 ** (np.arange(0, D, 2) / D)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    cache = bench.dev(np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32))
    for T in c["T"]:
        sets = []
        for i in range(N_SETS):
            pos = bench.dev(np.random.default_rng(i).integers(0, max_pos, T).astype(np.int32))
            q, k = bench.rand((T, Hq * D), act), bench.rand((T, Hkv * D), act)
            sets.append(lambda pos=pos, q=q, k=k: b.rotary_embedding(pos, q, k, cache, D, True))
        moved = 2 * T * (Hq + Hkv) * D * esize(act) + T * 4 + T * D * 4
        yield Case("rotary_embedding", f"T={T} Hq={Hq} Hkv={Hkv} D={D}", "neox", moved, 0, sets)


def cases_silu(bench, c):
    b, act = bench.b, bench.b.act_dtype
    inter = c["I"]
    for T in c["T"]:
        sets = []
        for _ in range(N_SETS):
            x = bench.rand((T, 2 * inter), act)
            with bench.stream:
                out = bench.cp.empty((T, inter), dtype=act)
            sets.append(lambda x=x, out=out: b.silu_and_mul(x, out))
        yield Case("silu_and_mul", f"T={T} I={inter}", "", 3 * T * inter * esize(act), 0, sets)


def cases_reshape_and_cache(bench, c):
    b, act = bench.b, bench.b.act_dtype
    Hkv, D, BS = c["Hkv"], c["D"], c["BS"]
    for T in c["T"]:
        NB = -(-T // BS) * N_SETS + 16
        kc, vc = bench.rand((NB, BS, Hkv, D), act), bench.rand((NB, BS, Hkv, D), act)
        sets = []
        for i in range(N_SETS):
            slots = np.random.default_rng(i).permutation(NB * BS)[:T].astype(np.int32)
            k, v = bench.rand((T, Hkv, D), act), bench.rand((T, Hkv, D), act)
            sm = bench.dev(slots)
            sets.append(lambda k=k, v=v, sm=sm: b.reshape_and_cache(k, v, kc, vc, sm))
        moved = 4 * T * Hkv * D * esize(act) + 4 * T
        yield Case("reshape_and_cache", f"T={T} Hkv={Hkv} D={D} BS={BS}", "", moved, 0, sets)


def kv_pool(bench, act, num_blocks, BS, Hkv, D):
    return (bench.rand((num_blocks, BS, Hkv, D), act), bench.rand((num_blocks, BS, Hkv, D), act))


def fp8_pool(bench, num_blocks, BS, Hkv, D):
    """K and V caches of e4m3 codes: random 2-byte values seen as bytes, masked to <= 0x77 so no
    code is NaN (0x7f, 0xff)."""
    pool = []
    for _ in range(2):
        codes = bench.rand((num_blocks, BS, Hkv, D // 2), np.float16).view(bench.cp.uint8)
        codes &= 0x77
        pool.append(codes.reshape(num_blocks, BS, Hkv, D))
    return tuple(pool)


def decode_call(b, args, scale, scales, splits=0):
    """paged_attention on one input set; splits > 0 forces that many split-K partitions instead
    of the rule's count."""
    b.decode_splits = splits
    try:
        b.paged_attention(*args, scale, 0, *scales)
    finally:
        b.decode_splits = 0


def cases_decode(bench, c):
    """Decode attention over an activation-dtype cache and an FP8 one, one pass and split-K with
    the count of pyx/decode_splits.py (the variant names it: "split-K x57"), plus the counts of
    --shape splits=... forced, to see how far the rule's pick is from the best."""
    act = bench.b.act_dtype
    Hq, Hkv, D, BS = c["Hq"], c["Hkv"], c["D"], c["BS"]
    scale = 1.0 / np.sqrt(D)
    for kv in ("act", "fp8"):
        e = esize(act) if kv == "act" else 1
        for B in c["B"]:
            for ctx in c["ctx"]:
                yield from decode_shape(bench, c, act, kv, e, B, ctx, Hq, Hkv, D, BS, scale)


def decode_shape(bench, c, act, kv, e, B, ctx, Hq, Hkv, D, BS, scale):
    per_seq = -(-ctx // BS)
    pool_bytes = 2 * B * per_seq * BS * Hkv * D * e
    # small pools: one per input set; large ones (well past L2): one, permuted per set
    n_pools = N_SETS if pool_bytes < (1 << 30) else 1
    if kv == "fp8":
        pools = [fp8_pool(bench, B * per_seq, BS, Hkv, D) for _ in range(n_pools)]
        scales = (bench.dev(np.full(Hkv, 0.05, np.float32)),
                  bench.dev(np.full(Hkv, 0.05, np.float32)))
    else:
        pools = [kv_pool(bench, act, B * per_seq, BS, Hkv, D) for _ in range(n_pools)]
        scales = ()
    inputs = []
    for i in range(N_SETS):
        perm = np.random.default_rng(i).permutation(B * per_seq).astype(np.int32)
        tables = bench.dev(perm.reshape(B, per_seq))
        seq_lens = bench.dev(np.full(B, ctx, np.int32))
        qsl = bench.dev(np.arange(B + 1, dtype=np.int32))
        q = bench.rand((B, Hq, D), act)
        with bench.stream:
            out = bench.cp.empty((B, Hq, D), dtype=act)
        inputs.append((out, q, *pools[i % n_pools], tables, seq_lens, qsl))
    moved = 2 * B * ctx * Hkv * D * e + 2 * B * Hq * D * esize(act) + B * per_seq * 4 + B * 8
    shape = f"B={B} ctx={ctx} Hq={Hq} Hkv={Hkv} D={D}" + (" fp8-kv" if kv == "fp8" else "")
    for split_k in (False, True):
        b = bench.backend(split_k=split_k)
        n = b.decode_split_count(B, Hq, Hkv, D, BS, per_seq, kv == "fp8")
        sets = [lambda a=a, b=b: decode_call(b, a, scale, scales) for a in inputs]
        yield Case("decode_attention", shape, f"split-K x{n}" if split_k else "one-pass", moved,
                   0, sets, stream=b.stream)
    b = bench.backend(split_k=True)
    for splits in c["splits"]:
        sets = [lambda a=a, s=splits: decode_call(b, a, scale, scales, s) for a in inputs]
        yield Case("decode_attention", shape, f"forced x{splits}", moved, 0, sets,
                   stream=b.stream)
    sets = None
    del pools, inputs
    bench.free()


def cases_prefill(bench, c):
    act = bench.b.act_dtype
    Hq, Hkv, D, BS = c["Hq"], c["Hkv"], c["D"], c["BS"]
    e = esize(act)
    for n, L, P in c["prefill"]:
        per_seq = -(-(P + L) // BS)
        T = n * L
        k_cache, v_cache = kv_pool(bench, act, n * per_seq, BS, Hkv, D)
        inputs = []
        for i in range(N_SETS):
            perm = np.random.default_rng(i).permutation(n * per_seq).astype(np.int32)
            tables = bench.dev(perm.reshape(n, per_seq))
            seq_lens = bench.dev(np.full(n, P + L, np.int32))
            qsl = bench.dev((np.arange(n + 1) * L).astype(np.int32))
            q = bench.rand((T, Hq, D), act)
            with bench.stream:
                out = bench.cp.empty((T, Hq, D), dtype=act)
            inputs.append((out, q, k_cache, v_cache, tables, seq_lens, qsl))
        # QK^T and PV over the causal triangle after the P cached keys (a rectangle)
        flops = 4 * D * Hq * n * (L * P + L * (L + 1) // 2)
        moved = 2 * T * Hq * D * e + 2 * n * (P + L) * Hkv * D * e + n * per_seq * 4
        for kernel in ("simple", "fa2", "fa3"):
            b = bench.backend(prefill=kernel)
            if b.prefill_kernel != kernel:  # fa3 off compute capability 9.0 runs fa2: no row
                continue
            sets = [lambda a=a, b=b: b.paged_attention(*a, 1.0 / np.sqrt(D), 0) for a in inputs]
            chunk = f"{n}x{L}+{P}" if P else f"{n}x{L}"
            yield Case("prefill_attention", f"{chunk} Hq={Hq} Hkv={Hkv} D={D}", kernel, moved,
                       flops, sets, stream=b.stream)
        sets = None
        del k_cache, v_cache, inputs
        bench.free()


def linear_shapes(c):
    H, Hq, Hkv, D, inter = c["H"], c["Hq"], c["Hkv"], c["D"], c["I"]
    return [("qkv", (Hq + 2 * Hkv) * D, H), ("o", H, Hq * D), ("gate_up", 2 * inter, H),
            ("down", H, inter)]


def cases_linear(bench, c):
    b, act = bench.b, bench.b.act_dtype
    e = esize(act)
    for name, N, K in linear_shapes(c):
        weights = [bench.rand((N, K), act, 1.0 / np.sqrt(K)) for _ in range(N_SETS)]
        for M in c["M"]:
            sets = []
            for i in range(N_SETS):
                x = bench.rand((M, K), act)
                with bench.stream:
                    out = bench.cp.empty((M, N), dtype=act)
                sets.append(lambda x=x, w=weights[i], out=out: b.linear(x, w, None, out))
            moved = (M * K + N * K + M * N) * e
            yield Case("linear", f"{name} M={M} N={N} K={K}", "", moved, 2 * M * N * K, sets)
            del sets
        del weights
        bench.free()


# ---- quantized GEMMs (issue 6, item 7)

_HOST_QUANT: dict = {}


def host_quant(fmt: str, N: int, K: int, seed: int = 0):
    """The host-side weight of one format for an (N, K) projection, made once per shape: "q4k" and
    "q8_0" ggml blocks (quantize_weight of random normal f32), "marlin" (random int4 codes,
    f32 group-128 scales, symmetric zeros 8, repacked once to the Marlin layout, which
    place_weight takes as it is), "fp8" (random e4m3
    codes without the NaN codes 0x7f / 0xff, random 128 x 128 block scales)."""
    key = (fmt, N, K, seed)
    if key in _HOST_QUANT:
        return _HOST_QUANT[key]
    rng = np.random.default_rng(seed)
    if fmt in ("q4k", "q8_0"):
        from pyx.cpu_backend import quantize_weight
        from pyx.weights.ggml import ISQ_TYPES
        w = rng.standard_normal((N, K), dtype=np.float32)
        w *= 1.0 / np.sqrt(K)
        obj = quantize_weight(w, ISQ_TYPES[fmt])
        del w
    elif fmt == "marlin":
        from pyx.weights.int4 import Int4Part, Int4Weight
        from pyx.weights.marlin import repack_int4
        g = QGEMM_GROUP
        if K % g:
            raise ValueError(f"int4 group {g} must divide K = {K}")
        codes = rng.integers(0, 16, (N, K), dtype=np.uint8)
        scales = rng.uniform(0.5, 1.5, (N, K // g)).astype(np.float32)
        scales *= 2.0 / (15.0 * np.sqrt(K))
        zeros = np.full((N, K // g), 8.0, np.float32)
        obj = repack_int4(Int4Weight([Int4Part.from_codes(codes, scales, zeros, g)], K))
        del codes
    elif fmt == "fp8":
        from pyx.weights.fp8 import Fp8Weight
        bn, bk = FP8_BLOCK
        if N % bn:
            raise ValueError(f"FP8 block rows {bn} must divide N = {N}")
        codes = rng.integers(0, 254, (N, K), dtype=np.uint8)
        codes += codes >= 0x7F            # 0..253 -> 0..0x7e, 0x80..0xfe: no NaN codes
        scales = rng.uniform(0.5, 1.5, (N // bn, -(-K // bk))).astype(np.float32)
        scales *= 1e-3
        obj = Fp8Weight(codes, scales, FP8_BLOCK)
    else:
        raise ValueError(f"unknown quantized format {fmt!r}")
    _HOST_QUANT[key] = obj
    return obj


def weight_nbytes(w) -> int:
    """Bytes of a placed weight (what a GEMM must read): CuPy array, ggml blocks, Marlin or FP8."""
    if hasattr(w, "quant_parts"):
        return sum(int(b.nbytes) for _, b in w.quant_parts)
    if hasattr(w, "qweight"):
        return sum(int(a.nbytes) for a in (w.qweight, w.scales, w.zeros) if a is not None)
    if hasattr(w, "codes"):
        return int(w.codes.nbytes) + int(w.scales.nbytes)
    return int(w.nbytes)


def qgemm_layers(c):
    wanted = c["qlayers"]
    layers = [s for s in linear_shapes(c) if s[0] in wanted]
    unknown = set(wanted) - {s[0] for s in linear_shapes(c)}
    if unknown:
        raise ValueError(f"qlayers: unknown {sorted(unknown)}; known: qkv, o, gate_up, down")
    return layers


def fp8_gemv_linear(b, x, w, bias, out):
    """linear through the FP8 GEMV (kernels fp8_gemv=on) at any M it takes, whatever the
    backend's default crossover."""
    saved = b.fp8_gemv, b.fp8_gemv_max_m
    b.fp8_gemv, b.fp8_gemv_max_m = True, FP8_GEMV_MAX_M
    try:
        b.linear(x, w, bias, out)
    finally:
        b.fp8_gemv, b.fp8_gemv_max_m = saved


def cases_qgemm(bench, c):
    """Per layer shape: place every format (QGEMM_SETS device copies), then per M one case per
    format, bf16 dense first (the baseline of the speed-ups)."""
    from pyx.cuda_backend import DeviceFp8Weight, _dtype_code, launch_fp8_dequantize

    b, act, cp = bench.b, bench.b.act_dtype, bench.cp
    cc = str(b.device.compute_capability)
    cutlass = cc == "90"
    if not cutlass:
        bench.notes.append(f"qgemm fp8-cutlass skipped: the device is sm_{cc}; the CUTLASS FP8 "
                           "block GEMM is built for sm_90a only")
    for name, N, K in qgemm_layers(c):
        t0 = time.time()
        hosts = {}
        for f in ("q4k", "q8_0", "marlin", "fp8"):
            try:
                hosts[f] = host_quant(f, N, K)
            except Exception as e:      # one format failing does not end the others
                bench.notes.append(f"qgemm {f} {name}: host weights failed: "
                                   f"{type(e).__name__}: {e}")
        host_s = time.time() - t0
        weights = {"bf16": [bench.rand((N, K), act, 1.0 / np.sqrt(K)) for _ in range(QGEMM_SETS)]}
        saved_flags = b.fp8_cutlass, b.fp8_gemv
        for f in ("q4k", "q8_0", "marlin", "fp8-cutlass", "fp8-gemv"):
            src = hosts.get("fp8" if f.startswith("fp8") else f)
            if src is None or (f == "fp8-cutlass" and not cutlass):
                continue
            b.fp8_cutlass, b.fp8_gemv = f == "fp8-cutlass", f == "fp8-gemv"
            try:
                with bench.stream:
                    placed = [b.place_weight(src) for _ in range(QGEMM_SETS)]
            except Exception as e:
                bench.notes.append(f"qgemm {f} {name}: place_weight failed: "
                                   f"{type(e).__name__}: {e}")
                continue
            finally:
                b.fp8_cutlass, b.fp8_gemv = saved_flags
            if f == "fp8-cutlass" and not all(isinstance(w, DeviceFp8Weight) for w in placed):
                bench.notes.append(f"qgemm fp8-cutlass {name}: place_weight dequantized the codes "
                                   f"(activations {act.name}; the CUTLASS GEMM needs bf16)")
                continue
            weights[f] = placed
        placed = None
        print(f"qgemm {name} N={N} K={K}: host weights {host_s:.1f} s (cached per shape)",
              flush=True)
        wbytes = {f: weight_nbytes(ws[0]) for f, ws in weights.items()}

        # The default FP8 path's one-time cost: codes + scales -> the activation dtype at load
        # (the GEMMs after it are the bf16 rows).
        if "fp8" in hosts:
            fp8 = hosts["fp8"]
            codes, scales = bench.dev(fp8.weight), bench.dev(fp8.scale)
            with bench.stream:
                deq = cp.empty((N, K), dtype=act)
            code = _dtype_code(act)
            moved = int(codes.nbytes) + int(scales.nbytes) + N * K * esize(act)
            yield Case("qgemm", f"{name} N={N} K={K}", "fp8-dequant", moved, 0,
                       [lambda: launch_fp8_dequantize(codes.data.ptr, scales.data.ptr,
                                                      deq.data.ptr, N, K, FP8_BLOCK[0],
                                                      FP8_BLOCK[1], code, b.stream.ptr)],
                       stream=b.stream, extra=dict(layer=name, M=None, N=N, K=K,
                                                   format="fp8-dequant (load, once)",
                                                   weight_bytes=moved))
            del codes, scales, deq

        for M in c["QM"]:
            xs, outs = [], []
            for _ in range(QGEMM_SETS):
                xs.append(bench.rand((M, K), act))
                with bench.stream:
                    outs.append(cp.empty((M, N), dtype=act))
            for f, ws in weights.items():
                if f == "fp8-gemv" and M > FP8_GEMV_MAX_M:
                    continue
                run = fp8_gemv_linear if f == "fp8-gemv" else type(b).linear
                sets = [lambda x=xs[i], w=ws[i], out=outs[i], run=run: run(b, x, w, None, out)
                        for i in range(QGEMM_SETS)]
                yield Case("qgemm", f"{name} M={M} N={N} K={K}", f, wbytes[f], 2 * M * N * K,
                           sets, stream=b.stream, baseline=f == "bf16", compare=f != "bf16",
                           extra=dict(layer=name, M=M, N=N, K=K, format=f,
                                      weight_bytes=wbytes[f]))
            del xs, outs, sets
        del weights
        bench.free()


# ---- fused MoE grouped GEMM (issue 16)

def moe_q8_0_stack(cp, E, N, K):
    """(E, N, K / 32 * 34) Q8_0 blocks: random int8 codes, every scale 2^-7 (fp16 0x2000)."""
    blocks = cp.random.randint(0, 256, size=(E, N, K // 32, 34), dtype=cp.int32).astype(cp.uint8)
    blocks[..., 0] = 0x00
    blocks[..., 1] = 0x20
    return blocks.reshape(E, N, K // 32 * 34)


def cases_moe(bench, c):
    from pyx.moe import StackedExperts, moe_align_capacity, moe_block_m

    b, act, cp = bench.b, bench.b.act_dtype, bench.cp
    e = esize(act)
    if e != 2:
        bench.notes.append("moe skipped: the grouped GEMM runs on bf16/f16 activations")
        return
    rng = np.random.default_rng(0)
    for model, (H, I, E, k) in MOE_MODELS.items():
        for proj, N, K in (("gate_up", 2 * I, H), ("down", H, I)):
            with bench.stream:
                dense = bench.rand((E, N, K), act, 1.0 / np.sqrt(K))
                stacks = {"bf16": StackedExperts((E, N, K), None, dense, 0),
                          "q8_0": StackedExperts((E, N, K), None, moe_q8_0_stack(cp, E, N, K),
                                                 8)}
            row_bytes = {"bf16": K * e, "q8_0": K // 32 * 34}
            for T in c["MT"]:
                P = T * k
                ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
                active = np.unique(ids)
                bm = moe_block_m(P, E)
                cap = moe_align_capacity(P, E, bm)
                with bench.stream:
                    d_ids = cp.asarray(ids)
                    align = (cp.empty(cap, cp.int32), cp.empty(cap // bm, cp.int32),
                             cp.empty(E + 1, cp.int32), cp.empty(1, cp.int32))
                    x = bench.rand((T if proj == "gate_up" else P, K), act)
                    out = cp.empty((P, N), dtype=act)
                b.moe_align(d_ids, E, bm, *align)
                x_div = k if proj == "gate_up" else 1
                shape = f"{model} {proj} T={T} P={P} N={N} K={K} active={active.size}/{E}"
                # the unfused path's GEMMs: one cuBLAS linear per active expert on its rows
                counts = np.bincount(ids.reshape(-1), minlength=E)
                with bench.stream:
                    xs = {int(j): bench.rand((int(counts[j]), K), act) for j in active}
                    outs = {int(j): cp.empty((int(counts[j]), N), dtype=act) for j in active}

                def per_expert(xs=xs, outs=outs):
                    for j, xj in xs.items():
                        b.linear(xj, dense[j], None, outs[j])
                moved = active.size * N * row_bytes["bf16"] + (x.size + out.size) * e
                yield Case("moe", shape, "per-expert bf16", moved, 2 * P * N * K, [per_expert],
                           stream=b.stream, baseline=True,
                           extra=dict(model=model, proj=proj, T=T, weight_bytes=moved))
                for f, st in stacks.items():
                    moved = active.size * N * row_bytes[f] + (x.size + out.size) * e
                    yield Case("moe", shape, f"grouped {f}", moved, 2 * P * N * K,
                               [lambda st=st: b.moe_grouped_linear(x, st, align[0], align[1],
                                                                   align[3], x_div, bm, out)],
                               stream=b.stream, compare=True,
                               extra=dict(model=model, proj=proj, T=T, format=f,
                                          weight_bytes=moved))
                del xs, outs, x, out, align
            del dense, stacks
            bench.free()


def cases_sampling(bench, c, op):
    b, cp = bench.b, bench.cp
    V = c["V"]
    for B in c["SB"]:
        sets, prepare = [], []
        for i in range(N_SETS):
            logits = bench.rand((B, V), np.float32, 3.0)
            with bench.stream:
                out = cp.empty(B, dtype=cp.int64)
            if op == "argmax":
                sets.append(lambda lg=logits, out=out: b.argmax(lg, out))
            elif op == "gumbel_sample":
                seeds = bench.dev(np.arange(i * B, (i + 1) * B, dtype=np.uint64))
                pos = bench.dev(np.full(B, 17, np.int64))
                sets.append(lambda lg=logits, s=seeds, p=pos, out=out: b.gumbel_sample(lg, s, p,
                                                                                        out))
            else:  # filter_logits, in place: each timed launch gets the pristine logits back
                work = bench.rand((B, V), np.float32)
                params = [bench.dev(np.full(B, v, dt)) for v, dt in
                          ((0.7, np.float32), (50, np.int32), (0.9, np.float32),
                           (0.05, np.float32))]
                prepare.append(lambda w=work, lg=logits: bench.copy_async(w, lg))
                sets.append(lambda w=work, p=params: b.filter_logits(w, *p))
        if op == "filter_logits":
            moved, variant = 2 * B * V * 4, "t=0.7 k=50 p=0.9 min_p=0.05"
        else:
            moved, variant = B * V * 4 + B * 8 + (16 * B if op == "gumbel_sample" else 0), ""
        yield Case(op, f"B={B} V={V}", variant, moved, 0, sets, prepare or None)
        del sets, prepare
        bench.free()


# (name, greedy, temperature, top_k, top_p, min_p, penalties): the settings the sampler meets,
# each timed fused and op by op (the engine's simple path: only the ops the setting needs)
SAMPLE_SETTINGS = (
    ("t=0.7 k=50 p=0.9 min_p=0.05, 16 penalties/row", 0, 0.7, 50, 0.9, 0.05, True),
    ("t=1 p=0.9 only, 16 penalties/row", 0, 1.0, 0, 0.9, 0.0, True),
    ("greedy, 16 penalties/row", 1, 1.0, 0, 1.0, 0.0, True),
    ("t=1, no filter, no penalties", 0, 1.0, 0, 1.0, 0.0, False),
)


def cases_sample_fused(bench, c):
    """The sampling step of kernels sampling=fused (penalties, then the argmax or temperature,
    top-k, top-p, min-p and the Gumbel draw) in one launch, against the op-by-op path it
    replaces, as the sampler runs it (engine/sampling/sampler.py: apply_penalties when a row
    has penalties, argmax for greedy rows, filter_logits only when a filter is set, then
    gumbel_sample), for each of SAMPLE_SETTINGS: the rows of a setting compare like with like.
    Top-p alone over these N(0, 3^2) logits lets 8k-12k tokens through, more candidates than
    fit, so that row times the fused kernel's fallback. Bytes: the logits read once. Penalties
    write in place, so each timed launch gets the pristine logits back first."""
    b, cp = bench.b, bench.cp
    V = c["V"]
    rng = np.random.default_rng(0)
    for B in c["SB"]:
        shape = f"B={B} V={V}"
        for name, greedy, *filters, with_penalties in SAMPLE_SETTINGS:
            fused, op_by_op, prepare = [], [], []
            for i in range(N_SETS):
                logits = bench.rand((B, V), np.float32, 3.0)
                work = bench.rand((B, V), np.float32)
                with bench.stream:
                    out = cp.empty(B, dtype=cp.int64)
                pen = None
                if with_penalties:
                    cols = np.stack([np.sort(rng.choice(V, 16, replace=False))
                                     for _ in range(B)])
                    pen = [bench.dev(a) for a in (
                        np.repeat(np.arange(B, dtype=np.int32), 16),
                        cols.ravel().astype(np.int32), np.full(16 * B, -0.0, np.float32),
                        np.full(16 * B, 1.3, np.float32), np.full(16 * B, 0.5, np.float32))]
                t, k, p, m = (bench.dev(np.full(B, v, dt)) for v, dt in
                              zip(filters, (np.float32, np.int32, np.float32, np.float32)))
                seeds = bench.dev(np.arange(i * B, (i + 1) * B, dtype=np.uint64))
                pos = bench.dev(np.full(B, 17, np.int64))
                g = bench.dev(np.full(B, greedy, np.uint8))
                prepare.append(lambda w=work, lg=logits: bench.copy_async(w, lg))
                fused.append(lambda w=work, g=g, t=t, k=k, p=p, m=m, s=seeds, q=pos, o=out,
                             pen=pen: b.sample_fused(w, g, t, k, p, m, s, q, o, penalties=pen))
                filtered = filters[1:] != [0, 1.0, 0.0] or filters[0] != 1.0

                def separate(w=work, t=t, k=k, p=p, m=m, s=seeds, q=pos, o=out, pen=pen,
                             greedy=greedy, filtered=filtered):
                    if pen is not None:
                        b.apply_penalties(w, *pen)
                    if greedy:
                        b.argmax(w, o)
                        return
                    if filtered:
                        b.filter_logits(w, t, k, p, m)
                    b.gumbel_sample(w, s, q, o)
                op_by_op.append(separate)
            moved = B * V * 4
            yield Case("sample_fused", shape, "op-by-op " + name, moved, 0, op_by_op, prepare,
                       baseline=True)
            yield Case("sample_fused", shape, "fused " + name, moved, 0, fused, prepare,
                       compare=True)
            del fused, op_by_op, prepare
            bench.free()


def cases_token_bitmask(bench, c):
    """Every row constrained, a random mask (about half the tokens allowed). In place but
    idempotent, so the timed launches need no restore."""
    b, cp = bench.b, bench.cp
    V = c["V"]
    W = (V + 31) // 32
    rng = np.random.default_rng(0)
    for B in c["SB"]:
        sets = []
        for _ in range(N_SETS):
            logits = bench.rand((B, V), np.float32, 3.0)
            mask = bench.dev(rng.integers(-2**31, 2**31, size=(B, W), dtype=np.int64)
                             .astype(np.int32))
            rows = bench.dev(np.arange(B, dtype=np.int32))
            sets.append(lambda lg=logits, m=mask, r=rows: b.apply_token_bitmask(lg, m, r))
        # logits read once, the masked half written, the mask read once
        yield Case("apply_token_bitmask", f"B={B} V={V}", "", B * V * 4 + B * V * 2 + B * W * 4,
                   0, sets)
        del sets
        bench.free()


def kernel_switch(op: str, variant: str) -> str | None:
    """The KernelConfig choice a row's kernel sits behind ("prefill=fa2"), None on the default
    path: the GPU suite drops the switches whose tests failed (--without) and picks winners by it."""
    from pyx.kernel_config import KernelConfig

    default = KernelConfig()
    choice = None
    if op == "decode_attention":
        choice = ("decode", "simple" if variant == "one-pass" else "split")
    elif op == "prefill_attention":
        choice = ("prefill", variant)
    elif op == "qgemm":
        choice = {"fp8-cutlass": ("fp8", "cutlass"), "fp8-gemv": ("fp8_gemv", "on")}.get(variant)
    elif op == "sample_fused" and variant.startswith("fused"):
        choice = ("sampling", "fused")
    elif op == "moe" and variant.startswith("grouped"):
        choice = ("moe", "fused")
    if choice is None or getattr(default, choice[0]) == choice[1]:
        return None
    return f"{choice[0]}={choice[1]}"


def all_cases(bench, c, ops):
    gens = {
        "embedding": lambda: cases_embedding(bench, c),
        "rms_norm": lambda: cases_rms_norm(bench, c, False),
        "fused_add_rms_norm": lambda: cases_rms_norm(bench, c, True),
        "scale": lambda: cases_scale(bench, c),
        "layer_norm": lambda: cases_layer_norm(bench, c, False),
        "fused_add_layer_norm": lambda: cases_layer_norm(bench, c, True),
        "rotary_embedding": lambda: cases_rotary(bench, c),
        "silu_and_mul": lambda: cases_silu(bench, c),
        "reshape_and_cache": lambda: cases_reshape_and_cache(bench, c),
        "decode_attention": lambda: cases_decode(bench, c),
        "prefill_attention": lambda: cases_prefill(bench, c),
        "linear": lambda: cases_linear(bench, c),
        "argmax": lambda: cases_sampling(bench, c, "argmax"),
        "gumbel_sample": lambda: cases_sampling(bench, c, "gumbel_sample"),
        "filter_logits": lambda: cases_sampling(bench, c, "filter_logits"),
        "sample_fused": lambda: cases_sample_fused(bench, c),
        "apply_token_bitmask": lambda: cases_token_bitmask(bench, c),
        "qgemm": lambda: cases_qgemm(bench, c),
        "moe": lambda: cases_moe(bench, c),
    }
    for op in ops:
        yield op, gens[op]


# ---- command line


def parse_prefill(item: str, v: str) -> tuple[int, int, int]:
    """NxL (N prompts of L tokens) or NxL+P (N chunks of L rows after P cached tokens each)."""
    try:
        n, rest = v.lower().split("x")
        L, _, P = rest.partition("+")
        shape = (int(n), int(L), int(P or 0))
    except ValueError:
        raise SystemExit(f"--shape {item!r}: prefill takes NxL or NxL+P items, e.g. "
                         "1x4096,8x512,1x1024+3072") from None
    if shape[0] < 1 or shape[1] < 1 or shape[2] < 0:
        raise SystemExit(f"--shape {item!r}: prefill needs N, L >= 1 and P >= 0")
    return shape


def parse_shapes(items) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--shape {item!r}: expected key=value")
        key, value = item.split("=", 1)
        if key == "prefill":
            out[key] = [parse_prefill(item, v) for v in value.split(",")]
        elif key in LIST_KEYS:
            out[key] = [int(v) for v in value.split(",")]
        elif key == "qlayers":
            out[key] = [v for v in value.split(",") if v]
        elif key in DEFAULT:
            out[key] = int(value)
        else:
            raise SystemExit(f"--shape {item!r}: unknown key; known: {', '.join(DEFAULT)}")
    return out


def build_parser():
    ap = argparse.ArgumentParser(
        prog="python -m bench.kernels",
        description="Time each CUDA backend op alone (CUDA events, median of many runs, rotating "
                    "inputs) against the copy bandwidth and a cuBLAS bf16 GEMM measured in the "
                    "same run.")
    ap.add_argument("ops", nargs="*", metavar="op",
                    help=f"ops to run (default all): {', '.join(OPS)}")
    ap.add_argument("--shape", action="append", metavar="k=v",
                    help="override a dimension: T, B, ctx, M, SB, QM (qgemm's M), splits "
                         "(decode attention's forced split counts) take lists "
                         "(T=1,64); prefill=1x4096,8x512,1x1024+3072 (N chunks of L rows "
                         "after P cached tokens); qlayers=gate_up,down (qgemm's "
                         "projections); MT (moe's token counts) a list; H, Hq, Hkv, D, I, V, "
                         "BS one value")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"],
                    help="activation dtype (default bf16)")
    ap.add_argument("--quick", action="store_true", help="a small subset, well under a minute")
    ap.add_argument("--runs", type=int, default=50, help="timed launches per case (default 50)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed launches first (default 5)")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON to FILE")
    ap.add_argument("--without", default="", metavar="KEY=VALUE,...",
                    help="skip the rows of these kernel switches (e.g. those whose tests failed: "
                         "prefill=fa3,fp8_gemv=on)")
    return ap


def no_device_reason() -> str | None:
    try:
        import cupy
    except Exception as e:
        return f"CuPy does not import ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    if n < 1:
        return "CuPy sees no device"
    try:
        from pyx.cuda_backend import device_count
    except Exception as e:
        return f"pyx.cuda_backend does not import ({type(e).__name__}: {e}); build with nvcc"
    if device_count() < 1:
        return "pyx.cuda_backend.device_count() == 0"
    return None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, cwd=os.path.dirname(__file__)).stdout.strip()
    except Exception:
        return ""


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_qgemm_table(rows, gemm):
    """The quantized-GEMM rows: per layer, M and format."""
    head = ("layer", "M", "N", "K", "format", "us", "TFLOP/s", "%GEMM", "%FP8pk", "wGB/s", "%BW",
            "x bf16")
    body = []
    for r in rows:
        if r.get("error") is not None:
            body.append((r.get("layer", r["shape"]), r.get("M") or "-", r.get("N", ""),
                         r.get("K", ""), r.get("format", r["variant"]), "ERROR", "", "", "", "",
                         "", ""))
            continue
        fp8 = r.get("format") == "fp8-cutlass" and r["tflops"] is not None
        body.append((r["layer"], "-" if r["M"] is None else r["M"], r["N"], r["K"], r["format"],
                     fmt(r["time_us"], ".1f"), fmt(r["tflops"], ".1f"), fmt(r["pct_gemm"], ".0f"),
                     fmt(100.0 * r["tflops"] / (2 * gemm) if fp8 else None, ".0f"),
                     fmt(r["gbps"], ".0f"), fmt(r["pct_bw"], ".0f"),
                     fmt(r.get("speedup_vs_bf16"), ".2f")))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    for line in [head] + body:
        print("  ".join(str(x).ljust(w) if i in (0, 4) else str(x).rjust(w)
                        for i, (x, w) in enumerate(zip(line, widths))))


def print_table(rows):
    head = ("op", "shape", "variant", "us", "GB/s", "%BW", "TFLOP/s", "%GEMM")
    body = [(r["op"], r["shape"], r["variant"], fmt(r["time_us"], ".1f"), fmt(r["gbps"], ".0f"),
             fmt(r["pct_bw"], ".0f"), fmt(r["tflops"], ".1f"), fmt(r["pct_gemm"], ".0f"))
            if r.get("error") is None else
            (r["op"], r["shape"], r["variant"], "ERROR", "", "", "", "") for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    for line in [head] + body:
        print("  ".join(str(x).ljust(w) if i < 3 else str(x).rjust(w)
                        for i, (x, w) in enumerate(zip(line, widths))))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        print(f"unknown op(s) {unknown}; known: {', '.join(OPS)}", file=sys.stderr)
        return 2
    if args.runs < 1 or args.warmup < 0:
        print("--runs must be >= 1 and --warmup >= 0", file=sys.stderr)
        return 2
    why = no_device_reason()
    if why:
        print(f"no CUDA device: {why}", file=sys.stderr)
        return 2

    import cupy as cp

    c = dict(DEFAULT)
    if args.quick:
        c.update(QUICK)
    c.update(parse_shapes(args.shape))
    ops = args.ops or OPS
    without = {item.strip() for item in args.without.split(",") if item.strip()}
    if without:
        print(f"without the rows of {', '.join(sorted(without))}")
    bench = Bench(cp, args.dtype, args.runs, args.warmup)
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"device: {name}, {props['multiProcessorCount']} SMs, "
          f"{props['totalGlobalMem'] / 2**30:.1f} GiB; date: {date}; commit {git_commit()}")
    print(f"CUDA runtime {cp.cuda.runtime.runtimeGetVersion()}, driver "
          f"{cp.cuda.runtime.driverGetVersion()}, CuPy {cp.__version__}; activations "
          f"{args.dtype}; {args.runs} timed runs (median), {args.warmup} warm-up, {N_SETS} input "
          f"sets, L2 flushed before each run", flush=True)

    t0 = time.time()
    bw = copy_peak(bench, (1 << 30) if args.quick else (2 << 30))
    bench.free()
    print(f"peak copy bandwidth (read + write): {bw:.0f} GB/s", flush=True)
    gemm = gemm_peak(bench)
    bench.free()
    print(f"peak cuBLAS bf16 GEMM {GEMM_PEAK_N}^3: {gemm:.1f} TFLOP/s", flush=True)

    rows = []
    baselines = {}      # (op, shape) -> the baseline variant's time (qgemm: bf16 dense)
    for op, gen in all_cases(bench, c, ops):
        cases = gen()
        while True:
            try:
                case = next(cases)
            except StopIteration:
                break
            except Exception as e:  # setting up this op's inputs failed: report, go on
                rows.append(dict(op=op, shape="(setup)", variant="",
                                 error=f"{type(e).__name__}: {e}"))
                print(f"{op}: setup failed: {type(e).__name__}: {e}", flush=True)
                break
            switch = kernel_switch(case.op, case.variant)
            if switch in without:
                continue
            row = dict(op=case.op, shape=case.shape, variant=case.variant, switch=switch,
                       bytes=case.nbytes, flops=case.flops, time_us=None, gbps=None, pct_bw=None,
                       tflops=None, pct_gemm=None, error=None, **case.extra)
            try:
                us = bench.time_us(case)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                print(f"{case.op} {case.shape} {case.variant}: ERROR {row['error']}", flush=True)
                rows.append(row)
                try:
                    bench.stream.synchronize()
                except Exception:
                    pass
                continue
            row["time_us"] = us
            row["gbps"] = case.nbytes / us / 1e3
            row["pct_bw"] = 100.0 * row["gbps"] / bw
            if case.flops:
                row["tflops"] = case.flops / us / 1e6
                row["pct_gemm"] = 100.0 * row["tflops"] / gemm
            if case.baseline:
                baselines[(case.op, case.shape)] = us
            elif case.compare and (case.op, case.shape) in baselines:
                row["speedup_vs_bf16"] = baselines[(case.op, case.shape)] / us
            rows.append(row)
            print(f"{case.op:<18} {case.shape:<40} {case.variant:<12} {us:10.1f} us "
                  f"{row['gbps']:7.0f} GB/s ({row['pct_bw']:3.0f}% BW)"
                  + (f" {row['tflops']:6.1f} TFLOP/s ({row['pct_gemm']:3.0f}% GEMM)"
                     if case.flops else "")
                  + (f" {row['speedup_vs_bf16']:5.2f}x "
                     + ("bf16" if case.op == "qgemm" else "baseline")
                     if "speedup_vs_bf16" in row else ""), flush=True)
        bench.free()

    print(f"\n== {name}, {date}: peak copy {bw:.0f} GB/s, cuBLAS bf16 GEMM {gemm:.1f} TFLOP/s "
          f"({time.time() - t0:.0f} s)")
    if any(r["op"] != "qgemm" for r in rows):
        print_table([r for r in rows if r["op"] != "qgemm"])
    qrows = [r for r in rows if r["op"] == "qgemm"]
    if qrows:
        print("\n== quantized GEMMs: wGB/s = weight bytes read / time (%BW of the copy peak); "
              "x bf16 = speed-up over bf16 dense at the same shape; %FP8pk against 2x the bf16 "
              "cuBLAS peak (an estimate of FP8 dense)")
        print_qgemm_table(qrows, gemm)
    for note in bench.notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, date=date, commit=git_commit(), dtype=args.dtype,
                           runs=args.runs, warmup=args.warmup, input_sets=N_SETS,
                           peak_copy_gbps=bw, peak_gemm_tflops=gemm, shapes=c, rows=rows,
                           notes=bench.notes),
                      f, indent=1, default=str)
    return 1 if any(r.get("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
