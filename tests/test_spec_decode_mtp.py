"""Speculative decoding with the checkpoint's own multi-token-prediction head (method mtp) on tiny
random DeepSeek-V3 checkpoints (tests/mtp_heads.py): the head's drafts equal a float64 reference
of the MTP computation (vLLM's deepseek_mtp.py as documented: the zeroed embedding at position 0,
enorm, hnorm, eh_proj, shared_head written here, transformers' DeepSeek-V3 decoder layer for MLA
and DeepSeekMoE; the target's final-norm hidden states from transformers; a second and third
chained step fed the head's own output); greedy and seeded outputs are the target's with any
head, in the engine and through the server; a head made to compute the target's next token
accepts every draft, a random one few; drafts depend only on the context whatever rejections,
preemption and prefix caching did to the pools; errors name the problem."""
from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from engine import LLM, SamplingParams
from mtp_heads import MTP_ONLY, bigram_mtp_checkpoint, config, load, mtp_checkpoint, save
from test_engine import StressRunner
from spec_rollback import assert_drafts_depend_only_on_the_context

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(autouse=True)
def free_drafts(monkeypatch):
    """The cost model (engine/spec/costs.py) follows this machine's step times; drafts are made
    free so that acceptance alone decides how many are proposed."""
    from engine.spec.costs import StepCost
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)


