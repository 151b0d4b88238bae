"""The server around the API: loading and draining states, auth, CORS, body and queue limits,
/metrics, /version, /tokenize and /detokenize, server-side defaults, and what chat messages may
carry. Against the scripted fake engine (tests/server_fakes.py) on a real Hypercorn."""
from __future__ import annotations

import json
import logging

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.app import ServerSettings, create_app
from server import request_body
from server.limits import Limits
from server_fakes import (CHAT, FakeEngine, ThreadedServer, assert_error, client_for,
                          http_response, post_json)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def serve():
    """serve(engine, **settings) -> a running server; all closed after the test."""
    servers = []

    def start(engine, **settings):
        settings.setdefault("served_model_names", ["fake-model"])
        server = ThreadedServer(create_app(engine, ServerSettings(**settings)))
        server.engine, server.state = engine, server.app.taper
        servers.append(server)
        return server
    yield start
    for s in servers:
        s.close()


def metric_samples(port: int, headers=None) -> dict[str, float]:
    status, _, payload = http_response(port, "GET", "/metrics", headers=headers)
    assert status == 200, payload
    return {s.name + (f"{{{s.labels['finished_reason']}}}" if "finished_reason" in s.labels
                      else ""): s.value
            for fam in text_string_to_metric_families(payload.decode()) for s in fam.samples}


# ---- states

def test_loading_then_ready_then_draining(serve):
    server = serve(None)                       # the model is still loading
    status, headers, body = http_response(server.port, "GET", "/health")
    assert (status, json.loads(body)) == (503, {"status": "loading"})
    status, headers, body = http_response(server.port, "POST", "/v1/chat/completions", CHAT)
    assert_error(status, json.loads(body), 503, None, "model_loading")
    assert headers["retry-after"] == "5"
    assert http_response(server.port, "GET", "/v1/models")[0] == 200   # names are known already

    server.state.engine = FakeEngine()         # loaded
    assert http_response(server.port, "GET", "/health")[0] == 200
    assert post_json(server.port, "/v1/chat/completions", CHAT)[0] == 200

    server.state.draining = True               # SIGTERM
    status, _, body = http_response(server.port, "GET", "/health")
    assert (status, json.loads(body)) == (503, {"status": "shutting down"})
    status, body = post_json(server.port, "/v1/completions", {"prompt": "x"})
    assert_error(status, body, 503, None, "shutting_down")
    assert http_response(server.port, "GET", "/v1/models")[0] == 503
    assert http_response(server.port, "GET", "/metrics")[0] == 200    # still scraped


# ---- auth, CORS, limits

def test_api_key_guards_every_route_but_health(serve):
    server = serve(FakeEngine(), api_key="s3cret")
    port = server.port
    assert http_response(port, "GET", "/health")[0] == 200
    for method, path, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                               ("GET", "/version", None), ("POST", "/v1/chat/completions", CHAT),
                               ("POST", "/tokenize", {"prompt": "x"})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            status, h, payload = http_response(port, method, path, body, headers=headers)
            assert_error(status, json.loads(payload), 401, None, "invalid_api_key")
            assert h["www-authenticate"] == "Bearer"
        status, _, payload = http_response(port, method, path, body,
                                           headers={"Authorization": "Bearer s3cret"})
        assert status == 200, (path, payload)
    with pytest.raises(openai.AuthenticationError):
        client_for(port).models.list()
    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="s3cret", max_retries=0)
    assert sdk.chat.completions.create(model="fake-model", messages=CHAT["messages"],
                                       max_tokens=3).choices[0].message.content == "Hello there,"


