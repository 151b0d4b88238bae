"""Shared by the model-level tests (test_models_vs_hf.py, test_models_families.py): the prompts,
a per-module cache of tiny checkpoints and their transformers references, ways to switch a
feature off in transformers' model, and a bare paged-KV harness that runs Taper's model alone."""
from __future__ import annotations

import os
import shutil

import numpy as np
import torch

from checkpoints import edit_config, tiny_checkpoint
from hf_oracle import assert_matches, hf_greedy, load_hf

GEN = 16
PROMPT_LENS = (48, 33)


def prompts_for(vocab: int = 512) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


class Cases:
    """Builds each case's checkpoint and transformers reference once per module. `cases` maps a
    name to (tiny_checkpoint kwargs, None) or (None, (base case, config.json rewrite)) for a copy
    of another case with its config rewritten (a legacy form)."""

    def __init__(self, root, cases):
        self.root, self.cases = root, cases
        self.dirs, self.refs = {}, {}

    def dir(self, name):
        if name not in self.dirs:
            kwargs, legacy = self.cases[name]
            path = os.path.join(self.root, name)
            if legacy:
                shutil.copytree(self.dir(legacy[0]), path)
                edit_config(path, legacy[1])
            else:
                tiny_checkpoint(path, **kwargs)
            self.dirs[name] = path
        return self.dirs[name]

    def ref(self, name):
        if name not in self.refs:
            model = load_hf(self.dir(name))
            self.refs[name] = [hf_greedy(model, p, GEN) for p in prompts_for()]
        return self.refs[name]


# ---- transformers' model with a feature switched off

def hf_tokens(model):
    return [hf_greedy(model, p, GEN)[0] for p in prompts_for()]


def hf_with_config(cases, name, **changes):
    """transformers' model for a case, with config attributes changed before it is built."""
    return _hf_edited(cases, name, lambda config: [setattr(config, k, v) for k, v in changes.items()])


def hf_with_rope_parameters(cases, name, update):
    """transformers' model for a case, its rope_parameters updated with update(rope_parameters)."""
    return _hf_edited(cases, name, lambda config: config.rope_parameters.update(
        update(config.rope_parameters)))


def _hf_edited(cases, name, edit):
    from transformers import AutoConfig, AutoModelForCausalLM
    d = cases.dir(name)
    config = AutoConfig.from_pretrained(d)
    edit(config)
    return AutoModelForCausalLM.from_pretrained(d, config=config, dtype=torch.float32).eval()


def qkv_bias_off(cases, name):
    model = load_hf(cases.dir(name))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    return model


def qk_norm_off(cases, name):
    model = load_hf(cases.dir(name))
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()
    return model


# ---- Taper through the whole engine, and the model alone

def assert_llm_greedy_matches(cases, name, **llm_kwargs):
    from engine import LLM, SamplingParams
    llm = LLM(cases.dir(name), num_kv_blocks=32, **llm_kwargs)
    outs = llm.generate(prompts_for(), SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, cases.ref(name))):
        assert_matches(list(out.token_ids), ref, min_trusted=8, label=f"{name} prompt {i}")


def assert_model_forward_matches(cases, backend, name, chunk=None):
    """Taper's model alone through the harness: prefill logits and greedy tokens."""
    from engine.loader.model_loader import load_model
    model, _ = load_model(cases.dir(name), backend, progress=False)
    tokens, first_logits = harness_greedy(model, prompts_for(), chunk=chunk)
    for i, ref in enumerate(cases.ref(name)):
        np.testing.assert_allclose(first_logits[i], ref[2], rtol=0,
                                   atol=1e-4 * max(1.0, np.abs(ref[2]).max()))
        assert_matches(tokens[i], ref, min_trusted=8, label=f"{name} prompt {i}")


# A minimal paged-KV harness: prefill all prompts in one batch, then one decode token per
# sequence per step.

def harness_greedy(model, prompts, n=GEN, block_size=16, chunk=None):
    """Greedy tokens and each prompt's last-row prefill logits. `chunk` caps the tokens a sequence
    computes per step (chunked prefill mixed with other sequences' decodes)."""
    from engine.runner.forward_batch import ForwardBatch
    max_blocks = -(-(max(map(len, prompts)) + n) // block_size)
    shape = model.kv_cache_shape(max_blocks * len(prompts) + 1, block_size)
    kv = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(model.num_layers)]
    # block 0 stays unused so a table padded with 0 could not alias a live block
    tables = (1 + np.arange(len(prompts) * max_blocks, dtype=np.int32)).reshape(len(prompts), -1)
    tables = np.ascontiguousarray(tables[::-1])  # non-monotonic block ids across sequences
    seqs = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    first_logits = [None] * len(prompts)
    while any(len(s) - len(p) < n for s, p in zip(seqs, prompts)):
        ids, pos, slots, starts, sampled = [], [], [], [0], []
        for i, s in enumerate(seqs):
            if len(s) - len(prompts[i]) >= n:
                continue
            new = range(computed[i], min(len(s), computed[i] + (chunk or len(s))))
            ids += [s[j] for j in new]
            pos += list(new)
            slots += [tables[i, j // block_size] * block_size + j % block_size for j in new]
            starts.append(len(ids))
            computed[i] = new.stop
            if new.stop == len(s):
                sampled.append((i, len(starts) - 2))
        active = [i for i, s in enumerate(seqs) if len(s) - len(prompts[i]) < n]
        batch = ForwardBatch(
            token_ids=np.array(ids, np.int32), positions=np.array(pos, np.int32),
            slot_mapping=np.array(slots, np.int32), query_start_loc=np.array(starts, np.int32),
            seq_lens=np.array([computed[i] for i in active], np.int32),
            block_tables=np.ascontiguousarray(tables[active]),
            logits_indices=np.array([starts[k + 1] - 1 for _, k in sampled], np.int32))
        logits = model.forward(batch, kv)
        assert logits.shape == (len(sampled), model.config.vocab_size) and logits.dtype == np.float32
        for row, (i, _) in enumerate(sampled):
            if first_logits[i] is None:
                first_logits[i] = logits[row].copy()
            seqs[i].append(int(np.argmax(logits[row])))
    return [s[len(p):] for s, p in zip(seqs, prompts)], first_logits
