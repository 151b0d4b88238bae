"""engine/tokenizer.py on tokenizers built offline in the test (no network).

Two tokenizers: a byte-level BPE trained with the `tokenizers` library on text with 3-byte (CJK)
and 4-byte (emoji) characters, adding BOS by default and carrying a chat template; and a
SentencePiece-style BPE with byte fallback (`<0xE4>` tokens, ByteFallback decoder, leading-space
strip); builders in tiny_tokenizers.py, fixtures in conftest.py.
"""
import json
import pathlib
import subprocess
import sys

import pytest

from engine.tokenizer import Tokenizer
from tiny_tokenizers import build_byte_level

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
MESSAGES = [{"role": "user", "content": "你好 world"}]


def test_encode_adds_bos_by_default(bl, sp):
    for tok in (bl, sp):
        ids = tok.encode("hello world")
        assert ids[0] == tok.bos_token_id
        assert ids[1:] == tok.encode("hello world", add_special_tokens=False)
        assert tok.bos_token_id not in ids[1:]


def test_encode_chat_has_single_bos(bl):
    text = bl.apply_chat_template(MESSAGES)
    assert text == "<s><|im_start|>user\n你好 world<|im_end|>\n<|im_start|>assistant\n"
    ids = bl.encode_chat(MESSAGES)
    assert ids == bl.encode(text, add_special_tokens=False)
    assert ids.count(bl.bos_token_id) == 1 and ids[0] == bl.bos_token_id
    # What the test guards against: the default encode would double the BOS.
    assert bl.encode(text)[:2] == [bl.bos_token_id, bl.bos_token_id]
    # Special tokens of the template are single ids, not spelled out.
    im_start = bl.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids[1] == im_start


def test_chat_template_kwargs_only_when_given(bl):
    assert "[think" not in bl.apply_chat_template(MESSAGES)
    assert "[think:False]" in bl.apply_chat_template(MESSAGES, enable_thinking=False)
    assert "[think:True]" in bl.apply_chat_template(MESSAGES, enable_thinking=True)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert "[tools:1]" in bl.apply_chat_template(MESSAGES, tools=tools)
    assert not bl.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith(
        "assistant\n")


def test_no_chat_template(sp):
    assert not sp.has_chat_template
    with pytest.raises(ValueError):
        sp.apply_chat_template(MESSAGES)
    text = sp.apply_chat_template(MESSAGES, chat_template="{% for m in messages %}"
                                  "{{ m['content'] }}{% endfor %}")
    assert text == "你好 world"


def test_has_chat_template(bl):
    assert bl.has_chat_template


def test_decode_skips_special_tokens(bl):
    ids = bl.encode_chat(MESSAGES)
    assert bl.decode(ids) == "user\n你好 world\nassistant\n"
    assert bl.decode(ids, skip_special_tokens=False) == bl.apply_chat_template(MESSAGES)
    specials = {bl.hf.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<|im_start|>",
                                                          "<|im_end|>")}
    assert specials <= bl.all_special_ids


@pytest.mark.parametrize("text", ["hello 世界 你好😀 world", "🎉café你"])
def test_roundtrip_multibyte(bl, sp, text):
    for tok in (bl, sp):
        assert tok.decode(tok.encode(text)) == text


def test_sentencepiece_byte_fallback_tokens(sp):
    ids = sp.encode("你", add_special_tokens=False)
    assert sp.convert_ids_to_tokens(ids) == ["▁", "<0xE4>", "<0xBD>", "<0xA0>"]


def test_vocab_size(bl, sp):
    assert bl.vocab_size == len(bl.hf) == 270
    assert sp.vocab_size == 3 + 256 + 27


def test_eos_token_ids(tmp_path):
    tok = build_byte_level(tmp_path)
    eos = tok.hf.convert_tokens_to_ids("</s>")
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_ids == {eos}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    assert Tokenizer.from_pretrained(str(tmp_path)).eos_token_ids == {eos, im_end}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 5]}))
    assert Tokenizer.from_pretrained(str(tmp_path)).eos_token_ids == {eos, im_end, 5}


def test_missing_path_does_not_reach_network(tmp_path):
    with pytest.raises(Exception):
        Tokenizer.from_pretrained(str(tmp_path / "nope"))


def test_loading_does_not_import_torch(bl):
    # AutoTokenizer would import torch whenever it is installed; Taper must never need it.
    code = ("import sys; from engine.tokenizer import Tokenizer; "
            f"t = Tokenizer.from_pretrained({bl.hf.name_or_path!r}); "
            "t.encode_chat([{'role': 'user', 'content': 'x'}]); t.decode([1]); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)
