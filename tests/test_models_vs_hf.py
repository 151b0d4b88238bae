"""Model level (DESIGN.md section 6, rung 2): greedy tokens equal transformers' on tiny checkpoints.

Each case first shows that transformers' own tokens change when its feature is switched off, so the
comparison can fail. Prompts (48 and 33 tokens) are longer than the Mistral window (16) and than
the RoPE original context (32). Comparison stops at the reference's first near-tie (top-two
log-probs within 1e-4). Taper runs twice: through `LLM.generate` (the whole engine, with its default
kernels and with the batch-invariant ones of `--batch-invariant`) and through a
bare model harness here (prefill logits against transformers' too), so a model bug and an engine
bug point at different tests.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from checkpoints import edit_config, tiny_checkpoint, to_legacy_rope
from hf_oracle import assert_matches, hf_greedy, load_hf

GEN = 16
PROMPT_LENS = (48, 33)

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 10000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}

# name -> (tiny_checkpoint kwargs, rewrite config.json to the legacy rope form)
CASES = {
    "llama_gqa_tied": (dict(arch="llama"), False),
    "qwen2_qkv_bias": (dict(arch="qwen2"), False),
    "qwen3_qk_norm": (dict(arch="qwen3"), False),
    "mistral_sliding_window": (dict(arch="mistral"), False),
    "llama3_rope": (dict(arch="llama", rope_parameters=LLAMA3), False),
    "llama3_rope_legacy": (dict(arch="llama", rope_parameters=LLAMA3), True),
    "yarn_rope": (dict(arch="llama", rope_parameters=YARN, max_position_embeddings=128), False),
    "yarn_rope_legacy": (dict(arch="llama", rope_parameters=YARN, max_position_embeddings=128), True),
    "llama_bf16": (dict(arch="llama", dtype="bfloat16", seed=1), False),
    "qwen2_bf16": (dict(arch="qwen2", dtype="bfloat16", seed=1), False),
}


def prompts_for(vocab: int = 512) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENS]


class Cases:
    """Builds each case's checkpoint and transformers reference once per module."""

    def __init__(self, root):
        self.root = root
        self.dirs, self.refs = {}, {}

    def dir(self, name):
        if name not in self.dirs:
            kwargs, legacy = CASES[name]
            base = name.removesuffix("_legacy")
            if legacy:
                path = os.path.join(self.root, name)
                shutil.copytree(self.dir(base), path)
                edit_config(path, to_legacy_rope)
            else:
                path = tiny_checkpoint(os.path.join(self.root, name), **kwargs)
            self.dirs[name] = path
        return self.dirs[name]

    def ref(self, name):
        if name not in self.refs:
            model = load_hf(self.dir(name))
            self.refs[name] = [hf_greedy(model, p, GEN) for p in prompts_for()]
        return self.refs[name]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("models")))


# ---- the features matter: transformers' tokens change when each is switched off

def _hf_tokens(model):
    return [hf_greedy(model, p, GEN)[0] for p in prompts_for()]


def _rope_off(cases, name):
    d = cases.dir(name)
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(d)
    config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    return AutoModelForCausalLM.from_pretrained(d, config=config, dtype=torch.float32).eval()


def _bias_off(cases, name):
    model = load_hf(cases.dir(name))
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    return model


def _qk_norm_off(cases, name):
    model = load_hf(cases.dir(name))
    for layer in model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()
    return model


def _window_off(cases, name):
    d = cases.dir(name)
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(d)
    assert config.sliding_window == 16 < min(PROMPT_LENS)
    config.sliding_window = None
    return AutoModelForCausalLM.from_pretrained(d, config=config, dtype=torch.float32).eval()


def _gqa_regrouped(cases, name):
    """Query head h reads KV head h % Hkv instead of h // group: permute the query heads (q_proj
    rows and o_proj columns together), which changes only the q -> KV head mapping."""
    model = load_hf(cases.dir(name))
    c = model.config
    D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    assert Hkv < Hq
    group = Hq // Hkv
    order = [g * group + j for j in range(group) for g in range(Hkv)]  # new slot -> old head
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            q = att.q_proj.weight.view(Hq, D, -1)[order].reshape(Hq * D, -1).clone()
            o = att.o_proj.weight.view(-1, Hq, D)[:, order].reshape(-1, Hq * D).clone()
            att.q_proj.weight.copy_(q)
            att.o_proj.weight.copy_(o)
    return model


def _untied(cases, name):
    """The LM head gets weights of its own instead of sharing the embedding's."""
    model = load_hf(cases.dir(name))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(1234)  # not the embedding's seed
    own = torch.randn(model.lm_head.weight.shape, generator=generator) * 0.15
    model.lm_head.weight = torch.nn.Parameter(own)
    return model


