"""Text <-> token ids, wrapping a Hugging Face fast tokenizer (DESIGN.md section 5, Tokenization).

Completions tokenize as the tokenizer does by default (BOS where it adds one). Chat renders the
template to text, then tokenizes that text with add_special_tokens=False: the template already
writes BOS, so adding it again would double it.

Decoding goes straight to the Rust tokenizer (`backend_tokenizer.decode`), never through
transformers' Python `decode`: it is several times faster (the incremental detokenizer calls it
twice per generated token) and it never runs `clean_up_tokenization_spaces`, which would rewrite
text already streamed to a client.
"""
from __future__ import annotations

import json
import os

# Not `from transformers import AutoTokenizer`: that pulls in transformers' configuration module,
# which imports torch whenever torch is installed (seconds of import, and its own thread pools).
from transformers import PreTrainedTokenizerFast


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
            from transformers import AutoTokenizer
            hf = AutoTokenizer.from_pretrained(path, use_fast=True,
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

    # ---- encode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Completion prompt: the tokenizer's default special tokens (BOS where it adds one)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

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
                    chat_template: str | None = None, **kwargs) -> list[int]:
        text = self.apply_chat_template(messages, tools=tools, enable_thinking=enable_thinking,
                                        add_generation_prompt=add_generation_prompt,
                                        chat_template=chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ---- decode
    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._rust.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return self.hf.convert_ids_to_tokens([int(i) for i in ids])


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
