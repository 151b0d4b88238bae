"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar), compiled once
into a grammar, and per step the token bitmask that keeps each constrained sequence inside it.

The library is llguidance (Microsoft; Rust core, abi3 wheels, MIT). It was chosen because:
- it needs nothing but NumPy: its `llguidance.numpy` helpers fill int32 bitmasks (the layout our
  `apply_token_bitmask` op reads); xgrammar, the other widely used engine, imports torch, which
  Taper never does;
- one matcher covers every kind a request can ask for (JSON schema, regex, choice, Lark and GBNF
  grammars); outlines-core covers JSON schema and regex only, through a precomputed index whose
  build time grows with the vocabulary;
- masks are computed lazily, in tens of microseconds for a 150k vocabulary, with no per-schema
  precompilation over the vocabulary, so compiling a schema takes about a millisecond; and it
  reports keywords it cannot enforce (`not`, unknown formats, look-around) as errors instead of
  silently ignoring them, which is what a request needs to get a 400 naming the problem.

Compiling: `GrammarCompiler.compile(params)` turns a `StructuredOutputsParams` into a validated
template matcher, cached by a hash of (kind, spec) in a bounded LRU; each request gets a deep copy
(about 10 us). `submit` runs the same on a small thread pool, so the server can await it with a
timeout without blocking its event loop. An invalid or unenforceable constraint is a ValueError,
remembered in the same cache (a refused grammar sent again is refused at once).

Bounded work: every llguidance call runs under `grammar_limits()` (lexer fuel when the grammar is
built and per mask, Earley items per step, lexer states, grammar size). A grammar over a limit
does not hang: its matcher enters an error state. The library builds most of a matcher lazily,
so a grammar can be valid and still hit a limit at its first mask or first tokens (the regex
`(x{1000}){1000}` once its first forced `x` is consumed, after a first mask of about a second; a
self-recursive required `$ref` once its forced `{` is). Compiling therefore also computes the
first mask and consumes the tokens the grammar forces from the start: a limit hit there is a
ValueError like any invalid grammar, and it costs the compile thread about a second at worst,
never the engine's step. A limit hit later, while generating, fails the request with a
`GrammarError` naming its parameter (`StructuredOutputsParams.param`): a matcher in its error
state allows only EOS, which must never pass for the end of a constrained answer.

Masking: `StructuredOutputs` keeps each constrained sequence's matcher, fills the step's bitmask
(B, ceil(V/32)) for the rows that sample, and advances the matchers with the sampled tokens.
Token ids past the tokenizer's vocabulary (padding rows of the model's vocabulary) are always
cleared in a constrained row; EOS is allowed exactly where the grammar accepts.

Reasoning models: when the prompt leaves a `<think>` open (the tokenizer has `<think>` and
`</think>` tokens and the last `<think>` of the prompt is not closed), the sequence is free until
it generates `</think>`; the grammar applies from the next token on.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger("taper.engine")

KINDS = ("json", "json_object", "regex", "choice", "grammar")

