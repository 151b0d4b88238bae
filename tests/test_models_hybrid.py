"""Hybrid linear attention: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (gated DeltaNet layers beside gated
full attention) give transformers' greedy tokens on tiny checkpoints written by transformers
itself (tests/checkpoints.py), through the whole engine: batched, with chunked prefill, under
forced preemption, across a multi-turn conversation whose later turns start from a state
snapshot, and through a live server.

The reference is transformers' own cached generation (hf_greedy_cached: the prompt through its
chunked gated delta rule, then one token at a time through its recurrent form with the cache),
with hf_oracle's near-tie rule; a test below checks it against hf_greedy's full recomputes.
Each feature the models have over Qwen3 first shows that transformers' tokens change without it.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from checkpoints import tiny_checkpoint
from hf_oracle import TIE, assert_matches, hf_greedy, load_hf
from model_cases import GEN, prompts_for

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

# each test takes seconds; a scheduling bug (a state slot never given back) would spin forever
pytestmark = pytest.mark.timeout(120)


@torch.no_grad()
def hf_greedy_cached(model, prompt: list[int], n: int = GEN, tie: float = TIE):
    """hf_greedy's (tokens, num_trusted, prefill last-row logits), from one prefill and n - 1
    cached decode steps (one torch thread: the shared machine's cores thrash with more)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens, trusted, first = [], None, None
        for i in range(n):
            logits = out.logits[0, -1]
            if first is None:
                first = logits.numpy().copy()
            top2 = torch.log_softmax(logits.double(), -1).topk(2).values
            if trusted is None and float(top2[0] - top2[1]) < tie:
                trusted = i
            tokens.append(int(logits.argmax()))
            if i + 1 < n:
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                            use_cache=True)
        return tokens, n if trusted is None else trusted, first
    finally:
        torch.set_num_threads(threads)


class Hybrid:
    """Each arch's checkpoint, transformers model and references, built once per module."""

    def __init__(self, root):
        self.root, self.dirs, self.models, self.refs = root, {}, {}, {}

    def dir(self, arch):
        if arch not in self.dirs:
            self.dirs[arch] = tiny_checkpoint(self.root / arch, arch=arch)
        return self.dirs[arch]

    def hf(self, arch):
        if arch not in self.models:
            self.models[arch] = load_hf(self.dir(arch))
        return self.models[arch]

    def ref(self, arch, prompt, n=GEN):
        key = (arch, tuple(prompt), n)
        if key not in self.refs:
            self.refs[key] = hf_greedy_cached(self.hf(arch), list(prompt), n)
        return self.refs[key]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return Hybrid(tmp_path_factory.mktemp("hybrid"))


def greedy(max_tokens=GEN, **kw):
    from engine import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def llm_for(hybrid, arch, **kw):
    from engine import LLM
    kw.setdefault("num_kv_blocks", 32)
    return LLM(hybrid.dir(arch), backend="cpu", **kw)


def assert_all_match(hybrid, arch, prompts, outs, label, n=GEN):
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches(list(out.token_ids), hybrid.ref(arch, prompt, n), min_trusted=8,
                       label=f"{arch} {label} prompt {i}")


# ---- the reference and the quirks

def test_cached_reference_equals_full_recompute(hybrid):
    """hf_greedy_cached (transformers' recurrent form across decode steps) gives hf_greedy's
    tokens and prefill logits (its chunked form over the whole sequence each step)."""
    prompt = prompts_for()[1]
    for arch in ("qwen3_next", "qwen3_5"):
        cached = hybrid.ref(arch, prompt)
        full = hf_greedy(hybrid.hf(arch), prompt, GEN)
        assert cached[:2] == full[:2]
        np.testing.assert_allclose(cached[2], full[2], rtol=0, atol=1e-5)


