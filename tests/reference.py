"""Float64 NumPy oracle for every backend op (DESIGN.md section 6, step 1).

Written from the formulas in pyx/backend.pyx, deliberately naive (dense gathers, explicit masks,
pure-integer Philox). Imports nothing from engine/ or pyx/. Every function returns new arrays;
16-bit weights are widened exactly (bf16 via its bits, f16 via NumPy) before the float64 math.
"""
import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = np.uint64(0xFFFFFFFF)


def to_f64(a):
    """Exact widening of f32 / f16 / bf16 (ml_dtypes) arrays to float64."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        bits = a.view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def embedding(token_ids, table):
    return to_f64(table)[np.asarray(token_ids)]


def linear(x, weight, bias=None):
    out = to_f64(x) @ to_f64(weight).T
    if bias is not None:
        out = out + to_f64(bias)
    return out


def lora_linear(x, lora_a, lora_b, ranks, parts, rows, seg_offsets, seg_slots, out):
    """out (as float64) plus each segment's rows' LoRA deltas, part by part (pyx/backend.pyx)."""
    out = to_f64(out).copy()
    x, lora_a, lora_b = to_f64(x), to_f64(lora_a), to_f64(lora_b)
    P = len(parts) - 1
    R = lora_a.shape[1] // P
    for g, s in enumerate(seg_slots):
        for t in rows[seg_offsets[g]:seg_offsets[g + 1]]:
            for p in range(P):
                r, c0, c1 = ranks[s, p], parts[p], parts[p + 1]
                y = lora_a[s, p * R:p * R + r] @ x[t]
                out[t, c0:c1] += y @ lora_b[s, :r, c0:c1]
    return out


def rms_norm(x, weight, eps):
    x = to_f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * to_f64(weight)


def fused_add_rms_norm(x, residual, weight, eps):
    """Returns (new_x, new_residual)."""
    r = to_f64(residual) + to_f64(x)
    return rms_norm(r, weight, eps), r


def layer_norm(x, weight, bias, eps):
    """torch.nn.LayerNorm: biased variance; bias None = none."""
    x = to_f64(x)
    centred = x - x.mean(axis=-1, keepdims=True)
    y = centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps) * to_f64(weight)
    return y if bias is None else y + to_f64(bias)


def fused_add_layer_norm(x, residual, weight, bias, eps):
    """Returns (new_x, new_residual)."""
    r = to_f64(residual) + to_f64(x)
    return layer_norm(r, weight, bias, eps), r


def rotary_embedding(positions, q, k, cos_sin_cache, head_dim, is_neox):
    """Returns rotated (q, k); q (T, Hq*D), k (T, Hkv*D)."""
    cache = to_f64(cos_sin_cache)
    rot = cache.shape[1]
    half = rot // 2
    cos = cache[np.asarray(positions), :half][:, None, :]  # (T, 1, half)
    sin = cache[np.asarray(positions), half:][:, None, :]

    def apply(x):
        T = x.shape[0]
        x = to_f64(x).reshape(T, -1, head_dim).copy()
        if is_neox:
            a, b = x[..., :half].copy(), x[..., half:rot].copy()
            x[..., :half] = a * cos - b * sin
            x[..., half:rot] = b * cos + a * sin
        else:
            a, b = x[..., 0:rot:2].copy(), x[..., 1:rot:2].copy()
            x[..., 0:rot:2] = a * cos - b * sin
            x[..., 1:rot:2] = b * cos + a * sin
        return x.reshape(T, -1)

    return apply(q), apply(k)


def silu_and_mul(x):
    x = to_f64(x)
    inter = x.shape[1] // 2
    g, u = x[:, :inter], x[:, inter:]
    return g / (1.0 + np.exp(-g)) * u


def gelu_tanh(x):
    x = to_f64(x)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def gelu_tanh_and_mul(x):
    x = to_f64(x)
    inter = x.shape[1] // 2
    return gelu_tanh(x[:, :inter]) * x[:, inter:]


def moe_experts(x, gate_up, down, topk_ids, topk_weights, activation):
    """gate_up, down: lists of each expert's (2I, H) and (H, I) float weights (dequantized by the
    caller); a slot whose id lies outside [0, E) adds nothing."""
    x, E = to_f64(x), len(gate_up)
    act = silu_and_mul if activation == "silu" else gelu_tanh_and_mul
    out = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if 0 <= e < E:
                a = act(x[t:t + 1] @ to_f64(gate_up[e]).T)
                out[t] += float(topk_weights[t, j]) * (a @ to_f64(down[e]).T)[0]
    return out


def softcap(x, cap):
    return cap * np.tanh(to_f64(x) / cap)


def scale(x, s):
    return to_f64(x) * s


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    """Returns updated copies of (k_cache, v_cache)."""
    kc, vc = k_cache.copy(), v_cache.copy()
    NB, BS, Hkv, D = kc.shape
    kf, vf = kc.reshape(NB * BS, Hkv, D), vc.reshape(NB * BS, Hkv, D)
    for t, s in enumerate(np.asarray(slot_mapping)):
        if s >= 0:
            kf[s] = k[t]
            vf[s] = v[t]
    return kc, vc


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                    sliding_window, softcap=0.0, sinks=None, attention_chunk=0):
    """Dense per-sequence attention: gather the sequence's K/V through its block table, build the
    causal (and sliding-window) mask explicitly, softmax in float64. softcap > 0: the scaled
    scores s become softcap * tanh(s / softcap) first (Gemma-2). sinks (Hq,): one more logit per
    head in each row's softmax, with no value (GPT-OSS). attention_chunk > 0: a row at position p
    sees no key before p // attention_chunk * attention_chunk (Llama 4)."""
    T, Hq, D = q.shape
    NB, BS, Hkv, _ = k_cache.shape
    kf = to_f64(k_cache).reshape(NB * BS, Hkv, D)
    vf = to_f64(v_cache).reshape(NB * BS, Hkv, D)
    out = np.zeros((T, Hq, D))
    group = Hq // Hkv
    for b in range(len(seq_lens)):
        s0, s1 = int(query_start_loc[b]), int(query_start_loc[b + 1])
        S = int(seq_lens[b])
        if s1 == s0:
            continue
        slots = np.array([block_tables[b, j // BS] * BS + j % BS for j in range(S)])
        K, V = kf[slots], vf[slots]  # (S, Hkv, D)
        rows = np.arange(s0, s1)
        pos = S - (s1 - rows)  # (q_len,)
        j = np.arange(S)
        mask = j[None, :] <= pos[:, None]
        if sliding_window:
            mask &= j[None, :] >= pos[:, None] - sliding_window + 1
        if attention_chunk:
            mask &= j[None, :] >= pos[:, None] // attention_chunk * attention_chunk
        for h in range(Hq):
            g = h // group
            scores = to_f64(q[s0:s1, h]) @ K[:, g].T * scale  # (q_len, S)
            if softcap > 0:
                scores = softcap * np.tanh(scores / softcap)
            scores = np.where(mask, scores, -np.inf)
            if sinks is not None:
                scores = np.concatenate([scores, np.full((s1 - s0, 1), float(sinks[h]))], axis=1)
            scores -= scores.max(axis=1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=1, keepdims=True)
            out[s0:s1, h] = p[:, :S] @ V[:, g]
    return out


def apply_penalties(logits, rows, cols, bias, rep, pres_freq):
    """Returns a float64 copy of logits with each (rows[n], cols[n]) entry, one at a time:
    x + bias, then / rep if positive else * rep, then - pres_freq."""
    out = to_f64(logits).copy()
    for r, c, b, p, f in zip(rows, cols, to_f64(bias), to_f64(rep), to_f64(pres_freq)):
        x = out[r, c] + b
        x = x / p if x > 0 else x * p
        out[r, c] = x - f
    return out


def filter_logits(logits, temperature, top_k, top_p, min_p):
    """Returns float64 filtered logits, row by row with full sorts: x / max(t, 1e-5) (t != 1);
    a threshold from the k-th largest value (0 < k < V), the value of the last token of the
    smallest most-likely set of the top-k survivors whose probability reaches top_p (top_p < 1),
    max + log(min_p) (min_p > 0); values below the largest threshold -> -inf."""
    out = to_f64(logits).copy()
    V = out.shape[1]
    for b, x in enumerate(out):
        t = float(temperature[b])
        if t != 1.0:
            x /= max(t, 1e-5)
        thr = -np.inf
        k = int(top_k[b])
        if 0 < k < V:
            thr = np.sort(x)[::-1][k - 1]
        if float(top_p[b]) < 1.0:
            kept = np.sort(x[x >= thr])[::-1]
            probs = np.exp(kept - kept[0])
            probs /= probs.sum()
            cum = np.cumsum(probs)
            n = int(np.argmax(cum >= float(top_p[b]))) if cum[-1] >= float(top_p[b]) else len(kept) - 1
            thr = max(thr, kept[n])
        if float(min_p[b]) > 0.0:
            thr = max(thr, x.max() + np.log(float(min_p[b])))
        x[x < thr] = -np.inf
    return out


def argmax(logits):
    return np.argmax(np.asarray(logits), axis=-1).astype(np.int64)


def _mulhilo(a, m):
    p = a.astype(np.uint64) * np.uint64(m)
    return p >> np.uint64(32), p & MASK32


def philox4x32_10(counter, key):
    """Philox4x32-10 on arrays: counter (4, ...) and key (2, ...) of uint32-valued ints.
    Pure integer arithmetic in uint64. Returns (4, ...) uint64 arrays of 32-bit words."""
    c = [np.asarray(w, dtype=np.uint64) & MASK32 for w in counter]
    k0, k1 = (np.asarray(w, dtype=np.uint64) & MASK32 for w in key)
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(W0)) & MASK32
            k1 = (k1 + np.uint64(W1)) & MASK32
        hi0, lo0 = _mulhilo(c[0], M0)
        hi1, lo1 = _mulhilo(c[2], M1)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return np.stack(np.broadcast_arrays(*c))


def gumbel_noise(seed, position, V):
    """g[v] = -log(-log(u)), u = (x0 + 0.5) / 2^32, x0 = Philox(counter=(v, pos_lo, pos_hi, 0),
    key=(seed_lo, seed_hi))[0]."""
    seed, pos = int(seed) & 0xFFFFFFFFFFFFFFFF, int(position) & 0xFFFFFFFFFFFFFFFF
    v = np.arange(V, dtype=np.uint64)
    x0 = philox4x32_10((v, pos & 0xFFFFFFFF, pos >> 32, 0), (seed & 0xFFFFFFFF, seed >> 32))[0]
    u = (x0.astype(np.float64) + 0.5) / 2.0 ** 32
    return -np.log(-np.log(u))


def gumbel_sample(logits, seeds, positions):
    logits = np.asarray(logits)
    out = np.zeros(logits.shape[0], dtype=np.int64)
    for b in range(logits.shape[0]):
        row = logits[b].astype(np.float64)
        val = row + gumbel_noise(seeds[b], positions[b], row.shape[0])
        val[row == -np.inf] = -np.inf
        out[b] = int(np.argmax(val))
    return out


# ---- FP8 (OCP e4m3, "e4m3fn"): 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
# S.1111.111 = NaN, largest finite 448, subnormals m * 2^-9.


def e4m3_decode(codes):
    """uint8 codes -> float64 values, from the bit fields."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return sign * mag


def e4m3_encode(x):
    """float64 -> uint8 codes: round to nearest, ties to even; |x| >= 448 (inf too) saturates to
    +-448; NaN -> 0x7f with the sign."""
    x = np.asarray(x, dtype=np.float64)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.int64)
    a = np.abs(x)
    with np.errstate(invalid="ignore"):
        small = a < 2.0 ** -6
        sub = np.rint(np.where(small, a, 0.0) * 512.0)        # 0..8; 8 is 2^-6's code
        mant, exp = np.frexp(np.where(small | ~np.isfinite(a), 1.0, a))  # a = mant * 2^exp
        q = np.rint((2.0 * mant - 1.0) * 8.0)                 # 3 mantissa bits, ties to even
        e = exp - 1 + (q == 8)
        q = np.where(q == 8, 0, q)
        normal = ((e + 7) << 3) | q.astype(np.int64)
        code = np.where(small, sub.astype(np.int64), normal)
        code = np.where(a >= 448.0, 0x7E, code)
        code = np.where(np.isnan(a), 0x7F, code)
    return (code | sign).astype(np.uint8)


def fp8_quotient(x, scale):
    """x / scale as the kernels compute it, in float32 (IEEE division: the float64 quotient of two
    float32 values rounded once to float32 is the correctly rounded float32 quotient)."""
    return (np.asarray(x, np.float64) / np.asarray(scale, np.float64)).astype(np.float32)


def reshape_and_cache_fp8(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """FP8 caches: element (h, d) stored as e4m3(x / scale[h]). Returns updated copies."""
    kc, vc = k_cache.copy(), v_cache.copy()
    NB, BS, Hkv, D = kc.shape
    kf, vf = kc.reshape(NB * BS, Hkv, D), vc.reshape(NB * BS, Hkv, D)
    ks, vs = np.asarray(k_scale)[:, None], np.asarray(v_scale)[:, None]
    for t, s in enumerate(np.asarray(slot_mapping)):
        if s >= 0:
            kf[s] = e4m3_encode(fp8_quotient(k[t], ks))
            vf[s] = e4m3_encode(fp8_quotient(v[t], vs))
    return kc, vc


def paged_attention_fp8(q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens,
                        query_start_loc, scale, sliding_window, softcap=0.0):
    """paged_attention on the caches read back as decode(code) * scale of their KV head."""
    k = e4m3_decode(k_cache) * np.asarray(k_scale, np.float64)[:, None]
    v = e4m3_decode(v_cache) * np.asarray(v_scale, np.float64)[:, None]
    return paged_attention(q, k, v, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                           softcap)


def fp8_block_dequantize(codes, scale, block):
    """(N, K) e4m3 codes with one scale per (bn x bk) block -> float64 weights."""
    bn, bk = block
    w = e4m3_decode(codes)
    s = np.repeat(np.repeat(np.asarray(scale, np.float64), bn, 0), bk, 1)
    return w * s[:w.shape[0], :w.shape[1]]


def fp8_quantize_per_token_group(x, group=128):
    """(M, K) activations -> ((M, K) uint8 e4m3 codes, (M, K // group) float32 scales), as the
    GPU quantizer: per token and group of `group` columns, s = float32(amax) / 448 in float32
    (amax = max |x|, NaN ignored), s = 1 where that is not > 0; codes = e4m3(x / s) with the
    float32 quotient. x holds the activation values (bf16/f16/f32, as float32)."""
    x = np.asarray(x, np.float32)
    M, K = x.shape
    if K % group:
        raise ValueError(f"K={K} is not a multiple of group={group}")
    g = x.reshape(M, K // group, group)
    with np.errstate(invalid="ignore"):
        amax = np.fmax.reduce(np.abs(g), axis=2, initial=np.float32(0.0))
    s = (amax / np.float32(448.0)).astype(np.float32)
    s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    codes = e4m3_encode(fp8_quotient(g, s[:, :, None])).reshape(M, K)
    return codes, s


def apply_token_bitmask(logits, bitmask, rows):
    """logits[b, v] = -inf for b in rows where bit v % 32 of word bitmask[b, v // 32] is 0."""
    out = to_f64(logits).copy()
    words = np.asarray(bitmask).astype(np.int64) & 0xFFFFFFFF     # the 32 bits, unsigned
    V = out.shape[1]
    for b in rows:
        for v in range(V):
            if not (words[b, v // 32] >> (v % 32)) & 1:
                out[b, v] = -np.inf
    return out
