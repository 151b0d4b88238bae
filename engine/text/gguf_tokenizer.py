"""A Hugging Face fast tokenizer rebuilt from a GGUF file's tokenizer.ggml.* metadata.

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary, merges or scores, token types
and special ids, and picks the rest of the pipeline by name. We rebuild that pipeline with the
`tokenizers` library so that it splits text as llama.cpp's own tokenizer does (llama-vocab.cpp):

- "gpt2" (byte-level BPE): tokens spelled in GPT-2's byte alphabet, merges in rank order. Text is
  split by the regexes llama.cpp lists for `tokenizer.ggml.pre`, each one splitting the pieces the
  previous one left (matches and the gaps between them both kept, tokenizers' "isolated"), then
  byte-encoded. llama3-style vocabularies look a whole piece up before merging (ignore_merges).
- "llama" (SentencePiece BPE): pieces with scores and no merges. SentencePiece joins the adjacent
  pair whose joint piece scores highest, which is BPE with every two-piece spelling of a
  vocabulary piece as a merge, ranked by that piece's score. Spaces become "▁" and one "▁" is
  put before each run of text, at the start and after every special token, as llama.cpp does
  (add_space_prefix); characters without a piece fall back to <0xXX> byte tokens.

Token types: CONTROL and UNKNOWN tokens become special added tokens, USER_DEFINED ones plain
added tokens (llama.cpp matches both whole, before splitting); for Phi-3 (by general.name, as
llama.cpp decides) they take the whitespace after them (rstrip). BOS/EOS follow add_bos_token /
add_eos_token (llama.cpp's defaults when absent); EOT/EOM ids count as end of generation.
"""
from __future__ import annotations

import logging

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers
# Not transformers' GGUF integration: it imports torch when torch is installed.
from engine.text.byte_level import bytes_to_unicode
from engine.text.hf_tokenizers import PreTrainedTokenizerFast
from engine.text.tokenizer import Tokenizer

logger = logging.getLogger("taper.tokenizer")

# llama.cpp's token types (llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---- pre-tokenizer regexes, as llama-vocab.cpp lists them per tokenizer.ggml.pre

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]


def _table(names: str, regexes: list[str], ignore_merges: bool = False,
           add_bos: bool = False) -> dict:
    return {n: (regexes, ignore_merges, add_bos) for n in names.split()}


