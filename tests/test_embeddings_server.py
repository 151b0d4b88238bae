"""POST /v1/embeddings on a live `python -m server`, called with the official `openai` SDK
(`client.embeddings.create`: by default it asks for base64 and decodes it itself) and raw HTTP,
against sentence-transformers' vectors (1e-4), the OpenAPI spec's CreateEmbeddingResponse, and
token counts from transformers' tokenizer."""
from __future__ import annotations

import base64
import signal

import numpy as np
import pytest
from transformers import AutoTokenizer

from embedding_checkpoints import edit_json, embedding_checkpoint
from server_fakes import (LiveServer, assert_error, client_for, http_request, post_json,
                          validate)
from test_embeddings import CHECKPOINTS, TEXTS, st_encode

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 64
FLAGS = ("--mem", "16", "--prefill-chunk-size", "8", "--max-model-len", str(MAX_MODEL_LEN),
         "--served-model-name", "emb")


@pytest.fixture(scope="module")
def ckpt_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding_ckpts")
    dirs = {mode: embedding_checkpoint(root / mode, **kwargs)
            for mode, kwargs in CHECKPOINTS.items()}
    # the mean checkpoint also says it is Matryoshka-trained: `dimensions` is allowed there
    edit_json(root / "mean" / "config.json", lambda c: {**c, "is_matryoshka": True})
    return dirs


@pytest.fixture(scope="module")
def servers(ckpt_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    started = {mode: LiveServer(tmp, d, *FLAGS, wait_ready=False)
               for mode, d in ckpt_dirs.items()}
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.close()


def token_ids(model_dir, texts) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t)["input_ids"] for t in texts]


@pytest.mark.parametrize("mode", list(CHECKPOINTS))
def test_sdk_embeddings_equal_sentence_transformers(ckpt_dirs, servers, mode):
    model_dir, port = ckpt_dirs[mode], servers[mode].port
    want = st_encode(model_dir, TEXTS)
    client = client_for(port)
    decoded = client.embeddings.create(model="emb", input=TEXTS)     # base64, SDK-decoded
    floats = client.embeddings.create(model="emb", input=TEXTS, encoding_format="float",
                                      user="user-1234")
    for resp in (decoded, floats):
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        np.testing.assert_allclose(np.array([d.embedding for d in resp.data], np.float32), want,
                                   atol=1e-4, rtol=0)
        num_tokens = sum(map(len, token_ids(model_dir, TEXTS)))
        assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (num_tokens, num_tokens)
        assert resp.model == "emb"

    # the wire: floats match the spec's schema; base64 is the same float32 values, little-endian
    status, body = post_json(port, "/v1/embeddings", {"model": "emb", "input": TEXTS[:2]})
    assert status == 200, body
    validate(body, "CreateEmbeddingResponse")
    status, b64 = post_json(port, "/v1/embeddings", {"model": "emb", "input": TEXTS[:2],
                                                     "encoding_format": "base64"})
    assert status == 200, b64
    for f, b in zip(body["data"], b64["data"]):
        assert np.array_equal(np.frombuffer(base64.b64decode(b["embedding"]), "<f4"),
                              np.array(f["embedding"], np.float32))


def test_inputs_as_string_token_ids_and_lists_of_them(ckpt_dirs, servers):
    model_dir, client = ckpt_dirs["cls"], client_for(servers["cls"].port)
    want = st_encode(model_dir, TEXTS)
    ids = token_ids(model_dir, TEXTS)
    one = client.embeddings.create(model="emb", input=TEXTS[3])
    assert len(one.data) == 1
    np.testing.assert_allclose(one.data[0].embedding, want[3], atol=1e-4, rtol=0)
    single_ids = client.embeddings.create(model="emb", input=ids[0])
    np.testing.assert_allclose(single_ids.data[0].embedding, want[0], atol=1e-4, rtol=0)
    assert single_ids.usage.prompt_tokens == len(ids[0])
    batch = client.embeddings.create(model="emb", input=ids)
    np.testing.assert_allclose([d.embedding for d in batch.data], want, atol=1e-4, rtol=0)


def test_dimensions(ckpt_dirs, servers):
    model_dir = ckpt_dirs["mean"]
    want = st_encode(model_dir, TEXTS, truncate_dim=32, normalize_embeddings=True)
    resp = client_for(servers["mean"].port).embeddings.create(model="emb", input=TEXTS,
                                                              dimensions=32)
    got = np.array([d.embedding for d in resp.data], np.float32)
    assert got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    status, body = post_json(servers["mean"].port, "/v1/embeddings",
                             {"input": "hi", "dimensions": 97})
    assert_error(status, body, 400, "dimensions", "invalid_value")
    # a model that does not declare Matryoshka training refuses `dimensions`
    status, body = post_json(servers["cls"].port, "/v1/embeddings",
                             {"input": "hi", "dimensions": 32})
    assert_error(status, body, 400, "dimensions", "invalid_value")
    assert "matryoshka" in body["error"]["message"]


