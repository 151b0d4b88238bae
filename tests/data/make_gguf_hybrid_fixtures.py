"""Make the hybrid linear-attention GGUF fixtures in tests/data/gguf/ with llama.cpp's own
converter (general.architecture "qwen3next", "qwen35", "qwen35moe").

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    python tests/data/make_gguf_hybrid_fixtures.py \\
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

As tests/data/make_gguf_mla_fixtures.py (whose helpers this reuses): transformers writes a random
Qwen3-Next-shaped checkpoint (in_proj_qkvz / in_proj_ba, every layer sparse with a shared
expert), a Qwen3.5 one (split projections, dense MLPs, the full-attention layer second) and a
Qwen3.5-MoE one, each with 2 key heads serving 4 value heads (so the converter's value-head
reordering for Qwen3.5 is exercised), and convert_hf_to_gguf.py (with --no-mtp: transformers'
checkpoints carry no MTP head, which the converter otherwise requires) turns each into an f32 and
a Q8_0 file. What llama.cpp's loader insists on shapes the models: the DeltaNet's key and value
head sizes equal (it reads both as ssm.state_size), and no dense layer in a qwen3next file (its
tensor list has no dense MLP).

The reference is transformers on the weights each file holds (gguf-py's dequantization of every
tensor, mapped back to the source parameter by the inverse of the converter's transforms written
out here, and each checked close to the source value), recorded with the prompt ids in
tests/data/gguf/hybrid_fixtures.json. Neither this script nor the tests import llama_cpp.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "gguf")
FIXTURES_JSON = os.path.join(OUT_DIR, "hybrid_fixtures.json")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


maker = _load("make_gguf_fixtures")

# Hidden 128 and every matrix row a multiple of 32 (Q8_0 blocks); 4 layers; 2 key heads of 32
# serving 4 value heads of 32; gated attention 4 query / 2 KV heads of 32, a quarter rotated.
HYBRID = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_conv_kernel_dim=4, vocab_size=512, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            shared_expert_intermediate_size=64, norm_topk_prob=True)

# Weight scales and seeds chosen so that transformers' top two logits on the Q8_0 files' weights
# stay >= 0.05 apart for the first 6 steps or more (tests/gguf_fixtures.py QUANT_TIE), and, for
# Qwen3.5-MoE, so that Taper's default Q8_0 path (activations rounded to 8 bits, as llama.cpp
# rounds them) keeps to them: with seed 3 it leaves them at step 17 of 23 (a reference margin of
# 0.079; with act_split=on it keeps all 23); of seeds 1-8, seed 6 keeps all 24.
MODELS = {
    "qwen3_next": dict(config="Qwen3NextConfig", tokenizer="bytelevel", outtypes=("f32", "q8_0"),
                       seed=3, scale=4.0, kwargs=dict(HYBRID, **_MOE, mlp_only_layers=[])),
    "qwen3_5": dict(config="Qwen3_5TextConfig", tokenizer="bytelevel", outtypes=("f32", "q8_0"),
                    seed=3, scale=4.0,
                    kwargs=dict(HYBRID, layer_types=["linear_attention", "full_attention",
                                                     "linear_attention", "linear_attention"])),
    "qwen3_5_moe": dict(config="Qwen3_5MoeTextConfig", tokenizer="bytelevel",
                        outtypes=("f32", "q8_0"), seed=6, scale=4.0,
                        kwargs=dict(HYBRID, **_MOE)),
}
NEW_TOKENS = 24


def source_config(name: str, token_ids: dict | None = None):
    return maker.source_config(name, token_ids, MODELS)


def source_model(name: str, config=None):
    """The transformers model of `name` with its scaled random weights (deterministic on CPU)."""
    return maker.source_model(name, config, MODELS)


def convert(llama_cpp_src: str, src_dir: str, out_path: str, outtype: str) -> None:
    """make_gguf_fixtures.convert with --no-mtp."""
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)      # use the gguf-py that ships with the converter
    subprocess.run([sys.executable, "-c", maker.CONVERT_WRAPPER.format(src=llama_cpp_src),
                    "--no-mtp", "--outtype", outtype, "--outfile", out_path, src_dir],
                   check=True, env=env, cwd=llama_cpp_src)


_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
           "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# GGUF tensor (per layer) -> transformers parameter (per layer, in memory: experts stacked as
# mlp.experts.gate_up_proj (E, 2I, H) and down_proj (E, H, I))
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "post_attention_norm.weight": "post_attention_layernorm.weight",
          "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
          "attn_v.weight": "self_attn.v_proj.weight",
          "attn_output.weight": "self_attn.o_proj.weight",
          "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate_inp.weight": "mlp.gate.weight",
          "ffn_down_exps.weight": "mlp.experts.down_proj",
          "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
          "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
          "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
          "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
          "attn_gate.weight": "linear_attn.in_proj_z.weight",
          "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
          "ssm_beta.weight": "linear_attn.in_proj_b.weight",
          "ssm_alpha.weight": "linear_attn.in_proj_a.weight", "ssm_a": "linear_attn.A_log",
          "ssm_dt.bias": "linear_attn.dt_bias", "ssm_conv1d.weight": "linear_attn.conv1d.weight",
          "ssm_norm.weight": "linear_attn.norm.weight",
          "ssm_out.weight": "linear_attn.out_proj.weight"}
# the norms the converter stores as 1 + w
_PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
             "attn_k_norm.weight", "output_norm.weight")


def _untile(arr, axis: int, nk: int, nv: int, d: int):
    """Value heads (d each) along `axis` from the converter's tiled order back to grouped by key
    head (conversion/qwen.py _reorder_v_heads, inverted)."""
    import numpy as np
    shape = list(arr.shape)
    t = arr.reshape(shape[:axis] + [nv // nk, nk, d] + shape[axis + 1:])
    return np.swapaxes(t, axis, axis + 1).reshape(shape)


def file_weights(path: str, model, name: str) -> dict:
    """{transformers parameter: the file's values} for every parameter of `model`, dequantized
    by gguf-py; each checked to be close to the source value."""
    import numpy as np
    from gguf import GGUFReader, quants

    c = model.config
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    raw = {t.name: np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
           .reshape([int(d) for d in reversed(t.shape.tolist())])
           for t in GGUFReader(path).tensors}
    out = {}
    for gname, arr in raw.items():
        if gname.endswith(_PLUS_ONE):
            arr = arr - np.float32(1.0)
        if gname in _GLOBAL:
            out[_GLOBAL[gname]] = arr
            continue
        _, layer, rest = gname.split(".", 2)
        p = f"model.layers.{layer}."
        if rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            continue
        if rest == "ssm_a":
            arr = np.log(-arr)
        if rest == "ssm_conv1d.weight":
            arr = arr[:, None, :]
        reorder = name != "qwen3_next" and nk != nv
        if rest == "attn_qkv.weight":
            q, k, v = np.split(arr, [nk * dk, 2 * nk * dk])
            if name == "qwen3_next":     # regrouped with attn_gate into in_proj_qkvz
                z = raw[f"blk.{layer}.attn_gate.weight"]
                H = arr.shape[1]
                out[p + "linear_attn.in_proj_qkvz.weight"] = np.concatenate(
                    [q.reshape(nk, dk, H), k.reshape(nk, dk, H), v.reshape(nk, r * dv, H),
                     z.reshape(nk, r * dv, H)], axis=1).reshape(-1, H)
                continue
            out[p + "linear_attn.in_proj_qkv.weight"] = np.concatenate(
                [q, k, _untile(v, 0, nk, nv, dv) if reorder else v])
            continue
        if rest == "attn_gate.weight" and name == "qwen3_next":
            continue
        if reorder:
            if rest in ("attn_gate.weight",):
                arr = _untile(arr, 0, nk, nv, dv)
            elif rest in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_a", "ssm_dt.bias"):
                arr = _untile(arr, 0, nk, nv, 1)
            elif rest == "ssm_conv1d.weight":
                arr = np.concatenate([arr[:2 * nk * dk], _untile(arr[2 * nk * dk:], 0, nk, nv,
                                                                 dv)])
            elif rest == "ssm_out.weight":
                arr = _untile(arr, 1, nk, nv, dv)
        out[p + _LAYER[rest]] = arr
        if rest == "ffn_down_exps.weight":
            out[p + "mlp.experts.gate_up_proj"] = np.concatenate(
                [raw[f"blk.{layer}.ffn_gate_exps.weight"], raw[f"blk.{layer}.ffn_up_exps.weight"]],
                axis=1)
    return maker.checked_against_source(out, model, path)


def reference(model, path: str, name: str, prompt_ids: list[int]) -> dict:
    """transformers' greedy data on the weights the GGUF file holds."""
    return maker.transformers_greedy_on(model, file_weights(path, model, name), prompt_ids,
                                        NEW_TOKENS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", required=True,
                        help="llama.cpp source tree (vendor/llama.cpp of the llama-cpp-python "
                             "sdist)")
    args = parser.parse_args()
    src_root = tempfile.mkdtemp(prefix="gguf-hybrid-src-")
    from transformers import AutoModelForCausalLM

    import importlib.metadata as md
    versions = {p: md.version(p) for p in ("transformers", "torch", "tokenizers", "gguf",
                                           "numpy")}
    versions["converter"] = ("llama-cpp-python 0.3.36 sdist: vendor/llama.cpp/"
                             "convert_hf_to_gguf.py --no-mtp")
    record = dict(versions=versions, prompt=maker.PROMPT, new_tokens=NEW_TOKENS, models={})
    for name, spec in MODELS.items():
        src = os.path.join(src_root, name)
        os.makedirs(src)
        ids = maker.build_bytelevel_tokenizer(src)
        model = source_model(name, source_config(name, ids))
        model.generation_config.eos_token_id = ids["generation_eos"]
        model.generation_config.bos_token_id = ids["bos_token_id"]
        model.save_pretrained(src)
        maker.commit_source(name, src)
        prompt_ids = maker.prompt_ids_of(src, True)
        source = AutoModelForCausalLM.from_pretrained(src, dtype="float32").eval()
        entry = dict(prompt_ids=prompt_ids, files={},
                     transformers=maker.transformers_greedy(source, prompt_ids, NEW_TOKENS))
        for outtype in spec["outtypes"]:
            path = os.path.join(OUT_DIR, f"{name}-{outtype}.gguf")
            convert(args.llama_cpp, src, path, outtype)
            entry["files"][outtype] = dict(
                file=os.path.basename(path), bytes=os.path.getsize(path),
                sha256=maker.sha256_file(path), tensor_types=maker.gguf_tensor_types(path),
                transformers=reference(source, path, name, prompt_ids))
        record["models"][name] = entry
        margins = {k: v["transformers"]["margins"][:8] for k, v in entry["files"].items()}
        print(f"{name}: " + ", ".join(f"{k} {v['bytes'] / 1e6:.2f} MB"
                                      for k, v in entry["files"].items()) + f"; margins {margins}")
    with open(FIXTURES_JSON, "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
    shutil.rmtree(src_root)


if __name__ == "__main__":
    main()
