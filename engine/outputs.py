"""What the engine hands back for a request: one RequestOutput per step that produced tokens."""
from __future__ import annotations

from dataclasses import dataclass, field


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
    embedding: object = None            # an embedding request's vector (float32 NumPy), at its end
