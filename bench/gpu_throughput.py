"""End-to-end decode throughput on the CUDA backend (issue 4, item 8), run by
`python -m bench.throughput --backend cuda`.

A random checkpoint with Llama-3-8B's dimensions is generated on the device (16 GB of bf16 would
take minutes to write and read back from disk), wrapped in the real engine (scheduler, paged KV
cache, sampler, CUDA graphs) and driven with token-id prompts: greedy, ignore_eos.

Figures per batch size B: prefill tokens/s (the step(s) that compute the prompts), decode tokens/s
(the remaining steps) and the p50 step time. The reference is the batch-1 roofline measured in the
same run: the bytes of weights read per decode step (every matrix but the embedding table, of
which a step reads only its tokens' rows) over the device-to-device copy bandwidth (read +
write). candle-vllm reports 119 tokens/s for Llama-3-8B bf16 on Hopper.

quant (issue 6, item 7) picks the format of the seven projections of every layer; the embedding
table and lm_head stay bf16, norm weights f32:
  bf16  random N(0, 0.02^2) matrices (about 15.0 GB read per step);
  fp8   random e4m3 codes (no NaN codes 0x7f / 0xff) with random 128 x 128 block scales, placed
        through CudaBackend.place_weight with fp8_cutlass on (sm_90: codes stay e4m3 for the
        CUTLASS block GEMM, about 8.0 GB per step, roofline about 417 tokens/s on an H100);
        elsewhere the default path dequantizes them once to bf16 (bf16's bytes and roofline);
  int4  random 4-bit codes with random f32 scales, group 128, symmetric, for the Marlin W4A16
        kernel (about 4.7 GB per step, roofline about 720 tokens/s on an H100).
Both are made directly on the device (random codes are random in any layout: the int4 words are
written in the Marlin layout, which skips the host repack, about two minutes for 7B codes; that
repack is tested in tests/). GGUF types are not run end to end (quantizing 8B on the host is too
slow); bench/kernels.py qgemm times their GEMMs.
"""
from __future__ import annotations

import datetime
import time

import numpy as np

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": 128001,
}


