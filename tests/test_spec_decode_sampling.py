"""Speculative decoding keeps the target's distribution exactly: the rejection sampler's emitted
tokens against the processed target distribution (chi-square over many seeds on a tiny
vocabulary) for point-mass drafts and for drafts drawn from a distribution q (accepted with
probability min(1, p/q), else a draw from the residual max(p - q, 0)); the engine with prompt
lookup against transformers' exact probabilities; structured outputs' mask applied to drafts
and verify rows; logprobs the same bits as without speculation under --batch-invariant."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from engine import LLM, SamplingParams
from engine.core.sequence import Sequence
from engine.sampling.sampler import Sampler, apply_filters
from engine.sampling.structured_outputs import StructuredOutputs, StructuredOutputsParams, json_spec
from engine.spec.rejection_sampler import RejectionSampler
from pyx.cpu_backend import CpuBackend

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def free_drafts(request, monkeypatch):
    """The cost model (engine/spec/costs.py) follows this machine's step times; tests that
    count drafts make them free, so that acceptance alone decides how many are proposed."""
    if request.node.originalname not in ():
        from engine.spec.costs import StepCost
        monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)


def chi_square_ok(counts, probs, alpha_z: float = 3.72) -> tuple[bool, float, float]:
    """Pearson's chi-square of observed counts against probabilities, bins with an expected
    count under 5 merged into one; (passes, statistic, critical value) at the one-sided z (3.72:
    alpha 1e-4) through the Wilson-Hilferty approximation of the chi-square quantile."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a draw where the distribution has no mass"
    counts, expected = counts[keep], expected[keep]
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(counts) - 1
    crit = df * (1 - 2 / (9 * df) + alpha_z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit, stat, crit


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# ---- the rejection sampler alone

V = 6
PARAMS = dict(temperature=0.9, top_k=4)      # top-k: p has zeros q does not, and the converse


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, V)) * 1.5).astype(np.float32)     # rows 0..2: k = 2
    p = softmax(apply_filters(logits, PARAMS["temperature"], PARAMS["top_k"], 1.0, 0.0))
    q = np.array([[0.5, 0.0, 0.2, 0.1, 0.1, 0.1],     # q and p differ, q has ids p lacks
                  [0.05, 0.3, 0.0, 0.3, 0.05, 0.3]], np.float64)
    return logits, p, q


def run_verify(logits, q, n: int, probabilistic: bool, seed0: int = 0):
    """n sequences, each with its own seed, verifying 2 drafts against the same rows; drafts
    drawn from q (probabilistic) or fixed at q's argmax (point masses). Returns the runs."""
    sampler = RejectionSampler(Sampler(CpuBackend()), set())
    rng = np.random.default_rng(seed0 + 1)
    seqs = [Sequence([1, 2, 3], SamplingParams(**PARAMS, seed=seed0 + i)) for i in range(n)]
    if probabilistic:
        drafts = [[int(rng.choice(V, p=q[0])), int(rng.choice(V, p=q[1]))] for _ in range(n)]
        probs = [q.astype(np.float32)] * n
    else:
        drafts = [[int(q[0].argmax()), int(q[1].argmax())]] * n
        probs = None
    verified = sampler.verify(np.tile(logits, (n, 1)), seqs, drafts, None, probs)
    assert all(len(t) == a + 1 for t, a in zip(verified.tokens, verified.num_accepted))
    return verified.tokens


@pytest.mark.parametrize("probabilistic", [True, False])
def test_emitted_tokens_follow_the_target_distribution(case, probabilistic):
    logits, p, q = case
    runs = []
    for chunk in range(8):
        runs += run_verify(logits, q, 2500, probabilistic, seed0=chunk * 2500)
    for position in range(3):          # token i is emitted when drafts 0..i-1 were accepted
        emitted = [r[position] for r in runs if len(r) > position]
        assert len(emitted) > 500, position
        ok, stat, crit = chi_square_ok(np.bincount(emitted, minlength=V), p[position])
        assert ok, (position, stat, crit)
    # the test has the power to see a wrong distribution: the first tokens are not q's
    first = np.bincount([r[0] for r in runs], minlength=V)
    assert not chi_square_ok(first, 0.5 * q[0] + 0.5 * p[0])[0]
    accepted = sum(len(r) - 1 for r in runs) / len(runs)
    # p(argmax q) for point masses; sum(min(p, q)) per draft for probabilistic ones
    rate = (np.minimum(p[0], q[0]).sum() if probabilistic else p[0][q[0].argmax()])
    assert abs(sum(len(r) > 1 for r in runs) / len(runs) - rate) < 0.02, (accepted, rate)


