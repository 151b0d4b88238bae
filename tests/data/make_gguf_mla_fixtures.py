"""Make the multi-head latent attention GGUF fixtures in tests/data/gguf/ with llama.cpp's own
converter (general.architecture "deepseek2").

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    python tests/data/make_gguf_mla_fixtures.py \\
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

As tests/data/make_gguf_moe_fixtures.py (whose helpers this reuses): transformers writes a random
DeepSeek-V2-Lite-shaped checkpoint (no q_lora_rank, softmax routing) and a DeepSeek-V3-shaped one
(q_lora_rank, sigmoid routing with e_score_correction_bias over groups, YaRN with mscale =
mscale_all_dim as in DeepSeek-V3's release, which is all a GGUF file can say), and
convert_hf_to_gguf.py turns each into GGUF files. The converter splits each layer's kv_b_proj
into attn_k_b (per head, transposed) and attn_v_b, stacks the experts, and writes the router's
scoring function only when config.json names it (`scoring_func`, as DeepSeek-V3's release does;
transformers does not save it), so the V3 source's config.json gets `scoring_func: sigmoid` and
`topk_method: noaux_tc` before conversion.

The reference is transformers on the weights each file holds (gguf-py's dequantization of every
tensor, mapped back to the source parameter and checked close to it), recorded with the prompt
ids in tests/data/gguf/mla_fixtures.json. Neither this script nor the tests import llama_cpp.
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
FIXTURES_JSON = os.path.join(OUT_DIR, "mla_fixtures.json")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


maker = _load("make_gguf_fixtures")

# Hidden 128 and every matrix row a multiple of 32 (Q8_0 blocks); 2 layers, the first dense.
MLA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=4, vocab_size=512, max_position_embeddings=512,
           rms_norm_eps=1e-5, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
           v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
           first_k_dense_replace=1, tie_word_embeddings=False)

# Weight scales and seeds chosen (of seeds 1-5, scales 2-4) so that transformers' top two logits
# on the Q8_0 files' weights stay >= 0.05 apart for the first 7 (V2-Lite: x3, seed 1) and 14
# (V3: x4, seed 3) steps: the Q8_0 files' comparison stops at the first margin under 0.05
# (tests/gguf_fixtures.py QUANT_TIE).
MODELS = {
    # V2-Lite's shape: one q_proj, softmax greedy top-2 (not renormalised), two shared experts
    "deepseek_v2_lite": dict(config="DeepseekV2Config", tokenizer="bytelevel",
                             outtypes=("f32", "q8_0"), seed=3, scale=4.0,
                             kwargs=dict(MLA, q_lora_rank=None, n_shared_experts=2,
                                         topk_method="greedy", routed_scaling_factor=1.0),
                             config_json={}),
    # V3: q_lora_rank, sigmoid routing with the correction bias over the best 2 of 4 groups,
    # renormalised, routed_scaling_factor 2.5, YaRN
    "deepseek_v3": dict(config="DeepseekV3Config", tokenizer="bytelevel",
                        outtypes=("f32", "q8_0"), seed=3, scale=4.0,
                        kwargs=dict(MLA, q_lora_rank=96, n_shared_experts=1, n_group=4,
                                    topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                    rope_parameters={
                                        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 128, "mscale": 1.0,
                                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
                        config_json={"scoring_func": "sigmoid", "topk_method": "noaux_tc"}),
}
NEW_TOKENS = 24


def source_config(name: str, token_ids: dict | None = None):
    return maker.source_config(name, token_ids, MODELS)


def source_model(name: str, config=None):
    """The transformers model of `name` with its scaled random weights (deterministic on CPU)."""
    return maker.source_model(name, config, MODELS)


_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# GGUF tensor (per layer) -> transformers parameter (per layer, in memory: experts stacked as
# mlp.experts.gate_up_proj (E, 2I, H) and down_proj (E, H, I))
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight",
          "attn_q_a.weight": "self_attn.q_a_proj.weight",
          "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
          "attn_q_b.weight": "self_attn.q_b_proj.weight",
          "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
          "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
          "attn_output.weight": "self_attn.o_proj.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight",
          "ffn_gate_inp.weight": "mlp.gate.weight",
          "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
          "ffn_down_exps.weight": "mlp.experts.down_proj",
          "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"}


def file_weights(path: str, model) -> dict:
    """{transformers parameter: the file's values} for every parameter (and the router bias
    buffer) of `model`, dequantized by gguf-py; each checked to be close to the source value."""
    import numpy as np
    from gguf import GGUFReader, quants

    raw = {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
           .reshape([int(d) for d in reversed(t.shape.tolist())])
           for t in GGUFReader(path).tensors}
    out = {}
    for name, arr in raw.items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = arr
            continue
        _, layer, rest = name.split(".", 2)
        p = f"model.layers.{layer}."
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "attn_v_b.weight"):
            continue
        if rest == "attn_k_b.weight":       # (Hq, L, N) and (Hq, V, L) -> kv_b (Hq * (N + V), L)
            k_b, v_b = arr, raw[f"blk.{layer}.attn_v_b.weight"]
            out[p + "self_attn.kv_b_proj.weight"] = np.concatenate(
                [k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])
            continue
        out[p + _LAYER[rest]] = arr
        if rest == "ffn_down_exps.weight":
            out[p + "mlp.experts.gate_up_proj"] = np.concatenate(
                [raw[f"blk.{layer}.ffn_gate_exps.weight"], raw[f"blk.{layer}.ffn_up_exps.weight"]],
                axis=1)
    return checked_against_source(out, model, path)


def checked_against_source(out: dict, model, path: str) -> dict:
    """make_gguf_fixtures.checked_against_source over the parameters and the router bias."""
    import numpy as np

    state = model.state_dict()
    assert set(out) == set(state), (set(out) ^ set(state))
    for k, v in out.items():
        src = state[k].float().numpy()
        v = v.reshape(src.shape)
        out[k] = v
        err = np.sqrt(np.mean((v - src) ** 2) / max(np.mean(src ** 2), 1e-30))
        assert err < 0.02, f"{path}: {k} differs from the source by {err:.3f} (relative RMS)"
    return out


def reference(model, path: str, prompt_ids: list[int]) -> dict:
    """transformers' greedy data on the weights the GGUF file holds."""
    return maker.transformers_greedy_on(model, file_weights(path, model), prompt_ids, NEW_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True,
                        help="llama.cpp source tree (vendor/llama.cpp of the llama-cpp-python "
                             "sdist)")
    args = parser.parse_args()
    src_root = tempfile.mkdtemp(prefix="gguf-mla-src-")
    from transformers import AutoModelForCausalLM

    import importlib.metadata as md
    versions = {p: md.version(p) for p in ("transformers", "torch", "tokenizers", "gguf",
                                           "numpy")}
    versions["converter"] = "llama-cpp-python 0.3.36 sdist: vendor/llama.cpp/convert_hf_to_gguf.py"
    record = dict(versions=versions, prompt=maker.PROMPT, new_tokens=NEW_TOKENS, models={})
    for name, spec in MODELS.items():
        src = os.path.join(src_root, name)
        os.makedirs(src)
        ids = maker.build_bytelevel_tokenizer(src)
        model = source_model(name, source_config(name, ids))
        model.generation_config.eos_token_id = ids["generation_eos"]
        model.generation_config.bos_token_id = ids["bos_token_id"]
        model.save_pretrained(src)
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump({**config, **spec["config_json"]}, f, indent=2)
        maker.commit_source(name, src)
        prompt_ids = maker.prompt_ids_of(src, True)
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
