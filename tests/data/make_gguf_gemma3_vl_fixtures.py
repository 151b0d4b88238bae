"""Make the GGUF fixtures of issue 33's --mmproj for Gemma 3 in tests/data/gguf/ with llama.cpp's
own converter (the llama.cpp tree as tests/data/make_gguf_vl_fixtures.py fetches it):

    python tests/data/make_gguf_gemma3_vl_fixtures.py \\
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

transformers writes the tiny random Gemma 3 of tests/gemma3_vision_checkpoint.py with six text
layers, five sliding and the sixth full: llama.cpp's fixed Gemma 3 layer pattern, which the text
GGUF does not hold; its tokenizer splits the text by Qwen2's regex before the byte-level BPE, the
pre-tokenizer the converter is told to record (make_gguf_fixtures.CONVERT_WRAPPER: a toy
vocabulary matches none of its known ones), so that the GGUF's tokenizer is the source's. Two
changes make the source what the converter's files hold exactly:
- its tensors are renamed to the hub's layout (vision_tower.vision_model.*, which the converter's
  tensor map knows; transformers 5 saves vision_tower.* without vision_model);
- the projection mm_input_projection_weight is rounded to float16, the type the converter
  forces for it whatever the --outtype.
convert_hf_to_gguf.py turns it into a gemma3 text GGUF and, with --mmproj, a clip projector GGUF
(projector type gemma3), both F32 but that one tensor. transformers' greedy tokens on the source,
for prompts with one and two images of tests/vision_checkpoint.py's sample_image (preprocessed
by the checkpoint's Gemma3Processor: 32 x 32 pixels, mean and std 0.5, Gemma3ImageProcessor's
defaults, which Taper serves beside a GGUF), go to gemma3vl_fixtures.json with their logprobs
and the prompt ids.
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
FIXTURES_JSON = os.path.join(OUT_DIR, "gemma3vl_fixtures.json")
TEXT_GGUF = "gemma3vl-f32.gguf"
MMPROJ_GGUF = "gemma3vl-mmproj-f32.gguf"
GEN = 8
TIE = 1e-4
TEXT_LAYERS = dict(num_hidden_layers=6,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"])
# (chat message parts: text, or None for an image), (width, height, seed) of each image
CASES = {
    "one image": (["Describe", None], [(40, 30, 1)]),
    "two images": (["Compare the two images:", None, None], [(30, 40, 2), (40, 30, 1)]),
}


def to_converter_source(ckpt: str) -> None:
    """In place: the hub's tensor names and a float16-exact projection (module docstring)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    path = os.path.join(ckpt, "model.safetensors")
    out = {}
    for name, w in load_file(path).items():
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        if name.endswith("mm_input_projection_weight"):
            w = w.astype(np.float16).astype(w.dtype)
        out[name] = w
    save_file(out, path, metadata={"format": "pt"})


def reference(ckpt: str, vc) -> dict:
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration
    model = Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(ckpt)
    out = {}
    for name, (parts, specs) in CASES.items():
        images = [vc.sample_image(w, h, seed=s) for w, h, s in specs]
        content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
        text = proc.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                        add_generation_prompt=True)
        inputs = proc(text=text, images=images, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        with torch.no_grad():
            g = model.generate(**inputs, max_new_tokens=GEN, do_sample=False,
                               output_scores=True, return_dict_in_generate=True)
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
                         text=proc.tokenizer.decode(tokens, skip_special_tokens=True))
    return out


def check_projector(ckpt: str, mmproj: str) -> None:
    """Taper's reading of the projector file holds the source's tower tensor for tensor (the
    soft-embedding norm as the encoder uses it, 1 + w)."""
    import numpy as np
    from safetensors import safe_open

    from engine.loader.gguf_mmproj import read_mmproj
    from engine.models.gemma3_vl import _checkpoint_names
    _, weights = read_mmproj(mmproj)
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        source = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("language_model.")}
    _checkpoint_names(source)
    assert sorted(weights) == sorted(source), set(weights) ^ set(source)
    for name, w in source.items():
        got = weights[name].astype(np.float32)
        if name.endswith("mm_soft_emb_norm.weight"):
            got, w = got + np.float32(1), w + np.float32(1)
        assert np.array_equal(got, w), name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree")
    args = parser.parse_args()
    import torch  # noqa: F401  (before the engine's modules: transformers must see it first)
    root = os.path.dirname(HERE)
    sys.path[:0] = [os.path.dirname(root), root, HERE]
    import vision_checkpoint as vc
    from gemma3_vision_checkpoint import tiny_gemma3_vision_checkpoint
    from make_gguf_fixtures import CONVERT_WRAPPER
    with tempfile.TemporaryDirectory() as tmp:
        from engine.text.gguf_tokenizer import PRE_TOKENIZERS
        (split,), _, _ = PRE_TOKENIZERS["qwen2"]
        ckpt = tiny_gemma3_vision_checkpoint(os.path.join(tmp, "ckpt"), text=TEXT_LAYERS,
                                             split=split)
        to_converter_source(ckpt)
        env = dict(os.environ)
        env.pop("NO_LOCAL_GGUF", None)
        for name, extra in ((TEXT_GGUF, []), (MMPROJ_GGUF, ["--mmproj"])):
            subprocess.run([sys.executable, "-c", CONVERT_WRAPPER.format(src=args.llama_cpp),
                            "--outtype", "f32", "--outfile", os.path.join(OUT_DIR, name),
                            *extra, ckpt], check=True, env=env, cwd=args.llama_cpp)
        check_projector(ckpt, os.path.join(OUT_DIR, MMPROJ_GGUF))
        with open(FIXTURES_JSON, "w") as f:
            json.dump(reference(ckpt, vc), f, indent=1)


if __name__ == "__main__":
    main()