def test_chunked_delta_rule_equals_transformers():
    """The chunked gated delta rule (150 rows: two whole chunks and a part, from a nonzero
    state) against transformers' chunked and recurrent torch forms: outputs and final state."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule)

    from pyx.gated_delta_net import delta_rule_chunked, l2norm
    rng = np.random.default_rng(0)
    n, H, dk, dv = 150, 4, 16, 24
    q, k = (rng.standard_normal((n, H, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((n, H, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.5, (n, H)).astype(np.float32)
    beta = rng.uniform(0, 1, (n, H)).astype(np.float32)
    S0 = rng.standard_normal((H, dk, dv)).astype(np.float32)
    out, S = delta_rule_chunked(l2norm(q) * np.float32(dk ** -0.5), l2norm(k), v, g, beta, S0)
    t = [torch.from_numpy(x)[None] for x in (q, k, v, g, beta, S0)]
    for form in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        ref, ref_S = form(*t[:5], initial_state=t[5], output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(out, ref[0].numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(S, ref_S[0].numpy(), rtol=0, atol=1e-5)


def test_bfloat16_widened_and_rounded_through_the_bits():
    """The CUDA path's bfloat16 conversions (CuPy stores ml_dtypes' bfloat16 but cannot compute
    with it) equal ml_dtypes' own: round to nearest even, exact widening."""
    import ml_dtypes

    from pyx.gated_delta_net import as_float32, store
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(np.float32)
    x[:4] = [1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -0.0, 3.0e38]          # ties, sign, range
    out = np.empty(x.shape, ml_dtypes.bfloat16)
    store(out, x)
    want = x.astype(ml_dtypes.bfloat16)
    assert (out.view(np.uint16) == want.view(np.uint16)).all()
    assert (as_float32(want) == want.astype(np.float32)).all()


def _attention_gate_open(model):
    """The full-attention output gate switched off (sigmoid(gate) = 1)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    original = m.torch.sigmoid
    m.torch.sigmoid = lambda x: torch.ones_like(x)
    model._restore = lambda: setattr(m.torch, "sigmoid", original)
    return model


def _norms_plain_w(model):
    """Every zero-centred RMSNorm (x * (1 + w)) as a plain one (x * w)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "linear_attn.norm" not in name:
                p.add_(1.0)
    return model


def _no_decay(model):
    """The delta rule's per-token decay switched off (A = 0: exp(g) = 1)."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(-1e4)
    return model


def _conv_identity(model):
    """The causal convolution reduced to its last tap (no mixing of earlier tokens)."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                w = layer.linear_attn.conv1d.weight
                w[:, :, :-1] = 0.0
    return model


def _value_heads_ungrouped(model):
    """Qwen3-Next's in_proj_qkvz read as if not grouped per key head (q, k, v, z each
    contiguous): the reordering the model file does at load, skipped."""
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                la = layer.linear_attn
                w = la.in_proj_qkvz.weight
                nk, dk, dv = la.num_k_heads, la.head_k_dim, la.head_v_dim
                r = la.num_v_heads // nk
                parts = torch.split(w, [la.key_dim, la.key_dim, la.value_dim, la.value_dim])
                groups = [torch.cat([parts[0][g * dk:(g + 1) * dk], parts[1][g * dk:(g + 1) * dk],
                                     parts[2][g * r * dv:(g + 1) * r * dv],
                                     parts[3][g * r * dv:(g + 1) * r * dv]]) for g in range(nk)]
                w.copy_(torch.cat(groups))
    return model


QUIRKS = {
    "attention_output_gate": ("qwen3_next", _attention_gate_open),
    "zero_centred_norms": ("qwen3_5", _norms_plain_w),
    "delta_rule_decay": ("qwen3_5", _no_decay),
    "causal_conv": ("qwen3_next", _conv_identity),
    "qkvz_grouped_per_key_head": ("qwen3_next", _value_heads_ungrouped),
}


@pytest.mark.parametrize("quirk", sorted(QUIRKS))
def test_quirk_changes_hf_tokens(hybrid, quirk):
    arch, switch_off = QUIRKS[quirk]
    prompt = prompts_for()[0]
    ref = hybrid.ref(arch, prompt)[0]
    model = switch_off(load_hf(hybrid.dir(arch)))
    try:
        off = hf_greedy_cached(model, prompt)[0]
    finally:
        getattr(model, "_restore", lambda: None)()
    assert off != ref, f"{quirk}: switching it off does not change transformers' tokens"


