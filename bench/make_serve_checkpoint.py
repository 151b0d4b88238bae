"""The 0.5B random-weight bf16 checkpoint with a tokenizer, for `python -m bench.serve`.

    python -m bench.make_serve_checkpoint      # -> bench/.cache/qwen2.5-0.5b-random-bf16-tok/

Qwen2's layout: 151643 byte-level BPE ids, then <|endoftext|> <|im_start|> <|im_end|> (151643-5).
The BPE is trained on the Python standard library's sources (~122.7k ids with min_frequency 1); the
ids above that are decode-only entries (two trained tokens glued, never produced by a merge), so
every id the random model can emit decodes to text and is streamed as its own chunk, as with the
real Qwen2.5 tokenizer. Config and weights are symlinks to the checkpoint make_checkpoint.py makes.
"""
import glob
import json
import os
import sysconfig

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from bench.make_checkpoint import CACHE, make_checkpoints

SRC = str(CACHE / "qwen2.5-0.5b-random-bf16")
HERE = str(CACHE / "qwen2.5-0.5b-random-bf16-tok")
NUM_BPE = 151643
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] "
                 "+ '<|im_end|>\\n' }}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def texts():
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"),
                             recursive=True))
    for f in files:
        if "site-packages" in f:
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                yield fh.read()
        except UnicodeDecodeError:
            pass


def main():
    if not os.path.isfile(os.path.join(SRC, "model.safetensors")):
        make_checkpoints()
    os.makedirs(HERE, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=NUM_BPE, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    trained = sorted(vocab, key=vocab.get)
    rng = np.random.default_rng(0)
    while len(vocab) < NUM_BPE:
        a, b = rng.integers(0, len(trained), size=2)
        s = trained[a] + trained[b]
        if s not in vocab:
            vocab[s] = len(vocab)
    spec["added_tokens"] = []
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    assert [tok.token_to_id(t) for t in SPECIALS] == [151643, 151644, 151645]
    tok.save(os.path.join(HERE, "tokenizer.json"))

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 32768,
              "bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
              "unk_token": None, "add_bos_token": False, "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE,
              "added_tokens_decoder": {str(151643 + i): {"content": t, "special": True,
                                                         "lstrip": False, "rstrip": False,
                                                         "normalized": False, "single_word": False}
                                       for i, t in enumerate(SPECIALS)}}
    with open(os.path.join(HERE, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        link = os.path.join(HERE, name)
        if not os.path.lexists(link):
            os.symlink(os.path.join(SRC, name), link)
    print("vocab", tok.get_vocab_size(), "->", HERE)


if __name__ == "__main__":
    main()
