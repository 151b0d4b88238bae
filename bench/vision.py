"""Images on the CPU (issue 33): the vision encoder's time per image against transformers' on the
same weights, time to first token with 1 and 4 images against text-only prompts of the same
length, and 16 clients of mixed text and image requests against 16 text-only clients, in one run.

    python -m bench.vision [--image-size 224] [--vision-depth 32] [--clients 16] [--gen-len 32]
        [--reps 3] [--wait-quiet S] [--json out.json]

Checkpoint (random weights, bf16, written once by transformers under bench/.cache/): Qwen2.5-VL's
vision tower at its released shape (32 blocks, hidden 1280, 16 heads, MLP 3420, 14-pixel patches
merged 2x2, 112-pixel windows, full attention in blocks 7/15/23/31: the same tower in the 3B, 7B
and 72B), --vision-depth fewer blocks for a quicker run (full attention every 8th block, as
released), on a small language model (SmolLM2-135M's shapes: hidden 576, 30 layers, 9 query and
3 KV heads), Qwen2-VL's chat template and image processor (min/max pixels around --image-size).
A --image-size square image is (size/14)^2 patches and a quarter as many image tokens.

encoder: one image through Taper's encoder (the engine's own Qwen25VisionEncoder, in this
process) and through transformers' `model.visual` (torch, as many threads, in bf16 and in float32:
the faster is the reference), median of --reps, on the same processor outputs. ratio =
transformers' time / Taper's (above 1: Taper faster).

ttft: `python -m server` on the checkpoint, one streamed chat request at a time with 1 and with 4
fresh images (new pixels each rep, so neither the encoder cache nor the prefix cache helps) and
a short question, against a text-only request of the same prompt length (the image request's
usage.prompt_tokens, random tokens); ratio = image TTFT / text TTFT, so the images' cost is what
the ratio adds above 1.

mixed: --clients concurrent requests, half of them with one fresh image, --gen-len tokens each
(ignore_eos), against the same number of text-only requests of the same prompt lengths; output
tok/s of both and their ratio.

On a shared machine each figure prints the share of the CPUs other processes used meanwhile;
--wait-quiet S waits up to S seconds for a quiet machine before each measurement.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import serve
from bench.make_checkpoint import CACHE
from bench.serve_check import start_process
from bench.throughput import OtherLoad, machine_info, wait_quiet

# the tests' tokenizer maker and sample images (tests/vision_checkpoint.py), as pytest imports it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import vision_checkpoint  # noqa: E402

SEED = 20261129
QUESTION = "Describe this picture in one sentence."
PATCH, MERGE = 14, 2


def checkpoint(depth: int, image_size: int, cache: Path = CACHE) -> Path:
    """The random Qwen2.5-VL directory (model, tokenizer, image processor), made once."""
    d = cache / f"qwen2_5_vl-tower{depth}-lm135m-random-bf16-img{image_size}"
    if (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file():
        return d
    import torch
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    d.mkdir(parents=True, exist_ok=True)
    tok = vision_checkpoint.build_tokenizer(d)    # Qwen's vision tokens, Qwen2-VL's template
    ids = {t: tok.convert_tokens_to_ids(t) for t in vision_checkpoint.SPECIAL}
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=len(tok),
                         max_position_embeddings=8192, rms_norm_eps=1e-6,
                         bos_token_id=None, eos_token_id=ids["<|im_end|>"],
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [8, 12, 12]}),
        vision_config=dict(depth=depth, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2,
                           window_size=112, out_hidden_size=576,
                           fullatt_block_indexes=list(range(7, depth, 8))),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True)
    torch.manual_seed(SEED)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(str(d))
    side = image_size * image_size
    Qwen2VLImageProcessorPil(min_pixels=side // 2, max_pixels=side * 2, patch_size=PATCH,
                             merge_size=MERGE, temporal_patch_size=2).save_pretrained(str(d))
    return d


def image(size: int, seed: int):
    """A size x size image of colour gradients plus noise: every seed gives different pixels."""
    return vision_checkpoint.sample_image(size, size, seed)


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(vision_checkpoint.png_bytes(img)).decode()


def quiet(max_s: float) -> None:
    if max_s > 0:
        wait_quiet(max_s)


def timed(fn, reps: int, quiet_s: float) -> dict:
    """Median and best seconds of fn() over reps (after one warm-up), and the others' CPU share."""
    fn()
    times, others = [], []
    for _ in range(reps):
        quiet(quiet_s)
        load = OtherLoad()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        others.append(load.fraction())
    return {"median_s": statistics.median(times), "best_s": min(times),
            "others": max(others)}


