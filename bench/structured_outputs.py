"""Structured outputs: decode overhead of the token mask at batch 1 and 8, and grammar compile time.

    python -m bench.structured_outputs [--vocab 32000] [--tokens 64] [--repeats 3]

The checkpoint is the demo model (random weights, 4 layers of 256) with a byte-level BPE
tokenizer trained to `--vocab` tokens on generated text, so the mask covers a realistic
vocabulary. Overhead: the same B requests (seeded, temperature 1, `--tokens` each, EOS ignored)
free and constrained by a JSON schema whose one string field runs for the whole length; reported
as decode tokens/s, the overhead in percent, and the mask's own host time per step (llguidance
filling the bitmask plus the sampler's `apply_token_bitmask`). Compile: 20 realistic schemas
(tool calls, API payloads, forms), each compiled cold 5 times: p50 / p99 / max in ms.
Prints numbers; it is not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import numpy as np


def make_checkpoint(path: str, vocab: int) -> str:
    """The demo checkpoint with a tokenizer of about `vocab` tokens (BPE on generated words)."""
    import server.demo_model as demo
    rng = random.Random(0)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in ("a", "e", "i", "o", "u", "ar",
                                                               "en", "is", "on", "ul")]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
             for _ in range(vocab * 2)]
    lines = [" ".join(rng.choice(words) for _ in range(24)) for _ in range(vocab // 2)]
    saved = demo.CORPUS, demo.VOCAB_TARGET
    demo.CORPUS, demo.VOCAB_TARGET = demo.CORPUS + "\n".join(lines), vocab
    try:
        return demo.write_demo_checkpoint(path)
    finally:
        demo.CORPUS, demo.VOCAB_TARGET = saved


LONG_TEXT = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 4000}},
             "required": ["text"], "additionalProperties": False}


def run_batch(llm, B: int, tokens: int, constrained: bool) -> tuple[float, int]:
    from engine import SamplingParams
    from engine.sampling.structured_outputs import StructuredOutputsParams, json_spec
    prompts = [f"Request {i}: write something." for i in range(B)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams("json", json_spec(
                                 LONG_TEXT)) if constrained else None) for i in range(B)]
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", engine.tokenizer.encode(p), sp)
    # prefill first (not timed: it is the same with and without the mask)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished():
        produced += len(engine.step())
    return time.perf_counter() - start, produced


def overhead(llm, tokens: int, repeats: int):
    """Free vs constrained decode tokens/s (wall clock: noisy on a shared machine), and the
    mask's own host time per step (median), which does not depend on the machine's load."""
    structured = llm.engine.structured_outputs()
    fills: list[float] = []
    inner = structured.bitmask

    def timed(seqs):
        t = time.perf_counter()
        out = inner(seqs)
        if out is not None:
            fills.append(time.perf_counter() - t)
        return out
    structured.bitmask = timed
    from engine.sampling import structured_outputs as so_module
    advances: list[float] = []
    inner_advance = so_module.StructuredOutputs.advance

    def timed_advance(seq, token):
        t = time.perf_counter()
        ok = inner_advance(seq, token)
        if seq.grammar is not None:
            advances.append(time.perf_counter() - t)
        return ok
    so_module.StructuredOutputs.advance = staticmethod(timed_advance)
    be = llm.engine.backend
    print(f"\n## decode with and without the mask ({tokens} tokens per request, median of "
          f"{repeats} interleaved runs)")
    print("| batch | free tok/s | constrained tok/s | overhead (wall) | host work per step: "
          "fill + apply + advance (median) | host work / constrained step |")
    print("|---|---|---|---|---|---|")
    for B in (1, 8):
        run_batch(llm, B, 8, True)            # warm-up: grammar cached, code paths hot
        free, cons, step = [], [], []
        fills.clear()
        for _ in range(repeats):
            dt, n = run_batch(llm, B, tokens, False)
            free.append(n / dt)
            dt, n = run_batch(llm, B, tokens, True)
            cons.append(n / dt)
            step.append(dt / (n / B))
        f, c = float(np.median(free)), float(np.median(cons))
        fill = float(np.median(fills))
        V = llm.engine.model_config.vocab_size
        logits = np.random.default_rng(0).standard_normal((B, V)).astype(np.float32)
        mask = np.full((B, (V + 31) // 32), 0x55555555, dtype=np.int32)
        rows = np.arange(B, dtype=np.int32)
        applies = []
        for _ in range(21):
            t = time.perf_counter()
            be.apply_token_bitmask(logits, mask, rows)
            applies.append(time.perf_counter() - t)
        apply = float(np.median(applies))
        host = fill + apply + B * float(np.median(advances))
        advances.clear()
        print(f"| {B} | {f:.1f} | {c:.1f} | {100 * (f - c) / f:+.1f}% | {1e3 * host:.3f} ms "
              f"({1e3 * fill:.3f} + {1e3 * apply:.3f} + {B} x "
              f"{1e6 * host / B - 1e6 * (fill + apply) / B:.0f} us) | "
              f"{100 * host / float(np.median(step)):.2f}% |")


def schemas() -> list[dict]:
    s = lambda **p: {"type": "string", **p}                      # noqa: E731
    i = lambda **p: {"type": "integer", **p}                     # noqa: E731
    obj = lambda props, req=None: {"type": "object", "properties": props,   # noqa: E731
                                   "required": req or list(props),
                                   "additionalProperties": False}
    address = obj({"street": s(maxLength=80), "city": s(maxLength=40),
                   "zip": s(pattern=r"^[0-9]{5}(-[0-9]{4})?$"), "country": s(minLength=2,
                                                                              maxLength=2)})
    person = obj({"first": s(), "last": s(), "email": s(format="email"), "age": i(minimum=0),
                  "address": address})
    money = obj({"amount": {"type": "number", "minimum": 0}, "currency": {"enum": ["USD", "EUR",
                                                                                  "GBP", "JPY"]}})
    return [
        obj({"location": s(), "unit": {"enum": ["celsius", "fahrenheit"]}}),      # weather tool
        obj({"query": s(maxLength=200), "top_k": i(minimum=1, maximum=50),
             "filters": {"type": "array", "items": s(), "maxItems": 10}}),        # search tool
        person,
        address,
        obj({"sku": s(pattern=r"^[A-Z]{3}-[0-9]{4}$"), "name": s(), "price": money,
             "tags": {"type": "array", "items": s(), "maxItems": 8},
             "stock": i(minimum=0)}),                                             # product
        obj({"order_id": s(format="uuid"), "customer": person, "items": {
            "type": "array", "minItems": 1, "items": obj({"sku": s(), "qty": i(minimum=1),
                                                          "unit_price": money})},
             "status": {"enum": ["pending", "paid", "shipped", "cancelled"]},
             "created": s(format="date-time")}),                                  # order
        obj({"title": s(), "start": s(format="date-time"), "end": s(format="date-time"),
             "attendees": {"type": "array", "items": s(format="email")},
             "location": {"anyOf": [address, {"type": "null"}]}}),                # calendar event
        obj({"sentiment": {"enum": ["positive", "neutral", "negative"]},
             "confidence": {"type": "number", "minimum": 0, "maximum": 1},
             "aspects": {"type": "array", "items": obj({"aspect": s(), "sentiment": {
                 "enum": ["positive", "neutral", "negative"]}})}}),               # classification
        obj({"entities": {"type": "array", "items": obj({
            "text": s(), "type": {"enum": ["PERSON", "ORG", "LOC", "DATE", "MONEY"]},
            "start": i(minimum=0), "end": i(minimum=0)})}}),                      # NER
        obj({"answer": s(), "citations": {"type": "array", "items": obj({
            "url": s(format="uri"), "quote": s(maxLength=300)}), "maxItems": 5}}),   # RAG answer
        obj({"steps": {"type": "array", "items": obj({"explanation": s(), "output": s()})},
             "final_answer": s()}),                                               # OpenAI's math
        {"$defs": {"node": {"type": "object", "properties": {
            "name": s(), "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["name"], "additionalProperties": False}},
         "$ref": "#/$defs/node"},                                                 # recursive tree
        obj({"name": s(), "arguments": {"oneOf": [
            obj({"path": s()}), obj({"url": s(format="uri"), "method": {"enum": ["GET", "POST"]}}),
            obj({"sql": s(maxLength=1000)})]}}),                                  # tool dispatch
        obj({"username": s(pattern=r"^[a-z0-9_]{3,16}$"), "password_strength": {
            "enum": ["weak", "medium", "strong"]}, "roles": {"type": "array", "items": {
                "enum": ["admin", "editor", "viewer"]}, "maxItems": 3}}),   # account form
        obj({"level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]}, "ts": s(format="date-time"),
             "service": s(), "message": s(), "context": {"type": "object",
                                                         "additionalProperties": s()}}),   # log line
        obj({"resume": obj({"name": s(), "skills": {"type": "array", "items": s()},
                            "experience": {"type": "array", "items": obj({
                                "company": s(), "role": s(), "years": {"type": "number"}})},
                            "education": {"type": "array", "items": obj({
                                "school": s(), "degree": s(), "year": i(minimum=1950,
                                                                        maximum=2030)})}})}),
        obj({"rows": {"type": "array", "items": {"type": "array", "items": {
            "type": ["string", "number", "null"]}, "maxItems": 12}, "maxItems": 100}}),   # table
        obj({"translation": s(), "source_lang": s(pattern=r"^[a-z]{2}$"),
             "target_lang": s(pattern=r"^[a-z]{2}$")}),
        obj({"rating": i(minimum=1, maximum=5), "title": s(maxLength=100),
             "body": s(maxLength=5000), "recommend": {"type": "boolean"}}),       # review
        obj({"plan": {"type": "array", "items": obj({
            "tool": {"enum": ["search", "browse", "python", "email"]},
            "input": s(), "depends_on": {"type": "array", "items": i(minimum=0)}}),
            "minItems": 1, "maxItems": 8}, "done": {"type": "boolean"}}),         # agent plan
    ]


def compile_times(llm, runs: int = 5):
    from engine.sampling.structured_outputs import (GrammarCompiler, StructuredOutputsParams,
                                                    json_spec)
    engine = llm.engine
    start = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size,
                               engine.eos_token_ids)
    wrap = time.perf_counter() - start
    all_schemas = schemas()
    assert len(all_schemas) == 20
    times = []
    for schema in all_schemas:
        spec = json_spec(schema)
        for _ in range(runs):
            t = time.perf_counter()
            compiler._compile(StructuredOutputsParams("json", spec))   # cold: no cache
            times.append(time.perf_counter() - t)
    ms = np.array(times) * 1e3
    hit = StructuredOutputsParams("json", json_spec(all_schemas[5]))
    compiler.compile(hit)
    t = time.perf_counter()
    compiler.compile(StructuredOutputsParams("json", json_spec(all_schemas[5])))
    cached = (time.perf_counter() - t) * 1e3
    print(f"\n## grammar compile, 20 schemas x {runs} cold compiles (V = "
          f"{engine.model_config.vocab_size})")
    print(f"p50 {np.percentile(ms, 50):.2f} ms, p99 {np.percentile(ms, 99):.2f} ms, "
          f"max {ms.max():.2f} ms; cache hit {cached:.3f} ms; wrapping the tokenizer once "
          f"{wrap * 1e3:.0f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from engine import LLM
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = make_checkpoint(os.path.join(tmp, "ckpt"), args.vocab)
        llm = LLM(path, backend="cpu", kv_cache_memory_mb=256)
        print(f"checkpoint: demo model, vocabulary {llm.engine.model_config.vocab_size} "
              f"(made in {time.perf_counter() - start:.0f} s); {os.cpu_count()} CPUs")
        compile_times(llm)
        overhead(llm, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
