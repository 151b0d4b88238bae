"""A reasoning model's text split into its reasoning (between <think> and </think>) and its answer.

One splitter serves whole and streamed responses: fed the text delta by delta, it gives back the
new reasoning and the new answer, holding back what the next delta could still change (a
half-written tag, the reasoning's trailing whitespace). Its work per delta is proportional to the
delta, not to the text so far, so a long reasoning costs nothing extra per token. The reasoning
and the answer are trimmed of the whitespace around the tags; text without reasoning is passed on
exactly as generated.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Templates of DeepSeek-R1 and of some Qwen3 variants open <think> in the prompt itself, so
    the model's text starts inside the reasoning."""
    return prompt_tail.rstrip().endswith(OPEN)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, opened: bool = False):
        """`opened`: the prompt already opened <think>, so the text starts inside it."""
        self.state = "reasoning" if opened else "start"     # start | reasoning | answer
        self.has_reasoning = opened
        self._pending = ""          # held back: maybe a tag, or whitespace that may be trimmed
        self._reasoning_begun = False
        self._answer_begun = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new answer) once `delta` is added; `final`: no more text comes."""
        text, self._pending = self._pending + delta, ""
        if self.state == "start":
            head = text.lstrip()
            if head.startswith(OPEN):
                self.state, self.has_reasoning = "reasoning", True
                text = head[len(OPEN):]
            elif not final and OPEN.startswith(head):       # "", "<", "<thi": may still open
                self._pending = text
                return "", ""
            else:
                self.state, self._answer_begun = "answer", True
                return "", text
        reasoning = ""
        if self.state == "reasoning":
            end = text.find(CLOSE)
            if end < 0:
                keep = 0 if final else _partial_tag(text, CLOSE)
                body = text[:len(text) - keep]
                reasoning = self._reasoning_piece(body)
                if not final:
                    self._pending = body[len(body.rstrip()):] + text[len(body):]
                return reasoning, ""
            reasoning = self._reasoning_piece(text[:end])
            self.state, text = "answer", text[end + len(CLOSE):]
        if not self._answer_begun:
            text = text.lstrip()
            self._answer_begun = bool(text)
        return reasoning, text

    def _reasoning_piece(self, body: str) -> str:
        """What of `body` goes out now: no leading whitespace before the first word, no trailing
        whitespace (held back in feed until more text follows it)."""
        if not self._reasoning_begun:
            body = body.lstrip()
            self._reasoning_begun = bool(body)
        return body.rstrip()


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a whole text; reasoning is None when it has none."""
    splitter = ReasoningSplitter(opened)
    reasoning, answer = splitter.feed(text, final=True)
    return (reasoning if splitter.has_reasoning else None), answer
