"""LoRA adapters per request (engine/lora/) on a tiny random Llama, with adapters written by
`peft`: greedy tokens of each adapter equal transformers with peft's merged model; one batch mixing
the base and several adapters equals each alone, bit for bit; the prefix cache never hands one
adapter's KV blocks to another; more adapters than slots are swapped in; adapters on a GGUF and an
int4 base; and every adapter that cannot be served is refused with an error naming it."""
from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from engine import LLM, SamplingParams
from engine.lora.adapter import LoraError
from hf_oracle import assert_matches, hf_greedy, load_hf
from lora_fixtures import ADAPTERS, merged, write_adapter

PROMPTS = [[5, 17, 300, 42, 8, 99, 256, 3, 77, 150, 12], [7, 480, 33, 201, 64, 410, 9],
           [1, 128, 250, 6, 19, 302, 44, 11, 90, 3, 77, 91, 300]]
N = 12


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("base"), "llama", seed=3)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    hf = load_hf(base)
    return {name: write_adapter(hf, root / name, seed=i, **args)
            for i, (name, args) in enumerate(ADAPTERS.items())}


def greedy(name=None, n=N, **extra):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, lora_name=name, **extra)


def engine(base, adapters, names=("alpha", "beta", "gamma"), max_loras=3, max_lora_rank=8,
           **config):
    lora = dict(modules={n: adapters[n] for n in names}, max_loras=max_loras,
                max_lora_rank=max_lora_rank)
    return LLM(base, num_kv_blocks=64, lora=lora, **config)


def tokens(llm, prompts, params):
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_greedy_matches_peft_merged(base, adapters, name):
    """Each adapter's greedy tokens are transformers' with peft's merged weights, and not the
    base model's (the adapters change the tokens, so a LoRA path that adds nothing fails)."""
    llm = engine(base, adapters)
    oracle = merged(base, adapters[name])
    plain = load_hf(base)
    for prompt in PROMPTS:
        got = tokens(llm, [prompt], greedy(name))[0]
        assert_matches(got, hf_greedy(oracle, prompt, N), label=f"{name} {prompt[:3]}")
        assert got != hf_greedy(plain, prompt, N)[0]


def test_mixed_batch_equals_each_alone(base, adapters):
    """Base, alpha, beta and gamma requests in one batch (prefills and decodes together) give
    the same tokens and logprobs, bit for bit, as each request alone."""
    llm = engine(base, adapters, batch_invariant=True)
    cases = [(p, name) for p in PROMPTS for name in (None, "alpha", "beta", "gamma")]
    params = [greedy(name, logprobs=2) for _, name in cases]
    together = llm.generate([p for p, _ in cases], params)
    plans = []
    plan = llm.engine.lora.plan
    llm.engine.lora.plan = lambda *a: plans.append(plan(*a)) or plans[-1]
    for (prompt, _), p, out in zip(cases, params, together):
        alone = llm.generate([prompt], p)[0]
        assert alone.token_ids == out.token_ids
        assert [lp.logprob for lp in alone.logprobs] == [lp.logprob for lp in out.logprobs]
    assert len({tuple(o.token_ids) for o in together[:4]}) == 4    # four different models
    assert all(b is None or len(b.seg_slots) == 1 for b in plans)   # alone: one adapter a step


def test_rows_are_grouped_by_adapter_once_per_step(base, adapters):
    """A step of mixed requests groups its adapter rows by slot (one segment per adapter, in
    slot order, base rows left out) and runs each projection once over them."""
    llm = engine(base, adapters, max_num_seqs=8)
    seen = []
    plan = llm.engine.lora.plan
    llm.engine.lora.plan = lambda *a: seen.append((a, plan(*a))) or seen[-1][1]
    names = ["beta", None, "alpha", "beta", None, "alpha"]
    llm.generate([PROMPTS[0]] * len(names), [greedy(n, n=3) for n in names])
    (seqs, qsl), batch = seen[0]
    assert [s.lora and s.lora.name for s in seqs] == names
    slots = {s.lora.name: None for s in seqs if s.lora}
    for slot, adapter in zip(batch.seg_slots, batch.adapters):
        slots[adapter.name] = int(slot)
    assert list(batch.seg_slots) == sorted(batch.seg_slots) and len(batch.seg_slots) == 2
    rows_of = {n: [r for i, s in enumerate(seqs) if s.lora and s.lora.name == n
                   for r in range(qsl[i], qsl[i + 1])] for n in ("alpha", "beta")}
    for g, adapter in enumerate(batch.adapters):
        got = batch.rows[batch.seg_offsets[g]:batch.seg_offsets[g + 1]].tolist()
        assert got == rows_of[adapter.name]
    assert len(batch.rows) == sum(map(len, rows_of.values()))


