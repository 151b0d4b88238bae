"""engine/tokenizer.py on tokenizers built offline in the test (no network).

Two tokenizers: a byte-level BPE trained with the `tokenizers` library on text with 3-byte (CJK)
and 4-byte (emoji) characters, adding BOS by default and carrying a chat template; and a
SentencePiece-style BPE with byte fallback (`<0xE4>` tokens, ByteFallback decoder, leading-space
strip). The builders are reused by test_detokenizer.py.
"""
import json
import pathlib
import subprocess
import sys

import pytest
from tokenizers import AddedToken, Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from engine.tokenizer import Tokenizer

REPO_ROOT = str(pathlib.Path(__file__).resolve().parents[1])
TRAIN_TEXT = ["你好世界你好世界 😀🎉😀🎉 hello world café STOP", "世界你好😀😀 你好 world"] * 10
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}[tools:{{ tools | length }}]{% endif %}"
    "{% if enable_thinking is defined %}[think:{{ enable_thinking }}]{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by the ByteLevel pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_byte_level(path, vocab_size=270):
    """Byte-level BPE; vocab_size=270 leaves merges that split 3- and 4-byte characters (one
    token holds a whole character plus the first bytes of the next)."""
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAIN_TEXT, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                 chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(str(path))
    return Tokenizer.from_pretrained(str(path))


def build_sentencepiece(path):
    """Llama-style BPE: '▁' for spaces, characters outside the vocabulary fall back to <0xNN>
    byte tokens; the decoder strips the leading space. No chat template."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for p in ["▁", "h", "e", "l", "o", "w", "r", "d", "S", "T", "O", "P", "世", "界", "▁h", "▁he",
              "ll", "▁hell", "▁hello", "▁w", "or", "▁wor", "ld", "▁world", "ST", "OP", "STOP"]:
        vocab[p] = len(vocab)
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o"), ("▁", "w"),
              ("o", "r"), ("▁w", "or"), ("l", "d"), ("▁wor", "ld"), ("S", "T"), ("O", "P"),
              ("ST", "OP")]
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<s>", special=True),
                            AddedToken("</s>", special=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    hf.save_pretrained(str(path))
    return Tokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def bl(tmp_path_factory):
    return build_byte_level(tmp_path_factory.mktemp("bl"))


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    return build_sentencepiece(tmp_path_factory.mktemp("sp"))


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
