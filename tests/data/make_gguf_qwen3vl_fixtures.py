"""Make the GGUF fixtures of issue 33's --mmproj for Qwen3-VL in tests/data/gguf/ with llama.cpp's
own converter (the llama.cpp tree as tests/data/make_gguf_vl_fixtures.py fetches it):

    python tests/data/make_gguf_qwen3vl_fixtures.py \\
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

transformers writes the tiny random dense Qwen3-VL of tests/qwen3_vl_checkpoint.py (DeepStack
from blocks 0 and 2, a 4 x 4 learned position grid, interleaved M-RoPE), and its MoE sibling with
experts in every layer (llama.cpp's qwen3vlmoe has no dense layers; the experts in the hub's
layout, which the converter reads); each one's image processor is replaced by
Qwen2VLImageProcessorPil's default pixel limits with Qwen3-VL's mean and std (0.5), which Taper
serves beside a GGUF without a preprocessor_config.json: the limits are its defaults, the mean
and std the projector file's (the converter reads them from this config).
convert_hf_to_gguf.py turns it into a qwen3vl (qwen3vlmoe) text GGUF and, with --mmproj, a
clip projector GGUF (projector type qwen3vl_merger), both F32 (the source's weights exactly).
transformers' greedy tokens on the source, for make_gguf_vl_fixtures.py's prompts (one, two and
a larger image of tests/vision_checkpoint.py's sample_image), go to qwen3vl_fixtures.json
(qwen3vlmoe_fixtures.json) with their logprobs and the prompt ids.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "gguf")
# variant -> (checkpoint maker's keywords, the files' stem): the dense model and the MoE one
# with experts in every layer (llama.cpp's qwen3vlmoe graph has no dense layers)
VARIANTS = {"dense": (dict(), "qwen3vl"),
            "moe": (dict(moe=True, text_overrides=dict(mlp_only_layers=[])), "qwen3vlmoe")}
PROCESSOR = dict(patch_size=4, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                 image_std=[0.5] * 3)


def reference(ckpt: str, vc, cases: dict, gen: int, tie: float, moe: bool) -> dict:
    import torch
    from transformers import (AutoTokenizer, Qwen2VLImageProcessorPil,
                              Qwen3VLForConditionalGeneration,
                              Qwen3VLMoeForConditionalGeneration)
    model_class = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    model = model_class.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    ip = Qwen2VLImageProcessorPil(**PROCESSOR)
    out = {}
    for name, (parts, specs) in cases.items():
        images = [vc.sample_image(w, h, seed=s) for w, h, s in specs]
        pixels = ip(images=images, return_tensors="pt")
        counts = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
        content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
        ids = []
        for t in tok(text, add_special_tokens=False)["input_ids"]:
            ids += [t] * next(counts) if t == model.config.image_token_id else [t]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            g = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                               pixel_values=pixels["pixel_values"],
                               image_grid_thw=pixels["image_grid_thw"], max_new_tokens=gen,
                               do_sample=False, output_scores=True, return_dict_in_generate=True)
        tokens = g.sequences[0, len(ids):].tolist()
        logprobs = [float(torch.log_softmax(s[0].double(), -1)[t])
                    for s, t in zip(g.scores, tokens)]
        trusted = gen
        for i, s in enumerate(g.scores):
            top2 = torch.log_softmax(s[0].double(), -1).topk(2).values
            if float(top2[0] - top2[1]) < tie:
                trusted = i
                break
        out[name] = dict(parts=parts, images=specs, prompt_ids=ids, tokens=tokens,
                         trusted=trusted, logprobs=logprobs,
                         text=tok.decode(tokens, skip_special_tokens=True))
    return out


def check_projector(ckpt: str, mmproj: str) -> None:
    """Taper's reading of the projector file holds the source's tower tensor for tensor."""
    import numpy as np
    from safetensors import safe_open

    from engine.loader.gguf_mmproj import read_mmproj
    _, weights = read_mmproj(mmproj)
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        source = {k[len("model."):]: f.get_tensor(k) for k in f.keys()
                  if k.startswith("model.visual.")}
    assert sorted(weights) == sorted(source), set(weights) ^ set(source)
    for name, w in source.items():
        assert np.array_equal(weights[name], w), name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree")
    args = parser.parse_args()
    import torch  # noqa: F401  (before the engine's modules: transformers must see it first)
    root = os.path.dirname(HERE)
    sys.path[:0] = [os.path.dirname(root), root, HERE]
    import vision_checkpoint as vc
    from make_gguf_fixtures import CONVERT_WRAPPER
    from make_gguf_vl_fixtures import CASES, GEN, TIE
    from qwen3_vl_checkpoint import tiny_qwen3_vl_checkpoint, to_hub_expert_layout
    from transformers import Qwen2VLImageProcessorPil
    for kwargs, stem in VARIANTS.values():
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = tiny_qwen3_vl_checkpoint(os.path.join(tmp, "ckpt"), **kwargs)
            Qwen2VLImageProcessorPil(**PROCESSOR).save_pretrained(ckpt)
            if kwargs.get("moe"):       # the converter reads the hub's expert layout
                to_hub_expert_layout(ckpt)
            env = dict(os.environ)
            env.pop("NO_LOCAL_GGUF", None)
            mmproj = os.path.join(OUT_DIR, f"{stem}-mmproj-f32.gguf")
            for out, extra in ((os.path.join(OUT_DIR, f"{stem}-f32.gguf"), []),
                               (mmproj, ["--mmproj"])):
                subprocess.run([sys.executable, "-c", CONVERT_WRAPPER.format(src=args.llama_cpp),
                                "--outtype", "f32", "--outfile", out, *extra, ckpt], check=True,
                               env=env, cwd=args.llama_cpp)
            check_projector(ckpt, mmproj)
            with open(os.path.join(OUT_DIR, f"{stem}_fixtures.json"), "w") as f:
                json.dump(reference(ckpt, vc, CASES, GEN, TIE, bool(kwargs.get("moe"))), f,
                          indent=1)


if __name__ == "__main__":
    main()
