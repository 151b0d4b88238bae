"""The OpenAI-compatible server's wire format, pinned with the official `openai` client and the
OpenAI schema, against a scripted fake engine behind the real app on a real Hypercorn: exact
chunks, validation, errors, batching, and that a client leaving mid-stream aborts the request.
(tests/test_server_live.py runs a real `python -m server` process.)
"""
from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from server.app import ServerSettings
from server_fakes import (CHAT, FakeTokenizer, aborted_after_disconnect, assert_error,
                          client_for, fake_text, http_request, post_json, post_sse,
                          reset_fake,  # noqa: F401 (autouse fixture)
                          serve_fake, validate)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fake():
    yield from serve_fake(ServerSettings(["fake-model", "alias"]))


# ---- fake engine: the wire format

def test_models_and_health(fake):
    status, models = http_request(fake.port, "GET", "/v1/models")[::2]
    models = json.loads(models)
    assert status == 200
    validate(models, "ListModelsResponse")
    assert [m["id"] for m in models["data"]] == ["fake-model", "alias"]
    assert all(m["owned_by"] == "taper" and m["object"] == "model" for m in models["data"])
    client = client_for(fake.port)
    assert [m.id for m in client.models.list()] == ["fake-model", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    validate(json.loads(http_request(fake.port, "GET", "/v1/models/fake-model")[2]), "Model")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/other")
    assert http_request(fake.port, "GET", "/health")[0] == 200
    fake.engine.is_running = False
    assert http_request(fake.port, "GET", "/health")[0] == 503


def test_chat_non_streaming(fake):
    status, body = post_json(fake.port, "/v1/chat/completions", CHAT)
    assert status == 200, body
    validate(body, "CreateChatCompletionResponse")
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "logprobs": None, "finish_reason": "length",
                                "message": {"role": "assistant", "content": fake_text(6),
                                            "refusal": None}}]
    prompt = FakeTokenizer().encode_chat(CHAT["messages"])
    usage = body["usage"]
    times = {k: usage.pop(k) for k in ("prompt_time_costs", "completion_time_costs")}
    assert usage == {"prompt_tokens": len(prompt), "completion_tokens": 6,
                     "total_tokens": len(prompt) + 6, "prompt_tokens_details": {"cached_tokens": 3},
                     "completion_tokens_details": {"reasoning_tokens": 0}}
    assert all(isinstance(t, int) and t >= 0 for t in times.values()), times
    ids, params = fake.engine.requests[body["id"]]
    assert ids == prompt and params.max_tokens == 6


