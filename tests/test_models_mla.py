"""Multi-head latent attention models (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM,
Glm4MoeLiteForCausalLM; issue 29 item 1): greedy tokens equal transformers' on tiny checkpoints
written by transformers (tests/checkpoints.py), through the whole engine with chunked prefill,
prefix-cache hits and preemption over the latent cache; the cache holds kv_lora_rank +
qk_rope_head_dim values per token and layer; the absorbed decode equals the plain path; the
DeepSeekMoE routers equal transformers'; each quirk first shown to change transformers' own
tokens (DESIGN.md section 6, rung 2)."""
from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch

from checkpoints import tiny_checkpoint
from hf_oracle import assert_matches, hf_greedy, load_hf
from model_cases import GEN, harness_greedy, prompts_for

ARCHS = ("deepseek_v2", "deepseek_v2_lite", "deepseek_v3", "glm4_moe_lite")
GREEDY = dict(temperature=0, max_tokens=GEN, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    out = {a: tiny_checkpoint(os.path.join(root, a), arch=a) for a in ARCHS}
    # V3 rotating halves (rotate_half) instead of interleaved pairs
    out["deepseek_v3_halves"] = tiny_checkpoint(os.path.join(root, "halves"), arch="deepseek_v3",
                                                rope_interleave=False)
    return out


@pytest.fixture(scope="module")
def refs(dirs):
    return {a: [hf_greedy(load_hf(d), p, GEN) for p in prompts_for()] for a, d in dirs.items()}


@pytest.fixture(scope="module")
def backend():
    from pyx.cpu_backend import CpuBackend
    return CpuBackend()


def hf_first_tokens(model):
    return [hf_greedy(model, p, GEN)[0] for p in prompts_for()]


# ---- tokens against transformers

@pytest.mark.parametrize("arch", ARCHS + ("deepseek_v3_halves",))
def test_greedy_tokens_equal_transformers(dirs, refs, arch):
    from engine import LLM, SamplingParams
    llm = LLM(dirs[arch], num_kv_blocks=32)
    outs = llm.generate(prompts_for(), SamplingParams(**GREEDY))
    for i, (out, ref) in enumerate(zip(outs, refs[arch])):
        assert_matches(list(out.token_ids), ref, min_trusted=8, label=f"{arch} prompt {i}")


@pytest.mark.parametrize("arch", ARCHS)
def test_model_forward_with_chunked_prefill_matches_transformers(dirs, refs, backend, arch):
    """The model alone (tests/model_cases.py's paged harness), prompts in chunks of 9 beside the
    other prompt's decodes: prefill logits and greedy tokens."""
    from engine.loader.model_loader import load_model
    model, _ = load_model(dirs[arch], backend, progress=False)
    tokens, first_logits = harness_greedy(model, prompts_for(), chunk=9)
    for i, ref in enumerate(refs[arch]):
        np.testing.assert_allclose(first_logits[i], ref[2], rtol=0,
                                   atol=1e-4 * max(1.0, np.abs(ref[2]).max()))
        assert_matches(tokens[i], ref, min_trusted=8, label=f"{arch} prompt {i}")


def test_chunks_prefix_hits_and_preemption_over_the_latent_cache(dirs):
    """One engine, DeepSeek-V3: six prompts in a pool too small for them (preemption), prompt
    chunks of 16 after their cached context, and batches mixing decodes with chunks; then a
    prompt sharing a 40-token prefix with an earlier one hits the prefix cache. Every
    continuation equals transformers'."""
    from engine import LLM, SamplingParams
    from pyx import mla
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 512, n).tolist() for n in (9, 70, 23, 41, 3, 55)]
    shared = prompts[1][:40] + rng.integers(3, 512, 12).tolist()
    model = load_hf(dirs["deepseek_v3"])
    refs = [hf_greedy(model, p, GEN) for p in prompts + [shared]]

    mixed = []
    plain_mixed = mla.MlaAttention._mixed

    def spy(self, batch, *args):
        lens = np.diff(batch.query_start_loc)
        mixed.append(((lens == 1).any(), (lens > 1).any()))
        return plain_mixed(self, batch, *args)

    llm = LLM(dirs["deepseek_v3"], block_size=8, num_kv_blocks=24, prefill_chunk_size=16,
              max_num_batched_tokens=48, max_num_seqs=8)
    engine = llm.engine
    engine.block_pool.shuffle_free_blocks(random.Random(1))
    mla.MlaAttention._mixed = spy
    try:
        outs = llm.generate(prompts, SamplingParams(**GREEDY))
        llm.generate([prompts[1]], SamplingParams(**GREEDY))   # its blocks cached afresh
        again = llm.generate([shared], SamplingParams(**GREEDY))[0]
    finally:
        mla.MlaAttention._mixed = plain_mixed
    for i, (out, ref) in enumerate(zip(outs + [again], refs)):
        assert_matches(list(out.token_ids), ref, label=f"prompt {i}")
    assert engine.scheduler.num_preemptions > 0
    assert again.num_cached_tokens == 40
    assert (True, True) in mixed           # decodes and prompt chunks in one batch