def mtp(k: int = 3, **kw) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """DeepSeek-V3 (YaRN, interleaved RoPE, sigmoid-routed MoE) with a random MoE MTP layer."""
    return mtp_checkpoint(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    return bigram_mtp_checkpoint(tmp_path_factory.mktemp("bigram"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 500, n).tolist() for n in (6, 33, 17, 50)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return LLM(target).generate(prompts, GREEDY)


# ---- the float64 reference of the MTP computation

def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


class ReferenceMtp:
    """The MTP head over rows 0..n-1 at positions 0..n-1 in float64: row p reads token t and a
    hidden state h; e = embed(t), zero at position 0; x = eh_proj(concat(enorm(e), hnorm(h)));
    the decoder layer is transformers' (a one-layer DeepseekV3Model holding the MTP layer's
    tensors, its final norm shared_head.norm); logits = shared_head.head(that norm's output)."""

    def __init__(self, directory):
        import torch
        from transformers import AutoConfig
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Model
        cfg = config(directory)
        w = {k: v.astype(np.float64) for k, v in load(directory).items()}
        p = f"model.layers.{cfg['num_hidden_layers']}."
        self.eps = cfg["rms_norm_eps"]
        self.embed = w.get(p + "embed_tokens.weight", w["model.embed_tokens.weight"])
        self.head = w.get(p + "shared_head.head.weight", w["lm_head.weight"])
        self.enorm, self.hnorm = w[p + "enorm.weight"], w[p + "hnorm.weight"]
        self.eh_proj = w[p + "eh_proj.weight"]
        sparse = p + "mlp.gate.weight" in w
        block_config = AutoConfig.from_pretrained(directory)
        block_config.num_hidden_layers = 1
        block_config.first_k_dense_replace = 0 if sparse else 1
        block_config._attn_implementation = "eager"
        block_config._experts_implementation = "eager"      # (grouped_mm takes no float64)
        self.block = DeepseekV3Model(block_config).double().eval()
        state = {"layers.0." + k[len(p):]: torch.tensor(v) for k, v in w.items()
                 if k.startswith(p) and not k[len(p):].startswith(MTP_ONLY)}
        if sparse:        # transformers holds the experts stacked, gate and up side by side
            experts = range(cfg["n_routed_experts"])
            x = "layers.0.mlp.experts."
            state[x + "gate_up_proj"] = torch.stack([torch.cat(
                [state.pop(f"{x}{i}.gate_proj.weight"), state.pop(f"{x}{i}.up_proj.weight")])
                for i in experts])
            state[x + "down_proj"] = torch.stack([state.pop(f"{x}{i}.down_proj.weight")
                                                  for i in experts])
        state["norm.weight"] = torch.tensor(w[p + "shared_head.norm.weight"])
        state["embed_tokens.weight"] = torch.tensor(self.embed)
        self.block.load_state_dict(state, strict=True)
        self.prenorm = None
        self.block.layers[0].register_forward_hook(
            lambda module, args, out: setattr(self, "prenorm", out[0].detach().numpy()))

    def rows(self, tokens, hidden):
        """(logits (n, V), prenorm (n, H)) of rows 0..n-1."""
        import torch
        e = self.embed[np.asarray(tokens)].copy()
        e[0] = 0.0                                   # the row at position 0
        x = np.concatenate([rms(e, self.enorm, self.eps), rms(hidden, self.hnorm, self.eps)],
                           axis=1) @ self.eh_proj.T
        with torch.no_grad():
            out = self.block(inputs_embeds=torch.tensor(x[None]),
                             position_ids=torch.arange(len(x))[None]).last_hidden_state
        return out[0].numpy() @ self.head.T, self.prenorm


def final_hidden(directory, tokens):
    """transformers' final-norm output (the lm_head's input) at every position, float64, and
    its logits."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        hidden = model.model(torch.tensor([tokens])).last_hidden_state[0]
        return hidden.numpy(), model.lm_head(hidden).numpy()


def test_drafts_equal_the_float64_reference(target, prompts):
    """The engine's features (the target's final-norm states, every row, prefill chunks of 8)
    and the head's logits in every drafting forward of the first verify steps, against the
    reference recomputed from the context: step 0 is the head's row for the last computed
    position (its earlier rows mirrored from prefill chunks and verify steps, rejected drafts'
    rows rewritten), steps 1 and 2 read the previous step's draft and prenorm output."""
    prompt = prompts[1]
    llm = LLM(target, speculative_config=mtp(3), block_size=8, prefill_chunk_size=8,
              max_num_batched_tokens=8)
    proposer = llm.engine.speculator.draft_model
    features, steps = [], []
    fuse, step_logits = proposer.model.fuse, proposer._step_logits

    def spy_fuse(states):
        features.append(np.array(states, np.float64))
        return fuse(states)

    def spy_steps(batch, tables, plans, live, rows, tokens, step):
        out = step_logits(batch, tables, plans, live, rows, tokens, step)
        steps.append((step, int(tokens[0]), int(batch.positions[rows[0]]) - 1,
                      np.array(out[0], np.float64)))
        return out

    proposer.model.fuse, proposer._step_logits = spy_fuse, spy_steps
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == LLM(target).generate([prompt], params)[0].token_ids
    context = prompt + out.token_ids
    hidden, target_logits = final_hidden(target, context)
    n = len(prompt)
    assert [int(t) for t in np.argmax(target_logits[n - 1:-1], axis=1)] == out.token_ids
    np.testing.assert_allclose(np.concatenate(features)[:n], hidden[:n], rtol=1e-4,
                               atol=1e-4 * np.abs(hidden).max())
    ref = ReferenceMtp(target)
    starts = [i for i, s in enumerate(steps) if s[0] == 0]
    # the first verify step drafts 3 (later ones fewer: the random head is soon turned down)
    assert len(starts) >= 3 and [s[0] for s in steps[:3]] == [0, 1, 2]
    for a, b in zip(starts[:3], starts[1:4]):
        p0 = steps[a][2]                   # draft step 0: the head's row for p0
        tokens, rows_hidden = list(context[1:p0 + 2]), hidden[:p0 + 1]
        assert steps[a][1] == context[p0 + 1]
        logits, prenorm = ref.rows(tokens, rows_hidden)
        for i, (step, token, position, got) in enumerate(steps[a:b]):
            assert (step, position) == (i, p0 + i)
            if i:                          # the previous step's draft and prenorm output
                assert token == int(np.argmax(logits[-1]))
                tokens.append(token)
                rows_hidden = np.concatenate([rows_hidden, prenorm[-1:]])
                logits, prenorm = ref.rows(tokens, rows_hidden)
            np.testing.assert_allclose(got, logits[-1], rtol=1e-3, atol=2e-3)
            assert int(np.argmax(got)) == int(np.argmax(logits[-1]))


# ---- outputs: the target's, whatever the head

def test_greedy_is_token_identical_with_a_random_head(target, prompts, reference):
    llm = LLM(target, speculative_config=mtp(3))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.speculator.stats
    assert stats.method == "mtp" and stats.num_drafts > 0
    # a random head rarely agrees: it soon stops drafting (engine/spec/adaptive.py)
    assert stats.acceptance_rate < 0.3, stats


def test_a_head_that_computes_the_target_accepts_every_draft(bigram, prompts):
    ref = LLM(bigram).generate(prompts, GREEDY)
    llm = LLM(bigram, speculative_config=mtp(4))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_accepted_length > 4.8
    assert llm.engine.runner.num_forward_calls <= 12      # the prefill, then ~8 steps of 5


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_p=0.9, seed=1),
                                dict(temperature=1.0, top_k=20, repetition_penalty=0.5,
                                     presence_penalty=0.3, logit_bias={5: 3.0}, seed=2,
                                     logprobs=2),
                                dict(temperature=0, frequency_penalty=-0.4, min_tokens=30,
                                     max_tokens=36, seed=3)])
