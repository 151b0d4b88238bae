"""Speculative decoding with a draft model of the target's tokenizer (method draft_model), through
the engine on tiny random checkpoints: the target as its own draft accepts every draft (its KV
pool mirrored through prefix-cache hits and preemption), a draft that always disagrees still gives
the target's tokens (and stops being asked), any draft keeps greedy and seeded outputs, drafts
drawn from the draft's distribution keep the target distribution (chi-square against
transformers), vocabularies padded on either side, structured outputs, the KV budget shared by
both pools, and the draft's errors."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from checkpoints import edit_config, tiny_checkpoint
from engine import LLM, SamplingParams
from engine.sampling.structured_outputs import StructuredOutputsParams, json_spec
from test_engine import StressRunner
from test_spec_decode_sampling import chi_square_ok, exact_joint

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def free_drafts(request, monkeypatch):
    """The cost model (engine/spec/costs.py) follows this machine's step times; tests that
    count drafts make them free, so that acceptance alone decides how many are proposed."""
    if request.node.originalname not in ():
        from engine.spec.costs import StepCost
        monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def draft_config(model: str, k: int = 4, **kw) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama")


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another random model of the same vocabulary: its drafts are mostly wrong."""
    return tiny_checkpoint(tmp_path_factory.mktemp("other"), "llama", seed=1)


@pytest.fixture(scope="module")
def contrary(target, tmp_path_factory):
    """The target with its output embedding rolled by one id: its argmax is always the target's
    argmax + 1 (mod V), so every greedy draft is wrong."""
    from safetensors.numpy import load_file, save_file
    d = Path(tmp_path_factory.mktemp("contrary"))
    for f in Path(target).iterdir():
        shutil.copy(f, d / f.name)
    w = load_file(str(d / "model.safetensors"))
    w["lm_head.weight"] = np.roll(w["model.embed_tokens.weight"], 1, axis=0)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    edit_config(d, lambda c: {**c, "tie_word_embeddings": False})
    return str(d)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 500, n).tolist() for n in (6, 33, 17, 50)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return LLM(target, batch_invariant=True).generate(prompts, GREEDY)


def test_the_target_as_its_own_draft_accepts_every_draft(target, prompts, reference):
    llm = LLM(target, batch_invariant=True, speculative_config=draft_config(target))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.mean_accepted_length > 4.8      # 5, but where max_tokens leaves fewer drafts
    # 40 tokens: the prefill's, then ~8 verify steps of 5
    assert llm.engine.runner.num_forward_calls <= 12