def copy_bandwidth(cp, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of reps)."""
    src = cp.ones(nbytes // 4, dtype=cp.float32)   # no cuRAND host library needed
    dst = cp.empty_like(src)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps + 3):
        start.record()
        cp.copyto(dst, src)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return 2 * nbytes / float(np.median(times[3:]))


QUANTS = ("bf16", "fp8", "int4")
FP8_BLOCK = (128, 128)
INT4_GROUP = 128
MARLIN_TILE_N = 64          # pyx/weights/marlin.py TILE_N: N is padded to a multiple of it


def is_projection(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def random_words(cp, rng, n: int):
    """n uniformly random uint32 words on the device: the low 16 mantissa bits of two standard
    normal float32 draws (the Generator's normal draws are the API this file already relies on,
    without cuRAND's host library)."""
    lo = rng.standard_normal(n, dtype=cp.float32).view(cp.uint32) & 0xFFFF
    hi = rng.standard_normal(n, dtype=cp.float32).view(cp.uint32) << 16
    return (lo | hi).astype(cp.uint32, copy=False)


_CLASSES = {}


def device_weight_classes():
    """Random packed weights made on the device, as LlamaForCausalLM takes them: `_take` hands
    each to CudaBackend.place_weight, `_fuse` stacks q/k/v and gate/up with the type's `concat`
    and places the result. Each is its pyx/weights/ type (so place_weight recognises it) holding
    CuPy arrays, which place_weight reads as they are (CudaBackend.asarray takes a CuPy array
    without a copy)."""
    if _CLASSES:
        return _CLASSES["fp8"], _CLASSES["int4"]
    import cupy as cp

    from pyx.weights.fp8 import Fp8Weight
    from pyx.weights.marlin import MarlinWeight

    class DeviceFp8Codes(Fp8Weight):
        """Block-wise e4m3 codes and scales on the device; Fp8Weight's host checks are skipped."""
        __slots__ = ()

        def __post_init__(self):
            pass

        @staticmethod
        def concat(weights):
            return DeviceFp8Codes(cp.concatenate([w.weight for w in weights]),
                                  cp.concatenate([w.scale for w in weights]), FP8_BLOCK)

        @classmethod
        def random(cls, backend, rng, shape):
            n, k = shape
            bn, bk = FP8_BLOCK
            with backend.stream:
                codes = random_words(cp, rng, -(-n * k // 4)).view(cp.uint8)[:n * k]
                codes = cp.where((codes & 0x7F) == 0x7F, codes - 1, codes).astype(cp.uint8)
                scale = cp.abs(rng.standard_normal((n // bn, -(-k // bk)), dtype=cp.float32))
                scale = (scale * 1e-3 + 5e-4).astype(cp.float32)
                return cls(codes.reshape(n, k), scale, FP8_BLOCK)

    class RandomMarlin(MarlinWeight):
        """Random int4 words already in the Marlin layout (pyx/weights/marlin.py: qweight
        (K/16, Np*2) uint32, scales (K/G, Np) f32, zeros None = symmetric 8), on the device; N a
        multiple of 64, so stacking along N is stacking tile columns."""
        __slots__ = ()

        @staticmethod
        def concat(weights):
            k, g = weights[0].k, weights[0].group_size
            if any(w.k != k or w.group_size != g or w.n % MARLIN_TILE_N for w in weights):
                raise ValueError("random Marlin weights stack along N in whole 64-column tiles")
            return RandomMarlin(cp.concatenate([w.qweight for w in weights], axis=1),
                                cp.concatenate([w.scales for w in weights], axis=1), None,
                                k, sum(w.n for w in weights), g)

        @classmethod
        def random(cls, backend, rng, shape):
            n, k = shape
            g = INT4_GROUP
            if n % MARLIN_TILE_N or k % g:
                raise ValueError(f"random Marlin weight {shape}: N must be a multiple of "
                                 f"{MARLIN_TILE_N} and K of {g}")
            with backend.stream:
                words = random_words(cp, rng, (k // 16) * n * 2).reshape(k // 16, n * 2)
                # W = scale * (code - 8), codes uniform in 0..15: std ~ 4.6 scale; aim at 0.02
                scale = cp.abs(rng.standard_normal((k // g, n), dtype=cp.float32))
                scale = (scale * 0.002 + 0.003).astype(cp.float32)
                return cls(words, scale, None, k, n, g)

    _CLASSES.update(fp8=DeviceFp8Codes, int4=RandomMarlin)
    return DeviceFp8Codes, RandomMarlin


def random_weights(cp, config, expected_shapes, seed: int = 0, quant: str = "bf16",
                   backend=None) -> dict:
    """Every tensor of the graph, generated on the device: matrices ~ N(0, 0.02^2) in bf16 (a
    float32 temporary one matrix at a time), norm weights 1; with quant "fp8" or "int4" the layer
    projections are random packed weights of that format (device_weight_classes)."""
    import ml_dtypes
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    packed = None
    if quant != "bf16":
        fp8_cls, int4_cls = device_weight_classes()
        packed = fp8_cls if quant == "fp8" else int4_cls
    rng = cp.random.default_rng(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            weights[name] = cp.ones(shape, cp.float32)
        elif packed is not None and is_projection(name):
            weights[name] = packed.random(backend, rng, shape)
        else:
            w = rng.standard_normal(shape, dtype=cp.float32)
            w *= 0.02
            weights[name] = w.astype(ml_dtypes.bfloat16)
            del w
    return weights


def step_bytes(config, expected_shapes, quant: str, fp8_codes: bool) -> int:
    """Bytes of weights one decode step reads: every matrix in its placed format but the
    embedding table (a step reads its tokens' rows only; a tied lm_head is read whole), and the
    f32 vectors."""
    total = 0
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            total += 4 * shape[0]
            continue
        if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            continue
        n, k = shape
        if quant == "fp8" and fp8_codes and is_projection(name):
            bn, bk = FP8_BLOCK
            total += n * k + 4 * (n // bn) * -(-k // bk)
        elif quant == "int4" and is_projection(name):
            total += n * k // 2 + 4 * (k // INT4_GROUP) * n
        else:
            total += 2 * n * k
    return total


def run(batches=(1, 16, 64), prompt_len: int = 128, gen_len: int = 128,
        cuda_graph: bool = True, json_rows: list | None = None,
        quant: str = "bf16", kernels=None) -> list[dict]:
    import gc

    import cupy as cp

    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.models.model_config import ModelConfig
    from engine.models.llama import LlamaForCausalLM, expected_shapes
    from engine.sampling.sampling_params import SamplingParams
    from pyx.cuda_backend import CudaBackend

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    backend = CudaBackend(dtype="bf16", kernels=kernels)
    props = cp.cuda.runtime.getDeviceProperties(backend.device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    cc = str(backend.device.compute_capability)
    print(f"device: {name}, {backend.num_sms} SMs, sm_{cc}; {datetime.date.today()}; "
          f"projections {quant}; kernels {backend.kernels}")
    fp8_codes = quant == "fp8" and cc == "90"
    if quant == "fp8":
        backend.fp8_cutlass = fp8_codes
        if not fp8_codes:
            print(f"note: sm_{cc} has no CUTLASS FP8 GEMM: the FP8 codes are dequantized to bf16 "
                  "at load (the default path), so this runs, and is bounded by, bf16's bytes")
    bandwidth = copy_bandwidth(cp)
    model_config = ModelConfig.from_dict(dict(LLAMA3_8B))
    t0 = time.perf_counter()
    weights = random_weights(cp, model_config, expected_shapes, quant=quant, backend=backend)
    per_step = step_bytes(model_config, expected_shapes, quant, fp8_codes)
    model = LlamaForCausalLM(model_config, weights, backend)
    backend.synchronize()
    made_s = time.perf_counter() - t0
    del weights
    roofline = bandwidth / per_step
    print(f"weights read per decode step {per_step / 1e9:.2f} GB ({quant}, made and placed in "
          f"{made_s:.1f} s); copy bandwidth {bandwidth / 1e12:.2f} TB/s; batch-1 roofline "
          f"{roofline:.0f} tokens/s")

    config = EngineConfig(model=f"llama3-8b-random-{quant}", backend="cuda", dtype="bf16",
                          max_num_seqs=max(batches), cuda_graph=cuda_graph,
                          max_num_batched_tokens=max(2048, max(batches) * prompt_len),
                          enable_prefix_caching=False, max_model_len=prompt_len + gen_len + 16,
                          kernels=backend.kernels)
    engine = LLMEngine(config, loaded=(backend, model, model_config))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    rows = []
    for B in batches:
        for warm in (True, False):
            for i in range(B):
                ids = rng.integers(0, model_config.vocab_size, prompt_len).tolist()
                engine.add_request(f"b{B}-{warm}-{i}", ids, params)
            steps, generated = [], 0
            while engine.has_unfinished():
                t0 = time.perf_counter()
                outs = engine.step()     # each step ends with the sampled tokens on the host
                steps.append((time.perf_counter() - t0, len(outs)))
                generated += len(outs)
        prefill = [t for t, n in steps[:1]]
        decode = [t for t, n in steps[1:]]
        row = {"backend": "cuda", "device": name, "quant": quant,
               "fp8_cutlass": fp8_codes if quant == "fp8" else None,
               "weight_bytes_per_step": per_step, "batch": B, "prompt_len": prompt_len,
               "gen_len": gen_len, "cuda_graph": cuda_graph,
               "prefill_tok_s": B * prompt_len / sum(prefill),
               "decode_tok_s": (generated - B) / sum(decode),
               "decode_step_p50_ms": 1e3 * float(np.median(decode)),
               "roofline_b1_tok_s": roofline}
        row["decode_vs_roofline"] = row["decode_tok_s"] / (B * roofline)
        rows.append(row)
        print(f"{quant:>4} B={B:3d}: prefill {row['prefill_tok_s']:9.0f} tok/s, decode "
              f"{row['decode_tok_s']:8.1f} tok/s (p50 step {row['decode_step_p50_ms']:.2f} ms), "
              f"{row['decode_vs_roofline']:.2f} x B * roofline")
    if json_rows is not None:
        json_rows.extend(rows)
    # give the device memory back before another format's model is built
    del engine, model
    gc.collect()
    backend.synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    return rows
