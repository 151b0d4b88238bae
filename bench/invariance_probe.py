"""Which CPU ops break batch invariance: one row computed alone vs. inside larger calls, bit by bit.

    python -m bench.invariance_probe [--batch-invariant] [--isa avx512|avx2|scalar]

For each op of the Llama graph it computes the same row (a token's activations, a query's
attention output) once in the smallest call that holds it and again in the calls a busy server
makes (16 other rows around it, a whole prompt, a chunk of a prompt, a decode step next to a
long prefill) and prints how many of those calls gave a result that differs in any bit, with
the largest difference. Shapes are Qwen2.5-0.5B's projections and head layout (and a
tiny-checkpoint shape with head_dim 24, the portable attention kernel).
"""
from __future__ import annotations

import argparse

import numpy as np

from pyx.cpu_backend import CpuBackend

ROWS = [1, 2, 3, 4, 8, 16, 17, 24, 32, 33, 64, 128, 257]   # token rows of the calls


def _report(name, ref, others):
    """others: label -> array that should equal ref bit for bit."""
    bad = {k: float(np.abs(v - ref).max()) for k, v in others.items()
           if not np.array_equal(v.view(np.uint32), ref.view(np.uint32))}
    verdict = "invariant" if not bad else f"DIFFERS in {len(bad)}/{len(others)}"
    worst = max(bad.values()) if bad else 0.0
    print(f"{name:<44} {verdict:<22} max |diff| {worst:.3g}"
          + (f"  e.g. {', '.join(list(bad)[:4])}" if bad else ""))
    return not bad


def probe_linear(b, rng, dtype, K, N):
    w = (rng.standard_normal((N, K)) * 0.05).astype(dtype)
    bias = rng.standard_normal(N).astype(np.float32)
    x = rng.standard_normal((max(ROWS), K)).astype(np.float32)
    out = np.empty((1, N), np.float32)
    b.linear(x[:1], w, bias, out)
    others = {}
    for T in ROWS[1:]:
        o = np.empty((T, N), np.float32)
        b.linear(x[:T], w, bias, o)
        others[f"T={T}"] = o[:1]
    return _report(f"linear {np.dtype(dtype).name} K={K} N={N}", out, others)


def probe_row_op(b, rng, name, H):
    x = rng.standard_normal((max(ROWS), H)).astype(np.float32)
    wt = rng.standard_normal(H).astype(np.float32)
    def run(T):
        if name == "rms_norm":
            o = np.empty((T, H), np.float32)
            b.rms_norm(x[:T], wt, 1e-6, o)
            return o[:1]
        if name == "fused_add_rms_norm":
            xs, res = x[:T].copy(), x[::-1][:T].copy()
            b.fused_add_rms_norm(xs, res, wt, 1e-6)
            return np.concatenate([xs[:1], res[:1]])
        o = np.empty((T, H // 2), np.float32)
        b.silu_and_mul(x[:T], o)
        return o[:1]
    return _report(f"{name} H={H}", run(1), {f"T={T}": run(T) for T in ROWS[1:]})


class Cache:
    """A paged f32 KV cache holding several sequences' keys, for attention calls."""

    def __init__(self, rng, lens, Hkv, D, BS=16):
        self.BS, self.lens = BS, lens
        nblk = [-(-n // BS) for n in lens]
        NB = sum(nblk) + 1
        self.k = rng.standard_normal((NB, BS, Hkv, D)).astype(np.float32)
        self.v = rng.standard_normal((NB, BS, Hkv, D)).astype(np.float32)
        perm = rng.permutation(np.arange(1, NB)).astype(np.int32)
        self.tables = np.zeros((len(lens), max(nblk)), np.int32)
        start = 0
        for i, n in enumerate(nblk):
            self.tables[i, :n] = perm[start:start + n]
            start += n

    def attend(self, b, q_by_seq, seqs, window=0):
        """q_by_seq[i]: the queries (q_len, Hq, D) of sequence seqs[i] (its last q_len tokens)."""
        q = np.ascontiguousarray(np.concatenate(q_by_seq))
        qsl = np.zeros(len(seqs) + 1, np.int32)
        qsl[1:] = np.cumsum([len(x) for x in q_by_seq])
        out = np.empty_like(q)
        b.paged_attention(out, q, self.k, self.v, np.ascontiguousarray(self.tables[seqs]),
                          np.array([self.lens[s] for s in seqs], np.int32), qsl,
                          q.shape[2] ** -0.5, window)
        return out, qsl


def probe_attention(b, rng, Hq, Hkv, D, window=0):
    """The last query of sequence 0 (context L): a decode row alone, then the same row as the
    last row of a prefill of the whole prompt, of chunks of 16 / 64, and beside 16 other
    sequences (decodes and a long prefill)."""
    L = 700  # > 2 x 256 keys: a decode row alone is split across the threads (split-K)
    lens = [L] + list(rng.integers(20, 400, 16))
    c = Cache(rng, lens, Hkv, D)
    qs = [rng.standard_normal((n, Hq, D)).astype(np.float32) for n in lens]
    ref, _ = c.attend(b, [qs[0][-1:]], [0], window)
    others = {}
    for chunk in (L, 64, 16, 2):
        out, _ = c.attend(b, [qs[0][-chunk:]], [0], window)
        others[f"prefill chunk {chunk}"] = out[-1:]
    others_dec = [qs[s][-1:] for s in range(1, 17)]
    out, _ = c.attend(b, [qs[0][-1:]] + others_dec, list(range(17)), window)
    others["decode + 16 decodes"] = out[:1]
    out, qsl = c.attend(b, [qs[1][-200:], qs[0][-1:]] + others_dec[1:], list(range(1, 2)) + [0]
                        + list(range(2, 17)), window)
    others["decode + prefill 200 + 15 decodes"] = out[qsl[1]:qsl[1] + 1]
    out, qsl = c.attend(b, [qs[0][-33:]] + others_dec, list(range(17)), window)
    others["chunk 33 + 16 decodes"] = out[qsl[1] - 1:qsl[1]]
    tag = f" window {window}" if window else ""
    return _report(f"paged_attention Hq={Hq} Hkv={Hkv} D={D}{tag}", ref, others)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--isa", default=None)
    args = ap.parse_args()
    b = CpuBackend(isa=args.isa, batch_invariant=args.batch_invariant)
    print(f"{b!r}")
    rng = np.random.default_rng(0)
    ok = True
    import ml_dtypes
    for dt in (np.float32, ml_dtypes.bfloat16):
        for K, N in ((896, 1152), (896, 4864), (4864, 896), (96, 512)):
            ok &= probe_linear(b, rng, dt, K, N)
    for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul"):
        ok &= probe_row_op(b, rng, name, 896)
    ok &= probe_attention(b, rng, 14, 2, 64)
    ok &= probe_attention(b, rng, 4, 2, 24)
    ok &= probe_attention(b, rng, 6, 2, 16, window=16)
    print("all invariant" if ok else "some ops are not batch-invariant")


if __name__ == "__main__":
    main()