# tokenizer.ggml.pre -> (regexes applied in turn, ignore_merges, add BOS when the file is silent)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool]] = {
    **_table("default", _DEFAULT),
    **_table("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", [_LLAMA3],
             ignore_merges=True, add_bos=True),
    **_table("dbrx smaug-bpe", [_LLAMA3]),
    **_table("qwen2 deepseek-r1-qwen megrez stablelm2 hunyuan", [_QWEN2]),
    **_table("qwen35", [_QWEN35]),
    **_table("gpt-2 phi-2 mpt olmo jais trillion", [_GPT2]),
    **_table("starcoder refact command-r smollm codeshell minerva", [r"\p{N}", _GPT2]),
    **_table("falcon", [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
    **_table("tekken", [_TEKKEN], ignore_merges=True, add_bos=True),
    **_table("gpt-4o llama4", [_GPT4O]),
}


def _vocab(tokens: list[str]) -> dict[str, int]:
    """token -> id, the first id winning where a string repeats (ids stay those of the file)."""
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    return vocab


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best joint score first (ties: longer left part,
    then longer right part, then lower ids), which is the order SentencePiece joins pairs in."""
    vocab = _vocab(tokens)
    merges = []
    for tok, tid in vocab.items():
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok))
                  if tok[:i] in vocab and tok[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(-scores[tid], -len(left), -len(right), left, right) for left, right in splits]
    merges.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in merges]


# llama.cpp's ids for a SentencePiece vocabulary whose file names none
_SPM_DEFAULT_IDS = {"bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}


def special_id(meta: dict, key: str, types: list[int]) -> int | None:
    """tokenizer.ggml.<key>, else llama.cpp's default: for SentencePiece vocabularies <unk> is
    the UNKNOWN-type token or id 0 (converters often mark it CONTROL and leave the key out)."""
    i = meta.get(f"tokenizer.ggml.{key}")
    if i is None and meta.get("tokenizer.ggml.model") == "llama":
        if key == "unknown_token_id":
            i = next((j for j, ty in enumerate(types) if ty == UNKNOWN), None)
        i = _SPM_DEFAULT_IDS.get(key) if i is None else i
    return None if i is None else int(i)


def _byte_level(meta: dict, tokens: list[str], types: list[int], path: str):
    regexes, ignore_merges, add_bos = PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre") or "default"]
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Normal tokens are stored byte-encoded; added (control, user-defined) ones as raw text,
    # which is also how the added-token matcher looks them up. A normal token outside the byte
    # alphabet is respelled in it.
    vocab = _vocab([tok if ty in (CONTROL, USER_DEFINED) or set(tok) <= alphabet
                    else "".join(spelling[b] for b in tok.encode("utf-8"))
                    for tok, ty in zip(tokens, types)])
    merges = []
    for m in meta.get("tokenizer.ggml.merges") or []:
        cut = m.find(" ", 1)
        if cut < 0:
            raise ValueError(f"{path}: malformed merge {m!r} in tokenizer.ggml.merges")
        merges.append((m[:cut], m[cut + 1:]))
    _check_merges(merges, vocab, path)
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok, add_bos


def _check_merges(merges: list[tuple[str, str]], vocab: dict[str, int], path: str) -> None:
    """ValueError naming the file and the first merge whose parts or result are not tokens of
    the vocabulary (the tokenizers library would raise a bare Exception, or panic, on it)."""
    for i, (left, right) in enumerate(merges):
        missing = [p for p in (left, right, left + right) if p not in vocab]
        if missing:
            raise ValueError(
                f"{path}: corrupt tokenizer: tokenizer.ggml.merges[{i}] {left + ' ' + right!r} "
                f"names {', '.join(repr(p) for p in dict.fromkeys(missing))}, not in "
                f"tokenizer.ggml.tokens ({len(vocab)} tokens)")


def _sentencepiece(meta: dict, tokens: list[str], types: list[int], path: str):
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(f"{path}: a SentencePiece (llama) vocabulary needs tokenizer.ggml.scores "
                         "with one score per token")
    unk_id = special_id(meta, "unknown_token_id", types)
    tok = RustTokenizer(models.BPE(
        vocab=_vocab(tokens), merges=sentencepiece_merges(tokens, scores),
        unk_token=None if unk_id is None else tokens[unk_id], byte_fallback=True, fuse_unk=True))
    replace = normalizers.Replace(" ", "▁")
    decoder = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        # Each text run between special tokens is normalised apart, so each gets its own "▁".
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace])
        decoder.append(decoders.Strip(" ", 1, 0))
    else:
        tok.normalizer = replace
    tok.decoder = decoders.Sequence(decoder)
    return tok, True


def rstrip_tokens(meta: dict, tokens: list[str], types: list[int]) -> set[str]:
    """The added tokens that take the whitespace after them, as llama-vocab.cpp sets by model
    name (the file has no per-token attributes): for a model named Phi-3 every special token
    but <unk>, <s> and <|endoftext|>, and </s>."""
    name = str(meta.get("general.name") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    special = {t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED, UNKNOWN)}
    return (special | {"</s>"}) - {"<unk>", "<s>", "<|endoftext|>"}


def build_tokenizer(meta: dict, path: str = "GGUF file"):
    """engine.text.tokenizer.Tokenizer from GGUF metadata, or None when the file carries none (or one
    of a kind we cannot rebuild: logged)."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model in (None, "none", "no_vocab") or not tokens:
        return None
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if model not in ("gpt2", "llama") or (model == "gpt2" and pre not in PRE_TOKENIZERS):
        what = f"model {model!r}" if model != "gpt2" else f"pre-tokenizer {pre!r}"
        logger.warning("%s: cannot rebuild a tokenizer with %s (supported: llama, and gpt2 with "
                       "pre-tokenizers %s); give one with --tokenizer", path, what,
                       " ".join(sorted(PRE_TOKENIZERS)))
        return None
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    build = _byte_level if model == "gpt2" else _sentencepiece
    tok, add_bos_default = build(meta, tokens, types, path)

    rstrip = rstrip_tokens(meta, tokens, types)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, rstrip=t in rstrip)
                            for t, ty in zip(tokens, types) if ty in (CONTROL, UNKNOWN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, rstrip=t in rstrip)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def token(key):
        i = special_id(meta, key, types)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    chat_template = meta.get("tokenizer.chat_template")
    named = {k.removeprefix("tokenizer.chat_template."): v for k, v in meta.items()
             if k.startswith("tokenizer.chat_template.")}
    if named:
        chat_template = {**({"default": chat_template} if chat_template else {}), **named}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"), chat_template=chat_template,
        add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False)
    eog = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return Tokenizer(hf, [i for i in eog if i is not None])