@pytest.mark.parametrize("body, param, code", [
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": ["a", ""]}, "input", "invalid_value"),
    ({"input": [[1, 2], []]}, "input", "invalid_value"),
    ({"input": ["a", 3]}, "input", "invalid_value"),
    ({"input": [5, -1]}, "input", "invalid_value"),
    ({"input": [5, 10**6]}, "input", "invalid_value"),          # past the vocabulary
    ({"input": [[5, 6], [5, 10**6]]}, "input", "invalid_value"),  # one bad input of a batch
    ({"input": list(range(3, 3 + MAX_MODEL_LEN + 1))}, "input", "context_length_exceeded"),
    ({"input": ["hi", "hello " * 80]}, "input", "context_length_exceeded"),
    ({"input": ["hi"] * 2049}, "input", "array_above_max_length"),  # --max-prompts: 2048
    ({"input": "hi", "encoding_format": "hex"}, "encoding_format", "invalid_value"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "invalid_value"),
    ({}, "input", "missing_required_parameter"),
])
def test_bad_requests_are_400_naming_the_parameter(servers, body, param, code):
    port = servers["cls"].port
    status, resp = post_json(port, "/v1/embeddings", body)
    assert_error(status, resp, 400, param, code)
    # and the server goes on serving, nothing of the refused request left running
    assert post_json(port, "/v1/embeddings", {"input": "still here"})[0] == 200
    status, _, metrics = http_request(port, "GET", "/metrics")
    assert 'taper:num_requests_running{model_name="emb"} 0.0' in metrics.decode()


def test_input_at_the_context_limit_and_unknown_model(servers):
    port = servers["cls"].port
    status, body = post_json(port, "/v1/embeddings",
                             {"input": list(range(3, 3 + MAX_MODEL_LEN))})
    assert status == 200 and body["usage"]["prompt_tokens"] == MAX_MODEL_LEN
    status, body = post_json(port, "/v1/embeddings", {"model": "other", "input": "hi"})
    assert_error(status, body, 404, "model", "model_not_found")


def test_generation_needs_an_lm_head(servers):
    # headless LlamaModel: embeddings only; Qwen3ForCausalLM used as an embedder: both
    status, body = post_json(servers["mean"].port, "/v1/completions",
                             {"prompt": "hi", "max_tokens": 2})
    assert_error(status, body, 400, "prompt")
    assert "lm_head" in body["error"]["message"]
    status, body = post_json(servers["lasttoken"].port, "/v1/completions",
                             {"prompt": "hi", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_generative_model_pools_its_last_token(tmp_path):
    """A plain causal LM (no modules.json) answers /v1/embeddings with its last token's final
    hidden state, L2-normalized (vLLM's default for decoder-only models); transformers computes
    the reference. This checkpoint has no tokenizer: token ids only."""
    import torch
    from transformers import AutoModel

    from checkpoints import tiny_checkpoint
    model_dir = tiny_checkpoint(tmp_path / "causal", arch="llama")
    prompts = [[5, 9, 200, 31, 7, 77, 1, 300, 12, 4], [8, 3]]
    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        last = [hf(torch.tensor([p])).last_hidden_state[0, -1].numpy() for p in prompts]
    want = np.array([v / np.linalg.norm(v) for v in last], np.float32)
    mean = [hf(torch.tensor([p])).last_hidden_state[0].mean(0).detach().numpy() for p in prompts]
    assert np.abs(want - [m / np.linalg.norm(m) for m in mean]).max() > 0.05   # pooling shows
    server = LiveServer(tmp_path, model_dir, *FLAGS)
    try:
        resp = client_for(server.port).embeddings.create(model="emb", input=prompts)
        np.testing.assert_allclose([d.embedding for d in resp.data], want, atol=1e-4, rtol=0)
        status, body = post_json(server.port, "/v1/embeddings", {"input": "text"})
        assert_error(status, body, 400, "input", "no_tokenizer")
        # and it generates from token ids (the text-length check has no tokenizer to ask)
        status, body = post_json(server.port, "/v1/completions",
                                 {"prompt": prompts[0], "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
        server.proc.send_signal(signal.SIGTERM)     # exits 0, having served without torch
        assert server.proc.wait(timeout=30) == 0, server.log()
        assert "TAPER_TORCH_IMPORTED=False" in server.log()
    finally:
        server.close()


def test_a_wrong_input_type_says_what_this_api_accepts():
    """`input` is a union in embeddings (texts or token ids) and in Responses (text or items):
    each 400 names its own API's forms."""
    from pydantic import ValidationError

    from server.embeddings import EmbeddingRequest
    from server.protocol import validation_error
    from server.responses_protocol import CreateResponseRequest
    messages = {}
    for cls in (EmbeddingRequest, CreateResponseRequest):
        with pytest.raises(ValidationError) as e:
            cls.model_validate({"model": "m", "input": {"a": 1}})
        messages[cls] = str(validation_error(e.value))
    assert "token ids" in messages[EmbeddingRequest]
    assert "input items" in messages[CreateResponseRequest]
