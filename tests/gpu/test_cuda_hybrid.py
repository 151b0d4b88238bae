"""GPU model level for the hybrid linear-attention models (Qwen3-Next, Qwen3.5): greedy tokens of
the CUDA engine equal the CPU engine's on the same bf16 weights of tiny-256 checkpoints
(tests/checkpoints.py ARCHS_256), as tests/gpu/test_cuda_families.py does for the other
families. The CPU engine itself is checked against transformers in tests/test_models_hybrid.py.

Exercised on the GPU: the gated DeltaNet layer composed of CuPy array operations
(pyx/gated_delta_net.py: the causal convolution, the chunked gated delta rule with its batched
triangular solves, the token loop, the bfloat16 widening and rounding through the bits), the
gated attention's output gate, the state rows carried across chunked prefill and decode steps,
and a second turn that starts from a prefix-cache state snapshot.
"""
from __future__ import annotations

import os

import pytest

from checkpoints import tiny256_checkpoint
from test_cuda_model import MIN_COMPARED, compare, cpu_margins, greedy, make_llm, random_prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid256")
    made = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = tiny256_checkpoint(os.path.join(root, arch), arch=arch)
        return made[arch]
    return get


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
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
    assert compared >= MIN_COMPARED, f"only {compared} tokens compared: near-ties everywhere"


def test_second_turn_from_a_snapshot_matches_cpu(checkpoints):
    """A 70-token prompt, then the conversation so far plus 9 tokens: the CUDA engine's second
    turn starts from the state snapshot at the history's last full block, and gives the CPU
    engine's tokens."""
    path = checkpoints("qwen3_next")
    cuda, cpu = make_llm(path, "cuda"), make_llm(path, "cpu")
    first = random_prompts(3, (70,))[0]
    one = greedy(cuda, [first])[0]
    second = first + list(one.token_ids) + random_prompts(4, (9,))[0]
    got = greedy(cuda, [second])[0]
    want = greedy(cpu, [second])[0]
    assert cuda.engine.block_pool.num_snapshot_restores == 1 and got.num_cached_tokens > 0
    compare("second turn", got.token_ids, want.token_ids, cpu_margins(cpu, second, want.token_ids))
