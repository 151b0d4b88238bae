"""Pipeline parallel's CUDA path for multi-head latent attention (issue 28; the CPU path is
tests/test_pipeline_parallel_mla.py): a DeepSeek-V3-shaped tiny checkpoint built as a pipeline of
one stage on one rank through the NCCL communicator (PipelineRunner's two micro-batches a step,
the stage's latent caches) gives the plain engine's greedy tokens, eager and with the stage's
decode graphs replayed per micro-batch (graphs_parallel=on: the absorbed decode path). Two
stages on two devices pend a machine with several."""
from __future__ import annotations

import os

import pytest

from test_cuda_model import greedy, make_llm, random_prompts
from test_cuda_pipeline_parallel import one_stage_llm
from test_cuda_tensor_parallel import assert_two_devices_match_one, need_two_devices


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from checkpoints import tiny_checkpoint
    return tiny_checkpoint(os.path.join(tmp_path_factory.mktemp("pp_mla"), "v3"),
                           arch="deepseek_v3")


def test_one_stage_matches_plain_engine_and_replays_graphs(v3, monkeypatch):
    """The eager stage's tokens start as the plain engine's (its micro-batches change the
    GEMMs' shapes) and the stage's graphs give the eager stage's exactly (same shapes)."""
    prompts = random_prompts(6, (40, 17, 70, 9))
    plain = [list(o.token_ids) for o in greedy(make_llm(v3, "cuda"), prompts)]
    eager_llm = one_stage_llm(v3, monkeypatch)
    assert eager_llm.engine.model.config.pipeline is not None
    assert eager_llm.engine.runner.graph_runner is None         # graphs_parallel=off
    eager = [list(o.token_ids) for o in greedy(eager_llm, prompts)]
    for a, b in zip(plain, eager):
        assert a[:8] == b[:8], (a, b)
    llm = one_stage_llm(v3, monkeypatch, kernels="graphs_parallel=on")
    graphs = llm.engine.runner.graph_runner
    assert graphs is not None and graphs.stage is not None
    assert [list(o.token_ids) for o in greedy(llm, prompts)] == eager
    assert graphs.num_replays > 0 and graphs.num_eager_fallbacks == 0


def test_two_stages_on_two_devices_match_one(v3):
    need_two_devices("an MLA model at pipeline_parallel_size 2")
    assert_two_devices_match_one(v3, random_prompts(7, (40, 17)), pipeline_parallel_size=2)
