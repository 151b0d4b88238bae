"""Tensor and expert parallel's CUDA path for multi-head latent attention (issue 28 item 1;
engine/parallel/sharding_mla.py): a DeepSeek-V3-shaped tiny checkpoint built as a group of one
rank through the NCCL communicator (the split graph: MLA's o_proj all-reduced, DeepSeekMoE's
experts within the rank or whole under expert parallel) gives the plain engine's greedy tokens,
eager and with decode graphs captured with the collectives inside (graphs_parallel=on: the
absorbed decode path replayed). Two devices pend a machine with several."""
from __future__ import annotations

import os

import pytest

from test_cuda_model import greedy, make_llm, random_prompts
from test_cuda_tensor_parallel import assert_two_devices_match_one, need_two_devices, one_rank_llm


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from checkpoints import tiny_checkpoint
    return tiny_checkpoint(os.path.join(tmp_path_factory.mktemp("tp_mla"), "v3"),
                           arch="deepseek_v3")


@pytest.mark.parametrize("how", [dict(), dict(kernels="graphs_parallel=on"),
                                 dict(enable_expert_parallel=True)])
def test_one_rank_split_matches_plain_engine(v3, monkeypatch, how):
    prompts = random_prompts(6, (40, 17, 70, 9))
    plain = [list(o.token_ids) for o in greedy(make_llm(v3, "cuda"), prompts)]
    llm = one_rank_llm(v3, monkeypatch, **how)
    tp = llm.engine.model.config.tensor_parallel
    assert tp is not None and tp.experts == ((0, 8) if how.get("enable_expert_parallel")
                                             else None)
    if "kernels" in how:
        assert llm.engine.runner.graph_runner is not None
    split = [list(o.token_ids) for o in greedy(llm, prompts)]
    assert split == plain
    if "kernels" in how:
        graphs = llm.engine.runner.graph_runner
        assert graphs.num_replays > 0 and graphs.num_eager_fallbacks == 0


def test_two_devices_match_one(v3):
    need_two_devices("an MLA model at tensor_parallel_size 2")
    assert_two_devices_match_one(v3, random_prompts(7, (40, 17)), tensor_parallel_size=2)
