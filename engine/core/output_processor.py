"""From committed tokens to RequestOutputs: token-level stops (stop token ids, EOS, length),
detokenization with stop strings, the release of logprobs once their token's text is out, finish
reasons, pooled embeddings and errors. The engine applies what it decides (LLMEngine._finish)."""
from __future__ import annotations

from engine.core.outputs import RequestOutput, TokenLogprobs
from engine.core.request import Request
from engine.core.sequence import Sequence


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def token_finish_reason(self, seq: Sequence, token: int) -> str | None:
        """The stop a token makes on its own (stop strings need its text: token_output)."""
        params = seq.sampling_params
        if token in params.stop_token_ids:
            return "stop"
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if seq.num_output_tokens == params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def token_output(self, seq: Sequence, token: int, logprob: TokenLogprobs | None,
                     token_reason: str | None) -> RequestOutput:
        """The output of a token the engine appended: its text (a stop string in it finishes the
        sequence, and wins over token_reason, the token-level stop), logprobs, finish reason."""
        request: Request = seq.request
        first = seq.num_output_tokens == 1
        params = seq.sampling_params
        pending = request.pending_logprobs.setdefault(seq.index, [])
        text_delta, stop_string = "", None
        detok = request.detokenizers.get(seq.index)
        if detok is not None:
            start, waited = detok.num_decoded_chars, detok.num_waiting_tokens
            text_delta, stopped = detok.add_token(token)
            if stopped:
                stop_string = detok.stop_reason
            if logprob is not None:
                end = detok.num_decoded_chars
                if waited and end > start:  # the text of earlier tokens came out with this one
                    own = detok.decode_one(token)
                    start = max(start, end - len(own))
                logprob.text_offset = start
                pending.append((logprob, end))
        elif logprob is not None:
            pending.append((logprob, 0))
        reason, stop_reason = token_reason, None
        if stop_string is not None:
            reason, stop_reason = "stop", stop_string
        elif token_reason == "stop" and token in params.stop_token_ids:
            stop_reason = token
        finished = reason is not None
        if finished:
            seq.finish_reason = reason
            if detok is not None:
                text_delta += detok.flush() if stop_string is None else ""
        # The whole output is filled in once, at the end (copying it every token is quadratic).
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=[token], text_delta=text_delta,
            token_ids=seq.output_token_ids if finished else [],
            text=detok.text if finished and detok else "",
            finished=finished, finish_reason=reason, stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens, index=seq.index,
            logprobs=(released_logprobs(request, seq.index, detok, finished,
                                        stop_string is not None)
                      if params.logprobs is not None else None),
            prompt_logprobs=request.prompt_logprobs if first and seq.index == 0 else None)

    @staticmethod
    def pooled_output(seq: Sequence) -> RequestOutput:
        return RequestOutput(seq.request_id, finished=True, finish_reason="stop",
                             num_prompt_tokens=seq.num_prompt_tokens,
                             embedding=seq.pooler.result())

    @staticmethod
    def error_output(seq: Sequence, error: Exception) -> RequestOutput:
        param = getattr(error, "param", None)
        return RequestOutput(seq.request_id, finished=True, finish_reason="error",
                             # the request's own fault is said as it is, a bug with its type
                             error=str(error) if param else f"{type(error).__name__}: {error}",
                             error_param=param,
                             num_prompt_tokens=seq.num_prompt_tokens,
                             num_output_tokens=seq.num_output_tokens, index=seq.index)


def released_logprobs(request: Request, index: int, detok, finished: bool,
                      stopped_by_string: bool) -> list[TokenLogprobs]:
    """The choice's pending logprobs whose token's text has been released: all of it, or at the
    end any of it. A token whose text a stop string cut away entirely gets none."""
    pending = request.pending_logprobs.get(index, [])
    if detok is None or (finished and not stopped_by_string):
        request.pending_logprobs[index] = []
        return [lp for lp, _ in pending]
    emitted = detok.num_emitted_chars
    n = 0
    while n < len(pending) and pending[n][1] <= emitted:
        n += 1
    out = [lp for lp, _ in pending[:n]]
    if finished:      # stopped by a stop string: the tokens whose text starts before its cut
        out += [lp for lp, _ in pending[n:] if lp.text_offset < emitted]
        n = len(pending)
    request.pending_logprobs[index] = pending[n:]
    return out
