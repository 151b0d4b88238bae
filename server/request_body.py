"""A request body, from its bytes to a validated request model, without stalling the event loop.

A large body is parsed on a worker thread, in pieces (server/json_io.py), and validated there.
pydantic holds the GIL while it validates, for as long as that takes (a second for 300,000
messages or five million token ids), so what no request may ask is refused before it: the
server's limits on nesting and list sizes (server/limits.py), a logit_bias with more entries
than the model has tokens, a token-id prompt longer than the context. The fan-out limit reads
the validated request. `read` is the one way a route reads its request.
"""
from __future__ import annotations

import functools

from server import json_io
from server.limits import Limits
from server.protocol import APIError, parse_json_body, parse_request


async def read(raw: bytes, cls, engine, limits: Limits):
    """The request model `cls` of the body `raw`; 400s naming the field. engine: the loaded
    engine (its vocabulary and context bound the checks), or None while it loads."""
    return await json_io.parse(raw, functools.partial(parse, cls=cls, engine=engine,
                                                      limits=limits))


def parse(raw: bytes, cls, engine, limits: Limits):
    """read's work, where it runs (the event loop for small bodies, a worker for large)."""
    limits.check_depth(raw)
    body = parse_json_body(raw)
    limits.check_lists(body, cls)
    if engine is not None:
        check_sizes(body, engine)
    req = parse_request(cls, body)
    limits.check_sequences(req)
    return req


def check_sizes(body: dict, engine) -> None:
    """400 for a field too large for any request to this model, read from the raw body."""
    bias = body.get("logit_bias")
    model_config = getattr(engine, "model_config", None)
    vocab = model_config.vocab_size if model_config is not None else engine.tokenizer.vocab_size
    if isinstance(bias, dict) and len(bias) > vocab:
        raise APIError(f"logit_bias has {len(bias)} entries, more than this model has tokens "
                       f"({vocab})", param="logit_bias", code="invalid_value")
    max_len = engine.max_model_len
    for name in ("prompt", "input"):
        value = body.get(name)
        if not isinstance(value, list) or not value:
            continue
        lists = [value] if isinstance(value[0], int) else value
        for ids in lists:
            if isinstance(ids, list) and len(ids) > max_len:
                raise APIError(f"This model's maximum context length is {max_len} tokens, and "
                               f"the {name} has {len(ids)} tokens. Please shorten it.",
                               param=name, code="context_length_exceeded")