def test_config_read_as_transformers_reads_it(hybrid):
    from engine.models.model_config import ModelConfig
    nxt = ModelConfig.from_pretrained(hybrid.dir("qwen3_next"))
    la = nxt.linear_attention
    assert la.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim, la.conv_kernel) == \
        (2, 4, 16, 24, 4)
    assert not la.split_projections and nxt.num_kv_layers == 1 and nxt.rope.rot_dim == 8
    assert nxt.moe.sparse_layers == [True, False, True, True] and nxt.moe.normalize
    assert nxt.moe.shared_intermediate_size == 64
    q35 = ModelConfig.from_pretrained(hybrid.dir("qwen3_5"))
    assert q35.linear_attention.split_projections and q35.moe is None
    assert q35.linear_attention.layer_types[1] == "full_attention"
    moe = ModelConfig.from_pretrained(hybrid.dir("qwen3_5_moe")).moe
    assert moe.sparse_layers == [True] * 4 and moe.normalize
    # a config.json without layer_types: every 4th layer full (full_attention_interval)
    cfg = {"architectures": ["Qwen3NextForCausalLM"], "hidden_size": 64, "num_hidden_layers": 8,
           "num_attention_heads": 2, "vocab_size": 32, "num_experts": 0}
    la = ModelConfig.from_dict(cfg).linear_attention
    assert [t[0] for t in la.layer_types] == list("lllflllf")
    assert (la.head_k_dim, la.num_v_heads, la.conv_kernel) == (128, 32, 4)
    with pytest.raises(ValueError, match="layer type 'sliding_attention'"):
        ModelConfig.from_dict({**cfg, "layer_types": ["sliding_attention"] * 8})


# ---- Taper through the whole engine

@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_transformers(hybrid, arch):
    prompts = prompts_for()
    outs = llm_for(hybrid, arch).generate(prompts, greedy())
    assert_all_match(hybrid, arch, prompts, outs, "batched")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_prefill_logits_equal_transformers(hybrid, arch):
    """The model alone: one prompt's last-row logits against transformers' (no argmax hiding a
    small error)."""
    from engine.core.hybrid_state import StatePlan
    from engine.loader.model_loader import load_model
    from engine.runner.forward_batch import ForwardBatch
    from pyx.cpu_backend import CpuBackend
    model, config = load_model(hybrid.dir(arch), CpuBackend(), progress=False)
    prompt = prompts_for()[0]
    T = len(prompt)
    caches = model.allocate_caches(4, 16, np.float32, num_state_rows=1)
    plan = StatePlan(np.array([0, T]), np.array([0]), np.array([0]), np.array([True]))
    batch = ForwardBatch(np.array(prompt, np.int32), np.arange(T, dtype=np.int32),
                         np.arange(T, dtype=np.int32), np.array([0, T], np.int32),
                         np.array([T], np.int32), np.arange(4, dtype=np.int32)[None],
                         np.array([T - 1], np.int32), state_plan=plan)
    logits = model.forward(batch, caches)[0]
    ref = hybrid.ref(arch, prompt)[2]
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4 * max(1.0, np.abs(ref).max()))


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_chunked_prefill_equals_unchunked(hybrid, arch):
    """Prompts in chunks of 7 (the state carried from chunk to chunk, chunks crossing block
    boundaries), and a step budget of 9 tokens mixing one sequence's chunk with the other's
    decodes: the same tokens as one-chunk prefill, and as transformers'."""
    prompts = prompts_for()
    whole = llm_for(hybrid, arch).generate(prompts, greedy())
    chunked = llm_for(hybrid, arch, prefill_chunk_size=7).generate(prompts, greedy())
    mixed = llm_for(hybrid, arch, max_num_batched_tokens=9, max_num_seqs=2).generate(
        prompts, greedy())
    for w, c, m in zip(whole, chunked, mixed):
        assert list(c.token_ids) == list(w.token_ids) == list(m.token_ids)
    assert_all_match(hybrid, arch, prompts, chunked, "chunked")


