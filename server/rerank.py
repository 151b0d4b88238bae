"""Rerank and score: POST /v1/rerank (also /v2/rerank and /rerank) and POST /v1/score (also
/score), shapes in server/rerank_protocol.py.

Two ways to score a (query, document) pair, chosen by --rerank:

- qwen3-reranker: a causal LM trained to answer "yes" or "no" (Qwen3-Reranker). The pair is
  written into its model card's prompt (a system line, `<Instruct>: ...\\n<Query>: ...\\n
  <Document>: ...` as the user turn, an empty think block opening the answer) and the score is
  P("yes") = softmax over the logits of "no" and "yes" at the prompt's last position. The
  engine computes just those two logits (PoolingParams.token_ids); no token is sampled. Client
  text cannot forge the template's special tokens: their strings in it tokenize as text.
- embedding: the cosine of the query's and the document's embeddings, pooled as /v1/embeddings
  pools them.

`--rerank auto` (the default) scores by embedding for an embedding checkpoint (one that declares
its pooling in modules.json, or a headless transformer) and with qwen3-reranker for a
Qwen3ForCausalLM checkpoint whose name says "reranker"; any other model answers 400 naming the
flag, rather than scores a chat model never learnt to give. `--rerank none` turns both off.

Every prompt of a request is submitted at once (one engine request each), so the engine batches
them into the same steps; the shared prefix of a query's prompts comes from the prefix cache.
Usage counts the prompt tokens computed for the request.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
from quart import Response, request

from engine.sampling.pooling import PoolingParams
from server import request_body, streaming, tokenizing
from server.embeddings import pool_batch
from server.protocol import APIError
from server.rerank_protocol import (RerankRequest, ScoreRequest, rerank_response,
                                    score_response)

log = logging.getLogger("taper.server")

# Qwen3-Reranker's prompt, from its model card.
QWEN3_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
                "the Query and the Instruct provided. Note that the answer can only be \"yes\" "
                "or \"no\".<|im_end|>\n<|im_start|>user\n")
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def qwen3_pair_text(instruction: str, query: str, document: str) -> str:
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


def choose_method(setting: str, engine, served_names: list[str]) -> tuple[str | None, str]:
    """(the scoring method, or None when the model cannot score; why), for --rerank `setting`."""
    if setting == "none":
        return None, "--rerank none"
    if setting != "auto":
        return setting, f"--rerank {setting}"
    config = engine.model_config
    if getattr(engine.pooling, "declared", False) or not config.has_lm_head:
        return "embedding", "an embedding checkpoint"
    names = [getattr(engine, "model_name", ""), *served_names]
    if config.architecture == "Qwen3ForCausalLM" and any("reranker" in n.lower() for n in names):
        return "qwen3-reranker", "a Qwen3 checkpoint named as a reranker"
    return None, ("not an embedding checkpoint, nor a Qwen3 checkpoint named as a reranker "
                  "(--rerank auto)")


@dataclass
class Texts:
    """What a request scores: pairs (i, j) of first[i] (a query, text_1) with second[j] (a
    document, text_2), each text with the parameter that names it in errors; `field` names the
    list the request's size comes from."""
    field: str
    first: list[str]
    first_params: list[str]
    second: list[str]
    second_params: list[str]
    pairs: list[tuple[int, int]]
    instruction: str | None


class YesNoScorer:
    """Qwen3-Reranker: P("yes") at the end of its prompt."""

    def __init__(self, engine):
        tok = engine.tokenizer
        problem = None
        if tok is None:
            problem = "this model has no tokenizer"
        elif not engine.model_config.has_lm_head:
            problem = "this checkpoint has no lm_head"
        else:
            missing = [t for t in ("yes", "no") if not tok.has_tokens([t])]
            if missing:
                problem = f"this tokenizer has no {' or '.join(repr(t) for t in missing)} token"
        if problem:
            raise APIError(f"This server scores with --rerank qwen3-reranker, but {problem}: "
                           "it is not a Qwen3-Reranker checkpoint", param="model",
                           code="model_cannot_score")
        self.tok = tok
        hf = tok.hf
        self.token_ids = (hf.convert_tokens_to_ids("no"), hf.convert_tokens_to_ids("yes"))
        self.prefix = tok.encode(QWEN3_PREFIX, add_special_tokens=False)
        self.suffix = tok.encode(QWEN3_SUFFIX, add_special_tokens=False)

    def prompt(self, instruction: str | None, query: str, document: str) -> list[int]:
        text = qwen3_pair_text(instruction or QWEN3_INSTRUCTION, query, document)
        return self.prefix + self.tok.encode_text(text) + self.suffix

    def prompts(self, texts: Texts) -> tuple[list[list[int]], list[str]]:
        """The prompt of each pair, and the parameter naming it."""
        out, params = [], []
        for i, j in texts.pairs:
            param = texts.second_params[j]
            out.append(encode(lambda: self.prompt(texts.instruction, texts.first[i],
                                                  texts.second[j]), param))
            params.append(param)
        return out, params

    async def score(self, state, engine, request_id: str, texts: Texts, check):
        check_text_lengths(engine, texts)
        batch, params = await tokenizing.run(self.prompts, texts)
        check(batch, params)
        logits = await pool_batch(state, engine, request_id, batch,
                                  PoolingParams(token_ids=self.token_ids), texts.field)
        return [p_yes(float(no), float(yes)) for no, yes in logits], sum(map(len, batch))


def check_text_lengths(engine, texts: Texts) -> None:
    """A 400 for a query or document longer than any prompt of this model can be, before any of
    the batch is tokenized (server/tokenizing.py)."""
    for text, param in zip(texts.first + texts.second, texts.first_params + texts.second_params):
        tokenizing.check_lengths(engine, [text], param)


