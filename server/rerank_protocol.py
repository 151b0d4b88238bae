"""The request and response shapes of /v1/rerank (Cohere's and Jina's, as vLLM serves it, also at
/v2/rerank) and /v1/score (vLLM's).

Rerank: `query` and `documents` (strings, or objects with a string `text`), `top_n` (the best n;
all when absent), `return_documents` (each result echoes its document as {"text": ...}; true by
default, as Jina and vLLM answer). The results come best first: {index, relevance_score,
document?}, with the response's id, model and usage.

Score: `text_1` and `text_2`, each a string or a list of strings. One text_1 is scored against
every text_2 (1:N); two lists of the same length pair up (N:N). The data come in pair order:
{index, object: "score", score}.

`instruction` (an extension) is the yes/no reranker's task line (Qwen3-Reranker's <Instruct>);
unset, the model card's default.
"""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from server.protocol import APIError, _Request


def _not_empty(text: str, param: str) -> None:
    if not text:
        raise APIError(f"{param} must not be empty", param=param, code="invalid_value")


class RerankRequest(_Request):
    # documents: --max-prompts, as an embeddings input list
    limited_fields: ClassVar[dict[str, str]] = {"documents": "prompts"}
    model: str | None = None
    query: str
    documents: list[str | dict]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    instruction: str | None = None

    def check_supported(self):
        _not_empty(self.query, "query")
        if not self.documents:
            raise APIError("documents must hold at least one document", param="documents",
                           code="invalid_value")
        for i, doc in enumerate(self.documents):
            if isinstance(doc, dict) and not isinstance(doc.get("text"), str):
                raise APIError(f"documents[{i}] must be a string or an object with a string "
                               "'text'", param=f"documents[{i}]", code="invalid_value")
            _not_empty(document_text(doc), f"documents[{i}]")
        if self.instruction is not None:
            _not_empty(self.instruction, "instruction")

    def texts(self) -> list[str]:
        return [document_text(d) for d in self.documents]


def document_text(doc: str | dict) -> str:
    return doc if isinstance(doc, str) else doc["text"]


class ScoreRequest(_Request):
    limited_fields: ClassVar[dict[str, str]] = {"text_1": "prompts", "text_2": "prompts"}
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None

    def check_supported(self):
        for name in ("text_1", "text_2"):
            value = getattr(self, name)
            if isinstance(value, list):
                if not value:
                    raise APIError(f"{name} must hold at least one text", param=name,
                                   code="invalid_value")
                for i, text in enumerate(value):
                    _not_empty(text, f"{name}[{i}]")
            else:
                _not_empty(value, name)
        first, second = self.as_lists()
        if len(first) != 1 and len(first) != len(second):
            raise APIError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one "
                           "text_1 (scored against each text_2) or as many as text_2 (scored "
                           "in pairs)", param="text_2", code="invalid_value")
        if self.instruction is not None:
            _not_empty(self.instruction, "instruction")

    def as_lists(self) -> tuple[list[str], list[str]]:
        def as_list(value):
            return [value] if isinstance(value, str) else list(value)
        return as_list(self.text_1), as_list(self.text_2)


def rerank_response(request_id: str, model: str, req: RerankRequest, scores: list[float],
                    num_tokens: int) -> dict:
    """Results best first (ties in document order), the best top_n when it is given."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n is not None:
        order = order[:req.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": document_text(req.documents[i])}
        results.append(result)
    return {"id": request_id, "model": model, "results": results,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def score_response(request_id: str, model: str, created: int, scores: list[float],
                   num_tokens: int) -> dict:
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                      "completion_tokens": 0}}