def test_chat_streaming_wire_format(fake):
    events = post_sse(fake.port, "/v1/chat/completions", {**CHAT, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for c in chunks:
        validate(c, "CreateChatCompletionStreamResponse")
        assert c["object"] == "chat.completion.chunk" and "usage" not in c
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == fake_text(6)


def test_chat_streaming_include_usage(fake):
    events = post_sse(fake.port, "/v1/chat/completions",
                      {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    chunks = events[:-1]
    for c in chunks:
        validate(c, "CreateChatCompletionStreamResponse")
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    # and through the SDK
    stream = client_for(fake.port).chat.completions.create(
        model="fake-model", messages=CHAT["messages"], max_tokens=4, stream=True,
        stream_options={"include_usage": True})
    got = list(stream)
    assert got[-1].choices == [] and got[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in got[:-1]) == fake_text(4)


def test_chat_sdk_and_sampling_params(fake):
    client = client_for(fake.port)
    r = client.chat.completions.create(
        model="alias", messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
        max_completion_tokens=20, temperature=0.5, top_p=0.9, seed=-5, stop=" How",
        presence_penalty=0.1, frequency_penalty=0.2,
        extra_body={"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2,
                    "ignore_eos": True, "stop_token_ids": [9], "thinking_token_budget": 64})
    assert r.model == "alias"
    assert r.choices[0].message.content == fake_text(5)    # cut before the stop string
    assert r.choices[0].finish_reason == "stop"
    ids, p = fake.engine.requests[r.id]
    assert bytes(ids).decode() == "<system>Be brief.<user>a\nb<assistant>"
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (20, 0.5, 0.9, 7, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.1)
    assert (p.seed, p.stop, p.stop_token_ids, p.min_tokens, p.ignore_eos) == (
        2**64 - 5, [" How"], [9], 2, True)
    assert p.reasoning_budget == 64


def test_max_tokens_defaults_to_the_room_left(fake):
    status, body = post_json(fake.port, "/v1/completions",
                             {"model": "fake-model", "prompt": "abc", "max_tokens": None})
    assert status == 200
    _, params = fake.engine.requests[body["id"] + "-0"]
    assert params.max_tokens == fake.engine.max_model_len - 4     # BOS + 3 bytes
    assert body["usage"]["completion_tokens"] == params.max_tokens


def test_completions(fake):
    client = client_for(fake.port)
    r = client.completions.create(model="fake-model", prompt="Say", max_tokens=3)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == [(0, fake_text(3), "length")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 3, 7)
    status, body = post_json(fake.port, "/v1/completions",
                             {"model": "fake-model", "prompt": ["a", "bb", "ccc"], "max_tokens": 2,
                              "echo": True})
    assert status == 200
    validate(body, "CreateCompletionResponse")
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "a" + fake_text(2)), (1, "bb" + fake_text(2)), (2, "ccc" + fake_text(2))]
    assert body["usage"]["prompt_tokens"] == 2 + 3 + 4
    assert body["usage"]["completion_tokens"] == 6
    for prompt, want in (([5, 6, 7], [[5, 6, 7]]), ([[5], [6, 7]], [[5], [6, 7]])):
        status, body = post_json(fake.port, "/v1/completions",
                                 {"model": "fake-model", "prompt": prompt, "max_tokens": 1})
        assert status == 200, body
        got = [fake.engine.requests[f"{body['id']}-{i}"][0] for i in range(len(want))]
        assert got == want
        assert len(body["choices"]) == len(want)


def test_completions_streaming_batch(fake):
    events = post_sse(fake.port, "/v1/completions",
                      {"prompt": ["x", "yy"], "max_tokens": 3, "stream": True, "echo": True,
                       "stream_options": {"include_usage": True}})
    chunks = events[:-1]
    for c in chunks[:-1]:
        validate(c, "CreateCompletionStreamResponse")
        assert c["object"] == "text_completion" and len(c["choices"]) == 1
    texts = {0: "", 1: ""}
    for c in chunks[:-1]:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == {0: "x" + fake_text(3), 1: "yy" + fake_text(3)}
    finals = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    # SDK streaming
    parts = list(client_for(fake.port).completions.create(model="fake-model", prompt="q",
                                                          max_tokens=5, stream=True))
    assert "".join(p.choices[0].text for p in parts) == fake_text(5)
    assert parts[-1].choices[0].finish_reason == "length"


# ---- fake engine: errors

@pytest.mark.parametrize("extra, param", [
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"stop": 5}, "stop"),
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 2}, "min_tokens"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]},
                                     "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_invalid_chat_params_are_400_naming_the_param(fake, extra, param):
    status, body = post_json(fake.port, "/v1/chat/completions", {**CHAT, **extra})
    assert_error(status, body, 400, param)


@pytest.mark.parametrize("extra, param", [({"best_of": 2}, "best_of")])
def test_later_features_are_400_not_yet_supported(fake, extra, param):
    status, body = post_json(fake.port, "/v1/chat/completions", {**CHAT, **extra})
    assert_error(status, body, 400, param, "unsupported_parameter")
    assert "not yet supported" in body["error"]["message"]


def test_completion_errors(fake):
    for extra, param in (({"suffix": "x"}, "suffix"), ({"logprobs": 21}, "logprobs"),
                         ({"n": 0}, "n"), ({"prompt": []}, "prompt"), ({"prompt": 7}, "prompt"),
                         ({"prompt": [1, -2]}, "prompt")):
        status, body = post_json(fake.port, "/v1/completions",
                                 {"prompt": "hi", "max_tokens": 2, **extra})
        assert_error(status, body, 400, param)


def test_sdk_errors(fake):
    client = client_for(fake.port)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=CHAT["messages"], temperature=5)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-model", messages=CHAT["messages"], n=0)
    assert e.value.param == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-5", messages=CHAT["messages"])
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x")


def test_malformed_json_and_routes(fake):
    for raw in (b"{not json", b"[1, 2]", b"", "\u00e9".encode("latin-1")):
        status, _, payload = http_request(fake.port, "POST", "/v1/chat/completions", raw=raw)
        assert_error(status, json.loads(payload), 400, None)
    status, _, payload = http_request(fake.port, "GET", "/v1/nothing")
    assert status == 404 and json.loads(payload)["error"]["type"] == "not_found_error"
    status, _, payload = http_request(fake.port, "GET", "/v1/chat/completions")
    assert status == 405 and "error" in json.loads(payload)


