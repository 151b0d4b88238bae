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


def rms_norm(x, weight, eps):
    x = to_f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * to_f64(weight)


def fused_add_rms_norm(x, residual, weight, eps):
    """Returns (new_x, new_residual)."""
    r = to_f64(residual) + to_f64(x)
    return rms_norm(r, weight, eps), r


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
                    sliding_window):
    """Dense per-sequence attention: gather the sequence's K/V through its block table, build the
    causal (and sliding-window) mask explicitly, softmax in float64."""
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
        for h in range(Hq):
            g = h // group
            scores = to_f64(q[s0:s1, h]) @ K[:, g].T * scale  # (q_len, S)
            scores = np.where(mask, scores, -np.inf)
            scores -= scores.max(axis=1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=1, keepdims=True)
            out[s0:s1, h] = p @ V[:, g]
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