def test_server_completion_matches_transformers(tmp_path):
    """DeepSeek-V3's checkpoint (vocabulary = the tokenizer's) served by `python -m server`: a
    greedy completion through the official openai client has transformers' text."""
    from transformers import AutoTokenizer

    from server_fakes import LiveServer, client_for
    from tiny_tokenizers import build_byte_level

    d = tmp_path / "deepseek_v3"
    build_byte_level(d)
    hf_tok = AutoTokenizer.from_pretrained(str(d))
    tiny_checkpoint(d, arch="deepseek_v3", vocab_size=len(hf_tok))
    whole = [i for i in range(3, len(hf_tok)) if "\ufffd" not in hf_tok.decode([i])]
    prompt = np.random.default_rng(5).choice(whole, 40).tolist()
    tokens, trusted, _ = hf_greedy(load_hf(d), prompt, GEN)
    assert trusted >= 8, f"reference near-tie at token {trusted}"
    server = LiveServer(tmp_path, str(d), "--mem", "16", "--served-model-name", "dsv3")
    try:
        out = client_for(server.port).completions.create(
            model="dsv3", prompt=prompt, max_tokens=trusted, temperature=0,
            extra_body={"ignore_eos": True})
    finally:
        server.close()
    assert out.choices[0].text == hf_tok.decode(tokens[:trusted], skip_special_tokens=True)
    assert "MLA latent KV cache: 48 values per token" in server.log_path.read_text()


# ---- the latent cache and the two attention paths

def test_the_pool_holds_the_latent_per_token(dirs):
    """Per layer one array of kv_lora_rank + qk_rope_head_dim = 48 values per token, given as
    both K and V; the KV budget counts those bytes (not Hq * (qk_head_dim + v_head_dim) = 240)."""
    from engine import LLM
    from engine.runner.model_runner import ModelRunner
    llm = LLM(dirs["deepseek_v3"], num_kv_blocks=10, block_size=16)
    runner, config = llm.engine.runner, llm.engine.model_config
    assert len(runner.kv_caches) == config.num_hidden_layers == 2
    for k, v in runner.kv_caches:
        assert k is v and k.shape == (10, 16, 1, 48) and k.dtype == np.float32
    pool_bytes = sum(k.nbytes for k, _ in runner.kv_caches)
    assert pool_bytes // (10 * 16) == 2 * 48 * 4
    assert ModelRunner.kv_bytes_per_block(config, 16) == 16 * 2 * 48 * 4
    assert config.kv_cache_elements_per_token == 48


def test_fp8_kv_cache_is_refused_by_name(dirs):
    from engine import LLM
    with pytest.raises(ValueError, match="FP8 KV cache is not supported for multi-head latent"):
        LLM(dirs["deepseek_v2"], num_kv_blocks=8, kv_cache_dtype="fp8")


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2_lite"])
def test_absorbed_decode_equals_the_plain_path(dirs, backend, arch):
    """Each layer's decode rows through the absorbed form (queries in latent space, attention
    over the latent rows) and through the plain one (K/V up-projected per head) over one filled
    cache: the same outputs to float32 rounding, for sequences of 1 to 40 cached tokens."""
    from engine.loader.model_loader import load_model
    from pyx.layers import Workspace
    model, config = load_model(dirs[arch], backend, progress=False)
    m, Hq = config.mla, config.num_attention_heads
    rng = np.random.default_rng(0)
    BS, lens = 16, np.array([1, 17, 40, 5], np.int32)
    tables = np.array([[3, 0, 0], [1, 4, 0], [2, 6, 5], [7, 0, 0]], np.int32)
    cache = rng.standard_normal((8, BS, 1, m.latent_dim)).astype(np.float32)
    q3 = rng.standard_normal((len(lens), Hq, m.qk_head_dim)).astype(np.float32)
    for layer in model.layers:
        attn = layer.attention
        absorbed = np.zeros((len(lens), Hq * m.v_head_dim), np.float32)
        plain = np.zeros_like(absorbed)
        attn._absorbed(q3.copy(), cache, tables, lens, absorbed, Workspace(np))
        attn._plain(q3.copy(), cache, tables, lens, np.arange(len(lens) + 1, dtype=np.int32),
                    plain, Workspace(np))
        assert np.abs(absorbed).max() > 0.1
        np.testing.assert_allclose(absorbed, plain, rtol=1e-4, atol=1e-5)


