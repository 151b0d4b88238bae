"""GPU model level for the families of issue 16 (Gemma-2, Gemma-3, Phi-3, GLM-4, StableLM): greedy
tokens of the CUDA engine equal the CPU engine's on the same bf16 weights of tiny-256 checkpoints
(tests/checkpoints.py ARCHS_256), as tests/gpu/test_cuda_model.py does for the Llama family. The
CPU engine itself is checked against transformers in tests/test_models_families.py.

Exercised on the GPU: the scale op (Gemma's embedding), GeGLU, attention soft-capping in the
prefill and decode kernels, the final soft-cap, sliding windows of 16 under 70-token prompts,
Gemma-3's two RoPE caches, LongRoPE's per-sequence long rows (prompts on both sides of the
original context of 32), partial and interleaved rotary, layer_norm with bias and the parallel
residual, StableLM-2 12B's per-head q/k LayerNorm (the layer_norm op per head); and CUDA Graph replay against eager decode for Phi-3, whose LongRoPE positions are
computed inside the captured forward.
"""
from __future__ import annotations

import os

import pytest

from checkpoints import tiny256_checkpoint
from test_cuda_model import MIN_COMPARED, compare, cpu_margins, greedy, make_llm, random_prompts

FAMILIES = ["gemma2", "gemma3", "phi3", "glm4", "stablelm", "stablelm_qk"]
# Gemma-2's final soft-cap of 3 (tests/checkpoints.py) squeezes the tiny checkpoint's logits:
# its CPU margins fall under the tie after 9 tokens in all over these prompts (the same 9 on the
# CPU here and on the 2026-11-28 H200 run), where the other families give 13 to 90.
MIN_COMPARED_FOR = {"gemma2": 9}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families256")
    made = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = tiny256_checkpoint(os.path.join(root, arch), arch=arch)
        return made[arch]
    return get


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_matches_cpu(checkpoints, arch):
    path = checkpoints(arch)
    common = dict(max_num_batched_tokens=48)    # chunked prefill mixed with decode rows
    cuda = make_llm(path, "cuda", **common)
    cpu = make_llm(path, "cpu", **common)
    prompts = random_prompts(1, (5, 23, 40, 70, 17, 33))
    got, want = greedy(cuda, prompts), greedy(cpu, prompts)
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        margins = cpu_margins(cpu, prompts[i], w.token_ids)
        compared += compare(f"{arch} prompt {i} (len {len(prompts[i])})", g.token_ids,
                            w.token_ids, margins)
    least = MIN_COMPARED_FOR.get(arch, MIN_COMPARED)
    assert compared >= least, f"only {compared} tokens compared: near-ties everywhere"


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_phi3_graph_replay_equals_eager(checkpoints, batch):
    path = checkpoints("phi3")
    graph = make_llm(path, "cuda", cuda_graph=True)
    eager = make_llm(path, "cuda", cuda_graph=False)
    prompts = random_prompts(200 + batch, [45, 20, 31, 60][:batch])   # both sides of 32
    got = [o.token_ids for o in greedy(graph, prompts)]
    want = [o.token_ids for o in greedy(eager, prompts)]
    assert got == want      # bucket sizes: the same kernels on the same shapes
