"""Tokenizers built offline for the tests (no network).

A byte-level BPE trained with the `tokenizers` library on text with 3-byte (CJK) and 4-byte (emoji)
characters, adding BOS by default and carrying a chat template; a SentencePiece-style BPE with
byte fallback (`<0xE4>` tokens, ByteFallback decoder, leading-space strip); and a Mistral-style
Metaspace(prepend_scheme="first") BPE with special [INST]/[/INST] and a template.
"""
from tokenizers import AddedToken, Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from engine.text.tokenizer import Tokenizer

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


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def build_metaspace(path):
    """Mistral-style BPE: Metaspace pre-tokenizer with prepend_scheme="first" (only the split at
    offset 0 of the text gets the '▁' prefix), byte fallback, special [INST]/[/INST] and a chat
    template that writes them."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = [("▁", "h"), ("▁h", "i"), ("h", "i"), ("▁", "w"), ("o", "r"), ("▁w", "or"),
              ("l", "d"), ("▁wor", "ld"), ("w", "or"), ("wor", "ld"), ("S", "u"), ("r", "e"),
              ("Su", "re")]
    for p in "▁abcdefghijklmnopqrstuvwxyzSIN<>/[]|_":
        vocab[p] = len(vocab)
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                   byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>", additional_special_tokens=["[INST]", "[/INST]"],
                                 chat_template=MISTRAL_TEMPLATE)
    hf.save_pretrained(str(path))
    return Tokenizer.from_pretrained(str(path))
