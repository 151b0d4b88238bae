"""Greedy continuations from Hugging Face transformers (torch, float32, CPU): the test oracle.

Each continuation comes with the number of leading tokens that are trustworthy: comparison stops at
the first position where the reference's top-two log-probs are within `tie` (a near-tie that float
rounding may flip in either engine).
"""
from __future__ import annotations

import numpy as np


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, tie: float = 1e-4,
              **config_overrides):
    """Returns [(tokens, num_trusted)] for each prompt, from the checkpoint upcast to float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, **config_overrides)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)
    model.eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None)
            tokens = out.sequences[0, len(prompt):].tolist()
            trusted = len(tokens)
            for i, logits in enumerate(out.logits):
                logp = torch.log_softmax(logits[0].double(), -1).numpy()
                top2 = np.sort(logp)[-2:]
                if top2[1] - top2[0] < tie:
                    trusted = i
                    break
            results.append((tokens, trusted))
    return results


def assert_matches(actual: list[int], reference: tuple[list[int], int], min_trusted: int = 4):
    tokens, trusted = reference
    assert trusted >= min_trusted, f"reference near-tie too early ({trusted}); change the seed"
    assert actual[:trusted] == tokens[:trusted], (actual, tokens, trusted)