def test_batch_equals_each_alone(hybrid):
    """Five sequences of different lengths in one batch, each in its own state slot: each
    gives the tokens it gives alone, and transformers'."""
    arch = "qwen3_5"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, n).tolist() for n in (40, 17, 5, 29, 1)]
    llm = llm_for(hybrid, arch)
    batched = llm.generate(prompts, greedy())
    for prompt, out in zip(prompts, batched):
        alone = llm_for(hybrid, arch, enable_prefix_caching=False).generate([prompt], greedy())[0]
        trusted = hybrid.ref(arch, prompt)[1]
        assert list(out.token_ids)[:trusted] == list(alone.token_ids)[:trusted]
    assert_all_match(hybrid, arch, prompts, batched, "batch of five")


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes(hybrid, prefix_caching):
    """A KV pool of 5 blocks (80 tokens) for prompts of 30 and 33 tokens (2 + 3 blocks), which
    grow to 46 and 49: when the first needs a third block the newest is preempted (its slot
    and blocks freed) and recomputed later, from scratch or from a state snapshot of its own
    prefix; both still give transformers' tokens."""
    arch = "qwen3_next"
    prompts = [prompts_for()[0][:30], prompts_for()[1]]
    llm = llm_for(hybrid, arch, num_kv_blocks=5, max_num_seqs=2,
                  enable_prefix_caching=prefix_caching)
    outs = llm.generate(prompts, greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_match(hybrid, arch, prompts, outs, "preempted")
    pool = llm.engine.block_pool
    assert pool.num_free_slots == pool.num_slots       # every slot back


def test_state_slots_bound_the_running_sequences(hybrid):
    """max_num_seqs 2 gives two state slots; four requests run two at a time, correctly."""
    arch = "qwen3_5"
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 512, n).tolist() for n in (21, 34, 9, 40)]
    llm = llm_for(hybrid, arch, max_num_seqs=2)
    pool = llm.engine.block_pool
    assert pool.num_slots == 2
    seen = []
    step = llm.engine.step
    llm.engine.step = lambda: (seen.append(llm.engine.scheduler.num_running), step())[1]
    outs = llm.generate(prompts, greedy())
    assert max(seen) == 2
    assert_all_match(hybrid, arch, prompts, outs, "two slots")


def _prefill_tokens(llm, prompt, params):
    """(the output, tokens the forward computed for it): the engine's own counter."""
    before = llm.engine.runner.num_forward_tokens
    out = llm.generate([prompt], params)[0]
    return out, llm.engine.runner.num_forward_tokens - before


def test_multi_turn_conversation_resumes_from_snapshots(hybrid):
    """Three turns, each prompt the whole conversation so far plus new tokens: turns 2 and 3
    compute only what follows the last full block of the history (their prefix-cache hit
    starts the linear layers from the snapshot taken there), and give transformers' tokens;
    without prefix caching they recompute everything."""
    arch = "qwen3_next"
    bs = 16
    rng = np.random.default_rng(7)
    llm = llm_for(hybrid, arch, num_kv_blocks=64)
    plain = llm_for(hybrid, arch, num_kv_blocks=64, enable_prefix_caching=False)
    conversation = rng.integers(3, 512, 40).tolist()
    pool = llm.engine.block_pool
    for turn in range(3):
        out, computed = _prefill_tokens(llm, conversation, greedy(24))
        plain_out, plain_computed = _prefill_tokens(plain, conversation, greedy(24))
        assert_matches(list(out.token_ids), hybrid.ref(arch, conversation, 24), min_trusted=8,
                       label=f"turn {turn + 1}")
        assert list(out.token_ids) == list(plain_out.token_ids)
        assert plain_computed == len(conversation) + 23
        if turn == 0:
            assert computed == plain_computed
        else:
            # the history's full blocks (its last token is never computed) come from the cache
            cached = (history_len - 1) // bs * bs
            assert out.num_cached_tokens == cached > 0
            assert computed == len(conversation) - cached + 23
        history_len = len(conversation) + 24
        conversation = conversation + list(out.token_ids) + rng.integers(3, 512, 9).tolist()
    assert pool.num_snapshot_restores == 2


def test_prefix_hit_cut_back_to_the_last_snapshot(hybrid):
    """A request sharing 50 tokens with an earlier 70-token prompt finds 3 cached blocks (48
    tokens). Computed in one chunk, the earlier prompt left a snapshot only at 64: the hit is
    cut back to nothing and all is recomputed. Computed in chunks of 20, it left snapshots at
    16, 32, 48 and 64: the hit keeps its 48 tokens. Both give transformers' tokens."""
    arch = "qwen3_5"
    rng = np.random.default_rng(9)
    first = rng.integers(3, 512, 70).tolist()
    second = first[:50] + rng.integers(3, 512, 10).tolist()
    for chunk, cached in [(0, 0), (20, 48)]:
        llm = llm_for(hybrid, arch, prefill_chunk_size=chunk)
        llm.generate([first], greedy(8))
        pool = llm.engine.block_pool
        assert len(pool.get_computed_blocks(_seq(second))[0]) == cached // 16
        out, computed = _prefill_tokens(llm, second, greedy())
        assert out.num_cached_tokens == cached
        assert computed == len(second) - cached + GEN - 1
        assert pool.num_prefix_tokens_cut >= (48 if cached == 0 else 0)
        assert_matches(list(out.token_ids), hybrid.ref(arch, second), min_trusted=8,
                       label=f"chunk {chunk}")