# ---- encoder: Taper's against transformers'

def bench_encoder(ckpt: Path, size: int, reps: int, quiet_s: float) -> dict:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.vision.config import ImageProcessorConfig
    from engine.vision.preprocess import preprocess_image

    engine = LLMEngine(EngineConfig(model=str(ckpt), backend="cpu", kv_cache_memory_mb=64,
                                    async_scheduling=False))
    model = engine.runner.model
    processed = preprocess_image(image(size, SEED), ImageProcessorConfig.from_pretrained(
        str(ckpt), model.config.vision))
    taper = timed(lambda: model.vision_encoder.encode(processed.pixel_values, processed.grid_thw),
                  reps, quiet_s)
    del engine, model

    torch.set_num_threads(os.cpu_count() or 1)
    grid = torch.tensor([list(processed.grid_thw)])
    refs = {}
    for name, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(ckpt), dtype=dtype).eval()
        pixels = torch.from_numpy(np.ascontiguousarray(processed.pixel_values)).to(dtype)
        with torch.inference_mode():
            refs[name] = timed(lambda: hf.model.visual(pixels, grid_thw=grid), reps, quiet_s)
        del hf
    ref = min(refs.values(), key=lambda r: r["median_s"])
    tokens = int(np.prod(processed.grid_thw)) // (MERGE * MERGE)
    return {"patches": int(np.prod(processed.grid_thw)), "image_tokens": tokens,
            "taper": taper, "transformers": ref, "transformers_by_dtype": refs,
            "ratio": ref["median_s"] / taper["median_s"]}


# ---- the server: TTFT and mixed serving

def image_content(n_images: int, size: int, seed: int) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image(size, seed + i))}}
             for i in range(n_images)]
    return parts + [{"type": "text", "text": QUESTION}]


def chat_len(tokenizer, content: str) -> int:
    """Tokens of the chat prompt of one user message with this text."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def text_like(tokenizer, n_tokens: int, seed: int) -> str:
    """A user message whose chat prompt is about n_tokens long: random non-special tokens."""
    rng = np.random.default_rng(seed)
    allowed = np.array(sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids)))
    overhead = chat_len(tokenizer, "")
    ids = rng.choice(allowed, size=max(1, n_tokens - overhead)).tolist()
    return serve.fit_to_length(tokenizer, ids, max(1, n_tokens - overhead), rng, allowed)[0]


async def one(url: str, model: str, content, gen_len: int) -> serve.RequestOutput:
    out = await serve.send_request(url, "openai-chat", model, content, 0, gen_len,
                                   ignore_eos=True)
    if not out.success:
        raise SystemExit(f"a request failed: {out.error}")
    return out


async def many(url: str, model: str, contents: list, gen_len: int) -> tuple[float, int]:
    """All at once; (seconds to the last token, output tokens)."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(one(url, model, c, gen_len) for c in contents))
    return time.perf_counter() - t0, sum(o.output_tokens for o in outs)


