"""Make the GGUF fixtures of issue 33's --mmproj for Mistral 3 (Pixtral's tower) in
tests/data/gguf/ with llama.cpp's own converter (the llama.cpp tree as
tests/data/make_gguf_vl_fixtures.py fetches it):

    python tests/data/make_gguf_mistral3_vl_fixtures.py \\
        --llama-cpp /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

transformers writes the tiny random Mistral 3 of tests/mistral3_checkpoint.py (a silu Pixtral
tower, projector biases); convert_hf_to_gguf.py turns it into a mistral3 text GGUF and, with
--mmproj, a clip projector GGUF (projector type pixtral), both F32 (the source's weights exactly,
q/k permuted as the converter does). transformers' greedy tokens on the source, for prompts with
one and two images of tests/vision_checkpoint.py's sample_image, go to mistral3vl_fixtures.json
with their logprobs, the prompt ids (PixtralProcessor's: each [IMG] expanded to the image's
rows) and the sha256 of each source tower tensor; the images are preprocessed as
PixtralImageProcessorPil's defaults (longest edge 1024, CLIP's mean and std), which Taper
serves beside a GGUF: the projector file holds no processor settings but the mean and std.
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
FIXTURES_JSON = os.path.join(OUT_DIR, "mistral3vl_fixtures.json")
TEXT_GGUF = "mistral3vl-f32.gguf"
MMPROJ_GGUF = "mistral3vl-mmproj-f32.gguf"
GEN = 8
TIE = 1e-4
# (chat message parts: text, or None for an image), (width, height, seed) of each image
CASES = {
    "one image": (["What is in this picture?", None, " Describe it."], [(40, 56, 5)]),
    "two images": ([None, "Compare the two images:", None, "which one is brighter?"],
                   [(23, 31, 5), (48, 40, 6)]),
}


def reference(ckpt: str, vc, unit: int) -> dict:
    import torch
    from transformers import (AutoTokenizer, Mistral3ForConditionalGeneration,
                              PixtralImageProcessorPil)
    model = Mistral3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(ckpt)
    ip = PixtralImageProcessorPil()
    out = {}
    for name, (parts, specs) in CASES.items():
        images = [vc.sample_image(w, h, seed=s) for w, h, s in specs]
        pixels = ip(images=images, patch_size={"height": unit, "width": unit},
                    return_tensors="pt")
        content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
        sizes = iter(pixels["image_sizes"].tolist())
        pieces = text.split("[IMG]")
        expanded = pieces[0]
        for piece in pieces[1:]:
            h, w = next(sizes)
            expanded += ("[IMG]" * (w // unit) + "[IMG_BREAK]") * (h // unit - 1)
            expanded += "[IMG]" * (w // unit) + "[IMG_END]" + piece
        ids = tok(expanded, add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            g = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                               pixel_values=pixels["pixel_values"],
                               image_sizes=pixels["image_sizes"], max_new_tokens=GEN,
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


def check_projector(ckpt: str, mmproj: str) -> dict:
    """Taper's reading of the projector file holds the source's tower tensor for tensor (q and
    k un-permuted); returns each tensor's sha256 (float32 bytes) for the tests, which have no
    source to compare with (the tiny tower's tokens barely move with its rotary pairing)."""
    import hashlib

    import numpy as np
    from safetensors import safe_open

    from engine.loader.gguf_mmproj import read_mmproj
    from engine.models.mistral3 import _checkpoint_names
    _, weights = read_mmproj(mmproj)
    with safe_open(os.path.join(ckpt, "model.safetensors"), "np") as f:
        source = {k: f.get_tensor(k) for k in f.keys() if "language_model" not in k}
    _checkpoint_names(source)
    assert sorted(weights) == sorted(source), set(weights) ^ set(source)
    for name, w in source.items():
        assert np.array_equal(weights[name], w), name
    return {name: hashlib.sha256(np.ascontiguousarray(w, np.float32).tobytes()).hexdigest()
            for name, w in sorted(source.items())}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-cpp", required=True, help="llama.cpp's source tree")
    args = parser.parse_args()
    import torch  # noqa: F401  (before the engine's modules: transformers must see it first)
    root = os.path.dirname(HERE)
    sys.path[:0] = [os.path.dirname(root), root, HERE]
    import vision_checkpoint as vc
    from make_gguf_fixtures import CONVERT_WRAPPER
    from mistral3_checkpoint import MERGE, PATCH, tiny_mistral3_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_mistral3_checkpoint(os.path.join(tmp, "ckpt"))
        env = dict(os.environ)
        env.pop("NO_LOCAL_GGUF", None)
        for name, extra in ((TEXT_GGUF, []), (MMPROJ_GGUF, ["--mmproj"])):
            subprocess.run([sys.executable, "-c", CONVERT_WRAPPER.format(src=args.llama_cpp),
                            "--outtype", "f32", "--outfile", os.path.join(OUT_DIR, name),
                            *extra, ckpt], check=True, env=env, cwd=args.llama_cpp)
        digests = check_projector(ckpt, os.path.join(OUT_DIR, MMPROJ_GGUF))
        with open(FIXTURES_JSON, "w") as f:
            json.dump({"cases": reference(ckpt, vc, PATCH * MERGE), "tower_sha256": digests},
                      f, indent=1)


if __name__ == "__main__":
    main()