def test_cors(serve):
    port = serve(FakeEngine(), api_key="k", cors_origins=["*"]).port
    asked = "authorization, content-type, x-stainless-os"      # what openai-node sends
    status, h, _ = http_response(port, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked})
    assert status == 204                       # a preflight needs no key
    assert h["access-control-allow-origin"] == "*"
    assert h["access-control-allow-headers"] == asked
    status, h, _ = http_response(port, "GET", "/v1/models",
                                 headers={"Origin": "http://ui.example", "Authorization": "Bearer k"})
    assert status == 200 and h["access-control-allow-origin"] == "*"

    port = serve(FakeEngine(), cors_origins=["http://ok.example"]).port
    _, h, _ = http_response(port, "GET", "/v1/models", headers={"Origin": "http://ok.example"})
    assert h["access-control-allow-origin"] == "http://ok.example"
    _, h, _ = http_response(port, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in h

    port = serve(FakeEngine()).port            # the default: no origin
    for method in ("OPTIONS", "GET"):
        _, h, _ = http_response(port, method, "/v1/models", headers={
            "Origin": "http://ui.example", "Access-Control-Request-Method": "GET"})
        assert not [k for k in h if k.startswith("access-control-")], h


def test_a_post_that_is_not_json_is_415(serve):
    port = serve(FakeEngine()).port
    body = json.dumps(CHAT).encode()
    for ctype in ("text/plain", "multipart/form-data; boundary=x", "application/jsonx", None):
        headers = {} if ctype is None else {"Content-Type": ctype}
        status, h, payload = http_response(port, "POST", "/v1/chat/completions", raw=body,
                                           headers=headers, content_type=None)
        assert_error(status, json.loads(payload), 415, None, "unsupported_media_type")
        assert (ctype or "none") in json.loads(payload)["error"]["message"]
    for ctype in ("application/json", "Application/JSON; charset=utf-8",
                  "application/vnd.api+json"):
        status, _, payload = http_response(port, "POST", "/v1/chat/completions", raw=body,
                                           headers={"Content-Type": ctype})
        assert status == 200, (ctype, payload)
    assert http_response(port, "GET", "/v1/models", content_type=None)[0] == 200

def test_body_size_limit(serve):
    port = serve(FakeEngine(), limits=Limits(max_body_bytes=4096)).port
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    status, _, payload = http_response(port, "POST", "/v1/chat/completions", big)
    assert_error(status, json.loads(payload), 413, None)
    assert post_json(port, "/v1/chat/completions", CHAT)[0] == 200      # still serving


SMALL = Limits(max_json_depth=5, max_messages=2, max_prompts=2, max_request_sequences=4,
               max_stop_strings=2, max_stop_length=5)
HI = {"role": "user", "content": "Hi"}


@pytest.mark.parametrize("path, body, param, named", [
    ("/v1/chat/completions", {**CHAT, "messages": [HI] * 3}, "messages", "2 (--max-messages)"),
    ("/tokenize", {"messages": [HI] * 3}, "messages", "2 (--max-messages)"),
    ("/v1/responses", {"input": [HI] * 3}, "input", "2 (--max-messages)"),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt", "2 (--max-prompts)"),
    ("/v1/completions", {"prompt": [[1], [2], [3]]}, "prompt", "2 (--max-prompts)"),
    ("/v1/embeddings", {"input": ["a", "b", "c"]}, "input", "2 (--max-prompts)"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 3}, "n",
     "2 prompts x 3 choices = 6 sequences; this server allows at most 4 a request "
     "(--max-request-sequences)"),
    ("/v1/chat/completions", {**CHAT, "n": 5}, "n", "4 a request (--max-request-sequences)"),
    ("/v1/chat/completions", {**CHAT, "use_beam_search": True, "best_of": 5}, "n",
     "5 beams = 5 sequences"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c"]}, "stop",
     "2 (--max-stop-strings)"),
    ("/v1/completions", {"prompt": "x", "stop": "abcdef"}, "stop", "5 (--max-stop-length)"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "abcdef"]}, "stop[1]",
     "5 (--max-stop-length)"),
    ("/v1/completions", {"prompt": [[[[["x"]]]]]}, None, "nested 6 levels deep; this server "
     "allows at most 5 (--max-json-depth)"),
])
def test_request_limits_name_the_limit_and_its_flag(serve, path, body, param, named):
    port = serve(FakeEngine(), limits=SMALL).port
    status, reply = post_json(port, path, body)
    assert_error(status, reply, 400, param)
    assert named in reply["error"]["message"], reply


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "messages": [HI] * 2, "stop": ["a", "abcde"]}),
    ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}),
    ("/v1/completions", {"prompt": list(range(1, 50)), "max_tokens": 2}),   # one prompt of ids
    ("/v1/completions", {"prompt": "[[[[[[[[", "max_tokens": 2, "x": [[[{"y": "]]]"}]]]}),
    ("/tokenize", {"messages": [HI] * 2}),
])
def test_requests_at_the_limits_are_served(serve, path, body):
    port = serve(FakeEngine(), limits=SMALL).port
    status, reply = post_json(port, path, body)
    assert status == 200, reply


def test_fan_out_at_the_limit_is_read():
    from server.protocol import ChatCompletionRequest, CompletionRequest
    raw = json.dumps({"prompt": ["a", "b"], "n": 2}).encode()
    assert request_body.parse(raw, CompletionRequest, None, SMALL).fan_out() == (4, "2 prompts x 2 choices")
    raw = json.dumps({**CHAT, "n": 2, "best_of": 4, "use_beam_search": True}).encode()
    assert request_body.parse(raw, ChatCompletionRequest, None, SMALL).fan_out() == (4, "4 beams")