# Compact JSON unless the schema asks otherwise ("x-guidance": {"whitespace_flexible": true}):
# free whitespace lets a weak model pad its output with newlines until max_tokens (vLLM's
# `disable_any_whitespace` exists for that reason).
JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint. kind: json (spec = the JSON schema as text), json_object (any JSON
    object; spec unused), regex, choice (spec = a JSON list of strings) or grammar (Lark or
    GBNF text). `compiled` is filled in by GrammarCompiler (the server compiles before the
    request reaches the engine; the engine compiles itself when it is missing). `param`: the
    request parameter the constraint came from, which a failure while generating names."""
    kind: str
    spec: str = ""
    compiled: "CompiledGrammar | None" = field(default=None, repr=False, compare=False)
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured_outputs kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()


class GrammarError(ValueError):
    """A constrained sequence's grammar failed while generating (a resource limit of the
    grammar library, met past the tokens compiling probes): the request's fault, named by
    `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def grammar_limits():
    """The llguidance limits every matcher runs under: the library's defaults, named here
    because they are what bounds a grammar's cost (see the module docstring). Measured on the
    2-core test machine, the worst of them costs about a second to build and a few hundred ms
    per mask at most."""
    from llguidance import LLParserLimits
    return LLParserLimits(
        max_items_in_row=2_000,          # branching of one grammar row
        initial_lexer_fuel=1_000_000,    # building the lexer's regexes (~50k a ms)
        step_lexer_fuel=200_000,         # the lexer's work for one mask (~14k a ms)
        step_max_items=50_000,           # Earley items in one step (~20k a ms)
        max_lexer_states=250_000,        # lexer states (1-2 kB each)
        max_grammar_size=500_000,        # symbols in the grammar's productions
        verbose_errors=False)            # errors without the parser's state dump


def error_text(message: str) -> str:
    """A library error as one line (its first: the rest is state dumps)."""
    first = message.strip().split("\n", 1)[0].strip()
    return first if len(first) < 600 else first[:600] + "..."


@dataclass(slots=True, frozen=True)
class CompiledGrammar:
    template: object          # llguidance.LLMatcher in its start state; never advanced

    def new_matcher(self):
        return self.template.deep_copy()


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not validated yet)."""
    import llguidance
    from llguidance import LLMatcher
    kind, spec = params.kind, params.spec
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.grammar_from("choice", spec)
    return llguidance.grammar_from("grammar", spec)      # Lark, or GBNF converted to Lark


class GrammarCompiler:
    """Compiles constraints against one tokenizer; thread-safe. vocab_size is the model's (the
    logits' width), which may exceed the tokenizer's."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 256,
                 max_workers: int = 2):
        from llguidance import LLTokenizer
        rust = tokenizer.hf.backend_tokenizer
        num_tokens = len(tokenizer.hf)
        if num_tokens > vocab_size:
            raise ValueError(f"the tokenizer has {num_tokens} tokens, more than the model's "
                             f"vocabulary ({vocab_size})")
        eos = sorted(int(t) for t in eos_token_ids if 0 <= int(t) < num_tokens)
        self.ll_tokenizer = LLTokenizer(_plain_tokenizer_json(rust), n_vocab=vocab_size,
                                        eos_token=eos or None)
        self.vocab_size, self.num_tokens = vocab_size, num_tokens
        self.limits = grammar_limits()
        self.cache_size = cache_size
        # a compiled grammar, or the ValueError message of one refused
        self._cache: OrderedDict[str, CompiledGrammar | str] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="taper-grammar")

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint's grammar, from the cache or compiled now; also stored in `params`.
        ValueError naming the problem for an invalid or unenforceable constraint."""
        if params.compiled is not None:
            return params.compiled
        key = params.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = self._compile(params)
            except ValueError as e:
                hit = str(e)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):
            raise ValueError(hit)
        params.compiled = hit
        return hit

    def submit(self, params: StructuredOutputsParams) -> Future:
        """compile() on the worker pool."""
        return self._pool.submit(self.compile, params)

    def cache_len(self) -> int:
        return len(self._cache)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        from llguidance import LLMatcher
        try:
            grammar = grammar_text(params)
        except ValueError as e:
            raise ValueError(f"invalid {_what(params.kind)}: {e}") from None
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer,
                                                                    limits=self.limits)
        if failed:
            raise ValueError(f"invalid {_what(params.kind)}: {_first_line(messages)}")
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise ValueError(f"invalid {_what(params.kind)}: {error_text(matcher.get_error())}")
        self._probe(matcher, params.kind)
        return CompiledGrammar(matcher)

    @staticmethod
    def _probe(matcher, kind: str) -> None:
        """Meet the limits a grammar hits at once here rather than in the engine's step: the
        first mask (on the template, whose lexer states its copies start from) and the tokens
        the grammar forces from the start (on a copy)."""
        matcher.compute_bitmask()
        probe = matcher.deep_copy()
        if not probe.is_error():       # (holds the GIL ~0.1 s for a million forced bytes)
            probe.consume_tokens(probe.compute_ff_tokens())
        for m in (matcher, probe):
            if m.is_error():
                raise ValueError(f"this {_what(kind)} is too complex for the grammar engine: "
                                 f"{error_text(m.get_error())}")


def _what(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice list", "grammar": "grammar"}[kind]


def _first_line(messages: list[str]) -> str:
    text = "; ".join(m.strip() for m in messages if m.strip()) or "rejected by the compiler"
    return text if len(text) < 600 else text[:600] + "..."


def _plain_tokenizer_json(rust) -> str:
    """The tokenizer as JSON without padding or truncation (they would change token strings)."""
    from tokenizers import Tokenizer as RustTokenizer
    copy = RustTokenizer.from_str(rust.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy.to_str()


# ---- per-sequence state and the step's mask

# Up to this many constrained rows, masks are filled on the engine thread, one after another
# (~30 us a row at V = 32k). The executor's worker threads must wake up and compete with the
# OpenMP threads still spinning after the forward pass: on the 2-core test machine a batch of 8
# took a median 3-9 ms that way against 0.27 ms serially (bench/HISTORY.md, 2026-11-26).
SERIAL_FILL_ROWS = 32


@dataclass(slots=True)
class GrammarState:
    matcher: object                 # llguidance.LLMatcher, advanced with each sampled token
    wait_for_token: int | None      # </think>: the grammar starts after it is generated


class StructuredOutputs:
    """The engine's side: matchers of the constrained sequences, the step's bitmask."""

    def __init__(self, compiler: GrammarCompiler, tokenizer):
        from llguidance import LLExecutor
        self.compiler = compiler
        V = compiler.vocab_size
        self.num_words = (V + 31) // 32
        # Bits of the ids the tokenizer has; padding ids past it are never allowed.
        valid = np.zeros(self.num_words * 32, dtype=np.uint8)
        valid[:compiler.num_tokens] = 1
        self.valid_words = np.packbits(valid, bitorder="little").view(np.int32)
        self.executor = LLExecutor(num_threads=max(1, min(4, os.cpu_count() or 1)))
        vocab = tokenizer.hf.get_vocab()
        self.think_ids = (vocab.get("<think>"), vocab.get("</think>"))

    def start(self, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> GrammarState:
        """The state of a new constrained sequence (compiles the grammar when not done yet)."""
        grammar = self.compiler.compile(params)
        return GrammarState(grammar.new_matcher(), self._open_reasoning_end(prompt_token_ids))

    def _open_reasoning_end(self, prompt: list[int]) -> int | None:
        """</think>'s id when the prompt's last <think> is still open, else None."""
        start, end = self.think_ids
        if start is None or end is None:
            return None
        last_start = _last_index(prompt, start)
        if last_start < 0 or _last_index(prompt, end) > last_start:
            return None
        return end

    def bitmask(self, seqs: list) -> tuple[np.ndarray, np.ndarray] | None:
        """(bitmask (B, ceil(V/32)) int32, rows (R,) int32) for the sampling rows `seqs` whose
        grammar is active; None when there is none."""
        active = [(s.grammar.matcher, b) for b, s in enumerate(seqs)
                  if s.grammar is not None and s.grammar.wait_for_token is None]
        if not active:
            return None
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par
        mask = np.zeros((len(seqs), self.num_words), dtype=np.int32)
        if len(active) <= SERIAL_FILL_ROWS:
            for matcher, b in active:
                fill_next_token_bitmask(matcher, mask, b)
        else:
            fill_next_token_bitmask_par(self.executor, active, mask)
        rows = np.fromiter((b for _, b in active), dtype=np.int32, count=len(active))
        mask[rows] &= self.valid_words
        return mask, rows

    def draft_bitmask(self, seqs: list, drafts: list[list[int]]
                      ) -> tuple[np.ndarray, np.ndarray] | None:
        """Speculative decoding's verification rows: sequence j has 1 + len(drafts[j]) rows, row
        i sampling after its first i drafts. (bitmask (R, ceil(V/32)) int32, rows) with each
        constrained row's mask in the grammar's state after those drafts; None when no row is
        constrained. Each matcher is walked through the drafts and rolled back: as it was. A
        draft the grammar refuses leaves the rows after it unconstrained: they are never used
        (the row before it cannot draw it, so the run ends there)."""
        if not any(s.grammar is not None for s in seqs):
            return None
        from llguidance.numpy import fill_next_token_bitmask
        total = sum(1 + len(d) for d in drafts)
        mask = np.zeros((total, self.num_words), dtype=np.int32)
        rows, row = [], 0
        for seq, draft in zip(seqs, drafts):
            if seq.grammar is None:
                row += 1 + len(draft)
                continue
            walk = DraftGrammar(seq.grammar)
            try:
                for i in range(len(draft) + 1):
                    if walk.constrained:
                        fill_next_token_bitmask(walk.state.matcher, mask, row + i)
                        rows.append(row + i)
                    if i < len(draft) and not walk.advance(draft[i]):
                        break
            finally:
                walk.restore()
            row += 1 + len(draft)
        if not rows:
            return None
        rows = np.array(rows, dtype=np.int32)
        mask[rows] &= self.valid_words
        return mask, rows

    def fill_row(self, walk: "DraftGrammar", mask: np.ndarray, row: int) -> bool:
        """Row `row` of `mask` for a draft walk's current state; False when it is unconstrained
        (waiting for </think>)."""
        if not walk.constrained:
            return False
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(walk.state.matcher, mask, row)
        mask[row] &= self.valid_words
        return True

    @staticmethod
    def valid_draft_prefix(seq, draft: list[int]) -> int:
        """How many of the draft's first tokens the sequence's grammar accepts in a row (all of
        them without a grammar); the matcher is left as it was."""
        if seq.grammar is None:
            return len(draft)
        walk = DraftGrammar(seq.grammar)
        try:
            for i, token in enumerate(draft):
                if not walk.advance(token):
                    return i
            return len(draft)
        finally:
            walk.restore()

    @staticmethod
    def advance(seq, token: int) -> bool:
        """Feeds a sampled token to the sequence's matcher; False when the grammar refuses it
        or has failed (`refusal` says which)."""
        state = seq.grammar
        if state is None:
            return True
        if state.wait_for_token is not None:
            if token == state.wait_for_token:
                state.wait_for_token = None
            return True
        if state.matcher.is_error():     # a limit met (its mask allowed only EOS): not an end
            return False
        if state.matcher.is_stopped():    # complete: only EOS is allowed, ignore_eos repeats it
            return True
        return bool(state.matcher.consume_token(token)) and not state.matcher.is_error()

    @staticmethod
    def refusal(seq, token: int) -> Exception:
        """Why `advance` refused `token`: the grammar failed (the request's fault), or the
        mask and the matcher disagree (a bug)."""
        matcher = seq.grammar.matcher
        if matcher.is_error():
            param = seq.sampling_params.structured_outputs.param
            return GrammarError(f"{param}: the grammar failed after {seq.num_output_tokens} "
                                f"output tokens: {error_text(matcher.get_error())}", param)
        return RuntimeError(f"token {token} is outside the request's grammar")


class DraftGrammar:
    """A sequence's grammar walked through draft tokens and back (speculative decoding): advance
    as StructuredOutputs.advance would with each draft, then `restore` rolls the matcher back and
    the </think> wait comes back as it was."""
    __slots__ = ("state", "waiting", "consumed")

    def __init__(self, state: GrammarState):
        self.state = state
        self.waiting = state.wait_for_token
        self.consumed = 0

    @property
    def constrained(self) -> bool:
        return self.waiting is None

    def advance(self, token: int) -> bool:
        if self.waiting is not None:
            if token == self.waiting:
                self.waiting = None
            return True
        matcher = self.state.matcher
        if matcher.is_stopped():
            return True
        # validated first: a refused token would leave the matcher in an error state that no
        # rollback undoes
        if matcher.validate_tokens([token]) != 1 or not matcher.consume_token(token):
            return False
        self.consumed += 1
        return True

    def restore(self) -> None:
        if self.consumed:
            self.state.matcher.rollback(self.consumed)
            self.consumed = 0


def _last_index(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


def json_spec(schema) -> str:
    """A JSON schema (dict, bool or JSON text) as canonical text for StructuredOutputsParams.
    ValueError when it is not JSON or not a schema object."""
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        return json.dumps(schema, separators=(",", ":"))   # key order is the output's order
    except RecursionError:       # a schema sent as text escapes the body's depth limit
        raise ValueError("the JSON schema is nested too deeply") from None