def bench_server(ckpt: Path, args) -> dict:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    port = args.port
    log = CACHE / "bench_vision_server.log"
    proc = start_process([sys.executable, "-m", "server", "--w", str(ckpt), "--p", str(port)],
                         f"http://127.0.0.1:{port}/health", str(log), 600)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    seed = [SEED + 1000]

    def fresh() -> int:
        seed[0] += 16
        return seed[0]

    try:
        model = json.loads(serve_get(f"http://127.0.0.1:{port}/v1/models"))["data"][0]["id"]
        asyncio.run(one(url, model, image_content(1, args.image_size, fresh()), 1))   # warm-up
        asyncio.run(one(url, model, text_like(tokenizer, 64, fresh()), 1))
        out = {}
        for n in (1, 4):
            rows = []
            for _ in range(args.reps):
                quiet(args.wait_quiet)
                load = OtherLoad()
                img = asyncio.run(one(url, model, image_content(n, args.image_size, fresh()), 1))
                txt = asyncio.run(one(url, model, text_like(tokenizer, img.prompt_len, fresh()),
                                      1))
                rows.append((img.ttft, txt.ttft, img.prompt_len, load.fraction()))
            img_t = statistics.median(r[0] for r in rows)
            txt_t = statistics.median(r[1] for r in rows)
            out[f"ttft_{n}"] = {"images": n, "prompt_tokens": rows[0][2], "image_s": img_t,
                                "text_s": txt_t, "ratio": img_t / txt_t,
                                "others": max(r[3] for r in rows)}
        img_len = out["ttft_1"]["prompt_tokens"]
        txt_len = chat_len(tokenizer, QUESTION)
        rows = []
        for _ in range(args.reps):      # fresh pixels and texts: no encoder or prefix cache hits
            contents = [image_content(1, args.image_size, fresh()) if i % 2 == 0
                        else text_like(tokenizer, txt_len, fresh()) for i in range(args.clients)]
            texts = [text_like(tokenizer, img_len if i % 2 == 0 else txt_len, fresh())
                     for i in range(args.clients)]
            quiet(args.wait_quiet)
            load = OtherLoad()
            mixed_s, mixed_tok = asyncio.run(many(url, model, contents, args.gen_len))
            text_s, text_tok = asyncio.run(many(url, model, texts, args.gen_len))
            rows.append((mixed_tok / mixed_s, text_tok / text_s, load.fraction()))
        mixed = statistics.median(r[0] for r in rows)
        text = statistics.median(r[1] for r in rows)
        out["mixed"] = {"clients": args.clients, "mixed_tok_s": mixed, "text_tok_s": text,
                        "ratio": mixed / text, "others": max(r[2] for r in rows)}
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def serve_get(url: str) -> str:
    import urllib.request
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--vision-depth", type=int, default=32)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--port", type=int, default=2187)
    p.add_argument("--wait-quiet", type=float, default=0.0)
    p.add_argument("--parts", nargs="+", choices=["encoder", "server"],
                   default=["encoder", "server"], help="encoder: the tower alone; server: TTFT "
                   "and 16 mixed clients")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.image_size % (PATCH * MERGE) or args.vision_depth < 1:
        p.error(f"--image-size must be a multiple of {PATCH * MERGE}, --vision-depth at least 1")
    ckpt = checkpoint(args.vision_depth, args.image_size)
    print(f"machine: {json.dumps(machine_info())}\ncheckpoint: {ckpt}", flush=True)
    enc, srv = {}, {}
    if "encoder" in args.parts:
        enc = bench_encoder(ckpt, args.image_size, args.reps, args.wait_quiet)
        show_encoder(enc, args)
    if "server" in args.parts:
        srv = bench_server(ckpt, args)
        show_server(srv, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "machine": machine_info(),
                                               "encoder": enc, **srv}, indent=2) + "\n")
    return 0


def show_encoder(enc: dict, args) -> None:
    refs = ", ".join(f"{k} {v['median_s']:.3f} s" for k, v in enc["transformers_by_dtype"].items())
    others = max(r["others"] for r in (enc["taper"], *enc["transformers_by_dtype"].values()))
    print(f"encoder, one {args.image_size}x{args.image_size} image ({enc['patches']} patches, "
          f"{enc['image_tokens']} tokens), tower depth {args.vision_depth}: Taper "
          f"{enc['taper']['median_s']:.3f} s, transformers {refs} -> {enc['ratio']:.2f}x "
          f"[others: {others:.0%}]", flush=True)


def show_server(srv: dict, args) -> None:
    for n in (1, 4):
        r = srv[f"ttft_{n}"]
        print(f"TTFT, {n} image(s), {r['prompt_tokens']} prompt tokens: {r['image_s']:.3f} s "
              f"against text only {r['text_s']:.3f} s -> {r['ratio']:.2f}x [others: "
              f"{r['others']:.0%}]", flush=True)
    m = srv["mixed"]
    print(f"{m['clients']} clients, half with an image, {args.gen_len} tokens each: "
          f"{m['mixed_tok_s']:.1f} output tok/s against text only {m['text_tok_s']:.1f} -> "
          f"{m['ratio']:.2f}x [others: {m['others']:.0%}]", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
