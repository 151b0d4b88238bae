"""Speculative decoding under tensor parallel on the CUDA path (issue 28; the CPU's checks:
tests/test_parallel_speculation.py).

  one device   an engine built as a group of one rank (the split graph, its NCCL communicator:
               tests/gpu/test_cuda_tensor_parallel.py's OneRank) with a draft model (whole on
               rank 0), an EAGLE-3 head (whole on rank 0, the target's embedding gathered
               whole through NCCL's all-gather in bf16) and DeepSeek-V3's MTP head (sharded,
               rank 0 sending a DraftStep before each drafting forward): the same tokens and
               acceptance counts as the plain engine with the same speculation.
  two devices  tensor_parallel_size 2 with each of them against one device (skipped with fewer
               than 2 GPUs: pending a machine with several).
"""
from __future__ import annotations

import pytest

from test_cuda_model import checkpoints, greedy, make_llm, random_prompts  # noqa: F401
from test_cuda_tensor_parallel import need_two_devices, one_rank_llm


@pytest.fixture(autouse=True)
def free_drafts(monkeypatch):
    """Drafts are free (engine/spec/costs.py): acceptance alone decides what is proposed."""
    from engine.spec.costs import StepCost
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)


@pytest.fixture(scope="module")
def cases(checkpoints, tmp_path_factory):  # noqa: F811
    """method -> (target, speculative config): the tiny-256 Llama as its own draft and with a
    random EAGLE-3 head of no embedding of its own (as test_cuda_features.py's), DeepSeek-V3
    with the MTP head that computes its bigram (tests/mtp_heads.py)."""
    from eagle3_heads import HEAD, draft_vocab, random_weights, write_head
    from mtp_heads import bigram_mtp_checkpoint
    llama = checkpoints("llama")
    cfg = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64)
    head = write_head(tmp_path_factory.mktemp("eagle3"), random_weights({**HEAD, **cfg},
                                                                       num_aux=2),
                      draft_vocab(512, 384, seed=1), eagle_aux_hidden_state_layer_ids=[0, 1],
                      **cfg)
    mtp_target = bigram_mtp_checkpoint(tmp_path_factory.mktemp("mtp"))
    return {"draft_model": (llama, {"method": "draft_model", "model": llama,
                                    "num_speculative_tokens": 3}),
            "eagle3": (llama, {"method": "eagle3", "model": head, "num_speculative_tokens": 3}),
            "mtp": (mtp_target, {"method": "mtp", "num_speculative_tokens": 3})}


def tokens_and_counts(llm, prompts):
    try:
        tokens = [list(o.token_ids) for o in greedy(llm, prompts)]
        st = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    return tokens, (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens)


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mtp"])
def test_one_rank_speculates_as_the_plain_engine(cases, method, monkeypatch):
    target, spec = cases[method]
    prompts = random_prompts(21, (40, 17, 33))
    plain = tokens_and_counts(make_llm(target, "cuda", speculative_config=spec), prompts)
    llm = one_rank_llm(target, monkeypatch, speculative_config=spec)
    assert llm.engine.model.config.tensor_parallel is not None      # the split graph ran
    split = tokens_and_counts(llm, prompts)
    assert split == plain
    assert split[1][0] > 0


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "mtp"])
def test_two_devices_speculate_as_one(cases, method):
    need_two_devices(f"{method} at tensor_parallel_size 2")
    target, spec = cases[method]
    prompts = random_prompts(21, (40, 17))
    one, _ = tokens_and_counts(make_llm(target, "cuda"), prompts)
    two, counts = tokens_and_counts(make_llm(target, "cuda", tensor_parallel_size=2,
                                             speculative_config=spec), prompts)
    for a, b in zip(one, two):         # bf16 sums in another order: the first tokens agree
        assert a[:8] == b[:8], (a, b)
    assert counts[0] > 0
