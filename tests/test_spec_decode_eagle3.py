"""Speculative decoding with an EAGLE-3 head (method eagle3) on tiny random checkpoints: the head
loads in EAGLE's and vLLM speculators' formats (one layer, or two); its drafts equal a float64
reference of the EAGLE-3 computation written here (fc over the target's aux hidden states from transformers, the
2H attention input, RoPE, the draft lm_head and d2t, then steps fed the head's own hidden state);
greedy and seeded outputs are the target's with any head; a head made to predict the target's
next token accepts every draft, a random one few; drafts depend only on the context whatever
rejections, preemption and prefix caching did to the pools; sampled output keeps the target's
distribution (chi-square); malformed heads fail with errors naming the problem."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from eagle3_heads import HEAD, draft_vocab, random_weights, write_head
from engine import LLM, SamplingParams
from test_engine import StressRunner
from test_spec_decode_sampling import chi_square_ok, exact_joint
from spec_rollback import assert_drafts_depend_only_on_the_context

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def free_drafts(monkeypatch):
    """The cost model (engine/spec/costs.py) follows this machine's step times; drafts are made
    free so that acceptance alone decides how many are proposed."""
    from engine.spec.costs import StepCost
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
LAYERS = 8          # the target's: vLLM's default aux layers 2, 4, 5 are distinct


def eagle(head: str, k: int = 3, **kw) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A random head in EAGLE's format: the target's embedding (none of its own), a draft
    vocabulary of 384 of the 512 ids, the default aux layers."""
    return write_head(tmp_path_factory.mktemp("head"), random_weights(HEAD),
                      draft_vocab(512, 384, seed=1))


@pytest.fixture(scope="module")
def head_speculators(tmp_path_factory):
    """A random head in speculators' format: its own embedding, named aux layers out of order,
    norm_before_residual, hidden 64 (target_hidden_size 96)."""
    cfg = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=1, head_dim=16)
    rng = np.random.default_rng(3)
    return write_head(tmp_path_factory.mktemp("spec_head"),
                      random_weights({**HEAD, **cfg}, target_hidden=96, draft_size=300, seed=2),
                      draft_vocab(512, 300, seed=2), layout="speculators",
                      embed=rng.standard_normal((512, 64)) * 0.15,
                      eagle_aux_hidden_state_layer_ids=[6, 1, 3], target_hidden_size=96,
                      norm_before_residual=True, **cfg)


@pytest.fixture(scope="module")
def head_two_layers(tmp_path_factory):
    """A random two-layer head in speculators' format (vLLM's multi-layer EAGLE-3: the second
    an ordinary Llama layer over the first's output)."""
    return write_head(tmp_path_factory.mktemp("head2"), random_weights(HEAD, seed=6, layers=2),
                      draft_vocab(512, 384, seed=4), layout="speculators", num_hidden_layers=2)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 500, n).tolist() for n in (6, 33, 17, 50)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return LLM(target).generate(prompts, GREEDY)


# ---- the float64 reference of the EAGLE-3 computation

def load_tensors(directory) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file
    return {k: v.astype(np.float64) if v.dtype.kind == "f" else v
            for k, v in load_file(str(Path(directory) / "model.safetensors")).items()}


