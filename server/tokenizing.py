"""Tokenizing a request's text: never on the event loop, a few at a time, and never a text that
cannot fit the context.

Tokenizing costs time and memory in proportion to the text (a 10 MB prompt took seconds and
about 700 MB), and every such request ends in a 400 anyway when the text has more tokens than the
context. So the text is measured first: more characters than `max_text_chars` (the context length
times the most characters one token can stand for, engine/text/char_bound.py) is a 400 at once.
Rendering a chat template and tokenizing run on TOKENIZER_THREADS threads of their own, so that
however many large requests arrive at once, at most that many tokenize (their memory is bounded)
while the event loop goes on serving everyone else.
"""
from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from engine.text.tokenizer import TextTooLong
from server.protocol import APIError

TOKENIZER_THREADS = 2

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="taper-tokenize")
        return _pool


async def run(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the tokenizer threads (a request that waits for one and is
    cancelled meanwhile never runs)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor(), functools.partial(fn, *args, **kwargs))


def max_text_chars(engine) -> int | None:
    """The most characters a prompt for this engine can have; None: the tokenizer gives no
    such bound, or the model has no tokenizer (its prompts are token ids)."""
    if engine.tokenizer is None:
        return None
    return engine.tokenizer.max_text_chars(engine.max_model_len)


def check_lengths(engine, texts, param: str) -> None:
    """A 400 for the first text of `texts` (token-id prompts are skipped) longer than any prompt
    for this engine can be: a batch is refused before any of it is tokenized."""
    limit = max_text_chars(engine)
    for text in texts:
        if limit is not None and isinstance(text, str) and len(text) > limit:
            raise too_long(engine, TextTooLong(len(text), limit), param)


def too_long(engine, e: TextTooLong, param: str) -> APIError:
    max_len = engine.max_model_len
    return APIError(f"This model's maximum context length is {max_len} tokens, and the {param} "
                    f"has {e.num_chars} characters: more than any text of {max_len} tokens can "
                    f"have with this model's tokenizer ({e.max_chars}). Please shorten it.",
                    param=param, code="context_length_exceeded")
