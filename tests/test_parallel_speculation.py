"""Speculative decoding under tensor and pipeline parallel on the CPU backend (issue 28).

- A draft model (method draft_model) runs whole on rank 0 beside the scheduler, its KV pool there
  too, and proposes; the target's verify steps run on every rank. With tensor parallel 2,
  pipeline parallel 2 and both (4 processes) the greedy tokens equal the one-process engine's
  without speculation and transformers', and the acceptance counts equal one process's with the
  same draft: the target as its own draft accepts every draft; a nearby draft (the target's
  layers with noise) about half of them, the same ones as in one process. (The draft reads the
  block tables before rank 0 sends the step to the other ranks: the tables' changes must still
  reach them.)
- An MTP head (DeepSeek-V3's layer, Qwen3-Next's mtp.*) under tensor parallel 2, sharded as the
  target is and run in lockstep on every rank (engine/parallel/draft_steps.py): greedy tokens equal
  the one-process engine's without speculation and transformers', acceptance counts equal one
  process's with the head: a head that computes the target's next token (tests/mtp_heads.py's
  bigram) accepts every draft through the target's vocab-parallel embedding and LM head; the same
  with noise in its MLP some of them, DeepSeek's reading its own embedding and shared_head.head
  (replicated whole).
- An EAGLE-3 head under tensor parallel 2, whole on rank 0 (as a draft model), reading the
  target's aux hidden states there and its embedding gathered whole from the ranks' shares: the
  same checks, with tests/test_spec_decode_eagle3.py's head that predicts its bigram target
  (every draft accepted) and that head made to read the target's features a little (some).
- EAGLE-3 and MTP heads under pipeline parallel stay refused by name.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from hf_oracle import assert_matches, hf_greedy, load_hf
from model_cases import GEN, prompts_for
from test_spec_decode_draft import draft_config, free_drafts  # noqa: F401 (a fixture)
from test_spec_decode_eagle3 import copy_head  # noqa: F401 (a fixture)
from test_tensor_parallel import (assert_same_as_one_process, cases, wait_for_workers_gone,  # noqa: F401
                                  worker_pids)

pytestmark = pytest.mark.timeout(600)

TOKENS = 2 * GEN      # past transformers' reference (GEN): more verify steps


def run(model, tp: int = 1, pp: int = 1, speculative_config=None):
    """(token ids, logprobs) of each prompt, and (drafts, draft tokens, accepted tokens)."""
    from engine import LLM, SamplingParams
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_kv_blocks=64,
              max_num_batched_tokens=32, speculative_config=speculative_config)
    try:
        outs = llm.generate(prompts_for(), SamplingParams(temperature=0, max_tokens=TOKENS,
                                                          ignore_eos=True, logprobs=0))
        st = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    return (([list(o.token_ids) for o in outs],
             [np.array([lp.logprob for lp in o.logprobs]) for o in outs]),
            (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens))


@pytest.fixture(scope="module")
def plain(cases):
    """The one-process engine without speculation, checked against transformers."""
    out, _ = run(cases.dir("llama"))
    for i, (tokens, ref) in enumerate(zip(out[0], cases.ref("llama"))):
        assert_matches(tokens[:GEN], ref, min_trusted=8, label=f"one process prompt {i}")
    return out


@pytest.fixture(scope="module")
def nearby(cases, tmp_path_factory):
    """The target with noise (6% of each matrix's spread) in its layers' weights: its greedy
    drafts agree with the target's tokens about half the time."""
    from safetensors.numpy import load_file, save_file
    d = str(tmp_path_factory.mktemp("nearby") / "draft")
    shutil.copytree(cases.dir("llama"), d)
    weights = load_file(f"{d}/model.safetensors")
    rng = np.random.default_rng(3)
    for name, w in weights.items():
        if ".layers." in name and w.ndim == 2:
            weights[name] = (w + 0.06 * w.std() * rng.standard_normal(w.shape)).astype(w.dtype)
    save_file(weights, f"{d}/model.safetensors", metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def one_process(cases, nearby):
    """The one-process engine's outputs and counts with each draft (computed once)."""
    done = {}

    def get(draft):
        if draft not in done:
            model = cases.dir("llama") if draft == "itself" else nearby
            done[draft] = run(cases.dir("llama"), speculative_config=draft_config(model, k=3))
        return done[draft]
    return get


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("draft", ["itself", "nearby"])
def test_draft_model(cases, nearby, plain, one_process, draft, tp, pp):
    before = worker_pids()
    target = cases.dir("llama")
    spec = draft_config(target if draft == "itself" else nearby, k=3)
    assert_speculates_as_one_process(plain, one_process(draft), run(target, tp, pp, spec),
                                     draft == "itself",
                                     f"draft {draft}, tensor parallel {tp}, pipeline parallel {pp}")
    wait_for_workers_gone(before)


def assert_speculates_as_one_process(plain, one, split, every_draft: bool, label):
    """one, split: run()'s (outputs, counts) with speculation in one process and split. Both
    give the tokens of `plain` (one process without speculation), and the same acceptance
    counts: every draft accepted, or some but not all."""
    (one_out, one_counts), (split_out, split_counts) = one, split
    assert_same_as_one_process(plain, one_out, f"one process, {label}")
    assert_same_as_one_process(plain, split_out, label)
    assert split_counts == one_counts, label
    drafts, proposed, accepted = split_counts
    assert drafts > 0
    if every_draft:
        assert accepted == proposed, label
    else:
        assert 0 < accepted < proposed, label


# ---- MTP heads under tensor parallel 2

def noisy_copy(src: str, dst: str, prefix: str, own_ends: str | None = None) -> str:
    """src with noise (30% of each matrix's spread) in the MLP tensors under `prefix`; with
    own_ends (DeepSeek's MTP layer prefix), the head also given its own copies of the target's
    embedding and LM head (embed_tokens, shared_head.head: replicated whole under tensor
    parallel)."""
    from mtp_heads import load, save
    shutil.copytree(src, dst)
    weights = load(dst)
    rng = np.random.default_rng(3)
    for name, w in weights.items():
        if name.startswith(prefix) and w.ndim == 2:
            weights[name] = (w + 0.3 * w.std() * rng.standard_normal(w.shape)).astype(w.dtype)
    if own_ends:
        weights[own_ends + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].copy()
        weights[own_ends + "shared_head.head.weight"] = weights["lm_head.weight"].copy()
    save(dst, weights)
    return dst


@pytest.fixture(scope="module")
def mtp_targets(tmp_path_factory):
    """(family, head) -> the checkpoint, made on first use."""
    import mtp_heads
    import qwen3_next_mtp_heads
    made = {}

    def get(family, head):
        if (family, head) not in made:
            d = str(tmp_path_factory.mktemp(f"{family}_{head}"))
            if head == "bigram":
                module = mtp_heads if family == "deepseek" else qwen3_next_mtp_heads
                made[family, head] = module.bigram_mtp_checkpoint(d)
            elif family == "deepseek":
                N = mtp_heads.config(get(family, "bigram"))["num_hidden_layers"]
                made[family, head] = noisy_copy(get(family, "bigram"), f"{d}/noisy",
                                                f"model.layers.{N}.mlp.", f"model.layers.{N}.")
            else:
                made[family, head] = noisy_copy(get(family, "bigram"), f"{d}/noisy",
                                                "mtp.layers.0.mlp.")
        return made[family, head]
    return get


def assert_tensor_parallel_speculates_as_one_process(target, spec, every_draft: bool, label):
    """Greedy tokens at tensor parallel 2 with `spec` equal the one-process engine's without it
    (and transformers'), and the acceptance counts one process's with it: every draft accepted,
    or some but not all."""
    before = worker_pids()
    plain, _ = run(target)
    hf = load_hf(target)
    for i, (tokens, prompt) in enumerate(zip(plain[0], prompts_for())):
        assert_matches(tokens[:GEN], hf_greedy(hf, prompt, GEN), min_trusted=8,
                       label=f"{label}: one process prompt {i}")
    assert_speculates_as_one_process(plain, run(target, speculative_config=spec),
                                     run(target, 2, speculative_config=spec), every_draft,
                                     f"{label}, tensor parallel 2")
    wait_for_workers_gone(before)


@pytest.mark.parametrize("family", ["deepseek", "qwen3_next"])
@pytest.mark.parametrize("head", ["bigram", "noisy"])
def test_mtp_head(mtp_targets, family, head):
    assert_tensor_parallel_speculates_as_one_process(
        mtp_targets(family, head), {"method": "mtp", "num_speculative_tokens": 3},
        head == "bigram", f"{family} MTP head {head}")


# ---- EAGLE-3 under tensor parallel 2

@pytest.fixture(scope="module")
def noisy_eagle3_head(copy_head, tmp_path_factory):
    """tests/test_spec_decode_eagle3.py's head that predicts its bigram target, made to read the
    target's features a little (a random fc, hidden_norm 0.03): some drafts change with them."""
    from safetensors.numpy import load_file, save_file
    d = str(tmp_path_factory.mktemp("eagle3") / "noisy")
    shutil.copytree(copy_head[1], d)
    path = f"{d}/model.safetensors"
    weights = load_file(path)
    H = weights["fc.weight"].shape[0]
    rng = np.random.default_rng(3)
    weights["fc.weight"] = (rng.standard_normal(weights["fc.weight"].shape)
                            / np.sqrt(weights["fc.weight"].shape[1])).astype(np.float32)
    weights["midlayer.hidden_norm.weight"] = np.full(H, 0.03, np.float32)
    save_file(weights, path, metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("head", ["bigram", "noisy"])
def test_eagle3_head(copy_head, noisy_eagle3_head, head):
    """The head whole on rank 0, its features the target's aux hidden states there, the target's
    embedding gathered whole from the ranks' shares."""
    target, bigram_head = copy_head
    spec = {"method": "eagle3", "model": bigram_head if head == "bigram" else noisy_eagle3_head,
            "num_speculative_tokens": 3}
    assert_tensor_parallel_speculates_as_one_process(target, spec, head == "bigram",
                                                     f"EAGLE-3 head {head}")


@pytest.mark.parametrize("method,what", [("eagle3", "an EAGLE-3 head"), ("mtp", "an MTP head")])
def test_heads_under_pipeline_parallel_are_refused_by_name(method, what):
    from engine.config import EngineConfig
    from engine.parallel.launch import check_supported
    spec = {"method": method, "num_speculative_tokens": 2}
    if method == "eagle3":
        spec["model"] = "a head's directory"
    config = EngineConfig(model="unused", pipeline_parallel_size=2, speculative_config=spec)
    with pytest.raises(ValueError, match=f"speculative decoding with {what} is not yet "
                                         f"supported"):
        check_supported(config)