def test_context_length(fake):
    long = "x" * 300
    status, body = post_json(fake.port, "/v1/completions", {"prompt": long})
    assert_error(status, body, 400, "prompt", "context_length_exceeded")
    status, body = post_json(fake.port, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": long}]})
    assert_error(status, body, 400, "messages", "context_length_exceeded")
    status, body = post_json(fake.port, "/v1/completions", {"prompt": "x", "max_tokens": 255})
    assert_error(status, body, 400, "max_tokens", "context_length_exceeded")
    status, body = post_json(fake.port, "/v1/completions", {"prompt": "x", "max_tokens": 254})
    assert status == 200 and body["usage"]["total_tokens"] == 256


def test_null_means_not_given(fake):
    status, body = post_json(fake.port, "/v1/chat/completions",
                             {**CHAT, "stream": None, "n": None, "temperature": None,
                              "stop": None, "stream_options": None, "ignore_eos": None})
    assert status == 200, body
    assert body["object"] == "chat.completion"
    status, body = post_json(fake.port, "/v1/chat/completions", {**CHAT, "messages": None})
    assert_error(status, body, 400, "messages", "missing_required_parameter")


def test_template_rejection_is_400(fake):
    status, body = post_json(fake.port, "/v1/chat/completions",
                             {"messages": [{"role": "assistant", "content": "x"}]})
    assert_error(status, body, 400, "messages")


def test_engine_failure(fake):
    fake.engine.fail_with = "kernel exploded"
    status, body = post_json(fake.port, "/v1/chat/completions", CHAT)
    assert_error(status, body, 500, None, "engine_error")
    assert "kernel exploded" in body["error"]["message"]
    status, body = post_json(fake.port, "/v1/chat/completions", {**CHAT, "stream": True})
    assert_error(status, body, 500, None, "engine_error")    # failed before the first chunk
    fake.engine.is_running = False
    status, body = post_json(fake.port, "/v1/completions", {"prompt": "x"})
    assert_error(status, body, 503, None)


def test_client_disconnect_aborts_the_request(fake):
    fake.engine.delay = 0.02
    sock = socket.create_connection(("127.0.0.1", fake.port))
    body = json.dumps({**CHAT, "max_tokens": 10_000 // 50, "stream": True}).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while received.count(b"data: ") < 3:
        received += sock.recv(65536)
    sock.close()
    request_id = json.loads(received.split(b"data: ")[1].split(b"\n\n")[0])["id"]
    deadline = time.time() + 10
    while request_id not in fake.engine.aborted:
        assert time.time() < deadline, "the request was not aborted after the client left"
        time.sleep(0.02)


def test_client_disconnect_aborts_a_non_streamed_request(fake):
    aborted = aborted_after_disconnect(fake, "/v1/chat/completions", {**CHAT, "max_tokens": 200})
    assert aborted <= set(fake.engine.requests)


def test_each_schema_rejects_a_broken_response(fake):
    """The schemas can fail: a real response validates, the same response broken does not."""
    import copy

    import jsonschema
    chat = post_json(fake.port, "/v1/chat/completions", CHAT)[1]
    chunk = post_sse(fake.port, "/v1/chat/completions", {**CHAT, "stream": True})[0]
    completion = post_json(fake.port, "/v1/completions", {"prompt": "x", "max_tokens": 2})[1]
    models = json.loads(http_request(fake.port, "GET", "/v1/models")[2])
    error = post_json(fake.port, "/v1/completions", {"prompt": 5})[1]

    def broken(obj, edit):
        obj = copy.deepcopy(obj)
        edit(obj)
        return obj
    cases = [("CreateChatCompletionResponse", chat, lambda o: o.pop("choices")),
             ("CreateChatCompletionStreamResponse", chunk,
              lambda o: o.update(object="chat.completion")),
             ("CreateCompletionResponse", completion,
              lambda o: o["choices"][0].update(finish_reason="done")),
             ("ListModelsResponse", models, lambda o: o["data"][0].update(created="yesterday")),
             ("ErrorResponse", error, lambda o: o["error"].pop("message"))]
    for name, good, edit in cases:
        validate(good, name)
        with pytest.raises(jsonschema.ValidationError):
            validate(broken(good, edit), name)