def p_yes(no: float, yes: float) -> float:
    """softmax([no, yes])[1], without overflow."""
    d = yes - no
    return 1.0 / (1.0 + math.exp(-d)) if d >= 0 else math.exp(d) / (1.0 + math.exp(d))


class CosineScorer:
    """The cosine of the two texts' embeddings (each pooled as the checkpoint says)."""

    def __init__(self, engine):
        if engine.tokenizer is None:
            raise APIError("This model has no tokenizer: it cannot embed text", param="model",
                           code="model_cannot_score")
        self.tok = engine.tokenizer

    async def score(self, state, engine, request_id: str, texts: Texts, check):
        if texts.instruction is not None:
            raise APIError("instruction applies to yes/no rerankers (--rerank qwen3-reranker); "
                           "this server scores by the cosine of embeddings",
                           param="instruction", code="unsupported_parameter")

        def tokenize():   # as /v1/embeddings tokenizes its inputs
            return [encode(lambda: self.tok.encode(t), p) for t, p in
                    zip(texts.first + texts.second, texts.first_params + texts.second_params)]
        check_text_lengths(engine, texts)
        batch = await tokenizing.run(tokenize)
        params = texts.first_params + texts.second_params
        check(batch, params)
        vectors = await pool_batch(state, engine, request_id, batch, PoolingParams(),
                                   texts.field)
        units = [v.astype(np.float64) / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
        first, second = units[:len(texts.first)], units[len(texts.first):]
        return [float(first[i] @ second[j]) for i, j in texts.pairs], sum(map(len, batch))


def encode(fn, param: str) -> list[int]:
    """fn() (tokenizing one text), its failure a 400 naming `param`."""
    try:
        return fn()
    except (TypeError, ValueError, UnicodeError) as e:
        raise APIError(f"{param} could not be tokenized: {e}", param=param,
                       code="invalid_value") from None


def register_rerank(app, state, check_queue) -> None:
    """Adds the rerank and score routes to `app`, served from `state` (server/app.py's
    ServerState); `check_queue` is create_app's, each prompt counting one sequence."""
    settings = state.settings
    chosen: dict = {}        # the scorer for the engine it was made for

    def scorer_for(engine, model: str):
        if chosen.get("engine") is not engine:
            method, why = choose_method(settings.rerank, engine, settings.served_model_names)
            log.info("rerank and score: %s (%s)", method or "off", why)
            chosen.clear()
            chosen.update(engine=engine, method=method, why=why, scorer=None)
        method = chosen["method"]
        if method is None:
            raise APIError(f"The model '{model}' cannot rerank or score: it is {chosen['why']}. "
                           "Start the server with --rerank qwen3-reranker to score with a "
                           "Qwen3-Reranker checkpoint's yes/no answer, or --rerank embedding to "
                           "score by the cosine of the model's embeddings", param="model",
                           code="model_cannot_score")
        if chosen["scorer"] is None:
            make = YesNoScorer if method == "qwen3-reranker" else CosineScorer
            chosen["scorer"] = make(engine)
        return chosen["scorer"]

    def checker(engine, field: str):
        def check(batch: list[list[int]], params: list[str]):
            max_len = engine.max_model_len
            for ids, param in zip(batch, params):
                if len(ids) > max_len:
                    raise APIError(f"This model's maximum context length is {max_len} tokens, "
                                   f"and the prompt for {param} has {len(ids)} tokens. Please "
                                   "shorten it.", param=param, code="context_length_exceeded")
            check_queue(engine, len(batch), param=field)
        return check

    async def run(cls, prefix: str):
        req = await request_body.read(await request.get_data(), cls, state.engine,
                                      settings.limits)
        engine = state.ready_engine()
        model = state.resolve_model(req.model)
        scorer = scorer_for(engine, model)
        texts = (rerank_texts(req) if cls is RerankRequest else score_texts(req))
        request_id = streaming.random_id(prefix)
        scores, num_tokens = await scorer.score(state, engine, request_id, texts,
                                                checker(engine, texts.field))
        return req, model, request_id, scores, num_tokens

    async def rerank():
        req, model, request_id, scores, num_tokens = await run(RerankRequest, "rerank")
        return _json(rerank_response(request_id, model, req, scores, num_tokens))

    async def score():
        req, model, request_id, scores, num_tokens = await run(ScoreRequest, "score")
        return _json(score_response(request_id, model, int(time.time()), scores, num_tokens))

    # vLLM serves these paths; Cohere's v2 clients call /v2/rerank
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        app.add_url_rule(path, "rerank" + path.replace("/", "_"), rerank, methods=["POST"])
    for path in ("/v1/score", "/score"):
        app.add_url_rule(path, "score" + path.replace("/", "_"), score, methods=["POST"])


def rerank_texts(req: RerankRequest) -> Texts:
    docs = req.texts()
    return Texts("documents", [req.query], ["query"], docs,
                 [f"documents[{j}]" for j in range(len(docs))],
                 [(0, j) for j in range(len(docs))], req.instruction)


def score_texts(req: ScoreRequest) -> Texts:
    first, second = req.as_lists()

    def params(name, value, n):
        return [name] if isinstance(value, str) else [f"{name}[{i}]" for i in range(n)]
    pairs = ([(0, j) for j in range(len(second))] if len(first) == 1
             else [(k, k) for k in range(len(second))])
    return Texts("text_2", first, params("text_1", req.text_1, len(first)), second,
                 params("text_2", req.text_2, len(second)), pairs, req.instruction)


def _json(body: dict) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=200,
                    content_type="application/json")
