"""vLLM's `stream_options.continuous_usage_stats` (guidellm sends it): every streamed chunk of a
chat completion or a completion carries the usage so far, its completion_tokens the tokens
generated up to that chunk; without it only the last chunk has usage. On the fake engine of
tests/server_fakes.py, one word per token."""
from __future__ import annotations

import pytest

from server.app import ServerSettings
from server_fakes import CHAT, post_sse, serve_fake

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def fake():
    yield from serve_fake(ServerSettings(["fake-model"]))


def chunks_of(port: int, path: str, body: dict) -> list[dict]:
    events = post_sse(port, path, {**body, "stream": True})
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_every_chat_chunk_carries_the_usage_so_far(fake):
    chunks = chunks_of(fake.port, "/v1/chat/completions", {
        **CHAT, "max_tokens": 5,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    final = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and final["completion_tokens"] == 5
    words = 0
    for chunk in chunks[:-1]:
        usage = chunk["usage"]
        assert usage is not None, chunk
        assert usage["prompt_tokens"] == final["prompt_tokens"]
        words += bool(chunk["choices"][0]["delta"].get("content"))
        # each word is one token: the tokens so far are the words sent so far (the role chunk
        # follows the first token)
        assert usage["completion_tokens"] == max(words, 1), chunk
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert words == 5

    # asked alone, it implies include_usage; without it, only the last chunk has usage
    alone = chunks_of(fake.port, "/v1/chat/completions", {
        **CHAT, "stream_options": {"continuous_usage_stats": True}})
    assert all(c["usage"] is not None for c in alone)
    plain = chunks_of(fake.port, "/v1/chat/completions", {
        **CHAT, "stream_options": {"include_usage": True}})
    assert [c["usage"] is None for c in plain] == [True] * (len(plain) - 1) + [False]


def test_a_batched_completion_counts_every_prompt(fake):
    chunks = chunks_of(fake.port, "/v1/completions", {
        "model": "fake-model", "prompt": ["One", "Two two", "Three"], "max_tokens": 4,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    final = chunks[-1]["usage"]
    assert final["completion_tokens"] == 12
    counts = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 12 and counts[0] < 12
    assert all(c["usage"]["prompt_tokens"] == final["prompt_tokens"] for c in chunks)
    texts = sum(1 for c in chunks[:-1] if c["choices"][0]["text"])
    assert texts == 12          # one chunk per token, each counted when it is sent
    sent = 0
    for c in chunks[:-1]:
        sent += bool(c["choices"][0]["text"])
        assert c["usage"]["completion_tokens"] >= sent
