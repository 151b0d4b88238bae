"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash), written once against the op table.

Per token the layer caches one row of L + R values: the latent c = kv_a_layernorm(first L outputs
of kv_a_proj_with_mqa) and the rotated key part k_pe (its last R outputs), shared by all heads.
Head h's key is [W_UK_h c, k_pe] and its value W_UV_h c, where kv_b_proj stacks each head's
W_UK_h (N, L) and W_UV_h (V, L). The cache is one "KV head" of L + R values, paged like any other
(NB, BS, 1, L + R), and written once per token (reshape_and_cache with the latent as both K and V
of one cache array: the pool keeps one array per layer).

Two ways to attend, chosen per sequence:
- decode (one new token): the absorbed form. q_nope_h . W_UK_h c = (W_UK_h^T q_nope_h) . c, so each
  head's query moves into latent space (batched_linear with the W_UK stack), attention runs over
  the latent rows themselves (mla_decode_attention: one cached head for all Hq query heads, head
  dim L + R), and its latent output leaves through W_UV (batched_linear) to the head's V values.
  A decode step reads L + R values per cached token, not Hq * (N + R + V).
- prefill (a prompt chunk, or a verify step's rows): the plain form, as transformers computes it.
  The sequence's cached blocks are gathered, their latents up-projected by kv_b_proj into each
  head's K and V, and paged_attention runs over those (a temporary pool of the gathered blocks in
  order, one per position as the originals). Heads are padded with zeros to D = max(N + R, V)
  for queries, keys and values alike, which changes no score and no value.
Both forms are exact in real arithmetic; test_models_mla.py checks that they agree in float32.

