"""Tiny random embedding checkpoints written by sentence-transformers itself.

A tiny transformers model (tests/checkpoints.py: hidden 96, weights scaled up) and a byte-level
BPE tokenizer trained on plain English (the demo checkpoint's), wrapped as
models.Transformer + models.Pooling (+ models.Normalize) and written with
SentenceTransformer.save(). The tokenizer has no chat template (sentence-transformers would then
render plain text through it) and no BOS, so the first token (CLS pooling) differs per input.
"""
from __future__ import annotations

import json
import os
import shutil

EOS, PAD = "<|im_end|>", "<|endoftext|>"


def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from server.demo_model import build_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token=EOS,
                                   pad_token=PAD, model_max_length=256)


def embedding_checkpoint(directory, pooling: str = "mean", normalize: bool = True,
                         arch: str = "llama", causal_lm: bool = False, seed: int = 0,
                         **overrides) -> str:
    """Write a sentence-transformers checkpoint to `directory`; returns it as a string.

    pooling: sentence-transformers' mode (mean, cls, lasttoken, max, ...). causal_lm: the
    transformer is saved as *ForCausalLM (with its lm_head, tensors under "model.") instead of
    the headless *Model that sentence-transformers itself writes."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models
    from transformers import AutoModel, AutoModelForCausalLM

    from checkpoints import scale_weights, tiny_config

    directory = str(directory)
    staging = directory + ".hf"
    tok = tokenizer()
    config = tiny_config(arch, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         **overrides)
    torch.manual_seed(seed)
    model = (AutoModelForCausalLM if causal_lm else AutoModel).from_config(config)
    scale_weights(model, seed=seed)
    model.save_pretrained(staging)
    tok.save_pretrained(staging)

    transformer = models.Transformer(staging)
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(),
                                           pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(directory)
    if causal_lm:   # the transformers save itself, lm_head and "model." prefixes included
        for name in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(staging, name), os.path.join(directory, name))
    shutil.rmtree(staging)
    return directory


def edit_json(path, fn) -> dict:
    with open(path) as f:
        data = fn(json.load(f))
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return data
