"""Greedy continuations from Hugging Face transformers (torch, float32, CPU): the test oracle.

Each continuation comes with the number of leading tokens that are trustworthy: comparison stops at
the first position where the reference's top-two log-probs are within TIE (a near-tie that float
rounding may flip in either engine).
"""
from __future__ import annotations

import torch

TIE = 1e-4


def load_hf(model_dir):
    """The checkpoint in transformers, upcast to float32."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int, tie: float = TIE):
    """(tokens, num_trusted, prefill last-row logits): full recompute each step, no KV cache.
    Trust ends where the top-two log-probs are within `tie`."""
    ids = torch.tensor([prompt])
    tokens, trusted, first = [], None, None
    for i in range(n):
        logits = model(ids).logits[0, -1]
        if first is None:
            first = logits.numpy().copy()
        top2 = torch.log_softmax(logits.double(), -1).topk(2).values
        if trusted is None and float(top2[0] - top2[1]) < tie:
            trusted = i
        tokens.append(int(logits.argmax()))
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
    return tokens, n if trusted is None else trusted, first


def assert_matches(actual: list[int], reference, min_trusted: int = 4, label: str = ""):
    """actual equals the reference's tokens up to its first near-tie."""
    tokens, trusted = reference[:2]
    assert trusted >= min_trusted, f"{label}: reference near-tie at token {trusted}; change the seed"
    assert actual[:trusted] == tokens[:trusted], \
        f"{label}: taper {actual} vs hf {tokens} (trusted {trusted})"
