"""A reasoning model's text split into its reasoning (between <think> and </think>) and its answer.

One pure function serves whole and streamed responses: a stream calls it on the text so far with
`final=False`, which holds back what the next delta could still change (a half-written tag, the
reasoning's trailing whitespace), so each call's parts extend the previous call's and the new
suffixes are the deltas to send.
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


def split_reasoning(text: str, opened: bool = False,
                    final: bool = True) -> tuple[str | None, str]:
    """(reasoning, answer). reasoning is None when the text has no reasoning part; then the
    answer is the text exactly as generated. `opened`: the prompt already opened <think>."""
    if not opened:
        head = text.lstrip()
        if not head.startswith(OPEN):
            if not final and OPEN.startswith(head):     # "", "<", "<thi": may still open
                return None, ""
            return None, text
        text = head[len(OPEN):]
    end = text.find(CLOSE)
    if end < 0:
        if not final:
            text = text[:len(text) - _partial_tag(text, CLOSE)].rstrip()
        return text.strip(), ""
    return text[:end].strip(), text[end + len(CLOSE):].lstrip()
