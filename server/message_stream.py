"""One chat choice's generated text as OpenAI message deltas: reasoning, content, tool calls.

The text goes first through the reasoning splitter (server/reasoning.py; reasoning models only),
then what is answer goes through the request's tool-call parser (server/tool_parsers/), and what
is left is content. Both stages send only what can no longer change, so the streamed deltas add
up to exactly the whole message that the non-streamed response folds from the same deltas.
"""
from __future__ import annotations

from server.reasoning import ReasoningSplitter
from server.tool_parsers import ToolCallStream, ToolParser


class MessageStream:
    def __init__(self, call_id_prefix: str, reasoning: ReasoningSplitter | None = None,
                 tool_parser: ToolParser | None = None, parallel_tool_calls: bool = True,
                 stop_texts: tuple[str, ...] = ()):
        """stop_texts: the stop tokens' text, cut from the end of the text (a request that keeps
        special tokens in its text would otherwise show its end-of-sequence token)."""
        self.reasoning = reasoning
        self.stop_texts = stop_texts
        self.tools = None if tool_parser is None else ToolCallStream(tool_parser, call_id_prefix)
        self.parallel = parallel_tool_calls
        self.num_reasoning_tokens = 0

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.num_calls > 0

    def feed(self, text: str, num_tokens: int = 0, final: bool = False) -> dict:
        """The delta fields for `text` (the next piece of the choice's text, made of
        `num_tokens` tokens); `final`: the choice has ended, flush everything."""
        delta: dict = {}
        if final:
            stop = next((t for t in self.stop_texts if t and text.endswith(t)), "")
            text = text[:len(text) - len(stop)]
        answer = text
        if self.reasoning is not None:
            was_answering = self.reasoning.state == "answer"
            thought, answer = self.reasoning.feed(text, final)
            if self.reasoning.has_reasoning and not was_answering:
                self.num_reasoning_tokens += num_tokens
            if thought:
                delta["reasoning_content"] = delta["reasoning"] = thought
        if self.tools is None:
            if answer:
                delta["content"] = answer
            return delta
        parts = [self.tools.feed(answer)]
        if final:
            parts.append(self.tools.finish())
        content = "".join(p.content for p in parts)
        calls = _merge_calls([c for p in parts for c in p.tool_calls
                              if self.parallel or c["index"] == 0])
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


def _merge_calls(calls: list[dict]) -> list[dict]:
    """Entries for one call index in one delta merged into one (argument text concatenated)."""
    merged: list[dict] = []
    for c in calls:
        if merged and merged[-1]["index"] == c["index"]:
            merged[-1]["function"]["arguments"] += c["function"]["arguments"]
        else:
            merged.append({**c, "function": dict(c["function"])})
    return merged