# feature -> (the case that has it, transformers' model with the feature switched off)
FEATURE_OFF = {
    "gqa": ("llama_gqa_tied", _gqa_regrouped),
    "tied_embeddings": ("llama_gqa_tied", _untied),
    "qkv_bias": ("qwen2_qkv_bias", _bias_off),
    "qk_norm": ("qwen3_qk_norm", _qk_norm_off),
    "sliding_window": ("mistral_sliding_window", _window_off),
    "llama3_rope": ("llama3_rope", _rope_off),
    "yarn_rope": ("yarn_rope", _rope_off),
}


@pytest.mark.parametrize("feature", sorted(FEATURE_OFF))
def test_feature_changes_hf_tokens(cases, feature):
    name, switch_off = FEATURE_OFF[feature]
    ref = [r[0] for r in cases.ref(name)]
    off = _hf_tokens(switch_off(cases, name))
    for a, b in zip(ref, off):
        assert a != b, f"{feature}: switching it off does not change transformers' tokens"


def test_tied_checkpoint_has_no_lm_head(cases):
    from engine.loader.safetensors import load_safetensors
    weights = load_safetensors(cases.dir("llama_gqa_tied"), progress=False)
    assert "lm_head.weight" not in weights
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape[0] == 2 * 24  # 2 KV heads


@pytest.mark.parametrize("name", ["llama3_rope", "yarn_rope"])
def test_legacy_rope_form_reads_the_same_in_hf(cases, name):
    from transformers import AutoConfig
    with open(os.path.join(cases.dir(name), "config.json")) as f:
        assert "rope_parameters" in json.load(f)  # what transformers 5 writes
    with open(os.path.join(cases.dir(name + "_legacy"), "config.json")) as f:
        legacy = json.load(f)
    assert "rope_parameters" not in legacy and legacy["rope_scaling"]["type"] in ("llama3", "yarn")
    nested = AutoConfig.from_pretrained(cases.dir(name)).rope_parameters
    parsed = AutoConfig.from_pretrained(cases.dir(name + "_legacy")).rope_parameters
    assert {k: v for k, v in parsed.items() if k != "type"} == nested
    assert [r[0] for r in cases.ref(name + "_legacy")] == [r[0] for r in cases.ref(name)]


# ---- Taper through the whole engine

@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("name", list(CASES))
def test_llm_greedy_matches_hf(cases, name, batch_invariant):
    from engine import LLM, SamplingParams
    # dtype auto: bf16 cases stay bf16; batch_invariant: the kernels of --batch-invariant
    llm = LLM(cases.dir(name), num_kv_blocks=32, batch_invariant=batch_invariant)
    outs = llm.generate(prompts_for(), SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    for i, (out, ref) in enumerate(zip(outs, cases.ref(name))):
        assert_matches(list(out.token_ids), ref, min_trusted=8, label=f"{name} prompt {i}")


def test_bf16_checkpoint_as_f32_matches_hf(cases):
    from engine import LLM, SamplingParams
    llm = LLM(cases.dir("llama_bf16"), dtype="f32", num_kv_blocks=32)
    outs = llm.generate(prompts_for(), SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True))
    for out, ref in zip(outs, cases.ref("llama_bf16")):
        assert_matches(list(out.token_ids), ref, min_trusted=8, label="llama_bf16 as f32")


# ---- Taper's model alone: a minimal paged-KV harness (prefill all prompts in one batch, then
# one decode token per sequence per step)

def harness_greedy(model, prompts, n=GEN, block_size=16, chunk=None):
    """Greedy tokens and each prompt's last-row prefill logits. `chunk` caps the tokens a sequence
    computes per step (chunked prefill mixed with other sequences' decodes)."""
    from engine.forward_batch import ForwardBatch
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


@pytest.fixture(scope="module")
def backend():
    from pyx.cpu_backend import CpuBackend
    return CpuBackend()


@pytest.mark.parametrize("name", ["llama_gqa_tied", "qwen2_qkv_bias", "qwen3_qk_norm",
                                  "mistral_sliding_window", "llama3_rope", "yarn_rope_legacy",
                                  "qwen2_bf16"])
def test_model_forward_matches_hf(cases, backend, name):
    from engine.models.registry import load_model
    model, config = load_model(cases.dir(name), backend, progress=False)
    chunk = {"mistral_sliding_window": 20, "qwen3_qk_norm": 7}.get(name)  # chunked prefill
    tokens, first_logits = harness_greedy(model, prompts_for(), chunk=chunk)
    for i, ref in enumerate(cases.ref(name)):
        ref_logits = ref[2]
        np.testing.assert_allclose(first_logits[i], ref_logits, rtol=0,
                                   atol=1e-4 * max(1.0, np.abs(ref_logits).max()))
        assert_matches(tokens[i], ref, min_trusted=8, label=f"{name} prompt {i}")
