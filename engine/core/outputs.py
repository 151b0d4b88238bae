"""What the engine hands back for a request: one RequestOutput per step that produced tokens
(per choice, when the request asked for n > 1)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprobs:
    """One position's log-probabilities: the token there and the most likely alternatives."""
    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)       # most likely first
    top_logprobs: list[float] = field(default_factory=list)
    text_offset: int = 0       # where the token's text starts in the output text
    rank: int = 1              # 1 + the number of tokens more likely than this one


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)  # tokens produced since the last output
    text_delta: str = ""                                    # text since the last output
    token_ids: list[int] = field(default_factory=list)      # all output tokens (final output only)
    text: str = ""                                          # all output text (final output only)
    finished: bool = False
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None            # message when finish_reason == "error"
    error_param: str | None = None      # the request parameter at fault, when it is the request's
    index: int = 0                      # the choice (0 .. n-1) this output belongs to
    # Logprobs of the tokens whose text this output releases (tokens held back because they
    # may start a stop string come later, or never when the stop string matches).
    logprobs: list[TokenLogprobs] | None = None
    # With the first output of choice 0: one entry per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: object = None            # an embedding request's vector (float32 NumPy), at its end
    # With speculative decoding on, in a choice's final output: its SpecDecodeCounts.
    spec_decode: "SpecDecodeCounts | None" = None


@dataclass(slots=True)
class SpecDecodeCounts:
    """One choice's speculative decoding: verify steps with drafts, drafts, accepted drafts."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
