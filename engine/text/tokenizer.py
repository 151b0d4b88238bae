"""Text <-> token ids, wrapping a Hugging Face fast tokenizer (DESIGN.md section 5, Tokenization).

Completions tokenize as the tokenizer does by default (BOS where it adds one). Chat renders the
template to text, then tokenizes that text with add_special_tokens=False: the template already
writes BOS, so adding it again would double it.

Message text cannot forge a turn: special-token strings (`<|im_end|>`) inside messages, tools or
template kwargs tokenize as plain text, while the special tokens the template writes stay single
ids (`encode_chat`). Conversations without such strings tokenize exactly as described above.

Decoding goes straight to the Rust tokenizer (`backend_tokenizer.decode`), never through
transformers' Python `decode`: it is several times faster (the incremental detokenizer calls it
twice per generated token) and it never runs `clean_up_tokenization_spaces`, which would rewrite
text already streamed to a client.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading

from tokenizers import AddedToken, Tokenizer as RustTokenizer

from engine.text.hf_tokenizers import PreTrainedTokenizerFast, auto_tokenizer
from engine.text.byte_level import bytes_to_unicode
from engine.text.char_bound import max_chars_per_token

log = logging.getLogger("taper.tokenizer")


# Strings the server reads as structure in model output (tool-call parsers, reasoning).
CONTROL_MARKERS = frozenset((
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<|python_start|>", "<|python_end|>"))


class TextTooLong(ValueError):
    """A text longer than any text of the allowed number of tokens can be
    (engine/text/char_bound.py): refused before it is tokenized."""

    def __init__(self, num_chars: int, max_chars: int):
        super().__init__(f"the text has {num_chars} characters, more than {max_chars}")
        self.num_chars, self.max_chars = num_chars, max_chars


class Tokenizer:
    def __init__(self, hf_tokenizer, generation_eos_ids: list[int] | None = None):
        self.hf = hf_tokenizer
        self._rust = hf_tokenizer.backend_tokenizer
        ids = set()
        if hf_tokenizer.eos_token_id is not None:
            ids.add(int(hf_tokenizer.eos_token_id))
        ids.update(int(i) for i in generation_eos_ids or [])
        self.eos_token_ids: set[int] = ids
        self.all_special_ids: set[int] = set(int(i) for i in hf_tokenizer.all_special_ids)
        # Added tokens flagged special (e.g. <|im_end|>) that transformers may not list above.
        for tid, tok in hf_tokenizer.added_tokens_decoder.items():
            if tok.special:
                self.all_special_ids.add(int(tid))
        # Special added tokens as the Rust tokenizer matches them (content and flags), for
        # encode_chat's guard against their strings in message text; with them the added tokens
        # that are markers the server reads (Qwen's <tool_call> and <think> are not flagged
        # special), so no user or tool text can forge a call, a result or a reasoning block.
        added = self._rust.get_added_tokens_decoder()
        self._specials: dict[int, AddedToken] = {
            int(i): t for i, t in added.items() if t.special or t.content in CONTROL_MARKERS}
        self._special_strings = {t.content for t in added.values() if t.special}
        self._special_re = _literal_re(t.content for t in self._specials.values())
        self._added_ids = set(int(i) for i in self._rust.get_added_tokens_decoder())
        self._byte_level: bool | None = None     # token_bytes: is the decoder byte-level BPE?
        self._guard: _TextGuard | None = None   # built on the first conversation that needs it
        self._guard_lock = threading.Lock()
        self._max_chars_per_token: int | None | bool = False     # False: not computed yet

    def __getstate__(self):
        """Pickled (a data-parallel replica hands its tokenizer to the API server) without the
        chat guard, rebuilt on first use, and its lock."""
        state = dict(self.__dict__)
        state["_guard"], state["_guard_lock"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._guard_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, path: str, local_files_only: bool = True, **kwargs) -> "Tokenizer":
        """Load from a local directory (or an already cached hub id); never reaches the network
        unless local_files_only=False.

        A directory with tokenizer.json loads through the generic fast tokenizer class: the file
        is the whole pipeline (normaliser, pre-tokeniser, BOS/EOS post-processor, decoder) and
        tokenizer_config.json adds special tokens, add_bos_token and the chat template. Anything
        else (slow-only files, hub ids) goes through AutoTokenizer, which converts."""
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            hf = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=local_files_only,
                                                         **kwargs)
        else:
            hf = auto_tokenizer().from_pretrained(path, use_fast=True,
                                                  local_files_only=local_files_only, **kwargs)
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{path}: no fast (tokenizers) tokenizer available")
        return cls(hf, _generation_eos_ids(path))

    @classmethod
    def try_from_pretrained(cls, path: str) -> "Tokenizer | None":
        """The tokenizer of a model directory, or None when it ships none (token ids only)."""
        names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
        if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, n)) for n in names):
            return None
        return cls.from_pretrained(path)

    # ---- properties
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (len(tokenizer), not the base vocab)."""
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def has_tokens(self, strings) -> bool:
        """Whether each string is one token of this vocabulary."""
        return all(self._rust.token_to_id(t) is not None for t in strings)

    def has_special_tokens(self, strings) -> bool:
        """Whether any of the strings is a special token (one that decoding may skip)."""
        return any(t in self._special_strings for t in strings)

    @property
    def max_chars_per_token(self) -> int | None:
        """The most characters of text one token can stand for; None when this tokenizer may
        drop text, so that no such bound holds (engine/text/char_bound.py). Computed once
        (about 0.1 s for a 150k vocabulary)."""
        if self._max_chars_per_token is False:
            self._max_chars_per_token = max_chars_per_token(self._rust)
        return self._max_chars_per_token

    def max_text_chars(self, num_tokens: int) -> int | None:
        """The most characters a text of `num_tokens` tokens can have (None: no bound)."""
        per_token = self.max_chars_per_token
        return None if per_token is None else per_token * num_tokens

    # ---- encode
    def encode(self, text: str, add_special_tokens: bool = True,
               max_chars: int | None = None) -> list[int]:
        """Completion prompt: the tokenizer's default special tokens (BOS where it adds one).
        TextTooLong, before any tokenizing, for a text of more than `max_chars` characters."""
        _check_length(text, max_chars)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_text(self, text: str) -> list[int]:
        """Client text that goes inside a prompt the server writes (a reranker's template):
        special-token strings in it tokenize as plain text, as encode_chat treats message text.
        Without any, exactly `encode(text, add_special_tokens=False)`."""
        if self._special_re is None or not self._special_re.search(text):
            return self.encode(text, add_special_tokens=False)
        guard = self.prepare_chat_guard()
        return guard.encode(self.hf, guard.escape(text))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            enable_thinking: bool | None = None, add_generation_prompt: bool = True,
                            chat_template: str | None = None, **kwargs) -> str:
        """Render a conversation to text. enable_thinking and extra kwargs reach the template only
        when given, so templates that test `enable_thinking is defined` see their default."""
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        if tools is not None:
            kwargs["tools"] = tools
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        elif not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template; pass chat_template")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **kwargs)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    enable_thinking: bool | None = None, add_generation_prompt: bool = True,
                    chat_template: str | None = None, max_chars: int | None = None,
                    rewrite=None, **kwargs) -> list[int]:
        """Render and tokenize a conversation; TextTooLong, before tokenizing, when the rendered
        text has more than `max_chars` characters. Special-token strings in the client's text
        (messages, their names and tool calls, tools, template kwargs) tokenize as plain text;
        only the template's own special tokens become special ids.

        Without such strings (the fast path) this is exactly `encode(apply_chat_template(...),
        add_special_tokens=False)`, i.e. transformers' `apply_chat_template(tokenize=True)`.
        With them, each one is replaced by a private marker before rendering; the rendered text
        is then encoded once by a private copy of the Rust tokenizer that reads special-token
        strings as text, in which each special token the template wrote is swapped for a sentinel
        added token (same lstrip/rstrip/single_word/normalized flags) that maps back to its id.
        One encode over the whole text keeps the template's split structure, so Metaspace
        `prepend_scheme="first"` (only the split at offset 0 gets the "▁" prefix) and per-split
        normalizers behave as in the fast path; only the client's text differs: it is no longer
        cut at the special-token strings it contains.

        rewrite: a function applied to the rendered text before tokenizing (a vision model's
        image placeholders expanded, server/media.py); the client's special-token strings are
        escaped by then, so it changes only what the template wrote."""
        client = dict(messages=messages, tools=tools, enable_thinking=enable_thinking, **kwargs)
        render = dict(add_generation_prompt=add_generation_prompt, chat_template=chat_template)
        if self._special_re is None or not _has_match(self._special_re, client):
            text = self.apply_chat_template(**client, **render)
            if rewrite is not None:
                text = rewrite(text)
            return self.encode(text, add_special_tokens=False, max_chars=max_chars)
        guard = self.prepare_chat_guard()
        text = self.apply_chat_template(**_map_text(client, guard.escape), **render)
        if rewrite is not None:
            text = rewrite(text)
        # markers shorter than the strings they stand for undercount by a few characters: the
        # context check after tokenizing still catches such a text
        _check_length(text, max_chars)
        return guard.encode(self.hf, text)

    def prepare_chat_guard(self) -> "_TextGuard":
        """The private tokenizer copy encode_chat uses for special-token strings in client text,
        built on first use: about 0.5 s and 70 MB for a 150k-token vocabulary, so a server may
        call this at load rather than on its first such request."""
        with self._guard_lock:   # the server's event loop and LLM callers may race to build it
            if self._guard is None:
                self._guard = _TextGuard(self._rust, self._specials, self.hf.unk_token_id)
            return self._guard

    # ---- decode
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._rust.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return self.hf.convert_ids_to_tokens([int(i) for i in ids])

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (OpenAI's logprobs `bytes`), not the text of decoding it
        alone: one byte-level token of a split emoji holds just its part of the UTF-8 bytes.
        Byte-level BPE maps its alphabet back to bytes; SentencePiece byte fallback
        `<0xE2>` is that byte and "▁" a space; added tokens are their content."""
        token_id = int(token_id)
        piece = self._rust.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level is None:
            state = json.loads(self._rust.decoder.__getstate__()) if self._rust.decoder else {}
            self._byte_level = '"ByteLevel"' in json.dumps(state)
        if self._byte_level:
            return bytes(_BYTE_DECODER.get(c, 0) for c in piece)
        m = _BYTE_PIECE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


# Byte-level BPE's alphabet back to bytes.
_BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _check_length(text: str, max_chars: int | None) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise TextTooLong(len(text), max_chars)


def _generation_eos_ids(path: str) -> list[int]:
    """eos_token_id from generation_config.json (int or list) when the directory has one."""
    cfg = os.path.join(path, "generation_config.json")
    if not os.path.isfile(cfg):
        return []
    with open(cfg, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


# ---- chat text guard

_INDEX_BASE = 0xF0000   # Supplementary Private Use Area-A: one character per special token


class _TextGuard:
    """What encode_chat needs to read special-token strings (and the markers guarded with them)
    in client text as text.

    A client occurrence of special token n becomes the marker `marker_nonce + chr(BASE + n)`
    before rendering; after rendering, each special token the template wrote (found where the
    shared tokenizer matches it, so its matching rules apply exactly) becomes the sentinel
    `sentinel_nonce + chr(BASE + n)` and each marker becomes the literal string again. A private
    copy of the Rust tokenizer with encode_special_tokens=True then reads the literals as text
    and matches the sentinels, added to it as non-special added tokens, whose ids map back to the
    special ids. The nonces are random private-use strings, so client text cannot spell them.
    The shared tokenizer is never mutated: the engine thread decodes with it meanwhile."""

    def __init__(self, rust: RustTokenizer, specials: dict[int, AddedToken], unk_id: int | None):
        if len(specials) > 0xFFFE:
            raise ValueError(f"{len(specials)} special tokens: more than one index plane holds")
        self.marker_nonce, self.sentinel_nonce = _nonce(), _nonce()
        self.specials = specials
        self.unk_id = unk_id    # the model's own answer to unknown text, special or not
        self.rust = RustTokenizer.from_str(rust.to_str())
        self.rust.no_truncation()
        self.rust.no_padding()
        self.rust.encode_special_tokens = True
        # Guarded markers that are plain added tokens (Qwen's <think>) become special in the
        # copy (same id), so that encode_special_tokens reads them as text too.
        self.rust.add_special_tokens([
            AddedToken(tok.content, single_word=tok.single_word, lstrip=tok.lstrip,
                       rstrip=tok.rstrip, normalized=tok.normalized, special=True)
            for tok in specials.values() if not tok.special])
        self.marker: dict[str, str] = {}        # special content -> marker
        self.literal: dict[str, str] = {}       # index character -> special content
        self.sentinel: dict[int, str] = {}      # special id -> sentinel
        for n, (tid, tok) in enumerate(sorted(specials.items())):
            index = chr(_INDEX_BASE + n)
            self.marker[tok.content] = self.marker_nonce + index
            self.literal[index] = tok.content
            self.sentinel[tid] = self.sentinel_nonce + index
        self.rust.add_tokens([
            AddedToken(self.sentinel[tid], single_word=tok.single_word, lstrip=tok.lstrip,
                       rstrip=tok.rstrip, normalized=tok.normalized, special=False)
            for tid, tok in specials.items()])
        self.special_id = {self.rust.token_to_id(s): tid for tid, s in self.sentinel.items()}
        self.special_re = _literal_re(tok.content for tok in specials.values())
        self.marker_re = re.compile(re.escape(self.marker_nonce) + "(.)", re.DOTALL)

    def escape(self, s: str) -> str:
        return self.special_re.sub(lambda m: self.marker[m.group()], s)

    def encode(self, hf, text: str) -> list[int]:
        """Ids of `text`, rendered from escaped client text."""
        if self.sentinel_nonce in text:
            raise ValueError("the conversation contains reserved private-use characters")
        # Where the tokenizer matches special tokens in the rendered text: the template's own
        # (client ones are markers now). The span must hold the token's string: an <unk> the
        # model gives for unknown characters (a marker's, say) is not one.
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        edits = [(s, e, self.sentinel[tid])
                 for tid, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])
                 if tid in self.specials and self.specials[tid].content in text[s:e]]
        edits += [(m.start(), m.end(), self.literal.get(m.group(1), m.group()))
                  for m in self.marker_re.finditer(text)]
        edits.sort()
        pieces, pos = [], 0
        for start, end, repl in edits:
            pieces += [text[pos:start], repl]
            pos = end
        pieces.append(text[pos:])
        text = "".join(pieces)
        if self.marker_nonce in text:
            log.warning("the chat template altered message text next to a special-token string")
        ids = self.rust.encode(text, add_special_tokens=False).ids
        # Special tokens are not matched here, so a special id means the model spelled one from
        # plain text (a vocabulary entry with merges leading to it): no safe reading exists.
        spelled = {i for i in ids if i in self.specials and i != self.unk_id}
        if spelled:
            names = sorted(self.specials[i].content for i in spelled)
            raise ValueError(f"the tokenizer makes special tokens {names} from the plain text in "
                             "this conversation; it cannot be tokenized safely")
        return [self.special_id.get(i, i) for i in ids]


def _nonce(n: int = 4) -> str:
    """n random characters of Supplementary Private Use Area-B (U+100000..U+10FFFD)."""
    return "".join(chr(0x100000 + secrets.randbelow(0xFFFE)) for _ in range(n))


def _literal_re(strings) -> re.Pattern | None:
    """Alternation of literal strings, longest first (leftmost-longest, like the tokenizer's
    added-token matcher); None when there are none."""
    strings = sorted({s for s in strings if s}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, strings))) if strings else None


def _has_match(pattern: re.Pattern, obj) -> bool:
    """Whether any string in obj (nested dicts, lists, tuples; keys included) matches."""
    if isinstance(obj, str):
        return pattern.search(obj) is not None
    if isinstance(obj, dict):
        return any(_has_match(pattern, k) or _has_match(pattern, v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return any(_has_match(pattern, v) for v in obj)
    return False


def _map_text(obj, fn):
    """obj with fn applied to every string in it (keys included); a new structure, obj untouched."""
    if isinstance(obj, str):
        return fn(obj)
    if isinstance(obj, dict):
        return {_map_text(k, fn): _map_text(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_map_text(v, fn) for v in obj]
    return obj
