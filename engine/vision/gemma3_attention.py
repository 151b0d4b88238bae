"""Gemma 3's attention mask quirk in the paged engine: during prefill an image's tokens attend to
each other both ways (transformers' token_type_ids mask, create_masks_for_vision_model): a
query at position p of an image spanning [start, end) sees
  full-attention layers:    keys k <= p, or start <= k < end      = keys [0, end)
  sliding layers (window W): that, and k > p - W                  = keys (p - W, end)
while text tokens, and every token once decoding, stay causal (transformers passes the
token types to the prefill forward only).

The paged attention op is causal, so the layers run it as for any model and then this overlay
recomputes the image rows (Attention.mask_overlay, pyx/layers.pyx): each image run's queries
against the sequence's keys, gathered from the paged cache, up to the image's end. That needs
the K/V of the image's last token in the cache, that is, in the same step: an image's tokens
are never split across prefill chunks (engine/vision/budget.py's whole_images; a prefix-cache
hit may end inside an image, whose cached tokens were computed with the whole image, so the
chunk then starts inside it and runs to its end).

The overlay is written over the array module (NumPy, or CuPy on CUDA: cuBLAS batched GEMMs and
elementwise kernels) and computes in float32 whatever the cache's and activations' dtype
(bf16 rows widened through their bits, the output rounded back), so one code serves both
backends. On CUDA the full-attention layers take the paged op instead (memory bounded at any
context length): each image row as a one-row sequence ending at the image's end sees keys
[0, end), the image's mask. A sliding layer's keys (p - W, end) are not the causal window of any
one position, and the paged op gives no softmax statistics to merge a second key range into:
those rows stay on the float32 path, over at most W + the image's length keys. The CPU keeps
the float32 path for every layer (its outputs unchanged).

Gemma3VisionRunner is the vision runner for such a model: positions stay plain (no M-RoPE);
it records each image run of the step (its batch rows, first position and the image's end) for
the overlay, and the rows whose embeddings the vision tower gives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.vision import act_arrays
from engine.vision.runner import VisionRunner
from pyx.gated_delta_net import as_float32, store


@dataclass(slots=True)
class ImageSpan:
    seq: int          # the sequence's row in the batch's block tables
    row: int          # its first batch row
    first: int        # that row's position in the sequence
    end: int          # the image's end position (exclusive): the last row's position + 1


@dataclass(slots=True)
class Gemma3VisionBatch:
    rows: np.ndarray              # (K,) int32: the batch rows of image tokens
    runs: list = field(default_factory=list)   # (PlacedImage, first, end) per run, row order
    spans: list = field(default_factory=list)  # ImageSpan per run
    embeds: object = None         # (K, hidden) f32 on the backend, set by encode()


class Gemma3VisionRunner(VisionRunner):
    def prepare(self, sched, batch) -> None:
        """batch.vision when the step has image rows; positions are left as they are."""
        qsl = batch.query_start_loc
        rows, runs, spans = [], [], []
        for b, (seq, a, n) in enumerate(zip(sched.seqs, sched.num_computed,
                                            sched.num_new_tokens)):
            mm = getattr(seq, "mm", None)
            if mm is None:
                continue
            q0 = int(qsl[b])
            for i in mm.overlapping(a, a + n):
                im = mm.images[i]
                first, end = max(a, im.offset), min(a + n, im.end)
                if end != im.end:
                    raise ValueError(f"a prefill chunk ends inside image {i} (tokens "
                                     f"{im.offset}-{im.end}, chunk {a}-{a + n}): Gemma 3's "
                                     "image tokens attend to each other, so an image must "
                                     "finish in the chunk that reaches it")
                rows.append(np.arange(first - a, end - a) + q0)
                runs.append((im, first - im.offset, end - im.offset))
                spans.append(ImageSpan(b, q0 + first - a, first, end))
        if rows:
            batch.vision = Gemma3VisionBatch(np.concatenate(rows).astype(np.int32), runs, spans)


class ImageBlockAttention:
    """The overlay (module docstring), shared by the model's attention layers."""

    def __init__(self, xp, paged_backend=None):
        """paged_backend: a backend whose paged attention op takes the full-attention layers'
        image rows (None: every layer in float32 over xp)."""
        self.xp = xp
        self.paged = paged_backend

    def apply(self, batch, q, attn, k_cache, v_cache, scale: float, sliding_window: int,
              softcap: float) -> None:
        """In place: the image rows of attn (T, Hq * D) recomputed from q (T, Hq * D, rotated)
        and the paged caches (blocks, block size, Hkv, D) with the image mask."""
        vb = batch.vision
        if vb is None or not getattr(vb, "spans", None):
            return
        xp = self.xp
        if k_cache.dtype.itemsize == 1:
            raise ValueError("Gemma 3's image tokens need a float KV cache (not FP8): their "
                             "bidirectional attention reads it back")
        _, bs, Hkv, D = k_cache.shape
        T = q.shape[0]
        Hq = q.shape[1] // D
        group = Hq // Hkv
        q3 = q.reshape(T, Hq, D)
        out3 = attn.reshape(T, Hq, D)
        tables = batch.block_tables
        if sliding_window <= 0 and self.paged is not None:
            for s in vb.spans:
                self._paged_rows(tables, s, q3, out3, k_cache, v_cache, scale, softcap)
            return
        # rows gathered through their bits (CuPy has no bfloat16 kernels), computed in float32
        k_bits, v_bits = act_arrays.bits(k_cache), act_arrays.bits(v_cache)
        for s in vb.spans:
            n = s.end - s.first
            lo = max(0, s.first - sliding_window + 1) if sliding_window > 0 else 0
            blocks = tables[s.seq, lo // bs:(s.end - 1) // bs + 1]
            skip = lo - (lo // bs) * bs
            L = s.end - lo
            # per KV head, its group's queries (group * n rows) against its keys: batched GEMMs
            keys = as_float32(k_bits[blocks].view(k_cache.dtype), xp).reshape(-1, Hkv, D)[
                skip:skip + L].transpose(1, 2, 0)
            values = as_float32(v_bits[blocks].view(v_cache.dtype), xp).reshape(-1, Hkv, D)[
                skip:skip + L].transpose(1, 0, 2)
            qs = as_float32(act_arrays.contiguous(xp, q3[s.row:s.row + n]), xp).reshape(
                n, Hkv, group, D).transpose(1, 2, 0, 3)
            scores = xp.matmul(qs.reshape(Hkv, group * n, D), keys).reshape(Hkv, group, n, L)
            scores *= np.float32(scale)
            if softcap > 0:
                scores = np.float32(softcap) * xp.tanh(scores / np.float32(softcap))
            if sliding_window > 0:         # key j visible to the query at p when j > p - W
                p = xp.arange(s.first, s.end)[:, None]
                j = xp.arange(lo, s.end)[None, :]
                scores = xp.where(j > p - sliding_window, scores, np.float32(-np.inf))
            scores -= scores.max(axis=-1, keepdims=True)
            weights = xp.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            o = xp.matmul(weights.reshape(Hkv, group * n, L), values)      # (Hkv, group*n, D)
            rows = o.reshape(Hkv, group, n, D).transpose(2, 0, 1, 3).reshape(n, Hq, D)
            store(out3[s.row:s.row + n], rows, xp)

    def _paged_rows(self, tables, s, q3, out3, k_cache, v_cache, scale, softcap) -> None:
        """A full-attention layer's image rows through the paged op: each query row as a
        one-row sequence ending at the image's end, so its causal keys are [0, end)."""
        xp, n = self.xp, s.end - s.first
        rows = slice(s.row, s.row + n)
        out = xp.empty((n,) + out3.shape[1:], out3.dtype)
        self.paged.paged_attention(
            out, act_arrays.contiguous(xp, q3[rows]), k_cache, v_cache,
            xp.ascontiguousarray(xp.repeat(tables[s.seq:s.seq + 1], n, axis=0)),
            xp.full((n,), s.end, np.int32), xp.arange(n + 1, dtype=np.int32), scale, 0,
            softcap=softcap)
        act_arrays.copy(xp, out3[rows], out)
