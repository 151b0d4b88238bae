"""The gated DeltaNet token mixer of Qwen3-Next and Qwen3.5 (transformers' Qwen3NextGatedDeltaNet
and its torch fallback), over a batch of sequences that each carry a state between steps.

Per token t of a sequence (v heads h; each q/k head serves num_v_heads / num_k_heads v heads):

    [q k v] = silu(causal depthwise conv1d, width K, over in_proj(x)'s q/k/v channels)
    q, k    = l2norm(q), l2norm(k);  q *= head_k_dim ** -0.5
    beta    = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    S_h    *= exp(g_h);   S_h += k (beta_h * (v_h - k^T S_h))^T;   o_h = q^T S_h
    out     = out_proj(rms_norm(o_h) * norm_weight * silu(z_h))

A sequence's state is the convolution's last K - 1 inputs and S (num_v_heads, head_k_dim,
head_v_dim), both float32, kept in rows of two arrays per layer: one row per state slot, then
the snapshot rows (engine/core/hybrid_state.py owns which row is what). The step's plan (duck
typed: engine/core/hybrid_state.StatePlan) says, per sequence, the row its state starts from (its
slot, or a snapshot restoring a cached prefix), whether it starts from zero (its first token),
the slot its state goes back to, and the snapshots to take: the state after the first `offset`
tokens of its chunk, copied into a snapshot row.

The recurrence runs in transformers' chunked form for a sequence's prefill chunk (a triangular
solve and matmuls per 64 rows) and token by token, vectorised over the batch's sequences and
heads, for decodes and short chunks (a decode step is one pass); the convolution is K shifted
multiply-adds over the batch's rows. A decode step on the CPU (one token per sequence, no
snapshot) runs the convolution and the recurrence as two C calls instead
(CpuBackend.gated_delta_conv_decode, gated_delta_recurrent_decode: pyx/gated_delta_kernels.c),
the exponentials between them NumPy's: the NumPy path's bits, without its dozens of small array
operations a layer (most of the step's time there). Like
pyx/layers.pyx, no device code: backend ops and the array API NumPy and CuPy share.
"""
from __future__ import annotations

import numpy as np


def softplus(x, xp=np):
    """torch.nn.functional.softplus (beta 1, threshold 20): x itself above 20."""
    return xp.where(x > 20.0, x, xp.log1p(xp.exp(xp.minimum(x, 20.0))))


def sigmoid(x, xp=np):
    return 1.0 / (1.0 + xp.exp(-x))


def as_float32(a, xp=np):
    """a as float32. bfloat16 (ml_dtypes: CuPy keeps the bits but has no arithmetic for it) is
    widened through its bits, exactly."""
    if a.dtype == np.float32:
        return a
    if a.dtype.name == "bfloat16":
        return (xp.ascontiguousarray(a).view(xp.uint16).astype(xp.uint32) << 16).view(xp.float32)
    return a.astype(xp.float32)


def store(out, x, xp=np):
    """out[...] = x (float32), rounded to out's dtype: bfloat16 to nearest even, through the
    bits (as torch and ml_dtypes round; NaN is not expected here)."""
    if out.dtype == np.float32:
        out[...] = x
    elif out.dtype.name == "bfloat16":
        u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        out.view(xp.uint16)[...] = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(xp.uint16)
    else:
        out[...] = x.astype(out.dtype)


