"""truncation "auto" in the Responses API: the longest tail of the conversation that fits the
context, found without rendering the conversation once per dropped turn.

What goes: the oldest turns first, and the assistant turns that would then open the conversation;
the instructions and the last turn always stay. So a tail starts at a turn that is not the
assistant's, or at the last turn.

How: counting from the end, each turn's text is tokenized on its own (its content and tool
calls, without what the template adds around it) until the context is full or the text is longer
than the context can hold (server/tokenizing.py); that gives a first guess. The guess is then
corrected by rendering candidate tails: a binary search between a tail known to be too long and
one known to fit, each rendering the size of the context, never of the whole conversation.
Dropping one turn at a time and rendering it all again took 161 s of CPU for 2,000 messages.
"""
from __future__ import annotations

import json
from typing import Awaitable, Callable

from server import tokenizing

# render(k): the prompt of the conversation from turn k on, or None when its text alone is
# longer than any prompt that fits.
Render = Callable[[int], Awaitable[list[int] | None]]


def tail_starts(turns: list[dict]) -> list[int]:
    """Where a truncated conversation may start, ascending (never 0: that is no truncation)."""
    last = len(turns) - 1
    return [k for k in range(1, len(turns)) if turns[k]["role"] != "assistant" or k == last]


def _turn_text(turn: dict) -> str:
    text = turn.get("content") or ""
    if not isinstance(text, str):
        text = json.dumps(text, ensure_ascii=False)
    if turn.get("tool_calls"):
        text += json.dumps(turn["tool_calls"], ensure_ascii=False)
    return text


def guess_from_end(tok, turns: list[dict], starts: list[int], budget: int,
                   max_chars: int | None) -> int:
    """The index in `starts` of the longest tail whose turns' own tokens fit `budget`
    (the last start when none does). Tokenizes only the turns that may fit."""
    valid = {k: i for i, k in enumerate(starts)}
    best = len(starts) - 1
    tokens = chars = 0
    for k in range(len(turns) - 1, 0, -1):
        text = _turn_text(turns[k])
        chars += len(text)
        if max_chars is not None and chars > max_chars:
            break
        tokens += len(tok.encode(text, add_special_tokens=False))
        if tokens > budget:
            break
        if k in valid:
            best = valid[k]
    return best


async def longest_fitting_tail(engine, turns: list[dict], budget: int,
                               render: Render) -> tuple[int, list[int] | None]:
    """(k, prompt) of the longest tail turns[k:] that fits `budget` tokens; when not even the
    last turn does, its (k, prompt) (None when too long to tokenize). `turns` has at least two
    turns."""
    starts = tail_starts(turns)
    guess = await tokenizing.run(guess_from_end, engine.tokenizer, turns, starts, budget,
                                 tokenizing.max_text_chars(engine))
    rendered: dict[int, list[int] | None] = {}          # by index in `starts`

    async def fits(i: int) -> bool:
        if i not in rendered:
            rendered[i] = await render(starts[i])
        ids = rendered[i]
        return ids is not None and len(ids) <= budget

    # A binary search for the first start that fits, between `bad` (too long; -1 stands for
    # the whole conversation, which the caller found too long) and `good` (fits).
    if await fits(guess):
        bad, good = -1, guess
        if guess > 0 and not await fits(guess - 1):      # the guess is usually right
            bad = guess - 1
    else:
        bad, good = guess, len(starts) - 1
        if not await fits(good):
            return starts[good], rendered[good]
    while good - bad > 1:
        mid = (bad + good) // 2
        if await fits(mid):
            good = mid
        else:
            bad = mid
    return starts[good], rendered[good]
