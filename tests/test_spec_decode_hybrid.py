"""Speculative decoding on the hybrid models (Qwen3-Next, Qwen3.5: gated DeltaNet layers with a
per-sequence recurrent and convolution state beside full attention), on tiny checkpoints written by
transformers (tests/checkpoints.py):

- the rollback of the linear layers' state (engine/core/hybrid_state.py, verify rows): n-gram and
  draft-model speculation with rejected drafts give the tokens of decoding without speculation
  (and transformers'), under forced preemption, and a conversation's next turn that starts from
  prefix-cache state snapshots taken while verifying gives them too;
- Qwen3-Next's and Qwen3.5's own MTP head (engine/models/qwen3_next_mtp.py, random mtp.* tensors
  in the checkpoints' format, tests/qwen3_next_mtp_heads.py): its drafts equal a float64
  reference (vLLM's qwen3_next_mtp.py as documented, the decoder layer transformers' own), the
  outputs are the target's whatever the head, a head made to compute the target accepts every
  draft, and its drafts depend only on the context after rejections, preemption and prefix
  caching (tests/spec_rollback.py).

Every engine here runs under HybridStress: before each step the full-attention K/V outside the
step's blocks, the verify rows and the free snapshot rows are NaN, so a state read from a row
this step did not write poisons the tokens."""
from __future__ import annotations

import random

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from engine import LLM, SamplingParams
from qwen3_next_mtp_heads import bigram_mtp_checkpoint, config, load, mtp_checkpoint, save

pytestmark = pytest.mark.timeout(600)

ARCHS = ("qwen3_next", "qwen3_5")
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(autouse=True)
def free_drafts(monkeypatch):
    """Drafts are made free (engine/spec/costs.py follows this machine's step times) so that
    acceptance alone decides how many are proposed."""
    from engine.spec.costs import StepCost
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)


