"""Make the GGUF fixtures of issue 33's --mmproj (Qwen2.5-VL) in tests/data/gguf/ with
llama.cpp's own converter:

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    python tests/data/make_gguf_vl_fixtures.py \\
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

transformers writes the tiny random Qwen2.5-VL of tests/vision_checkpoint.py, with windows of 112
pixels (llama.cpp's fixed attn_window_size: the mmproj file does not hold it);
convert_hf_to_gguf.py turns it into a qwen2vl text GGUF and, with --mmproj, a clip projector GGUF,
both F32 (so the files hold the source's weights exactly). transformers' greedy tokens on the
source checkpoint, for prompts with one and two images of tests/vision_checkpoint.py's
sample_image (and one wider than a window), go to qwen25vl_fixtures.json, with their logprobs
(which move with every weight of the tower, where the tokens of a tiny model may not) and the
prompt ids; the images are preprocessed as
Qwen2VLImageProcessorPil with its default pixel limits (the mmproj file holds none, so Taper
serves those). The source tokenizer files and config.json go to tests/data/gguf/qwen25vl-source/.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.join(HERE, "gguf")
FIXTURES_JSON = os.path.join(OUT_DIR, "qwen25vl_fixtures.json")
TEXT_GGUF = "qwen25vl-f32.gguf"
MMPROJ_GGUF = "qwen25vl-mmproj-f32.gguf"
GEN = 8
TIE = 1e-4
# (chat message parts: text, or None for an image), (width, height, seed) of each image
CASES = {
    "one image": (["What is in this picture?", None, " Describe it."], [(40, 56, 5)]),
    "two images": ([None, "Compare the two images:", None, "which one is brighter?"],
                   [(23, 31, 5), (48, 40, 6)]),
    # wider than a window (112 pixels): window attention in blocks 0 and 2
    "large image": (["Describe:", None], [(150, 120, 7)]),
}


def _load(name: str, folder: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(ckpt: str, vc) -> dict:
    import torch
    from transformers import (AutoTokenizer, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    ip = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2)
    out = {}
    for name, (parts, specs) in CASES.items():
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
                               image_grid_thw=pixels["image_grid_thw"], max_new_tokens=GEN,
                               do_sample=False, output_scores=True, return_dict_in_generate=True)
        tokens = g.sequences[0, len(ids):].tolist()
        logprobs = [float(torch.log_softmax(s[0].double(), -1)[t])
                    for s, t in zip(g.scores, tokens)]
        trusted = GEN
        for i, s in enumerate(g.scores):
            top2 = torch.log_softmax(s[0].double(), -1).topk(2).values
            if float(top2[0] - top2[1]) < TIE:
                trusted = i
                break
        out[name] = dict(parts=parts, images=specs, prompt_ids=ids, tokens=tokens,
                         trusted=trusted, logprobs=logprobs,
                         text=tok.decode(tokens, skip_special_tokens=True))
    return out


def check_projector(ckpt: str, mmproj: str) -> None:
    """Taper's reading of the projector file holds the source's tower tensor for tensor (the
    order of the patch embedding's temporal halves, which still images cannot tell apart)."""
    import numpy as np
    from safetensors import safe_open

    from engine.loader.gguf_mmproj import read_mmproj
    _, weights = read_mmproj(mmproj)
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        source = {k: f.get_tensor(k) for k in f.keys() if k.startswith("visual.")}
    assert sorted(weights) == sorted(source), set(weights) ^ set(source)
    for name, w in source.items():
        assert np.array_equal(weights[name], w), name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))
    vc = _load("vision_checkpoint", os.path.dirname(HERE))
    maker = _load("make_gguf_fixtures", HERE)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = vc.tiny_vl_checkpoint(os.path.join(tmp, "ckpt"), window_size=112)
        # the processor's default pixel limits, which Taper serves beside a GGUF (the converter
        # reads the mean and std from this file)
        from transformers import Qwen2VLImageProcessorPil
        Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2
                                 ).save_pretrained(ckpt)
        for name, extra in ((TEXT_GGUF, []), (MMPROJ_GGUF, ["--mmproj"])):
            code = maker.CONVERT_WRAPPER.format(src=args.llama_cpp)
            env = dict(os.environ)
            env.pop("NO_LOCAL_GGUF", None)
            import subprocess
            subprocess.run([sys.executable, "-c", code, "--outtype", "f32", "--outfile",
                            os.path.join(OUT_DIR, name), *extra, ckpt], check=True, env=env,
                           cwd=args.llama_cpp)
        check_projector(ckpt, os.path.join(OUT_DIR, MMPROJ_GGUF))
        source = os.path.join(OUT_DIR, "qwen25vl-source")
        os.makedirs(source, exist_ok=True)
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                     "chat_template.jinja", "generation_config.json"):
            if os.path.isfile(os.path.join(ckpt, name)):
                shutil.copy(os.path.join(ckpt, name), source)
        with open(FIXTURES_JSON, "w") as f:
            json.dump(reference(ckpt, vc), f, indent=1)


if __name__ == "__main__":
    main()
