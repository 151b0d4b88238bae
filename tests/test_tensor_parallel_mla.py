"""Tensor and expert parallel for multi-head latent attention (issue 28 item 1: DeepSeek-V2/V3,
GLM-4.7-Flash; engine/parallel/sharding_mla.py): 2 MPI ranks each hold half the attention heads
(q_b_proj / q_proj and kv_b_proj by head, o_proj's columns, one all-reduce after it), the
low-rank q_a_proj / kv_a_proj_with_mqa and their norms whole (each rank writes the whole latent
to its own cache), and DeepSeekMoE's experts split within the ranks (tensor parallel) or across
them (expert parallel), the shared experts within.

- Greedy tokens equal transformers' (up to a near-tie) and the single process's, logprobs within
  float tolerance, at tensor parallel 2 and expert parallel 2 (and 4, one head per rank): a
  DeepSeek-V2-Lite-shaped tiny checkpoint (one q_proj, two shared experts, softmax routing) and a
  V3-shaped one (q_lora_rank,
  sigmoid grouped routing with a correction bias, YaRN), with chunked prefill so that prompts
  take the plain path over several steps and decode the absorbed one; GLM-4.7-Flash's as well.
- llama.cpp's q8_0 deepseek2 GGUFs of both shapes: the single process's tokens and logprobs.
- The cut: each rank's rows of q_b_proj / kv_b_proj and columns of o_proj are its heads' alone,
  the latent projections whole.
"""
from __future__ import annotations

import os

import pytest

from hf_oracle import assert_matches
from model_cases import Cases
from test_expert_parallel import greedy
from test_tensor_parallel import assert_same_as_one_process, wait_for_workers_gone, worker_pids

pytestmark = pytest.mark.timeout(300)

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf")
CASES = {"deepseek_v2_lite": (dict(arch="deepseek_v2_lite"), None),
         "deepseek_v3": (dict(arch="deepseek_v3"), None),
         "glm4_moe_lite": (dict(arch="glm4_moe_lite"), None)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("tp_mla")), CASES)


@pytest.mark.parametrize("name,ranks", [("deepseek_v2_lite", 2), ("deepseek_v3", 2),
                                        ("glm4_moe_lite", 2), ("deepseek_v3", 4)])
def test_splits_within_and_across_ranks(cases, name, ranks):
    """8 routed experts: within the ranks (rank 0 holds all 8, each a slice) and across them
    (rank 0 holds experts 0 to 8 / ranks - 1 whole). 4 ranks: one attention head each."""
    before = worker_pids()
    one, _ = greedy(cases.dir(name))
    for expert_parallel, held in ((False, (0, 8, 8)), (True, (0, 8 // ranks, 8))):
        split, rank0 = greedy(cases.dir(name), ranks, enable_expert_parallel=expert_parallel)
        assert rank0 == {held}
        label = f"{name} {'ep' if expert_parallel else 'tp'}{ranks}"
        for i, (tokens, ref) in enumerate(zip(split[0], cases.ref(name))):
            assert_matches(tokens, ref, min_trusted=8, label=f"{label} prompt {i}")
        assert_same_as_one_process(one, split, label)
    wait_for_workers_gone(before)


@pytest.mark.parametrize("stem", ["deepseek_v2_lite-q8_0", "deepseek_v3-q8_0"])
def test_gguf_splits_by_head_and_expert(stem):
    """llama.cpp's deepseek2 files (tests/test_gguf_mla.py): q8_0 rows cut by head, o_proj's
    columns along whole 32-element blocks, the stacked experts' rows; the rank's heads' slices
    of the per-head attn_k_b / attn_v_b read and joined into its kv_b_proj rows
    (tests/test_pipeline_parallel_mla.py counts the bytes). Exact activations
    (act_split=on): the default rounds a q8_0 matmul's 8-bit activations, and the ranks'
    partial sums, added in another order than one process's, can round one the other way
    (a logprob moved 1.1e-3 with the tokens the same)."""
    kwargs = dict(weight_file=os.path.join(DATA, f"{stem}.gguf"), kernels="act_split=on")
    one, _ = greedy(DATA, **kwargs)
    for expert_parallel, held in ((False, (0, 8, 8)), (True, (0, 4, 8))):
        split, rank0 = greedy(DATA, 2, enable_expert_parallel=expert_parallel, **kwargs)
        assert rank0 == {held}
        assert_same_as_one_process(one, split, f"{stem} {'ep' if expert_parallel else 'tp'}2")


def test_each_rank_holds_its_heads(cases):
    """Rank r of 2 holds heads [2r, 2r + 2) of 4: their rows of q_b_proj (N + R = 40 each) and
    kv_b_proj (N + V = 44 each), their V = 20 columns of o_proj; the latent projections whole."""
    from engine.models.model_config import ModelConfig
    from engine.parallel.sharding import Cut, ShardPlan
    config = ModelConfig.from_pretrained(cases.dir("deepseek_v3"))
    a = "model.layers.0.self_attn."
    for r in range(2):
        plan = ShardPlan(config, r, 2)
        assert plan.cut(f"{a}q_b_proj.weight", (160, 48)) == Cut(0, ((80 * r, 80 * r + 80),))
        assert plan.cut(f"{a}kv_b_proj.weight", (176, 32)) == Cut(0, ((88 * r, 88 * r + 88),))
        assert plan.cut(f"{a}o_proj.weight", (96, 80)) == Cut(1, ((40 * r, 40 * r + 40),))
        for whole in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "q_a_layernorm.weight",
                      "kv_a_layernorm.weight"):
            assert plan.cut(f"{a}{whole}", (48, 64)) is None
