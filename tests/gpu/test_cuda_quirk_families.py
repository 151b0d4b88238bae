"""GPU model level for the quirk families of issue 29 item 4 that the CUDA backend runs:
MiniMax-M2, whose attention (engine/models/composed_attention.py: q/k RMSNorm over all heads,
partial rotary) and sigmoid router with its correction bias (pyx/moe.py route_grouped, the fused
MoE path) are compositions of existing CUDA ops. Greedy tokens of the CUDA engine equal the CPU
engine's on the same bf16 weights of a tiny-256 checkpoint, eager and with CUDA Graph replay, as
tests/gpu/test_cuda_families.py does. The CPU engine itself is checked against transformers in
tests/test_models_quirk_families.py. Llama 4 and GPT-OSS refuse the CUDA backend by name (tested
on the CPU).
"""
from __future__ import annotations

import pytest

from checkpoints import tiny256_checkpoint
from test_cuda_model import MIN_COMPARED, compare, cpu_margins, greedy, make_llm, random_prompts


@pytest.fixture(scope="module")
def minimax_m2(tmp_path_factory):
    return tiny256_checkpoint(tmp_path_factory.mktemp("minimax_m2"), arch="minimax_m2")


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_minimax_m2_greedy_matches_cpu(minimax_m2, cuda_graph):
    common = dict(max_num_batched_tokens=48)    # chunked prefill mixed with decode rows
    cuda = make_llm(minimax_m2, "cuda", cuda_graph=cuda_graph, **common)
    cpu = make_llm(minimax_m2, "cpu", **common)
    prompts = random_prompts(1, (5, 23, 40, 70, 17, 33))
    got, want = greedy(cuda, prompts), greedy(cpu, prompts)
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        margins = cpu_margins(cpu, prompts[i], w.token_ids)
        compared += compare(f"minimax_m2 prompt {i} (len {len(prompts[i])})", g.token_ids,
                            w.token_ids, margins)
    assert compared >= MIN_COMPARED, f"only {compared} tokens compared: near-ties everywhere"
