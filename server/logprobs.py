"""OpenAI's logprobs shapes from the engine's TokenLogprobs.

- chat: `logprobs.content`, one {token, logprob, bytes, top_logprobs} per output token;
- legacy completions: parallel lists tokens / token_logprobs / top_logprobs (dicts token ->
  logprob: the top N plus the chosen token, as OpenAI's legacy API) / text_offset, with `echo`
  the prompt's tokens first (the first one's logprob null, as OpenAI writes it);
- vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
  decoded_token}} for the prompt token and the top N.

`bytes` are the token's own bytes (Tokenizer.token_bytes), so the bytes of consecutive tokens
join into the text even when a character is split across them; `token` is those bytes decoded
(with U+FFFD for a partial character).
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.outputs import TokenLogprobs

# -inf (a token a filter removed, with --logprobs-mode processed) is not JSON; vLLM writes this.
FLOOR = -9999.0


def _finite(x: float) -> float:
    return max(float(x), FLOOR)


class TokenText:
    """Token id -> (text, bytes) for one tokenizer, cached; without a tokenizer a token reads
    `token_id:<id>` (vLLM's spelling) with no bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            if self.tokenizer is None:
                hit = (f"token_id:{token_id}", b"")
            else:
                raw = self.tokenizer.token_bytes(token_id)
                hit = (raw.decode("utf-8", errors="replace"), raw)
            if len(self._cache) < 1 << 18:
                self._cache[token_id] = hit
        return hit


def token_text(tokenizer) -> TokenText:
    """The tokenizer's shared TokenText (built on first use)."""
    tt = getattr(tokenizer, "_taper_token_text", None)
    if tt is None:
        tt = TokenText(tokenizer)
        if tokenizer is not None:
            tokenizer._taper_token_text = tt
    return tt


@dataclass(slots=True)
class LogprobsOptions:
    """What a response shows: tokens rendered by `tt`, `logprobs` top entries per output token
    (None: no logprobs), vLLM's `prompt_logprobs` with that many top entries (None: none)."""
    tt: TokenText | None
    logprobs: int | None = None
    prompt_logprobs: int | None = None


# ---- chat

def chat_entries(entries: list[TokenLogprobs], tt: TokenText) -> list[dict]:
    def one(token_id: int, logprob: float) -> dict:
        text, raw = tt(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(raw)}
    return [{**one(e.token_id, e.logprob),
             "top_logprobs": [one(t, l) for t, l in zip(e.top_ids, e.top_logprobs)]}
            for e in entries]


# ---- legacy completions

def completion_logprobs(token_ids: list[int], entries: list[TokenLogprobs | None],
                        offsets: list[int], tt: TokenText, k: int | None = None) -> dict:
    """The legacy shape for these tokens (at most k top entries each); an entry None (the first
    prompt token) has null logprobs."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for token_id, e in zip(token_ids, entries):
        out["tokens"].append(tt(token_id)[0])
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_finite(e.logprob))
        top = {tt(t)[0]: _finite(l) for t, l in zip(e.top_ids[:k], e.top_logprobs[:k])}
        top.setdefault(tt(e.token_id)[0], _finite(e.logprob))
        out["top_logprobs"].append(top)
    return out


def join_completion_logprobs(a: dict | None, b: dict | None) -> dict | None:
    if a is None or b is None:
        return b if a is None else a
    return {k: a[k] + b[k] for k in a}


def prompt_text_offsets(tokenizer, prompt_ids: list[int]) -> list[int]:
    """Where each prompt token's text starts in the decoded prompt (echo's text_offset)."""
    if tokenizer is None:
        return [0] * len(prompt_ids)
    return [len(tokenizer.decode(prompt_ids[:j])) for j in range(len(prompt_ids))]


# ---- vLLM's prompt_logprobs

def vllm_prompt_logprobs(entries: list[TokenLogprobs | None], tt: TokenText,
                         k: int | None = None) -> list:
    def one(logprob: float, rank: int, token_id: int) -> dict:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": tt(token_id)[0]}

    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        top = zip(e.top_ids[:k], e.top_logprobs[:k])
        d = {str(t): one(l, r, t) for r, (t, l) in enumerate(top, 1)}
        d.setdefault(str(e.token_id), one(e.logprob, e.rank, e.token_id))
        out.append(d)
    return out
