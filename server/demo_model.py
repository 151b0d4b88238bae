"""A tiny Llama checkpoint with random weights, written without torch and without a network.

`python -m server` serves it when no model is given, so a fresh machine can try the API at once.
Its text is gibberish: the weights are seeded Gaussian noise. Everything is deterministic given the
seed: the byte-level BPE tokenizer is trained on the fixed text below, and the weights come from
NumPy's PCG64 generator.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

DEMO_VERSION = 1
HIDDEN = 256
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
INTERMEDIATE = 768
VOCAB_TARGET = 1024          # BPE merges stop here or when the corpus runs out of pairs
MAX_POSITIONS = 4096
WEIGHT_STD = 0.04

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen2 writes it (no default system prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Training text for the tokenizer: plain English, so common words become single tokens.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still say hello to the world.
Once upon a time there was a little town by the sea. Every morning the fishermen went out in
their boats, and every evening they came back with nets full of silver fish. The children ran
along the beach to meet them, and the old people sat in the sun and told stories about the
storms of long ago. In the middle of the town there was a market where people sold bread,
cheese, apples, honey and warm tea. The baker was the first to wake and the last to sleep.
What is the capital of France? The capital of France is Paris. What is two plus two? Two plus
two is four. How are you today? I am fine, thank you. Can you help me write a short poem about
the moon? Of course. Here is a poem: the moon is bright, the night is long, the stars all sing
a quiet song. Please answer the question in one sentence. The answer is yes. The answer is no.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024. Colors: red, green, blue, yellow, black,
white. Days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Months: January,
February, March, April, May, June, July, August, September, October, November, December.
A computer program reads input, does some work and writes output. Python is a programming
language. def hello(name): return "Hello, " + name + "!" Tests check that the code works.
The server answers requests from clients over the network. Each request has a prompt, and the
model writes a completion one token at a time until it reaches a stop token or the length limit.
"""


def build_tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS, with ChatML special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tok


def _weights(vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.Generator(np.random.PCG64(seed))
    head_dim = HIDDEN // NUM_HEADS

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * WEIGHT_STD).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        w[p + "self_attn.q_proj.weight"] = normal(NUM_HEADS * head_dim, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(NUM_KV_HEADS * head_dim, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(NUM_KV_HEADS * head_dim, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, NUM_HEADS * head_dim)
        w[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    w["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    w["lm_head.weight"] = normal(vocab_size, HIDDEN)
    return w


def write_demo_checkpoint(path: str, seed: int = 0) -> str:
    """Write the demo checkpoint into directory `path` (created if needed); returns `path`."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    tok.save(os.path.join(path, "tokenizer.json"))

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS, "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS, "head_dim": HIDDEN // NUM_HEADS,
        "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "vocab_size": vocab_size, "bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad,
        "torch_dtype": "float32", "initializer_range": WEIGHT_STD,
        "taper_demo": {"version": DEMO_VERSION, "seed": seed,
                       "note": "random weights: the generated text is gibberish"},
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": MAX_POSITIONS,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": True, "lstrip": False,
                                               "rstrip": False, "normalized": False,
                                               "single_word": False} for t in SPECIAL_TOKENS},
    }
    generation_config = {"eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": True,
                         "temperature": 1.0, "top_p": 1.0}
    for name, obj in (("config.json", config), ("tokenizer_config.json", tokenizer_config),
                      ("generation_config.json", generation_config),
                      ("special_tokens_map.json", {"eos_token": "<|im_end|>",
                                                   "pad_token": "<|endoftext|>"})):
        with open(os.path.join(path, name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    save_file(_weights(vocab_size, seed), os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _demo_stamp(path: str) -> dict:
    """The `taper_demo` entry of the config.json in `path`; {} for any other directory."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            stamp = json.load(f).get("taper_demo", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def is_demo_checkpoint(path: str) -> bool:
    """Whether `path` holds a checkpoint this module wrote (random weights), however it is
    served: by default or with --w."""
    return bool(_demo_stamp(path))


def _is_complete(path: str, seed: int) -> bool:
    stamp = _demo_stamp(path)
    files = ("model.safetensors", "tokenizer.json", "tokenizer_config.json")
    return (stamp.get("version") == DEMO_VERSION and stamp.get("seed") == seed
            and all(os.path.exists(os.path.join(path, f)) for f in files))


def taper_cache_dir() -> str:
    """Taper's cache: $XDG_CACHE_HOME/taper, default ~/.cache/taper."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "taper")


def default_cache_dir() -> str:
    return os.path.join(taper_cache_dir(), "demo")


def ensure_demo_checkpoint(path: str | None = None, seed: int = 0) -> str:
    """The demo checkpoint in `path` (default ~/.cache/taper/demo), written there if missing."""
    path = path or default_cache_dir()
    if _is_complete(path, seed):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-", dir=parent)
    try:
        write_demo_checkpoint(tmp, seed)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)   # atomic: a reader never sees half a checkpoint
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    import sys
    print(ensure_demo_checkpoint(sys.argv[1] if len(sys.argv) > 1 else None))