def test_json_nested_past_the_parser_is_a_400(serve):
    """Without the depth limit's check, json's own recursion limit is a 400 too, not a 500."""
    port = serve(FakeEngine(), limits=Limits(max_json_depth=10**6)).port
    status, _, payload = http_response(port, "POST", "/v1/completions",
                                       raw=b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert_error(status, json.loads(payload), 400, None, "json_too_deep")


def test_queue_limit_is_429_with_retry_after(serve):
    engine = FakeEngine()
    port = serve(engine, max_queued_requests=2).port
    engine.queued = 2
    status, h, payload = http_response(port, "POST", "/v1/chat/completions", CHAT)
    assert_error(status, json.loads(payload), 429, None, "queue_full")
    assert h["retry-after"] == "1"
    assert http_response(port, "POST", "/v1/completions", {"prompt": "x"})[0] == 429
    with pytest.raises(openai.RateLimitError):
        client_for(port).chat.completions.create(model="fake-model", messages=CHAT["messages"])
    engine.queued = 1
    assert post_json(port, "/v1/chat/completions", CHAT)[0] == 200
    status, body = post_json(port, "/v1/completions", {"prompt": ["a", "b"]})   # 1 + 2 > 2
    assert_error(status, body, 429, None, "queue_full")
    # a request counts its sequences: prompts x n
    status, body = post_json(port, "/v1/chat/completions", {**CHAT, "n": 2})     # 1 + 2 > 2
    assert_error(status, body, 429, None, "queue_full")
    status, body = post_json(port, "/v1/completions", {"prompt": "x", "n": 2})
    assert_error(status, body, 429, None, "queue_full")
    engine.queued = 0
    assert post_json(port, "/v1/completions", {"prompt": ["a", "b"]})[0] == 200
    status, body = post_json(port, "/v1/completions", {"prompt": ["a", "b"], "n": 2})
    assert_error(status, body, 400, "n", "too_many_sequences")   # could never wait: not a 429
    assert "4 sequences" in body["error"]["message"]
    assert "--max-queued-requests" in body["error"]["message"]
    # embeddings: each input a sequence
    status, body = post_json(port, "/v1/embeddings", {"input": ["a", "b", "c"]})
    assert_error(status, body, 400, "input", "too_many_sequences")
    engine.queued = 1
    status, body = post_json(port, "/v1/embeddings", {"input": ["a", "b"]})
    assert_error(status, body, 429, None, "queue_full")


# ---- service routes

def test_metrics_read_the_engine_and_time_requests(serve):
    port = serve(FakeEngine()).port
    before = metric_samples(port)
    assert before["taper:num_requests_running"] == 2
    assert before["taper:kv_cache_usage_perc"] == 0.25
    assert before["taper:prefix_cache_hits_total"] == 30
    assert before["taper:prefix_cache_queries_total"] == 40
    assert before["taper:num_preemptions_total"] == 1
    assert before["taper:generation_tokens_total"] == 45
    assert before["taper:time_to_first_token_seconds_count"] == 0
    assert post_json(port, "/v1/chat/completions", CHAT)[0] == 200
    assert post_json(port, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4})[0] == 200
    after = metric_samples(port)
    assert after["taper:time_to_first_token_seconds_count"] == 3
    assert after["taper:inter_token_latency_seconds_count"] == 5 + 3 + 3
    assert after["taper:e2e_request_latency_seconds_count"] == 3
    assert after["taper:request_success_total{length}"] == 3


def test_metrics_while_loading_have_no_engine_gauges(serve):
    samples = metric_samples(serve(None).port)
    assert "taper:num_requests_running" not in samples
    assert samples["taper:e2e_request_latency_seconds_count"] == 0


def test_version(serve):
    status, _, payload = http_response(serve(FakeEngine()).port, "GET", "/version")
    assert status == 200 and isinstance(json.loads(payload)["version"], str)