def head_config(directory) -> dict:
    import json
    cfg = json.loads((Path(directory) / "config.json").read_text())
    if "transformer_layer_config" in cfg:
        return {**cfg["transformer_layer_config"], **{k: v for k, v in cfg.items()
                                                      if k != "transformer_layer_config"}}
    return cfg


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos: int, theta: float):
    """HF's rotate_half RoPE of x (heads, D) at position pos."""
    D = x.shape[-1]
    angle = pos * theta ** -(np.arange(0, D, 2) / D)
    cos, sin = np.cos(angle), np.sin(angle)
    a, b = x[..., :D // 2], x[..., D // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class ReferenceHead:
    """EAGLE-3's head one row at a time, its K/V in lists: vLLM's llama_eagle3.py and EAGLE's
    cnets.py as documented, written again in float64."""

    def __init__(self, directory, target_embed):
        cfg = head_config(directory)
        w = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v
             for k, v in load_tensors(directory).items()}
        self.w, self.cfg = w, cfg
        self.eps, self.theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.D = cfg["head_dim"]
        self.embed = w.get("embed_tokens.weight", target_embed)
        draft = len(w["lm_head.weight"])
        self.ids = np.arange(draft) + (w["d2t"] if "d2t" in w else 0)
        self.before = bool(cfg.get("norm_before_residual", False))
        self.layers = cfg.get("num_hidden_layers", 1)
        self.keys = [[] for _ in range(self.layers)]
        self.values = [[] for _ in range(self.layers)]

    def fuse(self, aux):
        return aux @ self.w["fc.weight"].T

    def attend(self, layer: int, x, pos: int):
        """Layer `layer`'s attention output for input x at pos, its K/V appended."""
        w, p = self.w, f"layers.{layer}."
        q = (w[p + "self_attn.q_proj.weight"] @ x).reshape(self.heads, self.D)
        k = (w[p + "self_attn.k_proj.weight"] @ x).reshape(self.kv_heads, self.D)
        v = (w[p + "self_attn.v_proj.weight"] @ x).reshape(self.kv_heads, self.D)
        self.keys[layer].append(rope(k, pos, self.theta))
        self.values[layer].append(v)
        q = rope(q, pos, self.theta)
        K, V = np.stack(self.keys[layer]), np.stack(self.values[layer])   # (n, kv_heads, D)
        group = self.heads // self.kv_heads
        out = np.empty((self.heads, self.D))
        for h in range(self.heads):
            s = K[:, h // group] @ q[h] / np.sqrt(self.D)
            a = np.exp(s - s.max())
            out[h] = (a / a.sum()) @ V[:, h // group]
        return w[p + "self_attn.o_proj.weight"] @ out.ravel()

    def mlp(self, layer: int, x):
        w, p = self.w, f"layers.{layer}."
        m = rms(x, w[p + "post_attention_layernorm.weight"], self.eps)
        gate, up = w[p + "mlp.gate_proj.weight"] @ m, w[p + "mlp.up_proj.weight"] @ m
        return w[p + "mlp.down_proj.weight"] @ (gate / (1 + np.exp(-gate)) * up)

    def row(self, token: int, hidden, pos: int):
        """(logits over the target vocabulary (512,), prenorm hidden) of one row."""
        w, eps, p = self.w, self.eps, "layers.0."
        e = rms(self.embed[token], w[p + "input_layernorm.weight"], eps)
        hn = rms(hidden, w[p + "hidden_norm.weight"], eps)
        residual = hn if self.before else hidden
        residual = residual + self.attend(0, np.concatenate([e, hn]), pos)
        residual = residual + self.mlp(0, residual)
        for layer in range(1, self.layers):       # ordinary pre-norm Llama layers
            x = rms(residual, w[f"layers.{layer}.input_layernorm.weight"], eps)
            residual = residual + self.attend(layer, x, pos)
            residual = residual + self.mlp(layer, residual)
        draft = w["lm_head.weight"] @ rms(residual, w["norm.weight"], eps)
        logits = np.full(512, -np.inf)
        logits[self.ids] = draft
        return logits, residual


def aux_states(target_dir, tokens, layers):
    """transformers' residual stream entering each of `layers` (hidden_states[j]: the input of
    layer j), side by side, float64."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return (np.concatenate([out.hidden_states[j][0].numpy() for j in layers], axis=1),
            out.logits[0].numpy(), model.model.embed_tokens.weight.detach().numpy())


@pytest.mark.parametrize("which", ["eagle", "speculators", "two_layers"])
def test_drafts_equal_the_float64_reference(target, head, head_speculators, head_two_layers,
                                            prompts, which):
    """The engine's target features (its AuxCapture through fc) and the head's logits in every
    drafting forward of the first verify steps, against the reference recomputed from the
    context: the head's rows before a step's first draft came from prefill chunks and verify
    steps (mirrored, rejected drafts' rows rewritten), draft step 0 reads the last computed
    position's features, later steps the head's own prenorm output."""
    directory = {"eagle": head, "speculators": head_speculators,
                 "two_layers": head_two_layers}[which]
    layers = (1, 3, 6) if which == "speculators" else (2, 4, 5)
    prompt = prompts[1]                                   # 33 tokens: chunks of 8, blocks of 8
    llm = LLM(target, speculative_config=eagle(directory), block_size=8, prefill_chunk_size=8,
              max_num_batched_tokens=8)
    proposer = llm.engine.speculator.draft_model
    assert proposer.model.aux_layers == layers
    fused, steps = [], []
    fuse, step_logits = proposer.model.fuse, proposer._step_logits

    def spy_fuse(states):
        out = fuse(states)
        fused.append(np.array(out, np.float64))
        return out

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
    aux, target_logits, embed = aux_states(target, context, layers)
    n = len(prompt)
    assert [int(t) for t in np.argmax(target_logits[n - 1:-1], axis=1)] == out.token_ids
    features = ReferenceHead(directory, embed).fuse(aux)
    np.testing.assert_allclose(np.concatenate(fused)[:n], features[:n], rtol=1e-4,
                               atol=1e-4 * np.abs(features).max())
    starts = [i for i, s in enumerate(steps) if s[0] == 0]
    assert len(starts) >= 3
    for a, b in zip(starts[:3], starts[1:4]):
        ref = ReferenceHead(directory, embed)
        p0 = steps[a][2]                  # draft step 0: the head's row for p0
        for p in range(p0):               # row p reads token p + 1 and the features of p
            ref.row(context[p + 1], features[p], p)
        assert steps[a][1] == context[p0 + 1]
        logits, hidden = ref.row(context[p0 + 1], features[p0], p0)
        for i, (step, token, position, got) in enumerate(steps[a:b]):
            assert (step, position) == (i, p0 + i)
            if i:
                assert token == int(np.argmax(logits))     # the previous step's draft
                logits, hidden = ref.row(token, hidden, p0 + i)
            finite = np.isfinite(logits)
            assert (np.isfinite(got) == finite).all()       # only the draft vocabulary's ids
            np.testing.assert_allclose(got[finite], logits[finite], rtol=1e-3, atol=2e-3)
            assert int(np.argmax(got)) == int(np.argmax(logits))


# ---- outputs: the target's, whatever the head

def test_greedy_is_token_identical_with_a_random_head(target, head, head_speculators, prompts,
                                                      reference):
    for directory in (head, head_speculators):
        llm = LLM(target, speculative_config=eagle(directory))
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        stats = llm.engine.speculator.stats
        assert stats.num_drafts > 0
        # a random head rarely agrees: it soon stops drafting (engine/spec/adaptive.py)
        assert stats.acceptance_rate < 0.3, stats


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_p=0.9, seed=1),
                                dict(temperature=1.0, top_k=20, repetition_penalty=0.5,
                                     presence_penalty=0.3, logit_bias={5: 3.0}, seed=2,
                                     logprobs=2),
                                dict(temperature=0, frequency_penalty=-0.4, min_tokens=30,
                                     max_tokens=36, seed=3)])
def test_seeded_sampling_equals_the_non_speculative_engine(target, head, copy_head, prompts, kw):
    """Greedy drafting (the default): the head's drafts are point masses, so a seeded request
    draws the tokens it draws without speculation, whatever the head proposes."""
    params = SamplingParams(**{"max_tokens": 40, "ignore_eos": "min_tokens" not in kw, **kw})
    bigram_target, bigram_head = copy_head
    for model, directory in ((target, head), (bigram_target, bigram_head)):
        ref = LLM(model).generate(prompts, params)
        llm = LLM(model, speculative_config=eagle(directory))
        for o, r in zip(llm.generate(prompts, params), ref):
            assert o.token_ids == r.token_ids
            if params.logprobs is not None:
                np.testing.assert_allclose([x.logprob for x in o.logprobs],
                                           [x.logprob for x in r.logprobs], atol=1e-4)
        assert llm.engine.speculator.stats.num_drafts > 0


# ---- a head that predicts the target's next token

@pytest.fixture(scope="module")
def copy_head(tmp_path_factory):
    """(target, head): a target whose next token depends on the last token only (every
    attention's o_proj and the MLPs after the first zeroed: a bigram model), embedding rows of
    one RMS; and a head that computes that bigram for the token it reads. Its attention copies
    the row's own normalized embedding (one head of the full width, q = 16 x k: a row scores
    itself highest by Cauchy-Schwarz, every row having one norm), o_proj scales it back to the
    embedding, then the target's first MLP, final norm and lm_head. hidden_norm is zero with
    norm_before_residual: the head ignores the features, and every draft is the target's next
    token. The draft vocabulary holds every bigram successor and some other ids."""
    from safetensors.numpy import load_file, save_file
    d = Path(tiny_checkpoint(tmp_path_factory.mktemp("bigram"), "llama",
                             num_hidden_layers=LAYERS, seed=4))
    w = load_file(str(d / "model.safetensors"))
    r, eps = 0.15, 1e-5
    e = w["model.embed_tokens.weight"].astype(np.float64)
    e *= r / np.sqrt((e * e).mean(1, keepdims=True))
    w["model.embed_tokens.weight"] = e.astype(np.float32)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "self_attn.o_proj.weight"][:] = 0
        if i:
            w[p + "mlp.down_proj.weight"][:] = 0
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    p = "model.layers.0."
    w64 = {k: v.astype(np.float64) for k, v in w.items()}
    x = rms(e, w64[p + "post_attention_layernorm.weight"], eps)
    gate, up = x @ w64[p + "mlp.gate_proj.weight"].T, x @ w64[p + "mlp.up_proj.weight"].T
    h = e + (gate / (1 + np.exp(-gate)) * up) @ w64[p + "mlp.down_proj.weight"].T
    successors = np.argmax(rms(h, w64["model.norm.weight"], eps) @ e.T, axis=1)
    ids = draft_vocab(512, 400, seed=3, must=successors)
    H = 96
    eye, zero = np.eye(H, dtype=np.float32), np.zeros((H, H), np.float32)
    weights = {
        "fc.weight": np.zeros((H, 3 * H), np.float32),
        "midlayer.hidden_norm.weight": np.zeros(H, np.float32),
        "midlayer.input_layernorm.weight": np.ones(H, np.float32),
        "midlayer.self_attn.q_proj.weight": np.concatenate([16 * eye, zero], axis=1),
        "midlayer.self_attn.k_proj.weight": np.concatenate([eye, zero], axis=1),
        "midlayer.self_attn.v_proj.weight": np.concatenate([eye, zero], axis=1),
        "midlayer.self_attn.o_proj.weight": np.sqrt(r * r + eps).astype(np.float32) * eye,
        "midlayer.post_attention_layernorm.weight": w[p + "post_attention_layernorm.weight"],
        "midlayer.mlp.gate_proj.weight": w[p + "mlp.gate_proj.weight"],
        "midlayer.mlp.up_proj.weight": w[p + "mlp.up_proj.weight"],
        "midlayer.mlp.down_proj.weight": w[p + "mlp.down_proj.weight"],
        "norm.weight": w["model.norm.weight"],
        "lm_head.weight": w["model.embed_tokens.weight"][ids]}      # tied: the embedding
    head_dir = write_head(tmp_path_factory.mktemp("copy"), weights, ids, num_attention_heads=1,
                          num_key_value_heads=1, head_dim=H, intermediate_size=192,
                          rms_norm_eps=eps, norm_before_residual=True)
    return str(d), head_dir


def test_a_head_that_predicts_the_target_accepts_every_draft(copy_head, prompts):
    bigram_target, bigram_head = copy_head
    ref = LLM(bigram_target).generate(prompts, GREEDY)
    llm = LLM(bigram_target, speculative_config=eagle(bigram_head, k=4))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_accepted_length > 4.8
    assert llm.engine.runner.num_forward_calls <= 12      # the prefill, then ~8 steps of 5


def test_the_pools_follow_prefix_caching_and_preemption(copy_head, prompts):
    """The head's K/V and feature pools live in the target's blocks: a prefix-cache hit or a
    recomputed (preempted) sequence finds them there. Both pools are NaN outside each step's
    blocks (as the target's KV is): a read of a slot the head never wrote poisons its drafts,
    and the head would stop agreeing."""
    bigram_target, bigram_head = copy_head
    shared = [prompts[1][:19] + p for p in prompts] * 2
    ref = LLM(bigram_target).generate(shared, GREEDY)
    llm = LLM(bigram_target, speculative_config=eagle(bigram_head, k=4), block_size=8,
              num_kv_blocks=48, prefill_chunk_size=16, max_num_batched_tokens=64,
              max_num_seqs=8)
    engine = llm.engine
    engine.block_pool.shuffle_free_blocks(random.Random(2))
    stress = StressRunner(engine.runner, engine.block_pool)
    proposer = engine.speculator.draft_model
    execute = engine.runner.execute
    bs = engine.runner.block_size

    def poison_the_head_too(sched, *batch):
        dead = [b for b in range(engine.runner.num_blocks)
                if np.isnan(engine.runner.kv_caches[0][0][b]).all()]
        for k, v in proposer.kv_caches:
            k[dead] = np.nan
            v[dead] = np.nan
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


def test_drafts_depend_only_on_the_context(target, head, prompts):
    """Rollback: after verify steps with rejections, preemption and prefix-cache hits (prompts
    sharing 19 tokens: they part inside a block, where the head's rows do not depend on the
    next block), the head's first draft logits for a context equal those of a fresh engine that
    prefills that context: every row the head reads was rewritten after its rejected draft."""
    assert_drafts_depend_only_on_the_context(
        target, eagle(head, disable_by_batch_size=None), eagle(head, k=1), prompts)


# ---- sampling: the target's distribution

def test_probabilistic_drafts_keep_the_target_distribution(tmp_path_factory):
    """Drafts drawn from the head's distribution over its 6-id draft vocabulary (zero on the
    target's other 2 ids), verified by rejection sampling against it: the emitted tokens follow
    the target's distribution exactly (chi-square against transformers)."""
    v8 = tiny_checkpoint(tmp_path_factory.mktemp("v8"), "llama", vocab_size=8, seed=3,
                         num_hidden_layers=4)
    head_dir = write_head(tmp_path_factory.mktemp("v8h"),
                          random_weights(HEAD, draft_size=6, seed=5),
                          np.array([0, 1, 3, 4, 6, 7]), target_vocab=8, vocab_size=8,
                          eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    prompt = [3, 4, 5, 6, 7, 3, 4]
    n, T = 4000, 0.9
    llm = LLM(v8, max_num_seqs=256, speculative_config=eagle(
        head_dir, 2, draft_sampling="probabilistic", disable_by_batch_size=None))
    params = [SamplingParams(temperature=T, max_tokens=3, seed=s, ignore_eos=True)
              for s in range(n)]
    outs = llm.generate([prompt] * n, params)
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 2000 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    joint = exact_joint(v8, prompt, T)
    counts = np.zeros((8, 8, 8))
    for out in outs:
        counts[tuple(out.token_ids)] += 1
    for name, observed, expected in [("t1 t2", counts.sum(2), joint.sum(2)),
                                     ("t2 t3", counts.sum(0), joint.sum(0))]:
        ok, stat, crit = chi_square_ok(observed.ravel(), expected.ravel())
        assert ok, (name, stat, crit)


# ---- structured outputs: a draft vocabulary without the grammar's tokens

@pytest.fixture(scope="module")
def demo_head(tmp_path_factory):
    """(the demo checkpoint, a random head for it whose draft vocabulary lacks every token with
    a JSON delimiter: where a grammar wants one, no draft id is allowed)."""
    from server.demo_model import write_demo_checkpoint
    demo = write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))
    tok = LLM(demo).engine.tokenizer
    vocab = tok.hf.get_vocab()
    ids = np.array(sorted(i for t, i in vocab.items() if not set('{}":,[]') & set(t)))
    cfg = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
               num_key_value_heads=1, head_dim=64, vocab_size=len(vocab),
               max_position_embeddings=4096)
    rng = np.random.default_rng(0)
    head_dir = write_head(tmp_path_factory.mktemp("demo_head"),
                          random_weights({**HEAD, **cfg}, target_hidden=256, draft_size=len(ids)),
                          ids, target_vocab=len(vocab),
                          embed=rng.standard_normal((len(vocab), 128)) * 0.1,
                          target_hidden_size=256, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
                          **cfg)
    return demo, head_dir


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_structured_outputs_where_the_grammar_allows_no_draft_id(demo_head, draft_sampling):
    """Rows whose grammar mask leaves no id of the draft vocabulary: a greedy draft there is
    refused by the grammar (and rejected), a drawn one is a point mass in the draft
    distribution the verifier reads (rejected, then a draw from the target's own masked
    distribution): outputs stay valid JSON, and with greedy drafting the non-speculative
    engine's tokens for the same seed."""
    import json
    from engine.sampling.structured_outputs import StructuredOutputsParams, json_spec
    demo, head_dir = demo_head
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    plain = LLM(demo)
    spec = LLM(demo, speculative_config=eagle(head_dir, draft_sampling=draft_sampling))
    for seed in range(3):
        params = SamplingParams(temperature=0.0 if seed == 0 else 0.9, seed=seed, max_tokens=50,
                                structured_outputs=StructuredOutputsParams(
                                    "json", json_spec(schema)))
        out = spec.generate("Facts about the sea:", params)[0]
        assert out.finish_reason == "stop", (out.finish_reason, out.error)
        assert set(json.loads(out.text)) == {"name", "n"}
        if draft_sampling == "greedy" or seed == 0:
            assert out.token_ids == plain.generate("Facts about the sea:", params)[0].token_ids
    assert spec.engine.speculator.stats.num_drafts > 0


# ---- loading, budget, errors

def test_the_kv_budget_pays_for_the_heads_pools(target, head):
    from engine.runner.model_runner import ModelRunner
    alone = LLM(target, kv_cache_memory_mb=4).engine
    both = LLM(target, kv_cache_memory_mb=4, speculative_config=eagle(head)).engine
    per_block = ModelRunner.kv_bytes_per_block(alone.model_config, 16)
    # the head: one layer's K/V (2 KV heads of 24) and a 96-wide feature row per token, f32
    head_bytes = 16 * (2 * 2 * 24 * 4 + 96 * 4)
    assert alone.block_pool.num_blocks == 4 * 2**20 // per_block
    assert both.block_pool.num_blocks == 4 * 2**20 // (per_block + head_bytes)
    proposer = both.speculator.draft_model
    assert proposer.features.shape == (both.block_pool.num_blocks * 16, 96)


def test_malformed_heads_are_refused_with_the_problem_named(target, tmp_path):
    ids = draft_vocab(512, 384, seed=1)

    def refused(match, weights=None, ids=ids, tgt=target, **config):
        d = write_head(tmp_path / f"h{len(list(tmp_path.iterdir()))}",
                       weights or random_weights(HEAD), ids, **config)
        with pytest.raises(ValueError, match=match):
            LLM(tgt, speculative_config=eagle(d))

    refused("draft_vocab_size 384 differs from the target's vocabulary \\(512 ids\\) and the "
            "checkpoint has no d2t", ids=None)
    refused("its target_hidden_size is 128, the target's hidden_size is 96",
            random_weights(HEAD, target_hidden=128), target_hidden_size=128)
    refused("tensor fc.weight has shape \\[96, 192\\], expected \\[96, 288\\]",
            random_weights(HEAD, num_aux=2))
    refused("layer 8 is not one of the target's 8 layers",
            eagle_aux_hidden_state_layer_ids=[2, 4, 8])
    short = tiny_checkpoint(tmp_path / "six", "llama", num_hidden_layers=6)
    refused("the default aux layers \\[2, 3, 3\\] .* name a layer twice", tgt=short)
    no_head = random_weights(HEAD)
    del no_head["lm_head.weight"]
    refused("missing tensor lm_head.weight", no_head)
    bad = ids.copy()
    bad[-1] = 600
    refused("d2t maps draft id 383 to 600, outside the target's vocabulary of 512 ids", ids=bad)
    refused("not an EAGLE-3 head: architectures \\['LlamaForCausalLM'\\]",
            architectures=["LlamaForCausalLM"])
    pickled = Path(write_head(tmp_path / "bin", random_weights(HEAD), ids))
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pytorch_model.bin, a torch pickle; Taper reads "
                                         "safetensors. Convert it once"):
        LLM(target, speculative_config=eagle(pickled))


def test_the_server_flag_takes_method_eagle3():
    from server.__main__ import build_parser, engine_config
    config = engine_config(build_parser().parse_args([
        "--w", "/m", "--cpu", "--speculative-config",
        '{"method": "eagle3", "model": "/h", "num_speculative_tokens": 3}']))
    assert dataclasses.astuple(config.speculative_config)[:2] == ("eagle3", 3)
    assert config.speculative_config.model == "/h"
