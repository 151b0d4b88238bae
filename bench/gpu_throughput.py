"""End-to-end decode throughput on the CUDA backend (issue 4, item 8), run by
`python -m bench.throughput --backend cuda`.

A random checkpoint with Llama-3-8B's dimensions is generated on the device (16 GB of bf16 would
take minutes to write and read back from disk), wrapped in the real engine (scheduler, paged KV
cache, sampler, CUDA graphs) and driven with token-id prompts: greedy, ignore_eos.

Figures per batch size B: prefill tokens/s (the step(s) that compute the prompts), decode tokens/s
(the remaining steps) and the p50 step time. The reference is the batch-1 roofline measured in the
same run: weight bytes read per decode step over the device-to-device copy bandwidth (read +
write). candle-vllm reports 119 tokens/s for Llama-3-8B bf16 on Hopper.
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


def random_weights(cp, config, expected_shapes, seed: int = 0) -> dict:
    """Every tensor of the graph, generated on the device: matrices ~ N(0, 0.02^2) in bf16 (a
    float32 temporary one matrix at a time), norm weights 1."""
    import ml_dtypes
    rng = cp.random.default_rng(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            weights[name] = cp.ones(shape, cp.float32)
        else:
            w = rng.standard_normal(shape, dtype=cp.float32)
            w *= 0.02
            weights[name] = w.astype(ml_dtypes.bfloat16)
            del w
    return weights


def run(batches=(1, 16, 64), prompt_len: int = 128, gen_len: int = 128,
        cuda_graph: bool = True, json_rows: list | None = None) -> list[dict]:
    import cupy as cp

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_config import ModelConfig
    from engine.models.llama import LlamaForCausalLM, expected_shapes
    from engine.sampling_params import SamplingParams
    from pyx.cuda_backend import CudaBackend

    backend = CudaBackend(dtype="bf16")
    props = cp.cuda.runtime.getDeviceProperties(backend.device.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"device: {name}, {backend.num_sms} SMs; {datetime.date.today()}")
    bandwidth = copy_bandwidth(cp)
    model_config = ModelConfig.from_dict(dict(LLAMA3_8B))
    weights = random_weights(cp, model_config, expected_shapes)
    weight_bytes = sum(int(w.nbytes) for w in weights.values())
    model = LlamaForCausalLM(model_config, weights, backend)
    roofline = bandwidth / weight_bytes
    print(f"weights {weight_bytes / 1e9:.2f} GB; copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"batch-1 roofline {roofline:.0f} tokens/s")

    config = EngineConfig(model="llama3-8b-random", backend="cuda", dtype="bf16",
                          max_num_seqs=max(batches), cuda_graph=cuda_graph,
                          max_num_batched_tokens=max(2048, max(batches) * prompt_len),
                          enable_prefix_caching=False, max_model_len=prompt_len + gen_len + 16)
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
        row = {"backend": "cuda", "device": name, "batch": B, "prompt_len": prompt_len,
               "gen_len": gen_len, "cuda_graph": cuda_graph,
               "prefill_tok_s": B * prompt_len / sum(prefill),
               "decode_tok_s": (generated - B) / sum(decode),
               "decode_step_p50_ms": 1e3 * float(np.median(decode)),
               "roofline_b1_tok_s": roofline}
        row["decode_vs_roofline"] = row["decode_tok_s"] / (B * roofline)
        rows.append(row)
        print(f"B={B:3d}: prefill {row['prefill_tok_s']:9.0f} tok/s, decode "
              f"{row['decode_tok_s']:8.1f} tok/s (p50 step {row['decode_step_p50_ms']:.2f} ms), "
              f"{row['decode_vs_roofline']:.2f} x B * roofline")
    if json_rows is not None:
        json_rows.extend(rows)
    return rows