def test_a_seed_gives_the_same_tokens_alone_or_batched(case):
    """The acceptance uniforms and residual draws are keyed by (seed, output position): a
    sequence verifies the same way in any batch."""
    logits, _, q = case
    sampler = RejectionSampler(Sampler(CpuBackend()), set())
    rng = np.random.default_rng(1)
    drafts = [[int(rng.choice(V, p=q[0])), int(rng.choice(V, p=q[1]))] for _ in range(40)]
    seqs = [Sequence([1, 2, 3], SamplingParams(**PARAMS, seed=i)) for i in range(40)]
    probs = [q.astype(np.float32)] * 40
    batched = sampler.verify(np.tile(logits, (40, 1)), seqs, drafts, None, probs).tokens
    for i in (0, 17, 39):
        alone = sampler.verify(logits, [seqs[i]], [drafts[i]], None, probs[:1]).tokens[0]
        assert alone == batched[i]
    assert len({tuple(t) for t in batched}) > 5


# ---- the engine against transformers' probabilities

@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("v8"), "llama", vocab_size=8, seed=3)


def exact_joint(model_dir: str, prompt: list[int], temperature: float) -> np.ndarray:
    """P(t1, t2, t3) (8, 8, 8) from transformers' logits, at the request's temperature."""
    import torch
    from hf_oracle import load_hf
    model = load_hf(model_dir)
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double().numpy()
        p1 = softmax(first / temperature)
        ids = torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])
        logits = model(ids).logits.double().numpy()        # (64, L + 2, 8)
    p2 = softmax(logits[:, -2] / temperature).reshape(8, 8, 8)[:, 0]    # given t1 (any t2)
    p3 = softmax(logits[:, -1] / temperature).reshape(8, 8, 8)          # given t1, t2
    return p1[:, None, None] * p2[:, :, None] * p3


def test_engine_samples_follow_the_target_distribution(tiny_vocab):
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]       # prompt lookup proposes 6 3 4 ...
    n = 4000
    llm = LLM(tiny_vocab, max_num_seqs=256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "disable_by_batch_size": None})
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, max_tokens=3, seed=s,
                                                      ignore_eos=True) for s in range(n)])
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens > 500 and stats.num_draft_tokens > stats.num_accepted_tokens
    joint = exact_joint(tiny_vocab, prompt, 1.0)
    counts = np.zeros((8, 8, 8))
    for out in outs:
        counts[tuple(out.token_ids)] += 1
    for name, observed, expected in [("t1 t2", counts.sum(2), joint.sum(2)),
                                     ("t2 t3", counts.sum(0), joint.sum(0))]:
        ok, stat, crit = chi_square_ok(observed.ravel(), expected.ravel())
        assert ok, (name, stat, crit)


# ---- structured outputs: the grammar's mask on drafts and verify rows

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "tags": {"type": "array", "maxItems": 4,
                                                    "items": {"enum": ["red", "green"]}}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


def test_structured_outputs_equal_the_non_speculative_engine(demo, monkeypatch):
    cuts = []
    prefix = StructuredOutputs.valid_draft_prefix

    def recording(seq, draft):
        n = prefix(seq, draft)
        cuts.append((n, len(draft)))
        return n

    monkeypatch.setattr(StructuredOutputs, "valid_draft_prefix", staticmethod(recording))
    example = json.dumps({"name": "sea", "tags": ["red", "green", "red"]})
    prompt = f"Answer as {example} or {example} or {example}: the sea?"
    spec = LLM(demo, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                         "prompt_lookup_min": 1})
    plain = LLM(demo)
    for seed in range(4):
        params = SamplingParams(temperature=0.8 if seed % 2 else 0.0, seed=seed, max_tokens=60,
                                repetition_penalty=0.5, structured_outputs=StructuredOutputsParams(
                                    "json", json_spec(SCHEMA)))
        out = spec.generate(prompt, params)[0]
        ref = plain.generate(prompt, params)[0]
        assert out.token_ids == ref.token_ids and out.finish_reason == "stop"
        value = json.loads(out.text)
        assert set(value) == {"name", "tags"}
    stats = spec.engine.speculator.stats
    assert stats.num_accepted_tokens > 0
    assert any(n < k for n, k in cuts) and any(n == k for n, k in cuts), cuts


# ---- logprobs

@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_are_the_same_bits_under_batch_invariance(tmp_path_factory, mode):
    model = tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")
    rng = np.random.default_rng(11)
    base = rng.integers(3, 500, 7).tolist()
    prompts = [base * 5, rng.integers(3, 500, 40).tolist()]
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7,
                            repetition_penalty=0.3, seed=3, logprobs=3)
    ref = LLM(model, batch_invariant=True, logprobs_mode=mode).generate(prompts, params)
    llm = LLM(model, batch_invariant=True, logprobs_mode=mode, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    outs = llm.generate(prompts, params)
    assert llm.engine.speculator.stats.num_accepted_tokens > 10
    for out, r in zip(outs, ref):
        assert out.token_ids == r.token_ids
        assert [(x.token_id, x.logprob, x.rank, x.top_ids, x.top_logprobs) for x in out.logprobs] \
            == [(x.token_id, x.logprob, x.rank, x.top_ids, x.top_logprobs) for x in r.logprobs]