def test_tokenize_and_detokenize(serve):
    server = serve(FakeEngine())
    port = server.port
    status, body = post_json(port, "/tokenize", {"prompt": "Hi!", "return_token_strs": True})
    assert (status, body) == (200, {"count": 4, "max_model_len": 256, "tokens": [1, 72, 105, 33],
                                    "token_strs": ["<1>", "<72>", "<105>", "<33>"]})
    status, body = post_json(port, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})
    assert body["tokens"] == [72, 105]
    status, body = post_json(port, "/tokenize", {"messages": CHAT["messages"]})
    assert body["tokens"] == list(b"<user>Hi<assistant>") and body["token_strs"] is None
    status, body = post_json(port, "/tokenize", {"messages": CHAT["messages"], "prompt": "x"})
    assert_error(status, body, 400, None)
    status, body = post_json(port, "/detokenize", {"tokens": [72, 105]})
    assert (status, body) == (200, {"prompt": "Hi"})
    status, body = post_json(port, "/detokenize", {"tokens": [72, 999]})
    assert_error(status, body, 400, "tokens[1]", "invalid_value")
    status, body = post_json(port, "/detokenize", {"tokens": "Hi"})
    assert_error(status, body, 400, "tokens")


# ---- defaults

def test_server_defaults_fill_what_the_request_leaves_out(serve):
    engine = FakeEngine()
    engine.generation_defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    port = serve(engine, sampling_defaults={"temperature": 0.3, "min_p": 0.05},
                 max_gen_tokens=5).port

    def params(body):
        status, resp = post_json(port, "/v1/chat/completions", body)
        assert status == 200, resp
        return engine.requests[resp["id"]][1]

    p = params({"messages": CHAT["messages"]})
    # flags over generation_config.json, both under the request; max_tokens capped by default
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.3, 0.9, 20, 0.05, 5)
    p = params({"messages": CHAT["messages"], "temperature": 1.0, "top_k": -1, "max_tokens": 50})
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 0, 50)   # an explicit value wins
    # without defaults the engine's own apply
    plain = FakeEngine()
    port = serve(plain).port
    status, resp = post_json(port, "/v1/chat/completions", {"messages": CHAT["messages"]})
    p = plain.requests[resp["id"]][1]
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 256 - len(b"<user>Hi<assistant>"))


def test_chat_template_flag_serves_a_model_without_one(serve):
    engine = FakeEngine()
    engine.tokenizer.has_chat_template = False
    port = serve(engine).port
    status, body = post_json(port, "/v1/chat/completions", CHAT)
    assert_error(status, body, 400, "messages", "no_chat_template")
    assert "--chat-template" in body["error"]["message"]
    port = serve(engine, chat_template="{{ messages }}").port
    assert post_json(port, "/v1/chat/completions", CHAT)[0] == 200
    assert engine.tokenizer.last_chat_template == "{{ messages }}"
    # a template in the request is code from the client: refused unless the operator trusts it
    own = {**CHAT, "chat_template": "{{ 'x' }}"}
    status, body = post_json(port, "/v1/chat/completions", own)
    assert_error(status, body, 400, "chat_template", "unsupported_parameter")
    port = serve(engine, trust_request_chat_template=True).port
    assert post_json(port, "/v1/chat/completions", own)[0] == 200
    assert engine.tokenizer.last_chat_template == "{{ 'x' }}"


# ---- what messages may carry

def test_message_shapes(serve, caplog):
    engine = FakeEngine()
    port = serve(engine).port
    tok = engine.tokenizer
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Weather?"},
                                                            {"type": "text", "text": "In Paris"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with caplog.at_level(logging.INFO, logger="taper.server"):
        status, body = post_json(port, "/v1/chat/completions",
                                 {"messages": messages, "max_tokens": 2, "some_new_field": 1,
                                  "chat_template_kwargs": {"x": 1}, "thinking": True})
    assert status == 200, body
    assert "ignoring unknown request fields: some_new_field" in caplog.text
    assert tok.last_messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?\nIn Paris", "name": "ann"},
        {"role": "assistant", "content": "",
         "tool_calls": [{**call, "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    assert tok.last_template_kwargs == {"x": 1, "enable_thinking": True}
    for spelling in ({"enable_thinking": False}, {"thinking": {"type": "disabled"}},
                     {"chat_template_kwargs": {"enable_thinking": False}}):
        assert post_json(port, "/v1/chat/completions", {**CHAT, **spelling})[0] == 200
        assert tok.last_template_kwargs == {"enable_thinking": False}

    image = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url",
                                          "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    status, body = post_json(port, "/v1/chat/completions", {"messages": [image]})
    assert_error(status, body, 400, "messages[0].content[1].type", "unsupported_content")
    assert "text-only" in body["error"]["message"]
    bad_call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}
    status, body = post_json(port, "/v1/chat/completions",
                             {"messages": [CHAT["messages"][0], bad_call]})
    assert_error(status, body, 400, "messages[1].tool_calls[0]")