def test_seeded_sampling_equals_the_non_speculative_engine(target, bigram, prompts, kw):
    """Greedy drafting (the default): drafts are point masses, so a seeded request draws the
    tokens it draws without speculation, whatever the head proposes."""
    params = SamplingParams(**{"max_tokens": 40, "ignore_eos": "min_tokens" not in kw, **kw})
    for model in (target, bigram):
        ref = LLM(model).generate(prompts, params)
        llm = LLM(model, speculative_config=mtp(3))
        for o, r in zip(llm.generate(prompts, params), ref):
            assert o.token_ids == r.token_ids
            if params.logprobs is not None:
                np.testing.assert_allclose([x.logprob for x in o.logprobs],
                                           [x.logprob for x in r.logprobs], atol=1e-4)
        assert llm.engine.speculator.stats.num_drafts > 0


# ---- rollback, prefix caching, preemption

def test_the_pools_follow_prefix_caching_and_preemption(bigram, prompts):
    """The head's latent cache and feature pool live in the target's blocks: a prefix-cache hit
    or a recomputed (preempted) sequence finds them there. Both are NaN outside each step's
    blocks (as the target's cache is): a read of a slot the head never wrote poisons its drafts,
    and the head would stop agreeing."""
    shared = [prompts[1][:19] + p for p in prompts] * 2
    ref = LLM(bigram).generate(shared, GREEDY)
    llm = LLM(bigram, speculative_config=mtp(4), block_size=8, num_kv_blocks=48,
              prefill_chunk_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    engine = llm.engine
    engine.block_pool.shuffle_free_blocks(random.Random(2))
    stress = StressRunner(engine.runner, engine.block_pool)
    proposer = engine.speculator.draft_model
    execute = engine.runner.execute
    bs = engine.runner.block_size

    def poison_the_head_too(sched, *batch):
        dead = [b for b in range(engine.runner.num_blocks)
                if np.isnan(engine.runner.kv_caches[0][0][b]).all()]
        proposer.kv_caches[0][0][dead] = np.nan
        for b in dead:
            proposer.features[b * bs:(b + 1) * bs] = np.nan
        return execute(sched, *batch)

    engine.runner.execute = poison_the_head_too
    outs = llm.generate(shared, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert engine.scheduler.num_preemptions > 0 and engine.block_pool.prefix_cache_hits > 0
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stress.steps and engine.block_pool.num_free_blocks == 48


def test_drafts_depend_only_on_the_context(target, prompts):
    """Rollback: after verify steps with rejections, preemption and prefix-cache hits, the head's
    first draft logits for a context equal those of a fresh engine that prefills that context:
    every row the head reads was rewritten after its rejected draft."""
    assert_drafts_depend_only_on_the_context(
        target, mtp(3, disable_by_batch_size=None), mtp(1), prompts)


# ---- loading, budget, errors

def test_the_kv_budget_pays_for_the_heads_pools(target):
    from engine.runner.model_runner import ModelRunner
    alone = LLM(target, kv_cache_memory_mb=4).engine
    both = LLM(target, kv_cache_memory_mb=4, speculative_config=mtp()).engine
    per_block = ModelRunner.kv_bytes_per_block(alone.model_config, 16)
    # the head: one layer's latent (32 + 16 values) and a 96-wide hidden row per token, f32
    head_bytes = 16 * (48 * 4 + 96 * 4)
    assert alone.block_pool.num_blocks == 4 * 2**20 // per_block
    assert both.block_pool.num_blocks == 4 * 2**20 // (per_block + head_bytes)
    proposer = both.speculator.draft_model
    assert proposer.features.shape == (both.block_pool.num_blocks * 16, 96)
    assert proposer.kv_caches[0][0].shape == (both.block_pool.num_blocks, 16, 1, 48)
    # the MTP tensors are the head's, and dropped when nothing drafts with them
    assert not both.model.mtp_weights and not alone.model.mtp_weights


def test_refusals_name_the_problem(target, tmp_path):
    from checkpoints import tiny_checkpoint
    from engine.spec.config import SpeculativeConfig
    plain = tiny_checkpoint(tmp_path / "plain", "deepseek_v3")
    with pytest.raises(ValueError, match="the checkpoint has no multi-token-prediction layers "
                                         "\\(no model.layers.2.\\* tensors"):
        LLM(plain, speculative_config=mtp())
    llama = tiny_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="MTP: the target's architecture \\(LlamaForCausalLM\\) "
                                         "has no multi-token-prediction head"):
        LLM(llama, speculative_config=mtp())
    with pytest.raises(ValueError, match="model is for methods draft_model and eagle3, not mtp "
                                         "\\(the MTP head comes from the target's checkpoint\\)"):
        SpeculativeConfig.parse(mtp(model="/h"))
    assert SpeculativeConfig.parse({"method": "deepseek_mtp",
                                    "num_speculative_tokens": 2}).method == "mtp"

    def refused(match, edit):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        import shutil
        shutil.copytree(target, d)
        w = load(d)
        edit(w)
        save(d, w)
        with pytest.raises(ValueError, match=match):
            LLM(str(d), speculative_config=mtp())

    refused("tensor model.layers.2.eh_proj.weight has shape \\[96, 96\\], expected \\[96, 192\\]",
            lambda w: w.update({"model.layers.2.eh_proj.weight": np.zeros((96, 96), np.float32)}))
    refused("missing tensor model.layers.2.enorm.weight",
            lambda w: w.pop("model.layers.2.enorm.weight"))
    refused("tensor model.layers.2.shared_head.head.weight has shape \\[500, 96\\]",
            lambda w: w.update({"model.layers.2.shared_head.head.weight":
                                np.zeros((500, 96), np.float32)}))


def test_the_server_flag_takes_method_mtp():
    from server.__main__ import build_parser, engine_config
    config = engine_config(build_parser().parse_args([
        "--w", "/m", "--cpu", "--speculative-config",
        '{"method": "deepseek_mtp", "num_speculative_tokens": 2}']))
    assert dataclasses.astuple(config.speculative_config)[:2] == ("mtp", 2)


# ---- the server

def test_an_mtp_server_equals_the_server_without_speculation(tmp_path):
    """A DeepSeek-V3 checkpoint with a byte-level tokenizer and a bigram MTP head served by
    `python -m server`, with and without --speculative-config: greedy completions (streamed or
    not) and a seeded sampled one have the same text; the usage counts accepted drafts."""
    from transformers import AutoTokenizer

    from server_fakes import LiveServer, client_for
    from tiny_tokenizers import build_byte_level
    d = tmp_path / "dsv3"
    build_byte_level(d)
    vocab = len(AutoTokenizer.from_pretrained(str(d)))
    bigram_mtp_checkpoint(d, vocab_size=vocab)
    plain = LiveServer(tmp_path, str(d), "--mem", "16", "--served-model-name", "dsv3")
    spec = LiveServer(tmp_path, str(d), "--mem", "16", "--served-model-name", "dsv3",
                      "--speculative-config", json.dumps(mtp(3)))
    try:
        a, b = client_for(plain.port), client_for(spec.port)
        for prompt in ("The sea and the sky", "Count: one, two,"):
            args = dict(model="dsv3", prompt=prompt, max_tokens=40, temperature=0,
                        extra_body={"ignore_eos": True})
            assert (b.completions.create(**args).choices[0].text
                    == a.completions.create(**args).choices[0].text)
            streamed = "".join(c.choices[0].text for c in b.completions.create(stream=True,
                                                                                 **args))
            assert streamed == a.completions.create(**args).choices[0].text
            args.update(temperature=0.8, seed=3)
            assert (b.completions.create(**args).choices[0].text
                    == a.completions.create(**args).choices[0].text)
        usage = b.completions.create(model="dsv3", prompt="abc", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).usage
        counts = usage.model_extra["speculative_decoding"]
        assert counts["num_draft_tokens"] > 0
        assert counts["num_accepted_tokens"] == counts["num_draft_tokens"]
        assert "the checkpoint's MTP head" in spec.log()
    finally:
        plain.close()
        spec.close()