def test_one_snapshot_row_keeps_the_latest(hybrid):
    """With a single snapshot row the newest snapshot evicts the older one (LRU): after a
    40-token prompt and 24 tokens the row holds the state at 48 (taken at the decode that
    completed the third block; the one at 32 is gone), and the next turn resumes from it."""
    arch = "qwen3_5"
    rng = np.random.default_rng(8)
    llm = llm_for(hybrid, arch, state_snapshots=1)
    pool = llm.engine.block_pool
    first = rng.integers(3, 512, 40).tolist()
    out = llm.generate([first], greedy(24))[0]
    assert pool.num_snapshots_taken == 2 and len(pool.snapshots) == 1
    second = first + list(out.token_ids) + rng.integers(3, 512, 5).tolist()
    again = llm.generate([second], greedy())[0]
    assert again.num_cached_tokens == 48 and pool.num_snapshot_restores == 1
    assert_matches(list(again.token_ids), hybrid.ref(arch, second), min_trusted=8, label="lru")


def _seq(tokens):
    from engine.core.sequence import Sequence
    return Sequence(tokens)


def test_n_choices_share_the_prompt_state(hybrid):
    """n = 2: the second choice starts from the snapshot choice 0 left at the prompt's last
    block boundary before its final token, and gives the same greedy tokens."""
    arch = "qwen3_5_moe"
    prompt = prompts_for()[0]                       # 48 tokens: snapshot at 32
    llm = llm_for(hybrid, arch)
    choices = llm.generate([prompt], greedy(n=2))[0]
    assert llm.engine.block_pool.num_snapshot_restores == 1
    assert choices[1].num_cached_tokens == 32
    for c in choices:
        assert_matches(list(c.token_ids), hybrid.ref(arch, prompt), min_trusted=8, label="n=2")


def test_multimodal_checkpoint_serves_its_text(tmp_path):
    """Qwen3.5 as released: Qwen3_5ForConditionalGeneration, its language model's config under
    text_config and its tensors under model.language_model., beside a vision tower. Taper
    serves the text model (the tower not loaded) with transformers' tokens for a text prompt."""
    import transformers

    from checkpoints import ARCHS, TINY, scale_weights
    text = {**TINY, **ARCHS["qwen3_5"][1]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=96,
                  patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision))
    scale_weights(model)
    model.save_pretrained(tmp_path)
    model.eval()
    from engine import LLM
    prompts = prompts_for()
    outs = LLM(str(tmp_path), backend="cpu", num_kv_blocks=32).generate(prompts, greedy())
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_matches(list(out.token_ids), hf_greedy_cached(model, prompt), min_trusted=8,
                       label=f"Qwen3_5ForConditionalGeneration prompt {i}")


