"""How one streamed answer appears in the terminal: the reasoning in a panel of its own, then the
answer as plain text written as it arrives (so it scrolls like any terminal output and copies
exactly).

Reasoning comes either as `reasoning_content` / `reasoning` deltas (vLLM's and OpenRouter's field
names) or inline as `<think>...</think>` in the content; ThinkSplitter finds the tags even when
a delta ends in the middle of one.
"""
from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Model text may hold any byte: drop control characters (an escape sequence could rewrite the
# terminal), keeping tabs and newlines.
_CONTROL = {c: None for c in [*range(0, 9), *range(11, 32), *range(127, 160)]}


def printable(text: str) -> str:
    return text.translate(_CONTROL)


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkSplitter:
    """Splits streamed content into ("reasoning" | "answer", text) pieces at <think> tags."""

    def __init__(self):
        self.thinking = False
        self.pending = ""          # the end of the last delta, when it may be a tag's start

    def feed(self, text: str) -> list[tuple[str, str]]:
        text, self.pending = self.pending + text, ""
        pieces = []
        while text:
            kind = "reasoning" if self.thinking else "answer"
            tag = THINK_CLOSE if self.thinking else THINK_OPEN
            at = text.find(tag)
            if at >= 0:
                pieces.append((kind, text[:at]))
                text = text[at + len(tag):]
                self.thinking = not self.thinking
                continue
            keep = _partial_tag(text, tag)
            pieces.append((kind, text[:len(text) - keep]))
            self.pending = text[len(text) - keep:]
            break
        return [(kind, text) for kind, text in pieces if text]

    def flush(self) -> list[tuple[str, str]]:
        """The held-back end of the stream: it was no tag after all."""
        text, self.pending = self.pending, ""
        return [("reasoning" if self.thinking else "answer", text)] if text else []


class AnswerView:
    """Draws one answer as its deltas arrive; `close()` ends it whatever state it is in.
    `answer` is the answer's text without the reasoning: what the conversation keeps."""

    def __init__(self, console: Console):
        self.console = console
        self.splitter = ThinkSplitter()
        self.answer = ""
        self.reasoning = ""              # of the panel now open
        self.live: Live | None = None    # the reasoning panel while it streams
        self.streaming = False           # the panel still grows: draw its newest lines
        self.after_reasoning = False     # the answer's first text follows a panel

    def add(self, content: str | None = None, reasoning: str | None = None):
        if reasoning:
            self._add_reasoning(reasoning)
        if content:
            for kind, text in self.splitter.feed(content):
                (self._add_reasoning if kind == "reasoning" else self._add_answer)(text)

    def close(self, note: str | None = None):
        for kind, text in self.splitter.flush():
            (self._add_reasoning if kind == "reasoning" else self._add_answer)(text)
        self._close_panel()
        if self.answer:
            self.console.out("")          # end the answer's line
        if note:
            self.console.print(Text(note, style="dim"))

    # ---- the reasoning panel

    def _add_reasoning(self, text: str):
        if self.live is None:
            if self.answer and not self.answer.endswith("\n"):
                self.console.out("")      # a panel after some answer starts on its own line
            self.reasoning, self.streaming = "", True
            # get_renderable: each refresh draws the text as it is then, at most 8 times a second
            self.live = Live(console=self.console, get_renderable=self._panel,
                             refresh_per_second=8, transient=False)
            self.live.start()
        self.reasoning += text

    def _panel(self) -> Panel:
        text = Text(printable(self.reasoning.strip()), style="dim italic")
        if self.streaming:        # only the newest lines fit while it grows; all of it at the end
            lines = text.wrap(self.console, max(self.console.width - 4, 10))
            room = max(self.console.height - 4, 3)
            if len(lines) > room:
                text = Text("\n").join(lines[-room:])
        return Panel(text, title="reasoning", title_align="left", border_style="dim")

    def _close_panel(self):
        if self.live is not None:
            self.streaming = False
            self.live.stop()
            self.live = None
            self.after_reasoning = True

    # ---- the answer

    def _add_answer(self, text: str):
        self._close_panel()
        if not self.answer and self.after_reasoning:
            text = text.lstrip()          # the blank line models put after </think>
        if text:
            self.answer += text
            self.console.out(printable(text), end="", highlight=False)