def test_the_draft_pool_mirrors_through_prefix_caching_and_preemption(target, prompts):
    """The draft's KV lives in the target's blocks: a prefix-cache hit or a recomputed
    (preempted) sequence finds the draft's K/V there too, or the self-draft would stop agreeing.
    Blocks outside each step's tables are NaN in both pools."""
    shared = [prompts[1][:16] + p for p in prompts] * 2
    ref = LLM(target, batch_invariant=True).generate(shared, GREEDY)
    llm = LLM(target, batch_invariant=True, speculative_config=draft_config(target),
              block_size=8, num_kv_blocks=48, prefill_chunk_size=16, max_num_batched_tokens=64,
              max_num_seqs=8)
    engine = llm.engine
    engine.block_pool.shuffle_free_blocks(random.Random(2))
    stress = StressRunner(engine.runner, engine.block_pool)
    draft = engine.speculator.draft_model
    execute = engine.runner.execute

    def poison_the_draft_too(sched, *batch):
        # the target's KV of the blocks outside the step is NaN now: the draft's too
        dead = [b for b in range(engine.runner.num_blocks)
                if np.isnan(engine.runner.kv_caches[0][0][b]).all()]
        for k, v in draft.kv_caches:
            k[dead] = np.nan
            v[dead] = np.nan
        return execute(sched, *batch)

    engine.runner.execute = poison_the_draft_too
    outs = llm.generate(shared, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert engine.scheduler.num_preemptions > 0 and engine.block_pool.prefix_cache_hits > 0
    stats = engine.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert stress.steps and engine.block_pool.num_free_blocks == 48


def test_a_draft_that_always_disagrees_gives_the_targets_tokens(target, contrary, prompts,
                                                                reference):
    llm = LLM(target, batch_invariant=True, speculative_config=draft_config(contrary))
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.speculator.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == 0
    # acceptance 0: after a few steps each sequence stops drafting, probing one draft now and
    # then (engine/spec/adaptive.py), instead of 4 drafts for each of its 39 decode steps
    assert stats.num_draft_tokens < 4 * 4 * 8, stats


@pytest.mark.parametrize("kw", [dict(temperature=0.8, top_p=0.9, seed=1),
                                dict(temperature=1.0, top_k=20, repetition_penalty=0.5,
                                     presence_penalty=0.3, logit_bias={5: 3.0}, seed=2,
                                     logprobs=2),
                                dict(temperature=0, frequency_penalty=-0.4, min_tokens=30,
                                     max_tokens=36, seed=3)])
def test_any_draft_keeps_greedy_and_seeded_outputs(target, other, prompts, kw):
    """Greedy drafting (the default): drafts are point masses, so the tokens are the
    non-speculative engine's for the same seed, whatever the draft proposes."""
    params = SamplingParams(**{"max_tokens": 40, "ignore_eos": "min_tokens" not in kw, **kw})
    ref = LLM(target).generate(prompts, params)
    for draft in (target, other):
        llm = LLM(target, speculative_config=draft_config(draft, 3))
        outs = llm.generate(prompts, params)
        for o, r in zip(outs, ref):
            assert o.token_ids == r.token_ids
            if params.logprobs is not None:
                np.testing.assert_allclose([x.logprob for x in o.logprobs],
                                           [x.logprob for x in r.logprobs], atol=1e-4)
        assert llm.engine.speculator.stats.num_drafts > 0


def test_probabilistic_drafts_keep_the_target_distribution(tmp_path_factory):
    """Drafts drawn from the draft's own distribution, verified by rejection sampling against
    it: the tokens are other than without speculation for the same seed, distributed the same."""
    v8 = tiny_checkpoint(tmp_path_factory.mktemp("v8"), "llama", vocab_size=8, seed=3)
    draft = tiny_checkpoint(tmp_path_factory.mktemp("v8d"), "llama", vocab_size=8, seed=4,
                            scale=4.0)
    prompt = [3, 4, 5, 6, 7, 3, 4]
    n, T = 4000, 0.9
    llm = LLM(v8, max_num_seqs=256, speculative_config=draft_config(
        draft, 2, draft_sampling="probabilistic", disable_by_batch_size=None))
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
    # not the non-speculative tokens: its own streams
    plain = LLM(v8).generate([prompt] * 50, params[:50])
    assert sum(o.token_ids != p.token_ids for o, p in zip(outs, plain)) > 5
    # the draft distribution is better than point masses here: more drafts accepted than with
    # greedy drafting on the same requests
    greedy = LLM(v8, max_num_seqs=256, speculative_config=draft_config(
        draft, 2, disable_by_batch_size=None))
    greedy.generate([prompt] * 1000, params[:1000])
    g = greedy.engine.speculator.stats
    assert stats.acceptance_rate > g.acceptance_rate, (stats.acceptance_rate, g.acceptance_rate)


# ---- vocabularies, structured outputs, the KV budget, errors

def padded(src: str, dst: Path, extra: int) -> str:
    """`src` with `extra` model-only ids past its tokenizer (rows of embed_tokens/lm_head)."""
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    rng = np.random.default_rng(1)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in w:
            a = w[name]
            w[name] = np.concatenate([a, (rng.standard_normal((extra, a.shape[1]))
                                          * a.std()).astype(a.dtype)])
    save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    edit_config(dst, lambda c: {**c, "vocab_size": c["vocab_size"] + extra})
    return str(dst)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


def test_padded_vocabularies_on_either_side(demo, tmp_path_factory):
    big = padded(demo, Path(tmp_path_factory.mktemp("pad")) / "big", 40)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    # a draft with more ids: its logits are cut to the target's; the same model otherwise, so
    # it agrees
    ref = LLM(demo).generate("The sea is", params)[0]
    llm = LLM(demo, speculative_config=draft_config(big))
    assert llm.generate("The sea is", params)[0].token_ids == ref.token_ids
    assert llm.engine.speculator.stats.num_accepted_tokens > 10
    # a draft with fewer: it never proposes the padding ids, which this random target does
    # sample (the draft reads them as id 0)
    ref = LLM(big).generate("The sea is", params)[0]
    assert max(ref.token_ids) >= LLM(demo).engine.model_config.vocab_size
    llm = LLM(big, speculative_config=draft_config(demo))
    assert llm.generate("The sea is", params)[0].token_ids == ref.token_ids
    assert llm.engine.speculator.stats.num_drafts > 0


def test_stop_strings_inside_an_accepted_run(demo):
    """The self-draft accepts runs of 5 tokens: a stop string in one ends it there, dropping
    the run's later tokens, with the text, tokens, counts and logprobs of one token at a time."""
    plain, spec = LLM(demo), LLM(demo, speculative_config=draft_config(demo))
    prompt = "The sea and the sky"
    free = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=40,
                                                 ignore_eos=True))[0]
    cases = 0
    for cut in (9, 14, 23, 31):
        stop = free.text[free.text.index(free.text[cut:cut + 3]):][:3]   # text inside the run
        for include in (False, True):
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                                    include_stop_str_in_output=include, logprobs=1)
            ref = plain.generate(prompt, params)[0]
            out = spec.generate(prompt, params)[0]
            assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (
                ref.text, ref.token_ids, ref.finish_reason, ref.stop_reason)
            assert out.num_output_tokens == ref.num_output_tokens == len(ref.token_ids)
            assert [lp.token_id for lp in out.logprobs] == [lp.token_id for lp in ref.logprobs]
            cases += ref.finish_reason == "stop"
    assert cases >= 6
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens > 20
    assert spec.engine.block_pool.num_free_blocks == spec.engine.block_pool.num_blocks


