"""Make the mixture-of-experts GGUF fixtures in tests/data/gguf/ with llama.cpp's own converter.

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    python tests/data/make_gguf_moe_fixtures.py \\
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

As tests/data/make_gguf_fixtures.py (whose tokenizers, converter wrapper and helpers this
reuses): transformers writes a random Mixtral, Qwen2-MoE and Qwen3-MoE checkpoint, and
convert_hf_to_gguf.py turns each into GGUF files: a float one and a Q8_0 one (the converter's
own Q8_0, `--outtype q8_0`, so no built llama.cpp is needed). The converter stacks each layer's
experts into `blk.N.ffn_{gate,up,down}_exps` and, for Mixtral (general.architecture "llama"),
interleaves the q/k rows.

The reference is transformers on the weights each file holds: every tensor of the file is
dequantized by gguf-py, un-permuted where the converter permuted, and put in place of the source
parameter it came from (checked to be close to it, so the mapping below is right), then
transformers records its greedy tokens, top-two margins and first-step logits. That goes to
tests/data/gguf/moe_fixtures.json with the prompt ids and the versions used. The source
tokenizer files and config.json are committed under tests/data/gguf/<name>-source/.

Neither this script nor the tests import llama_cpp.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "gguf")
FIXTURES_JSON = os.path.join(OUT_DIR, "moe_fixtures.json")


def _load_maker():
    spec = importlib.util.spec_from_file_location(
        "make_gguf_fixtures", os.path.join(HERE, "make_gguf_fixtures.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


maker = _load_maker()

# Hidden 128 (Q8_0 blocks of 32 divide every row), 2 layers, 4 heads of 32, 2 KV heads.
SMALL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5)

# Weights scaled x2 as the quantized qwen2 fixture (see make_gguf_fixtures.py), so 8-bit
# weights and activations move logits by hundredths, not tenths.
MODELS = {
    # top-2 of 4, renormalised; SentencePiece vocabulary; q/k rows permuted by the converter
    "mixtral": dict(config="MixtralConfig", tokenizer="sentencepiece", outtypes=("f32", "q8_0"),
                    seed=1, scale=2.0,
                    kwargs=dict(SMALL, intermediate_size=256, num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=None,
                                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
    # sigmoid-gated shared expert, top-k weights not renormalised, qkv bias
    # (seed 4: the reference's top two stay >= 0.25 apart, so 8-bit activations cannot flip a
    # token; the seeds whose tokens vary more had near-ties under 0.05 in the first 5 steps)
    "qwen2_moe": dict(config="Qwen2MoeConfig", tokenizer="bytelevel", outtypes=("f16", "q8_0"),
                      seed=4, scale=2.0,
                      kwargs=dict(SMALL, intermediate_size=256, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=128, norm_topk_prob=False,
                                  tie_word_embeddings=False, bos_token_id=None,
                                  eos_token_id=None)),
    # top-2 of 8 renormalised (norm_topk_prob), q/k RMSNorm, tied embeddings
    "qwen3_moe": dict(config="Qwen3MoeConfig", tokenizer="bytelevel", outtypes=("f32", "q8_0"),
                      seed=1, scale=2.0,
                      kwargs=dict(SMALL, intermediate_size=256, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=64,
                                  norm_topk_prob=True, tie_word_embeddings=True,
                                  bos_token_id=None, eos_token_id=None)),
}
NEW_TOKENS = 24


def source_config(name: str, token_ids: dict | None = None):
    return maker.source_config(name, token_ids, MODELS)


def source_model(name: str, config=None):
    """The transformers model of `name` with its scaled random weights (deterministic on CPU)."""
    return maker.source_model(name, config, MODELS)


# GGUF tensor (per layer) -> transformers parameter (per layer, the names transformers 5 uses
# in memory: experts stacked as mlp.experts.gate_up_proj (E, 2I, H) and down_proj (E, H, I)).
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
          "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
          "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
          "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate_inp.weight": "mlp.gate.weight",
          "ffn_down_exps.weight": "mlp.experts.down_proj",
          "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
          "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}


def interleaved_to_halves(w, num_heads: int):
    """Inverse of the converter's LlamaModel.permute along axis 0."""
    n = w.shape[0]
    return w.reshape(num_heads, n // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def file_weights(path: str, model) -> dict:
    """{transformers parameter: the file's values} for every parameter of `model`, dequantized
    by gguf-py; each checked to be close to the source value."""
    import numpy as np
    from gguf import GGUFReader, quants

    r = GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    cfg = model.config
    raw = {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
           .reshape([int(d) for d in reversed(t.shape.tolist())]) for t in r.tensors}
    out = {}
    for name, arr in raw.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = arr
            continue
        _, layer, rest = name.split(".", 2)
        p = f"model.layers.{layer}."
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            continue
        if arch == "llama" and rest.startswith(("attn_q.", "attn_k.")):
            heads = cfg.num_attention_heads if rest.startswith("attn_q") \
                else cfg.num_key_value_heads
            arr = interleaved_to_halves(arr, heads)
        out[p + _LAYER[rest]] = arr
        if rest == "ffn_down_exps.weight":
            out[p + "mlp.experts.gate_up_proj"] = np.concatenate(
                [raw[f"blk.{layer}.ffn_gate_exps.weight"], raw[f"blk.{layer}.ffn_up_exps.weight"]],
                axis=1)
    return maker.checked_against_source(out, model, path)


def reference(model, path: str, prompt_ids: list[int]) -> dict:
    """transformers' greedy data on the weights the GGUF file holds."""
    return maker.transformers_greedy_on(model, file_weights(path, model), prompt_ids, NEW_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True,
                        help="llama.cpp source tree (vendor/llama.cpp of the llama-cpp-python "
                             "sdist)")
    args = parser.parse_args()
    src_root = tempfile.mkdtemp(prefix="gguf-moe-src-")
    from transformers import AutoModelForCausalLM

    import importlib.metadata as md
    versions = {p: md.version(p) for p in ("transformers", "torch", "tokenizers",
                                           "sentencepiece", "gguf", "numpy")}
    versions["converter"] = "llama-cpp-python 0.3.36 sdist: vendor/llama.cpp/convert_hf_to_gguf.py"
    record = dict(versions=versions, prompt=maker.PROMPT, new_tokens=NEW_TOKENS, models={})
    for name, spec in MODELS.items():
        src = os.path.join(src_root, name)
        os.makedirs(src)
        build = (maker.build_bytelevel_tokenizer if spec["tokenizer"] == "bytelevel"
                 else maker.build_sentencepiece_tokenizer)
        ids = build(src)
        model = source_model(name, source_config(name, ids))
        model.generation_config.eos_token_id = ids["generation_eos"]
        model.generation_config.bos_token_id = ids["bos_token_id"]
        model.save_pretrained(src)
        maker.commit_source(name, src)
        prompt_ids = maker.prompt_ids_of(src, spec["tokenizer"] == "bytelevel")
        source = AutoModelForCausalLM.from_pretrained(src, dtype="float32").eval()
        entry = dict(prompt_ids=prompt_ids, files={},
                     transformers=maker.transformers_greedy(source, prompt_ids, NEW_TOKENS))
        for outtype in spec["outtypes"]:
            path = os.path.join(OUT_DIR, f"{name}-{outtype}.gguf")
            maker.convert(args.llama_cpp, src, path, outtype)
            entry["files"][outtype] = dict(
                file=os.path.basename(path), bytes=os.path.getsize(path),
                sha256=maker.sha256_file(path), tensor_types=maker.gguf_tensor_types(path),
                transformers=reference(source, path, prompt_ids))
        record["models"][name] = entry
        print(f"{name}: " + ", ".join(f"{k} {v['bytes'] / 1e6:.2f} MB"
                                      for k, v in entry["files"].items()))
    with open(FIXTURES_JSON, "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
    shutil.rmtree(src_root)


if __name__ == "__main__":
    main()
