"""Gemma 4 across processes on the CPU backend (issue 28): the E2B/E4B shapes (per-layer input
embeddings, KV-shared layers) under tensor parallel.

Greedy tokens equal transformers' (up to a near-tie, as the family tests) and the single-process
engine's, whose logprobs they equal within float tolerance, with chunked prefill so that a step
holds several sequences' chunks and the KV-shared layers run on the rows read:

- tensor parallel 2: E2B's shape (one KV head, replicated on both ranks; double-wide MLPs on the
  shared layers) and E4B's (two sliding KV heads, one per rank: each rank's shared layers read
  its own head of their source's cache), the per-layer embedding table vocab-parallel and its
  projection column-parallel (engine/models/gemma4_per_layer.py).
- expert parallel 2: the 26B-A4B shape's stacked GeGLU experts held whole, rank 0 experts 0-1
  and rank 1 experts 2-3 of 4 (its dense MLP beside them split within the ranks).
"""
from __future__ import annotations

import pytest

from hf_oracle import assert_matches
from model_cases import Cases
from test_tensor_parallel import assert_same_as_one_process, greedy, wait_for_workers_gone, \
    worker_pids

pytestmark = pytest.mark.timeout(300)

CASES = {"gemma4_e2b": (dict(arch="gemma4_e2b"), None),
         "gemma4_e4b": (dict(arch="gemma4_e4b"), None),
         "gemma4_moe": (dict(arch="gemma4", enable_moe_block=True, num_experts=4,
                             top_k_experts=2, moe_intermediate_size=32), None)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("gemma4_parallel")), CASES)


def check_split(cases, name, label, **split):
    """The split engine's greedy tokens equal transformers' and the single process's; what
    `inspect` (of rank 0's model, in split) saw is returned."""
    before = worker_pids()
    tokens = greedy(cases.dir(name), **split)
    seen = None
    if "inspect" in split:
        tokens, seen = tokens
    for i, (got, ref) in enumerate(zip(tokens[0], cases.ref(name))):
        assert_matches(got, ref, min_trusted=8, label=f"{name} {label} prompt {i}")
    assert_same_as_one_process(greedy(cases.dir(name)), tokens, f"{name} {label}")
    wait_for_workers_gone(before)
    return seen


@pytest.mark.parametrize("name", ["gemma4_e2b", "gemma4_e4b"])
def test_per_layer_inputs_and_kv_sharing_under_tensor_parallel(cases, name):
    check_split(cases, name, "tp2", tp=2)


def held_experts(model):
    """(first expert, held, of all) of each MoE layer of rank 0's model."""
    return {(layer.mlp.experts.first_expert, layer.mlp.experts.num_held,
             layer.mlp.experts.num_experts) for layer in model.layers}


def test_moe_under_expert_parallel(cases):
    seen = check_split(cases, "gemma4_moe", "ep2", tp=2, enable_expert_parallel=True,
                       inspect=held_experts)
    assert seen == {(0, 2, 4)}
