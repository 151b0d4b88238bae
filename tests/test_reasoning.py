"""server/reasoning.py: a reasoning model's text split into reasoning and answer, whole and
streamed. The streamed parts, cut at every position, must extend each other and end equal to
the whole text's split."""
from __future__ import annotations

import pytest

from server.reasoning import ReasoningSplitter, prompt_opens_reasoning, split_reasoning

CASES = [
    # (text, prompt opened <think>, reasoning, answer)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "Let me see.", "Paris."),
    ("  <think>a</think>b", False, "a", "b"),
    ("Paris.", False, None, "Paris."),
    ("\n\nParis is <think>ing</think>", False, None, "\n\nParis is <think>ing</think>"),
    ("<thinking>no tag", False, None, "<thinking>no tag"),
    ("<", False, None, "<"),
    ("", False, None, ""),
    ("<think>cut before the end", False, "cut before the end", ""),
    ("so x = 2.\n</think>\n\nx is 2", True, "so x = 2.", "x is 2"),
    ("only thoughts", True, "only thoughts", ""),
    ("<think></think>\n\nHi", False, "", "Hi"),
]


@pytest.mark.parametrize("text, opened, reasoning, answer", CASES)
def test_split_whole(text, opened, reasoning, answer):
    assert split_reasoning(text, opened) == (reasoning, answer)


@pytest.mark.parametrize("text, opened, reasoning, answer", CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_streamed_in_pieces_equals_whole(text, opened, reasoning, answer, step):
    splitter = ReasoningSplitter(opened)
    pieces = [text[i:i + step] for i in range(0, len(text), step)] + [""]
    parts = [splitter.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(r for r, _ in parts) == (reasoning or "")
    assert "".join(a for _, a in parts) == answer
    assert splitter.has_reasoning == (reasoning is not None)


def test_partial_tags_and_trailing_whitespace_are_held_back():
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>\nabc ") == ("abc", "")
    assert splitter.feed("\n</thi") == ("", "")
    assert splitter.feed("nk>\n") == ("", "")
    assert splitter.feed("\nHi ") == ("", "Hi ")
    assert splitter.feed("</think>", final=True) == ("", "</think>")    # the answer, verbatim
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("s is not", final=True) == ("", "<this is not")
    assert not splitter.has_reasoning


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<think>\n\n</think>\n\n")     # Qwen3, thinking off