Like pyx/layers.pyx: backend ops and the array API NumPy and CuPy share, no device code.
"""
from __future__ import annotations

import numpy as np


def split_kv_b(kv_b: np.ndarray, num_heads: int, nope: int, v_dim: int):
    """kv_b_proj (Hq * (N + V), L) -> (W_UK^T stack (Hq, L, N), W_UV stack (Hq, V, L)): the
    weights batched_linear takes to absorb queries into, and bring outputs out of, latent space."""
    L = kv_b.shape[1]
    per_head = np.asarray(kv_b).reshape(num_heads, nope + v_dim, L)
    uk_t = np.ascontiguousarray(per_head[:, :nope, :].transpose(0, 2, 1))
    uv = np.ascontiguousarray(per_head[:, nope:, :])
    return uk_t, uv


class MlaAttention:
    def __init__(self, backend, mla, num_heads: int, a_weight, a_bias, q_a_norm, q_b, q_proj,
                 kv_a_norm, kv_b, uk_t, uv, o_weight, o_bias, cos_sin_cache, is_neox: bool,
                 eps: float):
        """mla: an engine.models.deepseek_config.MlaConfig. Placed weights:
        a_weight (A, H) with a_bias (A,) or None: q_a_proj's rows (when q_lora_rank) then
        kv_a_proj_with_mqa's (L + R), one GEMM for both; q_a_norm (q_lora_rank,) and q_b
        (Hq * (N + R), q_lora_rank), or q_proj (Hq * (N + R), H) without q_lora_rank (then
        q_a_norm and q_b are None); kv_a_norm (L,); kv_b (Hq * (N + V), L) and its split_kv_b
        stacks uk_t (Hq, L, N), uv (Hq, V, L); o_weight (H, Hq * V), o_bias (H,) or None."""
        self.backend, self.xp = backend, backend.xp
        self.num_heads = num_heads
        self.q_lora = mla.q_lora_rank or 0
        self.L, self.R = mla.kv_lora_rank, mla.qk_rope_head_dim
        self.N, self.V = mla.qk_nope_head_dim, mla.v_head_dim
        self.D = max(self.N + self.R, self.V)        # the plain path's padded head size
        self.scale = mla.softmax_scale
        self.a_weight, self.a_bias = a_weight, a_bias
        self.q_a_norm, self.q_b, self.q_proj = q_a_norm, q_b, q_proj
        self.kv_a_norm, self.kv_b, self.uk_t, self.uv = kv_a_norm, kv_b, uk_t, uv
        self.o_weight, self.o_bias = o_weight, o_bias
        self.cos_sin_cache, self.is_neox, self.eps = cos_sin_cache, is_neox, eps

    def forward(self, batch, x, out, cache, v_cache, ws):
        """x (T, H) -> out (T, H); cache (NB, BS, 1, L + R) (v_cache is the same array)."""
        b, xp = self.backend, self.xp
        T = x.shape[0]
        Hq, L, R, N = self.num_heads, self.L, self.R, self.N
        qs = Hq * (N + R)
        a = ws.get("mla_a", T, self.a_weight.shape[0])
        b.linear(x, self.a_weight, self.a_bias, a)
        q = ws.get("mla_q", T, qs)
        if self.q_lora:
            q_a = ws.get("mla_q_a", T, self.q_lora)
            q_a_normed = ws.get("mla_q_a_normed", T, self.q_lora)
            xp.copyto(q_a, a[:, :self.q_lora])
            b.rms_norm(q_a, self.q_a_norm, self.eps, q_a_normed)
            b.linear(q_a_normed, self.q_b, None, q)
        else:
            b.linear(x, self.q_proj, None, q)
        kv_a = a[:, self.q_lora:]
        # the cached row: [kv_a_layernorm(latent), rotated k_pe]
        latent_raw = ws.get("mla_latent_raw", T, L)
        latent_normed = ws.get("mla_latent_normed", T, L)
        xp.copyto(latent_raw, kv_a[:, :L])
        b.rms_norm(latent_raw, self.kv_a_norm, self.eps, latent_normed)
        q3 = q.reshape(T, Hq, N + R)
        q_pe = ws.get("mla_q_pe", T, Hq * R)
        k_pe = ws.get("mla_k_pe", T, R)
        xp.copyto(q_pe.reshape(T, Hq, R), q3[:, :, N:])
        xp.copyto(k_pe, kv_a[:, L:])
        b.rotary_embedding(batch.positions, q_pe, k_pe, self.cos_sin_cache, R, self.is_neox)
        xp.copyto(q3[:, :, N:], q_pe.reshape(T, Hq, R))
        row = ws.get("mla_row", T, L + R)
        xp.copyto(row[:, :L], latent_normed)
        xp.copyto(row[:, L:], k_pe)
        row3 = row.reshape(T, 1, L + R)
        b.reshape_and_cache(row3, row3, cache, cache, batch.slot_mapping)

        attn = ws.get("mla_attn", T, Hq * self.V)
        B = batch.num_seqs
        if T == B:                  # every sequence decodes one token (no host round trip)
            self._absorbed(q3, cache, batch.block_tables, batch.seq_lens, attn, ws)
        else:
            self._mixed(batch, q3, cache, attn, ws)
        b.linear(attn, self.o_weight, self.o_bias, out)

    def _mixed(self, batch, q3, cache, attn, ws):
        """A batch with prompt chunks: its one-token sequences by the absorbed form, the rest by
        the plain one, each on its own rows."""
        xp = self.xp
        qsl = np.asarray(self.backend.to_host(batch.query_start_loc))
        lens = np.diff(qsl)
        decode = np.flatnonzero(lens == 1)
        prefill = np.flatnonzero(lens > 1)
        seq_lens = np.asarray(self.backend.to_host(batch.seq_lens))
        if len(decode):
            rows = self.backend.asarray(qsl[decode].astype(np.int64))
            sub_attn = ws.get("mla_attn_decode", len(decode), attn.shape[1])
            dev = self.backend.asarray(decode.astype(np.int64))
            self._absorbed(xp.ascontiguousarray(q3[rows]), cache,
                           xp.ascontiguousarray(batch.block_tables[dev]),
                           xp.ascontiguousarray(batch.seq_lens[dev]), sub_attn, ws)
            attn[rows] = sub_attn
        if len(prefill) == 0:
            return
        if len(decode) == 0:
            self._plain(q3, cache, batch.block_tables, seq_lens, qsl, attn, ws)
            return
        rows_np = np.concatenate([np.arange(qsl[s], qsl[s + 1]) for s in prefill])
        rows = self.backend.asarray(rows_np.astype(np.int64))
        sub_qsl = np.zeros(len(prefill) + 1, np.int32)
        np.cumsum(lens[prefill], out=sub_qsl[1:])
        sub_attn = ws.get("mla_attn_prefill", len(rows_np), attn.shape[1])
        tables = xp.ascontiguousarray(
            batch.block_tables[self.backend.asarray(prefill.astype(np.int64))])
        self._plain(xp.ascontiguousarray(q3[rows]), cache, tables, seq_lens[prefill], sub_qsl,
                    sub_attn, ws)
        attn[rows] = sub_attn

    def _absorbed(self, q3, cache, block_tables, seq_lens, attn, ws):
        """One query row per sequence: q3 (B, Hq, N + R) -> attn (B, Hq * V)."""
        b, xp = self.backend, self.xp
        B = q3.shape[0]
        Hq, L, R, N, V = self.num_heads, self.L, self.R, self.N, self.V
        q_nope = ws.get("mla_q_nope", Hq * B, N).reshape(Hq, B, N)
        xp.copyto(q_nope, q3[:, :, :N].transpose(1, 0, 2))
        q_latent = ws.get("mla_q_latent", Hq * B, L).reshape(Hq, B, L)
        b.batched_linear(q_nope, self.uk_t, q_latent)
        q_abs = ws.get("mla_q_abs", B * Hq, L + R).reshape(B, Hq, L + R)
        xp.copyto(q_abs[:, :, :L], q_latent.transpose(1, 0, 2))
        xp.copyto(q_abs[:, :, L:], q3[:, :, N:])
        o_latent = ws.get("mla_o_latent", B * Hq, L).reshape(B, Hq, L)
        b.mla_decode_attention(o_latent, q_abs, cache, block_tables, seq_lens, self.scale)
        o_heads = ws.get("mla_o_heads", Hq * B, L).reshape(Hq, B, L)
        xp.copyto(o_heads, o_latent.transpose(1, 0, 2))
        o_v = ws.get("mla_o_v", Hq * B, V).reshape(Hq, B, V)
        b.batched_linear(o_heads, self.uv, o_v)
        xp.copyto(attn.reshape(B, Hq, V), o_v.transpose(1, 0, 2))

    def _plain(self, q3, cache, block_tables, seq_lens, qsl, attn, ws):
        """Prompt rows: q3 (T, Hq, N + R) of sequences with host seq_lens (B,) and query starts
        qsl (B + 1,) -> attn (T, Hq * V), over K and V up-projected from the cached latents."""
        b, xp = self.backend, self.xp
        T = q3.shape[0]
        Hq, L, R, N, V, D = self.num_heads, self.L, self.R, self.N, self.V, self.D
        BS = cache.shape[1]
        # the sequences' blocks, gathered in order into a temporary pool
        nblocks = (seq_lens.astype(np.int64) + BS - 1) // BS
        starts = np.concatenate([[0], np.cumsum(nblocks)])
        seq_of = np.repeat(np.arange(len(nblocks)), nblocks)
        col = np.arange(int(starts[-1])) - starts[seq_of]
        ids = block_tables[b.asarray(seq_of), b.asarray(col)]
        rows = cache[ids].reshape(-1, L + R)                       # (NBt * BS, L + R)
        n = rows.shape[0]
        latent = ws.get("mla_ctx_latent", n, L)
        xp.copyto(latent, rows[:, :L])
        kv = ws.get("mla_ctx_kv", n, Hq * (N + V))
        b.linear(latent, self.kv_b, None, kv)
        kv3 = kv.reshape(n, Hq, N + V)
        # zeroed by allocation where the heads are padded (a prompt step: not graph-captured)
        k = xp.zeros((n // BS, BS, Hq, D), kv.dtype)
        v = xp.zeros((n // BS, BS, Hq, D), kv.dtype)
        k4, v4 = k.reshape(n, Hq, D), v.reshape(n, Hq, D)
        xp.copyto(k4[:, :, :N], kv3[:, :, :N])
        xp.copyto(k4[:, :, N:N + R], xp.broadcast_to(rows[:, None, L:], (n, Hq, R)))
        xp.copyto(v4[:, :, :V], kv3[:, :, N:])
        q = xp.zeros((T, Hq, D), kv.dtype)
        xp.copyto(q[:, :, :N + R], q3)
        tables = np.zeros((len(nblocks), max(int(nblocks.max()), 1)), np.int32)
        for s in range(len(nblocks)):
            tables[s, :nblocks[s]] = np.arange(starts[s], starts[s + 1])
        o = ws.get("mla_o_plain", T, Hq * D).reshape(T, Hq, D)
        b.paged_attention(o, q, k, v, b.asarray(tables), b.asarray(seq_lens.astype(np.int32)),
                          b.asarray(np.asarray(qsl, np.int32)), self.scale, 0)
        xp.copyto(attn.reshape(T, Hq, V), o[:, :, :V])
