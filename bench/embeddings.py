"""Embedding throughput: Taper's engine (LLM.embed) against plain prefill and sentence-transformers.

    python -m bench.embeddings [--inputs 64] [--tokens 128] [--repeats 3]

Writes (or reuses) bench/.cache/embed-llama-512/: a random headless LlamaModel (hidden 512,
8 layers, intermediate 1536, 8 heads of 64, 4 KV heads) saved as a sentence-transformers
checkpoint (mean pooling + Normalize) with the demo checkpoint's tokenizer. Prints inputs/s and
tokens/s for the same token ids:
  taper embed     LLM.embed, every input in one call (batched, chunked as the engine schedules)
  taper prefill   the same prompts generating one token (prefill + one LM-head row each), on a
                  *ForCausalLM copy of the weights: what pooling costs over a plain prefill
  st encode       sentence-transformers (torch, same thread count) on padded batches of 16,
                  when it is installed
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

HIDDEN, LAYERS, INTER, HEADS, KV_HEADS, HEAD_DIM = 512, 8, 1536, 8, 4, 64
CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".cache")


def write_checkpoint(path: str, causal: bool = False) -> str:
    from safetensors.numpy import save_file

    from server.demo_model import build_tokenizer
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    rng = np.random.default_rng(0)

    def normal(*shape, std=0.03):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
    prefix = "model." if causal else ""
    w = {prefix + "embed_tokens.weight": normal(vocab, HIDDEN, std=0.1),
         prefix + "norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        p = f"{prefix}layers.{i}."
        w |= {p + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
              p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
              p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
              p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": normal(INTER, HIDDEN),
              p + "mlp.up_proj.weight": normal(INTER, HIDDEN),
              p + "mlp.down_proj.weight": normal(HIDDEN, INTER)}
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM" if causal else "LlamaModel"],
              "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
              "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "vocab_size": vocab,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "float32"}
    tok.save(os.path.join(path, "tokenizer.json"))
    files = {"config.json": config,
             "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                       "pad_token": "<|endoftext|>",
                                       "eos_token": "<|im_end|>"}}
    if not causal:
        files |= {"modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}],
            "1_Pooling/config.json": {"embedding_dimension": HIDDEN, "pooling_mode": "mean"}}
    for name, obj in files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(obj, f)
    return path


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from engine import LLM, SamplingParams
    embed_dir = write_checkpoint(os.path.join(CACHE, "embed-llama-512"))
    causal_dir = write_checkpoint(os.path.join(CACHE, "causal-llama-512"), causal=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 400, args.tokens).tolist() for _ in range(args.inputs)]
    total = args.inputs * args.tokens
    # no prefix caching: every repeat computes every token
    llm = LLM(embed_dir, enable_prefix_caching=False)
    results = {"taper embed": best_of(lambda: llm.embed(prompts), args.repeats)}
    gen = LLM(causal_dir, enable_prefix_caching=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    results["taper prefill"] = best_of(lambda: gen.generate(prompts, one), args.repeats)
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("sentence-transformers is not installed: no st encode row")
    else:
        torch.set_num_threads(os.cpu_count())
        st = SentenceTransformer(embed_dir, device="cpu")
        ids = torch.tensor(prompts)

        def st_encode():
            with torch.inference_mode():
                for i in range(0, len(prompts), 16):
                    batch = ids[i:i + 16]
                    st({"input_ids": batch, "attention_mask": torch.ones_like(batch)})
        results["st encode"] = best_of(st_encode, args.repeats)
        with torch.inference_mode():
            want = st({"input_ids": ids[:2], "attention_mask": torch.ones_like(ids[:2])})
        got = np.stack([o.embedding for o in llm.embed(prompts[:2])])
        print(f"max |taper - st| over 2 inputs: "
              f"{np.abs(got - want['sentence_embedding'].numpy()).max():.2e}")
    print(f"{args.inputs} inputs x {args.tokens} tokens, best of {args.repeats}, "
          f"{os.cpu_count()} cores")
    for name, seconds in results.items():
        print(f"  {name:14s} {seconds:7.3f} s  {args.inputs / seconds:8.1f} inputs/s  "
              f"{total / seconds:9.0f} tokens/s")


if __name__ == "__main__":
    main()