def test_prefix_cache_never_crosses_adapters(base, adapters):
    """The same prompt cached by the base model is not a hit for an adapter, nor one adapter's
    for another; an adapter's own blocks are, and give the same tokens."""
    llm = engine(base, adapters)
    prompt = list(range(3, 60))                       # 3 full blocks of 16 are cacheable
    first = {}
    for name in (None, "alpha", "beta"):
        out = llm.generate([prompt], greedy(name))[0]
        assert out.num_cached_tokens == 0, name
        first[name] = out.token_ids
    for name in (None, "alpha", "beta"):
        out = llm.generate([prompt], greedy(name))[0]
        assert out.num_cached_tokens == 48, name
        assert out.token_ids == first[name]
    # an adapter unloaded and loaded again under its name is a new adapter: no stale blocks
    llm.engine.lora.unload("alpha")
    llm.engine.lora.load("alpha", adapters["alpha"])
    assert llm.generate([prompt], greedy("alpha"))[0].num_cached_tokens == 0


def test_more_adapters_than_slots_are_swapped_in(base, adapters):
    """With one slot, requests for three adapters and the base all finish with their own tokens:
    the scheduler runs one adapter at a time beside the base, and the slot is rewritten with the
    least recently used adapter going first."""
    names = [None, "alpha", "beta", "gamma", "alpha", None, "gamma"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    want = tokens(engine(base, adapters), prompts, [greedy(n) for n in names])
    llm = engine(base, adapters, max_loras=1)
    plans = []
    plan = llm.engine.lora.plan
    llm.engine.lora.plan = lambda *a: plans.append(plan(*a)) or plans[-1]
    assert tokens(llm, prompts, [greedy(n) for n in names]) == want
    assert all(b is None or len(b.seg_slots) == 1 for b in plans)
    assert llm.engine.lora.num_swaps >= 3
    # two slots, three adapters: the least recently used one leaves
    llm = engine(base, adapters, max_loras=2)
    manager = llm.engine.lora
    for name in ("alpha", "beta", "alpha", "gamma"):
        llm.generate([PROMPTS[0]], greedy(name, n=2))
    held = {a.name for a in manager._assigned}
    assert held == {"alpha", "gamma"} and manager.num_swaps == 3
    assert tokens(llm, [PROMPTS[1]], greedy("beta")) == tokens(
        engine(base, adapters), [PROMPTS[1]], greedy("beta"))


def test_bf16_base_takes_bf16_slots(tmp_path):
    """A bf16 base gets bf16 slots on the CPU (half the bytes a decode step reads): tokens equal
    transformers with the adapter rounded to bf16 merged (alpha / r = 2: the scaling folded into
    B^T rounds as B does)."""
    from safetensors.numpy import load_file, save_file

    base = tiny_checkpoint(tmp_path / "bf16", "llama", dtype="bfloat16", seed=5)
    path = write_adapter(base, tmp_path / "a", seed=9, r=8, lora_alpha=16,
                         target_modules=ADAPTERS["alpha"]["target_modules"])
    rounded = tmp_path / "rounded"
    shutil.copytree(path, rounded)
    weights = load_file(os.path.join(path, "adapter_model.safetensors"))
    save_file({k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in weights.items()},
              str(rounded / "adapter_model.safetensors"))
    llm = LLM(base, num_kv_blocks=32, lora=dict(modules={"a": path}, max_lora_rank=8))
    assert llm.engine.lora.dtype.name == "bfloat16"
    oracle = merged(base, str(rounded))
    for prompt in PROMPTS:
        got = tokens(llm, [prompt], greedy("a"))[0]
        assert_matches(got, hf_greedy(oracle, prompt, N), label=f"bf16 {prompt[:3]}")
        assert got != tokens(llm, [prompt], greedy())[0]


def test_adapter_on_gguf_base(tmp_path):
    """A GGUF base (the f32 tiny-256 Llama fixture) takes an adapter as safetensors does:
    tokens equal transformers reading the same GGUF with peft's merged adapter."""
    from gguf_fixtures import DATA
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch

    # the source checkpoint's config: transformers reads no llama3 RoPE scaling from a GGUF
    config = AutoConfig.from_pretrained(os.path.join(DATA, "llama-source"))
    hf = AutoModelForCausalLM.from_pretrained(DATA, gguf_file="llama-f32.gguf", config=config,
                                              dtype=torch.float32).eval()
    path = write_adapter(hf, tmp_path / "gguf-lora", seed=7, r=8, lora_alpha=32,
                         target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    oracle = merged(hf, path)
    llm = LLM(DATA, weight_file="llama-f32.gguf", num_kv_blocks=32,
              lora=dict(modules={"g": path}, max_lora_rank=8))
    for prompt in PROMPTS[:2]:
        got = tokens(llm, [prompt], greedy("g"))[0]
        assert_matches(got, hf_greedy(oracle, prompt, N), label=f"gguf {prompt[:3]}")
        assert got != tokens(llm, [prompt], greedy())[0]


def test_adapter_on_int4_base(tmp_path):
    """An int4 (GPTQ) base: tokens equal transformers on the dequantized weights with peft's
    merged adapter (the delta is added after the packed weights' linear)."""
    from test_int4_formats import CHECKPOINT, oracle, write_gptq_awq

    float_dir = tiny_checkpoint(tmp_path / "f32", "llama", **CHECKPOINT)
    gptq_dir, deq = write_gptq_awq(float_dir, tmp_path / "gptq", "gptq", True, 128)
    hf = oracle(float_dir, deq)
    path = write_adapter(hf, tmp_path / "int4-lora", seed=8, r=4, lora_alpha=16,
                         target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"])
    want_model = merged(hf, path)
    llm = LLM(gptq_dir, num_kv_blocks=32, lora=dict(modules={"q": path}, max_lora_rank=4))
    for prompt in PROMPTS[:2]:
        got = tokens(llm, [prompt], greedy("q"))[0]
        assert_matches(got, hf_greedy(want_model, prompt, N), label=f"int4 {prompt[:3]}")
        assert got != tokens(llm, [prompt], greedy())[0]


# ---- adapters that cannot be served


def refusal(base, name, path, max_lora_rank=8) -> str:
    with pytest.raises(LoraError) as e:
        LLM(base, num_kv_blocks=16, lora=dict(modules={name: path}, max_lora_rank=max_lora_rank))
    return str(e.value)


def test_bad_adapters_are_refused_naming_them(base, adapters, tmp_path):
    # made for another base: hidden 64 instead of 96
    other = tiny_checkpoint(tmp_path / "other", "llama", hidden_size=64, head_dim=16)
    wrong = write_adapter(other, tmp_path / "wrong", r=4, target_modules=["q_proj"])
    msg = refusal(base, "wrong", wrong)
    assert "LoRA adapter 'wrong'" in msg and "self_attn.q_proj" in msg
    assert "do not fit the base model" in msg and "another base model" in msg
    # rank above --max-lora-rank
    msg = refusal(base, "alpha", adapters["alpha"], max_lora_rank=4)
    assert "LoRA adapter 'alpha'" in msg and "rank 8, above --max-lora-rank 4" in msg
    # missing files
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "adapter_config.json is missing" in refusal(base, "empty", str(empty))
    half = tmp_path / "half"
    shutil.copytree(adapters["beta"], half)
    os.remove(half / "adapter_model.safetensors")
    assert "'half'" in (msg := refusal(base, "half", str(half)))
    assert "adapter_model.safetensors is missing" in msg
    assert "no such directory" in refusal(base, "nowhere", str(tmp_path / "nowhere"))
    # embeddings and LM head
    emb = write_adapter(base, tmp_path / "emb", r=4, target_modules=["embed_tokens", "q_proj"])
    msg = refusal(base, "emb", emb)
    assert "LoRA adapter 'emb'" in msg and "embed_tokens" in msg
    assert "token embeddings" in msg
    head = write_adapter(base, tmp_path / "head", r=4, target_modules=["lm_head", "q_proj"])
    assert "'lm_head'" in (msg := refusal(base, "head", head)) and "the LM head" in msg
    # DoRA
    dora = write_adapter(base, tmp_path / "dora", r=4, target_modules=["q_proj"], use_dora=True)
    assert "DoRA (use_dora) is not supported" in refusal(base, "dora", dora)
    # a weight's rank that its config contradicts
    lying = tmp_path / "lying"
    shutil.copytree(adapters["beta"], lying)
    config = json.loads((lying / "adapter_config.json").read_text())
    (lying / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
    assert "but adapter_config.json gives it r = 2" in refusal(base, "lying", str(lying))


def test_runtime_load_unload_and_unknown_names(base, adapters):
    llm = LLM(base, num_kv_blocks=16, lora=dict(max_lora_rank=8))
    manager = llm.engine.lora
    with pytest.raises(ValueError, match="LoRA adapter 'alpha' is not loaded"):
        llm.generate([PROMPTS[0]], greedy("alpha"))
    manager.load("alpha", adapters["alpha"])
    with pytest.raises(LoraError, match="'alpha' is already loaded"):
        manager.load("alpha", adapters["beta"])
    assert [a.name for a in manager.adapters()] == ["alpha"]
    out = llm.generate([PROMPTS[0]], greedy("alpha"))[0]
    manager.unload("alpha")
    with pytest.raises(ValueError, match="not loaded"):
        llm.generate([PROMPTS[0]], greedy("alpha"))
    with pytest.raises(KeyError):
        manager.unload("alpha")
    assert out.token_ids != llm.generate([PROMPTS[0]], greedy())[0].token_ids
    plain = LLM(base, num_kv_blocks=16)
    with pytest.raises(ValueError, match="not enabled on this engine"):
        plain.generate([PROMPTS[0]], greedy("alpha"))


def test_lora_slots_cost_no_memory_when_off(base):
    llm = LLM(base, num_kv_blocks=16)
    assert llm.engine.lora is None
    assert all(layer.attention.lora_qkv is None for layer in llm.engine.model.layers)
