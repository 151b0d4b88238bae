"""Tool-call grammars: compile time and the mask's cost per step, per call format.

    python -m bench.tool_grammar [--vocab 32000] [--repeats 20]

Two grammars per format (server/tool_grammar.py) over two tools with schemas: `required` (the
whole answer is calls) and `strict` under tool_choice auto (free text, a started call held to
its schema; a lazy grammar). Compile: cold (no cache), median and max of --repeats, in ms.
Mask: llguidance filling the bitmask for one row, median us per step over the tokens of a piece
of prose (strict only: the state where the model answers in text) and of a call. The tokenizer
is the demo model's BPE trained to about --vocab tokens (bench/structured_outputs.py), markers
plain text.
Prints numbers; it is not a test.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "strict": True, "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 80},
                                         "limit": {"type": "integer"}},
        "required": ["query"], "additionalProperties": False}}},
]
PROSE = ("The forecast for the coming days depends on the city; tell me which one and I will "
         "look it up for you right away")
CALLS = {
    "qwen": '<tool_call>\n{"name":"search","arguments":{"query":"weather in oslo","limit":3}}',
    "qwen_coder": "<tool_call>\n<function=search>\n<parameter=query>\nweather in oslo\n"
                  "</parameter>\n<parameter=limit>\n3\n</parameter>\n</function>",
    "mistral": '[TOOL_CALLS][{"name":"search","arguments":{"query":"weather in oslo","limit":3}}',
    "llama": '{"name":"search","parameters":{"query":"weather in oslo","limit":3}}',
    "json": '{"name":"search","arguments":{"query":"weather in oslo","limit":3}}',
    "pythonic": '[search(query="weather in oslo", limit=3)',
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    import llguidance
    from llguidance import LLMatcher, LLTokenizer
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
    from tokenizers import Tokenizer as RustTokenizer

    from bench.structured_outputs import make_checkpoint
    from server.tool_grammar import strict_call_constraint, tool_call_constraint
    from server.tool_parsers import get_parser

    with tempfile.TemporaryDirectory() as tmp:
        rust = RustTokenizer.from_file(make_checkpoint(tmp, args.vocab) + "/tokenizer.json")
    plain = types.SimpleNamespace(has_special_tokens=lambda strings: False)
    print(f"vocabulary {rust.get_vocab_size()} tokens, {args.repeats} repeats")
    print(f"{'format':<11} {'grammar':<9} {'compile p50/max ms':>19} {'mask prose us':>14} "
          f"{'mask in call us':>16}")
    for fmt, in_call in CALLS.items():
        prose = PROSE
        parser = get_parser(fmt)(TOOLS)
        for kind in ("required", "strict"):
            so = (tool_call_constraint(parser, TOOLS, "required", True, plain) if kind == "required"
                  else strict_call_constraint(parser, TOOLS, True, plain))
            times = []
            for _ in range(args.repeats):
                llt = LLTokenizer(rust.to_str(), n_vocab=rust.get_vocab_size())  # cold cache
                t = time.perf_counter()
                grammar = llguidance.grammar_from("lark", so.spec)
                template = LLMatcher(llt, grammar, log_level=0)
                times.append((time.perf_counter() - t) * 1e3)
                assert not template.is_error(), template.get_error()
            mask = allocate_token_bitmask(1, llt.vocab_size)
            cells = []
            for text in ((prose,) if kind == "strict" else ()) + (in_call,):
                m = template.deep_copy()
                steps = []
                for token in rust.encode(text).ids:    # one fill per step, as the engine does
                    t = time.perf_counter()
                    fill_next_token_bitmask(m, mask, 0)
                    steps.append((time.perf_counter() - t) * 1e6)
                    if not m.consume_token(token):
                        raise SystemExit(f"{fmt} {kind}: {text!r} refused: {m.get_error()}")
                cells.append(f"{statistics.median(steps):.0f}")
            prose_us = cells[0] if kind == "strict" else "-"
            print(f"{fmt:<11} {kind:<9} {statistics.median(times):>10.1f} / {max(times):<6.1f} "
                  f"{prose_us:>14} {cells[-1]:>16}")


if __name__ == "__main__":
    main()
