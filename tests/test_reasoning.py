"""server/reasoning.py: a reasoning model's text split into reasoning and answer, whole and
streamed. The streamed parts, cut at every position, must extend each other and end equal to
the whole text's split."""
from __future__ import annotations

import pytest

from server.reasoning import prompt_opens_reasoning, split_reasoning

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
def test_streamed_parts_extend_each_other(text, opened, reasoning, answer, step):
    sent_r, sent_a = "", ""
    for end in list(range(0, len(text), step)) + [len(text)]:
        r, a = split_reasoning(text[:end], opened, final=end == len(text))
        assert (r or "").startswith(sent_r) and a.startswith(sent_a), (text[:end], r, a)
        sent_r, sent_a = r or "", a
    assert (sent_r, sent_a) == (reasoning or "", answer)


def test_partial_tags_are_held_back():
    assert split_reasoning("<thi", final=False) == (None, "")
    assert split_reasoning("<think>abc</thi", final=False) == ("abc", "")
    assert split_reasoning("<think>abc \n", final=False) == ("abc", "")
    assert split_reasoning("<think>abc</think>\n", final=False) == ("abc", "")


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert not prompt_opens_reasoning("<think>\n\n</think>\n\n")     # Qwen3, thinking off
