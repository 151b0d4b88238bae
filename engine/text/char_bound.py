"""How many characters a text of N tokens can have at most, read from a tokenizer's pipeline.

A server must refuse a prompt that cannot fit the context before it tokenizes it: tokenizing ten
megabytes takes seconds and hundreds of megabytes, only to end in a 400. If every token covers at
most L characters of the text, a text of more than L * N characters has more than N tokens. L is
the longest token in the vocabulary (its string; byte-level BPE spells a byte as one character
and a character is at least one byte, SentencePiece spells a space as one "▁"; an added token is
its content), times what the normalizer can shrink a text by.

That reasoning needs a pipeline that never drops text, so the bound is None (no bound: tokenize
and count) for any step that may: a normalizer that strips accents, controls or whitespace (BERT's,
SentencePiece's precompiled charsmap, Strip, Replace by nothing or by a regex), a pre-tokenizer
that removes what it splits on (Whitespace, BERT's, a Split or Punctuation "removed"), a model
that maps an unknown word of any length to one token or drops what it has no piece for
(WordPiece, WordLevel, Unigram without byte fallback, BPE without byte fallback or a byte-level
alphabet unless each unknown character is a token of its own), and added tokens that swallow
the whitespace beside them (lstrip/rstrip). Byte-level BPE (GPT-2, Llama 3, Qwen, ...) and
SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma) keep every character.
"""
from __future__ import annotations

import json

# Canonical composition (NFC, NFKC) joins at most 4 code points into one (U+1F82 is alpha with
# three marks); decomposition, lowercasing and prepending only lengthen a text.
_COMPOSING = {"NFC": 4, "NFKC": 4}
_LENGTHENING = {"NFD", "NFKD", "Lowercase", "Prepend"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def max_chars_per_token(rust_tokenizer) -> int | None:
    """The most characters of input text one token can stand for, or None when the pipeline may
    drop text (see the module docstring). `rust_tokenizer`: a `tokenizers.Tokenizer`."""
    state = json.loads(rust_tokenizer.to_str())
    shrink = _normalizer_shrink(state.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps(state.get("pre_tokenizer")):
        return None
    if not _model_keeps(state.get("model") or {}, _has(state.get("pre_tokenizer"), "ByteLevel")):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in state.get("added_tokens") or []):
        return None
    vocab = rust_tokenizer.get_vocab(with_added_tokens=True)
    if not vocab:
        return None
    return max(len(piece) for piece in vocab) * shrink


def _normalizer_shrink(n: dict | None) -> int | None:
    """How many input characters one normalized character can come from; None: it may drop."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind == "Sequence":
        shrink = 1
        for part in n.get("normalizers") or []:
            s = _normalizer_shrink(part)
            if s is None:
                return None
            shrink *= s
        return shrink
    if kind in _COMPOSING:
        return _COMPOSING[kind]
    if kind in _LENGTHENING:
        return 1
    if kind == "Replace":        # a literal by a non-empty literal: len(pattern) chars into one
        pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
        if isinstance(pattern, str) and pattern and isinstance(content, str) and content:
            return max(1, -(-len(pattern) // len(content)))
    return None


def _pre_tokenizer_keeps(p: dict | None) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps(q) for q in p.get("pretokenizers") or [])
    if kind in ("Split", "Punctuation"):
        return str(p.get("behavior", "Isolated")).lower() != "removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def _has(p: dict | None, kind: str) -> bool:
    if p is None:
        return False
    return p.get("type") == kind or any(_has(q, kind) for q in p.get("pretokenizers") or [])


def _model_keeps(model: dict, byte_level: bool) -> bool:
    kind = model.get("type")
    if kind == "BPE":   # a character it has no piece for: its bytes, one unknown token, or lost
        return bool(model.get("byte_fallback") or byte_level
                    or (model.get("unk_token") is not None and not model.get("fuse_unk")))
    if kind == "Unigram":
        return bool(model.get("byte_fallback"))
    return False                  # WordPiece, WordLevel: an unknown word of any length is one
