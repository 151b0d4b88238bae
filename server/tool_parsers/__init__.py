"""Tool-call parsers, one per output format, registered by name (`--enforce-parser NAME`).

`choose_parser(architecture, chat_template)` picks one for a model: the family from its
architecture, refined by the markers its chat template writes (a Qwen3-Coder template writes
`<parameter=`, a Llama 4 one `<|python_start|>`); a model of another type gets the parser whose
markers its template holds. The choice is logged where it is made.
"""
from __future__ import annotations

from server.tool_parsers.base import (DeltaMessage, Parsed, ToolCall, ToolCallStream, ToolParser,
                                      tool_call_id)
from server.tool_parsers.json_calls import JsonToolParser
from server.tool_parsers.llama import LlamaToolParser
from server.tool_parsers.mistral import MistralToolParser
from server.tool_parsers.pythonic import PythonicToolParser
from server.tool_parsers.qwen import QwenToolParser
from server.tool_parsers.qwen_coder import QwenCoderToolParser

PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    MistralToolParser, LlamaToolParser, PythonicToolParser, QwenToolParser, QwenCoderToolParser,
    JsonToolParser)}

# Markers a chat template writes, most specific first, and the parser that reads them. Llama
# 3.2's pythonic templates (vLLM's) name no marker: they ask for "a python list" of calls.
TEMPLATE_MARKERS = (("<parameter=", "qwen_coder"), ("<tool_call>", "qwen"),
                    ("[TOOL_CALLS]", "mistral"), ("<|python_start|>", "pythonic"),
                    ("python list", "pythonic"), ("<|python_tag|>", "llama"))

# Architecture (config.json) -> its family's parsers, the usual one first.
FAMILIES = {"MistralForCausalLM": ("mistral",), "MixtralForCausalLM": ("mistral",),
            "LlamaForCausalLM": ("llama", "pythonic"), "Llama4ForCausalLM": ("pythonic",),
            **{f"{q}ForCausalLM": ("qwen", "qwen_coder")
               for q in ("Qwen2", "Qwen3", "Qwen2Moe", "Qwen3Moe")}}


def choose_parser(architecture: str | None, chat_template: str | None) -> tuple[str | None, str]:
    """(parser name or None, why)."""
    template = chat_template or ""
    marked = [name for marker, name in TEMPLATE_MARKERS if marker in template]
    family = FAMILIES.get(architecture or "")
    if family:
        for name in marked:
            if name in family:
                return name, f"{architecture} and the chat template's markers"
        return family[0], architecture
    if marked:
        return marked[0], "the chat template's markers"
    return None, f"no parser knows {architecture} or the chat template's markers"


def get_parser(name: str) -> type[ToolParser]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; choose one of "
                         f"{', '.join(sorted(PARSERS))}") from None


__all__ = ["PARSERS", "DeltaMessage", "Parsed", "ToolCall", "ToolCallStream", "ToolParser",
           "choose_parser", "get_parser", "tool_call_id"]