# ---- DeepSeekMoE's routers against transformers'

@pytest.mark.parametrize("arch, changes", [
    ("deepseek_v2", {}), ("deepseek_v2_lite", {}), ("deepseek_v3", {}),
    ("deepseek_v3", {"norm_topk_prob": False}), ("glm4_moe_lite", {})])
def test_router_equals_transformers(dirs, arch, changes):
    """route_grouped's experts and weights for 64 random tokens against the checkpoint's own
    transformers router (softmax or sigmoid, groups, correction bias, scaling)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models.model_config import ModelConfig
    from pyx.moe import route_grouped
    hf_config = AutoConfig.from_pretrained(dirs[arch])
    for k, v in changes.items():
        setattr(hf_config, k, v)
    hf = AutoModelForCausalLM.from_pretrained(dirs[arch], config=hf_config, dtype=torch.float32)
    router = hf.model.layers[1].mlp.gate
    ours = ModelConfig.from_dict(hf_config.to_dict()).moe
    x = torch.randn(64, hf_config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, weights, ids = router(x)
    bias = getattr(router, "e_score_correction_bias", None)
    our_ids, our_weights = route_grouped(logits.numpy(), ours.top_k, ours.normalize, ours.grouped,
                                         None if bias is None else bias.numpy())
    order, our_order = ids.numpy().argsort(1), our_ids.argsort(1)
    np.testing.assert_array_equal(np.take_along_axis(our_ids, our_order, 1),
                                  np.take_along_axis(ids.numpy(), order, 1))
    np.testing.assert_allclose(np.take_along_axis(our_weights, our_order, 1),
                               np.take_along_axis(weights.numpy(), order, 1), rtol=1e-6)


# ---- config

def test_config_is_read_as_transformers_reads_it(dirs):
    from engine.models.model_config import ModelConfig
    for arch in ARCHS:
        c = ModelConfig.from_pretrained(dirs[arch])
        hf = load_hf(dirs[arch])
        attn = hf.model.layers[0].self_attn
        assert c.mla.softmax_scale == pytest.approx(attn.scaling, rel=1e-12), arch
        assert (c.num_key_value_heads, c.head_dim) == (1, 48)
        assert c.rope.rot_dim == 16 and not c.rope.is_neox
        sparse = [not isinstance(layer.mlp, type(hf.model.layers[0].mlp))
                  for layer in hf.model.layers]
        assert c.moe.sparse_layers == sparse == [False, True], arch
    v3 = ModelConfig.from_pretrained(dirs["deepseek_v3"])
    assert v3.rope.rope_type == "yarn" and v3.rope.mscale == 0.8 and v3.rope.mscale_all_dim == 1.0
    assert v3.moe.grouped.method == "noaux_tc" and v3.moe.grouped.correction_bias
    assert v3.moe.shared_intermediate_size == 64 and not v3.moe.shared_expert_gate
    lite = ModelConfig.from_pretrained(dirs["deepseek_v2_lite"])
    assert lite.mla.q_lora_rank is None and lite.moe.shared_intermediate_size == 64
    assert lite.moe.grouped.method == "greedy" and not lite.moe.normalize


def test_bad_group_settings_are_named():
    from engine.models.model_config import ModelConfig
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 96, "intermediate_size": 192,
           "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512,
           "n_routed_experts": 8, "n_group": 3, "topk_group": 2}
    with pytest.raises(ValueError, match="8 experts in n_group 3 groups"):
        ModelConfig.from_dict(cfg)


# ---- multi-token prediction layers: loaded and kept

def test_mtp_layer_weights_are_kept(dirs, refs, tmp_path):
    """A checkpoint with DeepSeek-V3's MTP layer (model.layers.2.*: enorm, hnorm, eh_proj,
    shared_head and a decoder layer) loads; the model keeps the tensors in mtp_weights (for
    speculative decoding's MTP head: tests/test_spec_decode_mtp.py), none is reported unused; an
    engine that does not draft with them drops them, and its tokens are the decoder's."""
    from safetensors.numpy import load_file, save_file

    from engine import LLM, SamplingParams
    d = tmp_path / "with_mtp"
    shutil.copytree(dirs["deepseek_v3"], d)
    weights = load_file(str(d / "model.safetensors"))
    extra = {n.replace("model.layers.1.", "model.layers.2."): w for n, w in weights.items()
             if n.startswith("model.layers.1.")}
    H = 96
    extra.update({"model.layers.2.enorm.weight": np.ones(H, np.float32),
                  "model.layers.2.hnorm.weight": np.ones(H, np.float32),
                  "model.layers.2.eh_proj.weight": np.zeros((H, 2 * H), np.float32),
                  "model.layers.2.shared_head.norm.weight": np.ones(H, np.float32),
                  "model.layers.2.shared_head.head.weight": np.zeros((512, H), np.float32)})
    save_file({**weights, **extra}, str(d / "model.safetensors"), metadata={"format": "pt"})
    from engine.loader.model_loader import load_model
    from pyx.cpu_backend import CpuBackend
    model, _ = load_model(str(d), CpuBackend(), progress=False)
    assert set(model.mtp_weights) == set(extra)
    llm = LLM(str(d), num_kv_blocks=32)
    assert llm.engine.model.mtp_weights == {}
    outs = llm.generate(prompts_for(), SamplingParams(**GREEDY))
    for i, (out, ref) in enumerate(zip(outs, refs["deepseek_v3"])):
        assert_matches(list(out.token_ids), ref, min_trusted=8, label=f"prompt {i}")


# ---- each quirk changes transformers' own tokens (so the comparisons above can fail)

def _hf(dirs, arch, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(dirs[arch])
    for k, v in changes.items():
        if k == "rope":
            config.rope_parameters = {**config.rope_parameters, **v}
        else:
            setattr(config, k, v)
    return AutoModelForCausalLM.from_pretrained(dirs[arch], config=config,
                                                dtype=torch.float32).eval()


def _edited(dirs, arch, edit):
    model = load_hf(dirs[arch])
    with torch.no_grad():
        edit(model)
    return model


def _no_shared_experts(model):
    for layer in model.model.layers[1:]:
        layer.mlp.shared_experts.down_proj.weight.zero_()


def _unscaled_softmax(model):
    """qk_head_dim ** -0.5 without YaRN's mscale(factor, mscale_all_dim) ** 2."""
    for layer in model.model.layers:
        layer.self_attn.scaling = layer.self_attn.qk_head_dim ** -0.5


def _no_correction_bias(model):
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()


@pytest.mark.parametrize("arch, switch_off", [
    ("deepseek_v2", lambda d: _hf(d, "deepseek_v2", topk_method="greedy")),
    ("deepseek_v2", lambda d: _hf(d, "deepseek_v2", routed_scaling_factor=1.0)),
    ("deepseek_v2_lite", lambda d: _edited(d, "deepseek_v2_lite", _no_shared_experts)),
    ("deepseek_v3", lambda d: _edited(d, "deepseek_v3", _no_correction_bias)),
    ("deepseek_v3", lambda d: _hf(d, "deepseek_v3", topk_group=4)),
    ("deepseek_v3", lambda d: _hf(d, "deepseek_v3", norm_topk_prob=False)),
    ("deepseek_v3", lambda d: _hf(d, "deepseek_v3", rope_interleave=False)),
    ("deepseek_v3", lambda d: _edited(d, "deepseek_v3", _unscaled_softmax)),
    ("deepseek_v3", lambda d: _hf(d, "deepseek_v3", rope={"mscale": 1.0})),
    ("glm4_moe_lite", lambda d: _hf(d, "glm4_moe_lite", routed_scaling_factor=1.0)),
], ids=["v2_group_limited", "v2_routed_scaling", "shared_experts", "correction_bias",
        "v3_groups", "norm_topk_prob", "rope_interleave", "yarn_softmax_mscale",
        "yarn_cos_sin_mscale", "glm_routed_scaling"])
def test_each_quirk_changes_transformers_tokens(dirs, refs, arch, switch_off):
    on = [r[0] for r in refs[arch]]
    assert on != hf_first_tokens(switch_off(dirs))