class HybridStress:
    """Wraps the model runner of a hybrid model: before each step, the full-attention layers'
    blocks outside the step's block tables (and the previous step's, and the prefix cache's) and
    every linear layer's verify rows and free snapshot rows are filled with NaN."""

    def __init__(self, engine):
        runner, pool = engine.runner, engine.block_pool
        self.steps = 0
        self.previous = set()
        execute = runner.execute
        linear = [layer.is_linear for layer in runner.model.layers]
        first_verify = pool.num_slots + pool.num_snapshots

        def stressed(sched, *batch):
            tables = batch[0].block_tables
            bs = runner.block_size
            blocks = {int(b) for row, start, n in zip(tables, sched.num_computed,
                                                      sched.num_new_tokens)
                      for b in row[:-(-(start + n) // bs)]}
            live = blocks | self.previous | {b.block_id for b in
                                             list(pool.cached_blocks.values())}
            self.previous = blocks
            dead = np.array(sorted(set(range(runner.num_blocks)) - live), np.int64)
            free_rows = np.array(sorted(list(pool._free_snapshot_rows)), np.int64)
            for is_linear, (a, b) in zip(linear, runner.kv_caches):
                if is_linear:
                    for state in (a, b):
                        state[first_verify:] = np.nan
                        state[free_rows] = np.nan
                else:
                    a[dead] = np.nan
                    b[dead] = np.nan
            self.steps += 1
            return execute(sched, *batch)

        runner.execute = stressed


def stressed(model, **kw) -> LLM:
    llm = LLM(model, **kw)
    HybridStress(llm.engine)
    return llm


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {arch: tiny_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A dense Qwen3 of the same vocabulary: a random draft, almost every draft rejected."""
    return tiny_checkpoint(tmp_path_factory.mktemp("draft") / "qwen3", "qwen3", seed=7)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    loop = rng.integers(3, 500, 7).tolist()
    return [loop * 4, rng.integers(3, 500, 33).tolist(), rng.integers(3, 500, 17).tolist(),
            rng.integers(3, 500, 50).tolist()]


def methods(draft):
    return {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
            "draft_model": {"method": "draft_model", "model": draft,
                            "num_speculative_tokens": 3}}


def assert_rejections(llm):
    stats = llm.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_accepted_tokens, stats


# ---- the linear layers' state after rejected drafts

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_is_token_identical_with_rejected_drafts(targets, draft, prompts, arch, method):
    """Batched, with forced preemption (few KV blocks): the tokens of the engine without
    speculation, and for the first prompt transformers' own."""
    ref = LLM(targets[arch]).generate(prompts, GREEDY)
    llm = stressed(targets[arch], speculative_config=methods(draft)[method], block_size=8,
                   num_kv_blocks=24, max_num_seqs=4)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert_rejections(llm)
    assert llm.engine.scheduler.num_preemptions > 0
    if arch == "qwen3_next" and method == "ngram":
        from hf_oracle import assert_matches, load_hf
        from test_models_hybrid import hf_greedy_cached
        reference = hf_greedy_cached(load_hf(targets[arch]), prompts[0], 16)
        assert_matches(outs[0].token_ids[:16], reference, label=arch)


def test_verify_rows_through_the_chunked_form(monkeypatch, targets, draft, prompts):
    """A sequence with many verify rows (k + 1 >= CHUNKED_MIN_ROWS) takes the chunked delta
    rule, cut at every draft to save its state: lowered here so that 4 rows do."""
    import pyx.gated_delta_net as gdn
    monkeypatch.setattr(gdn, "CHUNKED_MIN_ROWS", 2)
    calls = []
    chunked = gdn.delta_rule_chunked
    monkeypatch.setattr(gdn, "delta_rule_chunked",
                        lambda q, *a, **kw: calls.append(len(q)) or chunked(q, *a, **kw))
    ref = LLM(targets["qwen3_next"]).generate(prompts, GREEDY)
    calls.clear()
    llm = stressed(targets["qwen3_next"], speculative_config=methods(draft)["draft_model"])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert_rejections(llm)
    assert calls.count(1) > 10        # the verify rows' pieces between saves


def test_snapshots_taken_while_verifying_hold_the_accepted_state(targets, draft, prompts):
    """Prefix-cache state snapshots at block boundaries that verify rows crossed: one past the
    accepted rows saw rejected drafts and is never registered, the next step takes it again. So
    every snapshot holds the state an engine without speculation snapshots for the same block
    hash, and a conversation's next turn that starts from them gives that engine's tokens."""
    target = targets["qwen3_next"]
    kw = dict(block_size=8, state_snapshots=64, max_num_seqs=4)
    plain = LLM(target, **kw)
    llm = stressed(target, speculative_config=methods(draft)["draft_model"], **kw)
    got, want = llm.generate(prompts, GREEDY), plain.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [w.token_ids for w in want]
    assert_rejections(llm)
    a, b = plain.engine, llm.engine
    shared = set(a.block_pool.snapshots) & set(b.block_pool.snapshots)
    assert len(shared) >= 4 * len(prompts) and len(shared) == len(b.block_pool.snapshots)
    for i, layer in enumerate(a.runner.model.layers):
        if layer.is_linear:
            for key in shared:
                for x, y in zip(a.runner.kv_caches[i], b.runner.kv_caches[i]):
                    np.testing.assert_allclose(y[b.block_pool.snapshots[key]],
                                               x[a.block_pool.snapshots[key]],
                                               rtol=1e-3, atol=1e-4)
    rng = np.random.default_rng(1)
    turn = [p + o.token_ids + rng.integers(3, 500, 5).tolist() for p, o in zip(prompts, got)]
    restores = b.block_pool.num_snapshot_restores
    assert ([o.token_ids for o in llm.generate(turn, GREEDY)]
            == [w.token_ids for w in plain.generate(turn, GREEDY)])
    assert b.block_pool.num_snapshot_restores >= restores + len(prompts)


def test_seeded_sampling_equals_the_non_speculative_engine(targets, draft, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=30,
                            ignore_eos=True, logprobs=2)
    ref = LLM(targets["qwen3_5"]).generate(prompts, params)
    llm = stressed(targets["qwen3_5"], speculative_config=methods(draft)["draft_model"])
    for o, r in zip(llm.generate(prompts, params), ref):
        assert o.token_ids == r.token_ids
        np.testing.assert_allclose([x.logprob for x in o.logprobs],
                                   [x.logprob for x in r.logprobs], atol=1e-4)
    assert_rejections(llm)


def test_verify_rows_are_sized_per_speculating_sequence(targets):
    from engine.core.hybrid_state import StatePoolSize
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2}
    engine = LLM(targets["qwen3_next"], speculative_config=spec, max_num_seqs=5).engine
    pool = engine.block_pool
    assert pool.num_verify_rows == 3 * 2
    assert pool.num_state_rows == 5 + pool.num_snapshots + 6
    conv, recurrent = engine.runner.kv_caches[0]
    assert conv.shape[0] == recurrent.shape[0] == pool.num_state_rows
    size = StatePoolSize(5, 5, 100, 6)
    assert size.total_bytes == 1600 and "6 speculative verify rows" in size.describe()


def test_refusals_name_the_problem(targets, tmp_path):
    hybrid_draft = {"method": "draft_model", "model": targets["qwen3_5"],
                    "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="a hybrid linear-attention draft \\(Qwen3_5"):
        LLM(targets["qwen3_next"], speculative_config=hybrid_draft)
    with pytest.raises(ValueError, match="no multi-token-prediction head \\(no mtp.\\* tensors"):
        LLM(targets["qwen3_next"], speculative_config=mtp())
    with pytest.raises(ValueError, match="EAGLE-3: the target's graph \\(Qwen3NextForCausalLM\\) "
                                         "cannot hand its hidden states"):
        LLM(targets["qwen3_next"], speculative_config={"method": "eagle3", "model": "/x",
                                                       "num_speculative_tokens": 2})


# ---- Qwen3-Next's MTP head

def mtp(k: int = 3, **kw) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {arch: mtp_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def bigrams(tmp_path_factory):
    root = tmp_path_factory.mktemp("bigrams")
    return {arch: bigram_mtp_checkpoint(root / arch, arch) for arch in ARCHS}


def rms1p(x, w, eps):
    """Qwen3-Next's RMSNorm: x normalised, times 1 + w."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


class ReferenceMtp:
    """The MTP head over rows 0..n-1 at positions 0..n-1 in float64: row p reads token t and
    hidden h; x = fc(concat(pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h))); the
    decoder layer is transformers' (a one-layer full-attention Qwen3-Next model holding
    mtp.layers.0's tensors, its final norm mtp.norm); logits = lm_head(its output)."""

    def __init__(self, directory):
        import torch
        from transformers import AutoConfig, AutoModel
        cfg = config(directory)
        w = {k: v.astype(np.float64) for k, v in load(directory).items()}
        self.eps = cfg["rms_norm_eps"]
        self.embed, self.head = w["model.embed_tokens.weight"], w["lm_head.weight"]
        self.norm_e = w["mtp.pre_fc_norm_embedding.weight"]
        self.norm_h = w["mtp.pre_fc_norm_hidden.weight"]
        self.fc = w["mtp.fc.weight"]
        sparse = "mtp.layers.0.mlp.gate.weight" in w
        block = AutoConfig.from_pretrained(directory)
        block.num_hidden_layers = 1
        block.layer_types = ["full_attention"]
        if sparse or block.model_type == "qwen3_next":
            block.mlp_only_layers = [] if sparse else [0]
        block._attn_implementation = "eager"
        block._experts_implementation = "eager"
        self.block = AutoModel.from_config(block).double().eval()
        state = {"layers.0." + k[len("mtp.layers.0."):]: torch.tensor(v) for k, v in w.items()
                 if k.startswith("mtp.layers.0.")}
        if sparse:
            x = "layers.0.mlp.experts."
            experts = range(cfg["num_experts"])
            state[x + "gate_up_proj"] = torch.stack([torch.cat(
                [state.pop(f"{x}{i}.gate_proj.weight"), state.pop(f"{x}{i}.up_proj.weight")])
                for i in experts])
            state[x + "down_proj"] = torch.stack([state.pop(f"{x}{i}.down_proj.weight")
                                                  for i in experts])
        state["norm.weight"] = torch.tensor(w["mtp.norm.weight"])
        state["embed_tokens.weight"] = torch.tensor(self.embed)
        missing, unexpected = self.block.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)

    def rows(self, tokens, hidden):
        """(logits (n, V), output (n, H)) of rows 0..n-1."""
        import torch
        e = self.embed[np.asarray(tokens)]
        x = np.concatenate([rms1p(e, self.norm_e, self.eps), rms1p(hidden, self.norm_h, self.eps)],
                           axis=1) @ self.fc.T
        with torch.no_grad():
            out = self.block(inputs_embeds=torch.tensor(x[None]),
                             position_ids=torch.arange(len(x))[None]).last_hidden_state[0]
        out = out.numpy()
        return out @ self.head.T, out


def final_hidden(directory, tokens):
    """transformers' final-norm output at every position, float64, and its logits."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        hidden = model.model(torch.tensor([tokens])).last_hidden_state[0]
        return hidden.numpy(), model.lm_head(hidden).numpy()


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_drafts_equal_the_float64_reference(heads, prompts, arch):
    """The features (the target's final-norm states, every row) and the head's logits in the
    drafting forwards of the first verify steps against the reference recomputed from the
    context: step 0 the head's row for the last computed position, steps 1 and 2 fed the
    previous step's draft and output."""
    target = heads[arch]
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
    context = prompt + out.token_ids
    hidden, target_logits = final_hidden(target, context)
    n = len(prompt)
    assert [int(t) for t in np.argmax(target_logits[n - 1:-1], axis=1)] == out.token_ids
    np.testing.assert_allclose(np.concatenate(features)[:n], hidden[:n], rtol=1e-4,
                               atol=1e-4 * np.abs(hidden).max())
    ref = ReferenceMtp(target)
    starts = [i for i, s in enumerate(steps) if s[0] == 0]
    assert len(starts) >= 3 and [s[0] for s in steps[:3]] == [0, 1, 2]
    for a, b in zip(starts[:3], starts[1:4]):
        p0 = steps[a][2]
        tokens, rows_hidden = list(context[1:p0 + 2]), hidden[:p0 + 1]
        assert steps[a][1] == context[p0 + 1]
        logits, output = ref.rows(tokens, rows_hidden)
        for i, (step, token, position, got) in enumerate(steps[a:b]):
            assert (step, position) == (i, p0 + i)
            if i:
                assert token == int(np.argmax(logits[-1]))
                tokens.append(token)
                rows_hidden = np.concatenate([rows_hidden, output[-1:]])
                logits, output = ref.rows(tokens, rows_hidden)
            np.testing.assert_allclose(got, logits[-1], rtol=1e-3, atol=2e-3)
            assert int(np.argmax(got)) == int(np.argmax(logits[-1]))


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_greedy_is_token_identical_with_a_random_head(heads, prompts, arch):
    ref = LLM(heads[arch]).generate(prompts, GREEDY)
    llm = stressed(heads[arch], speculative_config=mtp(3))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert_rejections(llm)
    assert llm.engine.speculator.stats.acceptance_rate < 0.3


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_head_that_computes_the_target_accepts_every_draft(bigrams, prompts, arch):
    ref = LLM(bigrams[arch]).generate(prompts, GREEDY)
    llm = stressed(bigrams[arch], speculative_config=mtp(4))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_accepted_length > 4.8
    assert llm.engine.runner.num_forward_calls <= 12      # the prefill, then ~8 steps of 5


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_p=0.9, seed=1),
                                dict(temperature=1.0, top_k=20, presence_penalty=0.3,
                                     logit_bias={5: 3.0}, seed=2, logprobs=2)])
def test_mtp_seeded_sampling_equals_the_non_speculative_engine(heads, bigrams, prompts, kw):
    """Greedy drafting (the default): a seeded request draws the tokens it draws without
    speculation, whatever the head proposes."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, **kw)
    for model in (heads["qwen3_next"], bigrams["qwen3_next"]):
        ref = LLM(model).generate(prompts, params)
        llm = stressed(model, speculative_config=mtp(3))
        for o, r in zip(llm.generate(prompts, params), ref):
            assert o.token_ids == r.token_ids
            if params.logprobs is not None:
                np.testing.assert_allclose([x.logprob for x in o.logprobs],
                                           [x.logprob for x in r.logprobs], atol=1e-4)
        assert llm.engine.speculator.stats.num_drafts > 0


def test_mtp_pools_follow_prefix_caching_and_preemption(bigrams, prompts):
    """The head's K/V and feature pool live in the target's blocks: NaN outside each step's
    blocks (as the target's cache is), a head reading a slot it never wrote would stop
    agreeing with the target."""
    target = bigrams["qwen3_next"]
    shared = [prompts[1][:19] + p for p in prompts] * 2
    ref = LLM(target).generate(shared, GREEDY)
    llm = LLM(target, speculative_config=mtp(4), block_size=8, num_kv_blocks=48,
              prefill_chunk_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    engine = llm.engine
    engine.block_pool.shuffle_free_blocks(random.Random(2))
    HybridStress(engine)
    proposer = engine.speculator.draft_model
    execute = engine.runner.execute
    bs = engine.runner.block_size
    full = [i for i, layer in enumerate(engine.runner.model.layers) if not layer.is_linear][0]

    def poison_the_head_too(sched, *batch):
        dead = [b for b in range(engine.runner.num_blocks)
                if np.isnan(engine.runner.kv_caches[full][0][b]).all()]
        for cache in proposer.kv_caches[0]:
            cache[dead] = np.nan
        for b in dead:
            proposer.features[b * bs:(b + 1) * bs] = np.nan
        return execute(sched, *batch)

    engine.runner.execute = poison_the_head_too
    outs = llm.generate(shared, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert engine.scheduler.num_preemptions > 0 and engine.block_pool.prefix_cache_hits > 0
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_mtp_drafts_depend_only_on_the_context(heads, prompts):
    from spec_rollback import assert_drafts_depend_only_on_the_context
    assert_drafts_depend_only_on_the_context(
        heads["qwen3_next"], mtp(3, disable_by_batch_size=None), mtp(1), prompts,
        stress=HybridStress, tolerance=1e-3)


def test_mtp_loading_budget_and_refusals(heads, tmp_path):
    import shutil
    target = heads["qwen3_next"]
    alone = LLM(target, kv_cache_memory_mb=4).engine
    both = LLM(target, kv_cache_memory_mb=4, speculative_config=mtp()).engine
    proposer = both.speculator.draft_model
    assert both.block_pool.num_blocks < alone.block_pool.num_blocks
    k, v = proposer.kv_caches[0]
    assert k.shape == v.shape == (both.block_pool.num_blocks, 16, 2, 32) and k is not v
    assert proposer.features.shape == (both.block_pool.num_blocks * 16, 96)
    # the MTP tensors are the head's, and dropped when nothing drafts with them
    assert not both.model.mtp_weights and not alone.model.mtp_weights

    def refused(match, edit):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(target, d)
        w = load(d)
        edit(w)
        save(d, w)
        with pytest.raises(ValueError, match=match):
            LLM(str(d), speculative_config=mtp())

    refused("tensor mtp.fc.weight has shape \\[96, 96\\], expected \\[96, 192\\]",
            lambda w: w.update({"mtp.fc.weight": np.zeros((96, 96), np.float32)}))
    refused("missing tensor mtp.pre_fc_norm_hidden.weight",
            lambda w: w.pop("mtp.pre_fc_norm_hidden.weight"))
    refused("missing tensor mtp.layers.0.self_attn.q_norm.weight",
            lambda w: w.pop("mtp.layers.0.self_attn.q_norm.weight"))


def test_an_mtp_server_equals_the_server_without_speculation(tmp_path):
    """A Qwen3-Next checkpoint with a byte-level tokenizer and a bigram MTP head served by
    `python -m server`, with and without --speculative-config: greedy completions (streamed or
    not) and a seeded sampled one have the same text; the usage counts accepted drafts."""
    import json

    from transformers import AutoTokenizer

    from server_fakes import LiveServer, client_for
    from tiny_tokenizers import build_byte_level
    d = tmp_path / "qwen3next"
    build_byte_level(d)
    vocab = len(AutoTokenizer.from_pretrained(str(d)))
    bigram_mtp_checkpoint(d, vocab_size=vocab)
    plain = LiveServer(tmp_path, str(d), "--mem", "16", "--served-model-name", "qn")
    spec = LiveServer(tmp_path, str(d), "--mem", "16", "--served-model-name", "qn",
                      "--speculative-config", json.dumps(mtp(3)))
    try:
        a, b = client_for(plain.port), client_for(spec.port)
        for prompt in ("The sea and the sky", "Count: one, two,"):
            args = dict(model="qn", prompt=prompt, max_tokens=40, temperature=0,
                        extra_body={"ignore_eos": True})
            want = a.completions.create(**args).choices[0].text
            assert b.completions.create(**args).choices[0].text == want
            streamed = "".join(c.choices[0].text for c in b.completions.create(stream=True,
                                                                                 **args))
            assert streamed == want
            args.update(temperature=0.8, seed=3)
            assert (b.completions.create(**args).choices[0].text
                    == a.completions.create(**args).choices[0].text)
        usage = b.completions.create(model="qn", prompt="abc", max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True}).usage
        counts = usage.model_extra["speculative_decoding"]
        assert counts["num_draft_tokens"] > 0
        assert counts["num_accepted_tokens"] == counts["num_draft_tokens"]
        assert "the checkpoint's MTP head (mtp.layers.0, MoE)" in spec.log()
    finally:
        plain.close()
        spec.close()