def test_stacked_experts_read_as_per_expert(tmp_path, hybrid):
    """A checkpoint whose experts are stacked as transformers 5 holds them (mlp.experts.
    gate_up_proj (E, 2I, H), down_proj (E, H, I): its state_dict written as is) gives the
    per-expert checkpoint's tokens."""
    from safetensors.torch import save_file

    from engine import LLM
    d = hybrid.dir("qwen3_5_moe")
    state = {k: v.contiguous() for k, v in hybrid.hf("qwen3_5_moe").state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(open(f"{d}/config.json").read())
    prompts = prompts_for()
    stacked = LLM(str(tmp_path), backend="cpu", num_kv_blocks=32).generate(prompts, greedy())
    per_expert = llm_for(hybrid, "qwen3_5_moe").generate(prompts, greedy())
    assert [o.token_ids for o in stacked] == [o.token_ids for o in per_expert]


# ---- sizing and what is refused

def test_state_slots_and_kv_blocks_sized_apart(hybrid, caplog):
    """The budget pays for the state rows (slots and as many snapshots, at most half of it)
    first, then KV blocks of the full-attention layers only; both are logged, and max_num_seqs
    is at most the slots."""
    from engine.runner.model_runner import ModelRunner
    arch = "qwen3_next"
    row = 3 * (3 * 160 + 4 * 16 * 24) * 4        # three linear layers: conv inputs, 4 states
    per_block = 2 * 2 * 32 * 4 * 16               # K+V, 2 heads of 32, one layer, 16 tokens
    # 2 MB: half of it holds 21 slots + 21 snapshots; 8 MB: 86, capped by the step's 64 tokens
    for mb, slots in [(2, 21), (8, 64)]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="taper.engine"):
            llm = llm_for(hybrid, arch, num_kv_blocks=None, kv_cache_memory_mb=mb,
                          max_num_batched_tokens=64)
        eng = llm.engine
        pool, config = eng.block_pool, eng.model_config
        assert config.linear_attention.state_floats() * 4 == row
        assert ModelRunner.kv_bytes_per_block(config, 16) == per_block
        assert (pool.num_slots, pool.num_snapshots) == (slots, slots)
        assert pool.num_blocks == (mb * 2**20 - 2 * slots * row) // per_block
        assert eng.config.max_num_seqs <= slots
        assert f"{slots} state slots + {slots} prefix snapshots" in caplog.text
        assert f"KV cache: {pool.num_blocks} blocks" in caplog.text
        conv, ssm = eng.runner.kv_caches[0]
        assert conv.shape == (2 * slots, 3, 160) and ssm.shape == (2 * slots, 4, 16, 24)
        k, v = eng.runner.kv_caches[3]
        assert k.shape == (pool.num_blocks, 16, 2, 32)
    explicit = llm_for(hybrid, arch, max_num_seqs=3, state_snapshots=5).engine.block_pool
    assert (explicit.num_slots, explicit.num_snapshots) == (3, 5)


def test_too_small_a_budget_is_refused(hybrid):
    with pytest.raises(ValueError, match="state .* does not fit the KV cache budget"):
        llm_for(hybrid, "qwen3_next", num_kv_blocks=None, kv_cache_memory_mb=1, max_num_seqs=64,
                max_num_batched_tokens=64)


def test_beam_search_is_refused(hybrid):
    """(Speculative decoding is supported: tests/test_spec_decode_hybrid.py.)"""
    from engine import SamplingParams
    llm = llm_for(hybrid, "qwen3_5")
    with pytest.raises(ValueError, match="beam search is not supported for hybrid"):
        llm.generate([[5, 6, 7]], SamplingParams(use_beam_search=True, best_of=2, temperature=0,
                                                 max_tokens=4))


# ---- through a live server

@pytest.mark.timeout(300)
def test_server_serves_a_conversation(tmp_path):
    """`python -m server` with a Qwen3-Next checkpoint: a completion, then a second one whose
    prompt is the first's prompt and answer plus more; both have the text of transformers'
    tokens, and the second reports the cached prefix."""
    from transformers import AutoTokenizer

    from server_fakes import LiveServer, client_for
    from tiny_tokenizers import build_byte_level

    d = tmp_path / "qwen3_next"
    build_byte_level(d)
    hf_tok = AutoTokenizer.from_pretrained(str(d))
    tiny_checkpoint(d, arch="qwen3_next", vocab_size=len(hf_tok))
    model = load_hf(d)
    whole = [i for i in range(3, len(hf_tok)) if "\ufffd" not in hf_tok.decode([i])]
    rng = np.random.default_rng(5)
    prompt = rng.choice(whole, 40).tolist()
    server = LiveServer(tmp_path, str(d), "--mem", "16", "--served-model-name", "hybrid")
    try:
        client = client_for(server.port)
        for turn in range(2):
            tokens, trusted, _ = hf_greedy_cached(model, prompt, GEN)
            assert trusted >= 8, f"turn {turn}: reference near-tie at token {trusted}"
            out = client.completions.create(model="hybrid", prompt=prompt, max_tokens=trusted,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert out.choices[0].text == hf_tok.decode(tokens[:trusted],
                                                        skip_special_tokens=True)
            if turn:
                assert out.usage.prompt_tokens_details.cached_tokens == 48
            prompt = prompt + tokens[:trusted] + rng.choice(whole, 8).tolist()
    finally:
        server.close()
