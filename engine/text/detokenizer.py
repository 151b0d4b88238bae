"""Incremental detokenization with stop strings, one instance per sequence.

Text: the prefix_offset/read_offset algorithm (as in TGI and vLLM). A token's text depends on its
neighbours (a multi-byte UTF-8 character split over byte tokens; SentencePiece's leading-space
rule), so each step decodes a small window twice: `prefix` = ids[prefix_offset:read_offset] (text
already emitted) and `full` = ids[prefix_offset:]. When `full` is longer and does not end in U+FFFD
(an unfinished character), the new text is full[len(prefix):], and the window slides forward;
otherwise the token waits for the next one. The window holds only the tokens since the last
emission plus a few of context, so a step costs O(1) in the sequence length.

Stop strings: text that could still be the start of a stop string is held back, so a stream never
shows part of one. On a match the output ends before the stop string (or after it with
include_stop_str_in_output) and `add_token` reports stopped. When the sequence finishes for another
reason (EOS, max_tokens) call `flush()` for the held-back tail.

Invariant: `text` == the concatenation of every delta returned so far (`flush()` included).
"""
from __future__ import annotations

# Tokens of prompt context decoded with the first output token (vLLM uses the same 5).
INITIAL_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: list[str] | None = None, include_stop_str_in_output: bool = False,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens         # stop strings are not checked before this many tokens
        # Window ids: a few prompt tokens for context, then the output tokens.
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.num_output_tokens = 0
        self._pieces: list[str] = []   # deltas handed out
        self.num_emitted_chars = 0      # their total length
        # Characters decoded so far, emitted, held back or cut by a stop string (tokens waiting
        # for the rest of a UTF-8 character not counted): a token's text ends here right after
        # add_token.
        self.num_decoded_chars = 0
        self._pending = ""              # decoded, held back: could start a stop string
        self.stopped = False
        self.stop_reason: str | None = None  # the matched stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def decode_one(self, token_id: int) -> str:
        return self._decode([token_id])

    def _next_text(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prefix = self._decode(self._ids[self.prefix_offset:self.read_offset])
        full = self._decode(self._ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            # Slide the window: drop tokens no longer needed as context.
            drop = self.read_offset
            self._ids = self._ids[drop:]
            self.prefix_offset = 0
            self.read_offset = len(self._ids)
            return delta
        return ""

    def add_token(self, token_id: int) -> tuple[str, bool]:
        """Append one generated token; return (text delta safe to show, stopped)."""
        if self.stopped:
            return "", True
        self.num_output_tokens += 1
        new = self._next_text(token_id)
        self.num_decoded_chars += len(new)
        if not new:
            return "", False
        pending = self._pending + new
        if not self.stop:
            return self._emit(new), False
        # Emitted text never holds the start of a stop string (it would have been held back), so
        # a match lies within the pending text.
        if self.num_output_tokens >= self.min_tokens:
            best = None
            for s in self.stop:
                i = pending.find(s)
                if i != -1 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, s = best
                self.stopped = True
                self.stop_reason = s
                self._pending = ""
                return self._emit(pending[:i + len(s) if self.include_stop_str_in_output else i]), True
        hold = _holdback(pending, self.stop)
        self._pending = pending[len(pending) - hold:]
        return self._emit(pending[:len(pending) - hold]), False

    def flush(self) -> str:
        """Release held-back text when the sequence ends without a stop string matching: text
        that could have started a stop string, and tokens that were waiting for the rest of a
        UTF-8 character (they end as U+FFFD, as decoding the whole output would give)."""
        tail = ""
        if len(self._ids) > self.read_offset:
            prefix = self._decode(self._ids[self.prefix_offset:self.read_offset])
            tail = self._decode(self._ids[self.prefix_offset:])[len(prefix):]
            self._ids = self._ids[self.read_offset:]
            self.prefix_offset, self.read_offset = 0, len(self._ids)
        pending, self._pending = self._pending + tail, ""
        return self._emit(pending)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens decoded to nothing yet: they wait for the rest of a UTF-8 character."""
        return len(self._ids) - self.read_offset


    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
            self.num_emitted_chars += len(delta)
        return delta


def _holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string: it could
    still become a match with the next tokens."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
