"""Make the K-quant fixtures in tests/data/quant_k/ with llama.cpp's own quantizer.

    python tests/data/make_quant_k_fixtures.py

Needs llama-cpp-python 0.3.36 installed (built from source; its ggml is plain x86-64 code, so the
reference quantizers run without FMA contraction, as ours do). Through ctypes on its
libggml-base.so it calls `ggml_quantize_chunk(type, src, dst, 0, rows, n_per_row, NULL)` for
Q2_K..Q6_K (with no importance matrix that is quantize_row_*_ref) and `quantize_row_q8_K_ref`
for Q8_K (ggml_quantize_chunk does not take the activation type), and writes one
`<type>.npz` per type: `blocks_<recipe>` (rows, row_bytes) uint8 for every input recipe below.
(For an all-zero super-block ggml's Q8_K leaves bsums unwritten; the output buffer here starts
zeroed, which is what our quantizer writes.)

The inputs are not stored: `make_inputs(recipe)` rebuilds them bit-exactly from PCG64's raw
64-bit stream (stable by NumPy's compatibility policy) with only correctly rounded float32
arithmetic (+ - * /), no libm, so every platform gets the same floats. Their sha256 is stored
(`sha256_<recipe>` in inputs.npz) and the test checks it before comparing blocks.

Only this script imports llama_cpp; the test suite never does.
"""
from __future__ import annotations

import ctypes
import hashlib
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "quant_k")

ROWS, K = 16, 768          # 3 super-blocks per row
TYPES = {"q2_K": 10, "q3_K": 11, "q4_K": 12, "q5_K": 13, "q6_K": 14, "q8_K": 15}  # ggml ids
RECIPES = ("normal", "outliers", "offset", "heavy", "edge", "row_scales")


def _uniform(rng: np.random.Generator, n: int) -> np.ndarray:
    """n float32 uniforms in [0, 1): the top 24 bits of raw PCG64 draws, times 2^-24 (exact)."""
    raw = rng.bit_generator.random_raw(n)
    return (raw >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)


def _normalish(rng: np.random.Generator, n: int) -> np.ndarray:
    """Irwin-Hall(4) centred: bell-shaped, unit-ish spread, exact float32 sums."""
    u = [_uniform(rng, n) for _ in range(4)]
    return ((u[0] + u[1]) + (u[2] + u[3])) - np.float32(2.0)


def make_inputs(recipe: str) -> np.ndarray:
    """(ROWS, K) float32 input of one recipe; deterministic on every platform."""
    seed = RECIPES.index(recipe) + 1000
    rng = np.random.default_rng(seed)
    n = ROWS * K
    f32 = np.float32
    if recipe == "normal":          # weight-like: ~N(0, 0.03)
        x = _normalish(rng, n) * f32(0.05)
    elif recipe == "outliers":      # ~1% of elements 8-40x larger, both signs
        x = _normalish(rng, n) * f32(0.05)
        hit = _uniform(rng, n) < f32(0.01)
        x = np.where(hit, x * (f32(8) + f32(32) * _uniform(rng, n)), x)
    elif recipe == "offset":        # all positive with a shifted mean: exercises min > 0 fits
        x = _uniform(rng, n) * f32(0.5) + f32(0.25)
    elif recipe == "heavy":         # ratio of uniforms: a heavy tail, signed
        sign = np.where(_uniform(rng, n) < f32(0.5), f32(-1), f32(1))
        x = sign * _uniform(rng, n) / (_uniform(rng, n) + f32(0.02)) * f32(0.01)
    elif recipe == "edge":          # zero / tiny / constant / one-spike groups of 16, mixed in
        x = _normalish(rng, n) * f32(0.05)
        kind = (_uniform(rng, n // 16) * f32(6)).astype(np.int64)  # per 16-element group
        g = x.reshape(-1, 16)
        g[kind == 1] = 0                                            # an all-zero group
        g[kind == 2] *= f32(1e-18)                                  # below ggml's 1e-15 eps
        g[kind == 3] = f32(0.0625)                                  # constant (max == min)
        g[kind == 4, 1:] = 0                                        # one spike, rest zero
        x = g.reshape(-1)
        x[:256] = 0                                                 # a whole zero super-block
        x[K:K + 256] = f32(-0.5)                                    # a constant super-block
    elif recipe == "row_scales":    # rows spanning 1e-4 .. 1e2 in magnitude
        x = _normalish(rng, n).reshape(ROWS, K) * np.array(
            [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10, 30, 100, 0.05, 0.02, 0.5],
            dtype=np.float32)[:, None]
    else:
        raise ValueError(recipe)
    return np.ascontiguousarray(x.reshape(ROWS, K), dtype=np.float32)


def sha256(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def row_bytes(name: str) -> int:
    return K // 256 * {"q2_K": 84, "q3_K": 110, "q4_K": 144, "q5_K": 176, "q6_K": 210,
                       "q8_K": 292}[name]


def _load_ggml() -> ctypes.CDLL:
    import llama_cpp  # benchmark-only dependency; only this script uses it
    lib_dir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    lib = ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    lib.quantize_row_q8_K_ref.restype = None
    lib.quantize_row_q8_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib


def ggml_quantize(lib: ctypes.CDLL, name: str, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], row_bytes(name)), np.uint8)
    if name == "q8_K":
        lib.quantize_row_q8_K_ref(x.ctypes.data, out.ctypes.data, x.size)
    else:
        size = lib.ggml_quantize_chunk(TYPES[name], x.ctypes.data, out.ctypes.data, 0,
                                       x.shape[0], x.shape[1], None)
        assert size == out.nbytes, (name, size, out.nbytes)
    return out


def main() -> None:
    import llama_cpp
    os.makedirs(OUT_DIR, exist_ok=True)
    lib = _load_ggml()
    inputs = {r: make_inputs(r) for r in RECIPES}
    for r, x in inputs.items():
        assert np.isfinite(x).all() and sha256(x) == sha256(make_inputs(r)), r
    np.savez_compressed(os.path.join(OUT_DIR, "inputs.npz"),
                        rows=ROWS, k=K, source=f"llama-cpp-python {llama_cpp.__version__}",
                        **{f"sha256_{r}": sha256(x) for r, x in inputs.items()})
    for name in TYPES:
        arrays = {f"blocks_{r}": ggml_quantize(lib, name, x) for r, x in inputs.items()}
        np.savez_compressed(os.path.join(OUT_DIR, f"{name}.npz"), **arrays)
    total = sum(os.path.getsize(os.path.join(OUT_DIR, f)) for f in os.listdir(OUT_DIR))
    print(f"wrote {len(TYPES) + 1} files to {OUT_DIR}, {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