def test_structured_outputs_with_a_draft_model(demo):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    plain, spec = LLM(demo), LLM(demo, speculative_config=draft_config(demo))
    for seed in range(3):
        params = SamplingParams(temperature=0.0 if seed == 0 else 0.9, seed=seed, max_tokens=50,
                                structured_outputs=StructuredOutputsParams(
                                    "json", json_spec(schema)))
        out = spec.generate("Facts about the sea:", params)[0]
        assert out.token_ids == plain.generate("Facts about the sea:", params)[0].token_ids
        assert set(json.loads(out.text)) == {"name", "n"}
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens > 10        # the drafts obeyed the grammar: it agreed


def test_the_kv_budget_pays_for_both_pools_and_the_context_for_the_drafts_limit(target, other,
                                                                                tmp_path):
    from engine.runner.model_runner import ModelRunner
    alone = LLM(target, kv_cache_memory_mb=4).engine
    both = LLM(target, kv_cache_memory_mb=4, speculative_config=draft_config(other)).engine
    per_block = ModelRunner.kv_bytes_per_block(alone.model_config, 16)
    assert alone.block_pool.num_blocks == 4 * 2**20 // per_block
    assert both.block_pool.num_blocks == 4 * 2**20 // (2 * per_block)
    short = tiny_checkpoint(tmp_path / "short", "llama", seed=1, max_position_embeddings=128)
    engine = LLM(target, speculative_config=draft_config(short)).engine
    assert engine.max_model_len == 128


def test_draft_errors_name_the_problem(target, demo, tmp_path):
    small = tiny_checkpoint(tmp_path / "v64", "llama", vocab_size=64)
    with pytest.raises(ValueError, match="vocabulary of 64 ids, the target's has 512"):
        LLM(target, speculative_config=draft_config(small))
    other_tok = padded(demo, tmp_path / "tok", 0)
    tok = json.loads((Path(other_tok) / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]         # two ids swapped: other token ids
    (Path(other_tok) / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="its tokenizer differs from the target's"):
        LLM(demo, speculative_config=draft_config(other_tok))