def l2norm(x, xp=np, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis (transformers' l2norm, the FLA library's)."""
    return x / xp.sqrt((x * x).sum(axis=-1, keepdims=True) + eps)


class GatedDeltaNet:
    def __init__(self, backend, in_proj, conv_weight, A_log, dt_bias, norm_weight, out_proj,
                 num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 eps: float):
        """in_proj: placed weight whose output columns are [q k v z b a] (each in head order;
        the model file reorders Qwen3-Next's per-k-head groups); conv_weight (conv_dim, K),
        A_log, dt_bias (num_v_heads,), norm_weight (head_v_dim,): host float32 arrays."""
        self.backend = backend
        self.xp = xp = backend.xp
        self.in_proj, self.out_proj = in_proj, out_proj
        self.nk, self.nv, self.dk, self.dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = conv_weight.shape[1]
        f32 = np.float32
        # (K, conv_dim): tap j multiplies the input j - (K - 1) tokens back... from the window's
        # start: out[t] = sum_j w[j] * window[t + j], window = [K - 1 earlier inputs, chunk]
        self.conv_taps = xp.asarray(np.ascontiguousarray(np.asarray(conv_weight, f32).T))
        self.neg_A = xp.asarray(-np.exp(np.asarray(A_log, f32)))
        self.dt_bias = xp.asarray(np.asarray(dt_bias, f32))
        self.norm_weight = xp.asarray(np.asarray(norm_weight, f32))
        self.eps = float(eps)
        # the CPU backend's decode kernels (False: the NumPy path alone)
        self.use_decode_kernels = hasattr(backend, "gated_delta_recurrent_decode")

    def state_shapes(self, num_rows: int) -> tuple[tuple, tuple]:
        """(conv state, recurrent state) array shapes for num_rows rows."""
        return ((num_rows, self.kernel - 1, self.conv_dim),
                (num_rows, self.nv, self.dk, self.dv))

    def forward(self, batch, x, out, conv_state, ssm_state, ws):
        """x (T, H) -> out (T, H); conv_state, ssm_state: this layer's state rows (updated)."""
        b, xp = self.backend, self.xp
        plan = batch.state_plan
        if plan is None:
            raise ValueError("a linear-attention layer needs the step's state plan "
                             "(ForwardBatch.state_plan): which state slot each sequence uses")
        T = x.shape[0]
        Kd, Vd, C, Hv = self.key_dim, self.value_dim, self.conv_dim, self.nv
        N = C + Vd + 2 * Hv                 # the projection, in float32 on any backend
        proj = (ws.get("gdn_proj", T, N) if b.act_dtype == np.float32
                else xp.empty((T, N), xp.float32))
        b.linear(x, self.in_proj, None, proj)
        z = proj[:, C:C + Vd].reshape(T, Hv, self.dv)
        beta = sigmoid(proj[:, C + Vd:C + Vd + Hv], xp)
        g = self.neg_A * softplus(proj[:, C + Vd + Hv:] + self.dt_bias, xp)
        if self._decode_kernels(plan, T):
            self._decode(proj, z, beta, g, conv_state, ssm_state, plan, ws, out)
            return
        mixed = self._conv(proj[:, :C], conv_state, plan)               # (T, C) f32
        q = l2norm(mixed[:, :Kd].reshape(T, self.nk, self.dk), xp) * np.float32(self.dk ** -0.5)
        k = l2norm(mixed[:, Kd:2 * Kd].reshape(T, self.nk, self.dk), xp)
        v = mixed[:, 2 * Kd:].reshape(T, Hv, self.dv)
        if Hv != self.nk:                    # grouped: q/k head j serves v heads j*r .. j*r+r-1
            q = xp.repeat(q, Hv // self.nk, axis=1)
            k = xp.repeat(k, Hv // self.nk, axis=1)
        o = self._recurrence(q, k, v, g, beta, ssm_state, plan)         # (T, Hv, dv) f32
        # the gated RMSNorm: norm first, then the weight, then silu(z)
        o = o / xp.sqrt((o * o).mean(axis=-1, keepdims=True) + self.eps)
        o = o * self.norm_weight * (z * sigmoid(z, xp))
        core = ws.get("gdn_core", T, Vd)
        store(core, o.reshape(T, Vd), xp)
        b.linear(core, self.out_proj, None, out)

    def _decode_kernels(self, plan, T: int) -> bool:
        """Whether the backend's gated DeltaNet decode kernels (the NumPy path's dozens of small
        array operations a layer in two C calls, with the same bits) can take this step: a CPU
        backend's float32 activations, one token per sequence, no snapshot to take, and no
        sequence starting from a row another one writes."""
        if (not self.use_decode_kernels or T != plan.num_seqs or plan.saves
                or self.backend.act_dtype != np.float32 or plan.lengths.max(initial=0) != 1):
            return False
        src, slots = plan.src_rows, plan.slots
        if src.dtype != np.int64 or slots.dtype != np.int64:
            return False
        return bool(np.array_equal(src, slots) or ((src == slots) | ~np.isin(src, slots)).all())

    def _decode(self, proj, z, beta, g, conv_state, ssm_state, plan, ws, out):
        """A decode step's conv, delta rule and gated norm: the C calls do what _conv and
        _recurrence do between the exponentials, which stay NumPy's (silu, the decay, the
        output gate), as in forward."""
        b, T, C, Vd = self.backend, proj.shape[0], self.conv_dim, self.value_dim
        fresh = np.ascontiguousarray(plan.fresh).view(np.uint8)
        acc = ws.get("gdn_conv", T, C)
        b.gated_delta_conv_decode(proj, self.conv_taps, conv_state, plan.src_rows, plan.slots,
                                  fresh, acc)
        mixed = acc * sigmoid(acc)
        gate = (z * sigmoid(z)).reshape(T, Vd)
        core = ws.get("gdn_core", T, Vd)
        b.gated_delta_recurrent_decode(mixed, np.exp(g), np.ascontiguousarray(beta), gate,
                                       self.norm_weight, ssm_state, plan.src_rows, plan.slots,
                                       fresh, core, self.nk, self.eps)
        b.linear(core, self.out_proj, None, out)

    def _conv(self, mixed, conv_state, plan):
        """silu(causal conv1d) of each sequence's rows after its K - 1 earlier inputs (its
        state, zeros for a fresh one); the state rows take each sequence's last K - 1 inputs,
        the snapshot rows the K - 1 before their offset."""
        xp = self.xp
        K1 = self.kernel - 1
        T, C = mixed.shape
        seq_of_row, B = plan.seq_of_row, plan.num_seqs
        # window: each sequence's K - 1 state rows, then its T_i rows
        window = xp.empty((T + B * K1, C), xp.float32)
        row_at = plan.asarray(seq_of_row * K1 + np.arange(T))           # row t: t + i * K1 + K1
        if K1:
            state_at = plan.asarray((plan.starts[:-1] + np.arange(B) * K1)[:, None]
                                   + np.arange(K1))                  # (B, K1)
            start = conv_state[plan.asarray(plan.src_rows)]
            if plan.any_fresh:
                start[plan.asarray(plan.fresh)] = 0.0
            window[state_at] = start
        window[row_at + K1] = mixed
        acc = window[row_at] * self.conv_taps[0]
        for j in range(1, self.kernel):
            acc += window[row_at + j] * self.conv_taps[j]
        if K1:
            ends = plan.starts[1:] + np.arange(1, B + 1) * K1        # one past each segment
            last = plan.asarray((ends - K1)[:, None] + np.arange(K1))
            for i, offset, row in plan.saves:
                at = int(plan.starts[i]) + i * K1 + offset
                conv_state[row] = window[at:at + K1]
            conv_state[plan.asarray(plan.slots)] = window[last]
        return acc * sigmoid(acc, xp)

    def _recurrence(self, q, k, v, g, beta, ssm_state, plan):
        """The gated delta rule over each sequence's rows from its starting state; the last
        state goes back to its slot, the snapshots' to their rows. Sequences with at least
        CHUNKED_MIN_ROWS rows (prefill chunks) take the chunked form one by one, the others
        (decodes, short chunks) a token loop over all of them at once."""
        xp = self.xp
        T = q.shape[0]
        S = ssm_state[plan.asarray(plan.src_rows)]                      # (B, Hv, dk, dv)
        if plan.any_fresh:
            S[plan.asarray(plan.fresh)] = 0.0
        out = xp.empty((T, self.nv, self.dv), xp.float32)
        saves_at = plan.saves_by_offset()
        lengths = plan.lengths.copy()
        for i in np.flatnonzero(lengths >= CHUNKED_MIN_ROWS):
            start, n = int(plan.starts[i]), int(lengths[i])
            cuts = sorted({0, n} | {offset for j, offset, _ in plan.saves if j == i})
            Si = S[i]
            for a, b in zip(cuts[:-1], cuts[1:]):
                rows = slice(start + a, start + b)
                out[rows], Si = delta_rule_chunked(q[rows], k[rows], v[rows], g[rows],
                                                   beta[rows], Si, xp)
                for j, row in saves_at.get(b, ()):
                    if j == i:
                        ssm_state[row] = Si
            S[i] = Si
            lengths[i] = 0                    # done: not in the token loop
        decay = xp.exp(g)                                              # (T, Hv)
        for t in range(int(lengths.max(initial=0))):
            seqs = np.flatnonzero(lengths > t)    # the sequences with a row t
            rows = plan.starts[:-1][seqs] + t
            if len(seqs) == plan.num_seqs:
                idx_s, idx_r = slice(None), plan.asarray(rows)
            else:
                idx_s, idx_r = plan.asarray(seqs), plan.asarray(rows)
            St = S[idx_s] * decay[idx_r][:, :, None, None]
            kt = k[idx_r]
            kv_mem = xp.einsum("bhkv,bhk->bhv", St, kt)
            delta = (v[idx_r] - kv_mem) * beta[idx_r][:, :, None]
            St += kt[:, :, :, None] * delta[:, :, None, :]
            out[idx_r] = xp.einsum("bhkv,bhk->bhv", St, q[idx_r])
            S[idx_s] = St
            for i, row in saves_at.get(t + 1, ()):
                if lengths[i] > t:
                    ssm_state[row] = S[i]
        ssm_state[plan.asarray(plan.slots)] = S
        return out


# A sequence with this many rows in a step goes through the chunked form.
CHUNKED_MIN_ROWS = 32
CHUNK = 64


def delta_rule_chunked(q, k, v, g, beta, S, xp=np, chunk: int = CHUNK):
    """The gated delta rule over one sequence's n rows from state S, in chunks of `chunk` rows
    as transformers' torch_chunk_gated_delta_rule computes it (the WY/UT form: within a chunk the
    delta updates are one triangular solve and a few matmuls; a loop carries S across chunks).
    q (n, Hv, dk) normalised and scaled, k (n, Hv, dk) normalised, v (n, Hv, dv), g and beta
    (n, Hv), S (Hv, dk, dv) float32. Returns (out (n, Hv, dv), the state after the n rows).
    Every operand is laid out (chunk, head, row, ...) and contiguous: NumPy's matmul on strided
    operands leaves BLAS for a loop hundreds of times slower."""
    n, Hv, dk = k.shape
    dv = v.shape[2]
    pad = (-n) % chunk
    N = (n + pad) // chunk

    def chunks_first(x):           # (n, Hv, ...) -> (N, Hv, chunk, ...), zero-padded
        if pad:
            x = xp.concatenate([x, xp.zeros((pad,) + x.shape[1:], x.dtype)])
        x = x.reshape((N, chunk) + x.shape[1:])
        return xp.ascontiguousarray(xp.swapaxes(x, 1, 2))

    def transposed(x):             # (..., a, b) -> contiguous (..., b, a)
        return xp.ascontiguousarray(xp.swapaxes(x, -1, -2))

    q, k, v, g, beta = (chunks_first(x) for x in (q, k, v, g, beta))
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    cum = xp.cumsum(g, axis=-1)                                        # (N, Hv, C)
    upper = xp.triu(xp.ones((chunk, chunk), bool), 1)
    pairwise = xp.exp(xp.where(upper, -xp.inf, cum[..., :, None] - cum[..., None, :]))
    strictly_lower = xp.tril(xp.ones((chunk, chunk), xp.float32), -1)
    kT = transposed(k)
    # (I + strictly lower part of (k_beta k^T) * decay) x = rhs: the unit-triangular system
    system = xp.eye(chunk, dtype=xp.float32) + (k_beta @ kT) * pairwise * strictly_lower
    new_values = xp.linalg.solve(system, v_beta)
    k_cumdecay = xp.linalg.solve(system, k_beta * xp.exp(cum)[..., None])
    intra = (q @ kT) * pairwise
    q = q * xp.exp(cum)[..., None]
    kT = transposed(k * xp.exp(cum[..., -1:] - cum)[..., None])       # (N, Hv, dk, C)
    chunk_decay = xp.exp(cum[..., -1])[..., None, None]                # (N, Hv, 1, 1)
    out = xp.empty((N, Hv, chunk, dv), xp.float32)
    S = xp.ascontiguousarray(S, dtype=xp.float32)
    for c in range(N):
        v_new = new_values[c] - k_cumdecay[c] @ S
        out[c] = q[c] @ S + intra[c] @ v_new
        S = S * chunk_decay[c] + kT[c] @ v_new
    out = xp.swapaxes(out, 1, 2).reshape(N * chunk, Hv, dv)[:n]
    return xp.ascontiguousarray(out), S
