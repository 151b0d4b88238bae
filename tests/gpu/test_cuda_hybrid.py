"""GPU model level for the hybrid linear-attention models (Qwen3-Next, Qwen3.5): greedy tokens of
the CUDA engine equal the CPU engine's on the same bf16 weights of tiny-256 checkpoints
(tests/checkpoints.py ARCHS_256), as tests/gpu/test_cuda_families.py does for the other
families. The CPU engine itself is checked against transformers in tests/test_models_hybrid.py.

Exercised on the GPU: the gated DeltaNet layer composed of CuPy array operations
(pyx/gated_delta_net.py: the causal convolution, the chunked gated delta rule with its batched
triangular solves, the token loop, the bfloat16 widening and rounding through the bits), the
gated attention's output gate, the state rows carried across chunked prefill and decode steps,
and a second turn that starts from a prefix-cache state snapshot; speculative decoding with the
checkpoint's own MTP head, the verify rows' states copied into the slots on the device.
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


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_speculation_matches_cpu(tmp_path, monkeypatch, arch):
    """The MTP head (tests/qwen3_next_mtp_heads.py, on tiny-256 targets) on the device in bf16:
    each verify step keeps the linear layers' per-draft states in verify rows and copies the
    accepted one into the slot (CuPy fancy indexing), the head drafts from the target's
    final-norm states with its own K/V. Greedy tokens equal the CPU engine's without
    speculation up to its near-ties, drafts proposed (and rejected: the random head's); a head
    that computes the bigram target's next token has most drafts accepted."""
    import functools

    from checkpoints import tiny256_checkpoint as write
    from engine.spec.costs import StepCost
    from qwen3_next_mtp_heads import bigram_mtp_checkpoint, mtp_checkpoint
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)
    f32 = functools.partial(write, dtype="float32")
    prompts = random_prompts(19, (5, 23, 40))
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    for name, path in (("random", mtp_checkpoint(tmp_path / "random", arch, checkpoint=f32)),
                       ("bigram", bigram_mtp_checkpoint(tmp_path / "bigram", arch,
                                                        checkpoint=f32))):
        cpu = make_llm(path, "cpu")
        cuda = make_llm(path, "cuda", speculative_config=spec)
        got, want = greedy(cuda, prompts), greedy(cpu, prompts)
        compared = 0
        for i, (g, w) in enumerate(zip(got, want)):
            margins = cpu_margins(cpu, prompts[i], w.token_ids)
            compared += compare(f"{arch} {name} prompt {i}", g.token_ids, w.token_ids, margins)
        assert compared >= 24, f"only {compared} tokens compared: near-ties everywhere"
        stats = cuda.engine.speculator.stats
        assert stats.num_drafts > 0
        if name == "bigram":
            assert stats.acceptance_rate > 0.8, stats
        else:              # rejections: the slots took verify rows' states
            assert stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_split_graph_of_one_rank_matches_plain_engine(checkpoints, monkeypatch, arch):
    """Tensor parallel's hybrid split on the device (engine/parallel/linear_attention_shards.py)
    in a group of one rank through the NCCL communicator: the DeltaNet's out_proj, the gated
    attention's o_proj and the MLPs all-reduced, the state plan set on the rank's runner; the
    plain CUDA engine's tokens, with chunked prefill and a second turn from a snapshot."""
    from test_cuda_tensor_parallel import one_rank_llm
    path = checkpoints(arch)
    prompts = random_prompts(5, (40, 17, 70))
    plain_llm = make_llm(path, "cuda", max_num_batched_tokens=48)
    plain = [list(o.token_ids) for o in greedy(plain_llm, prompts)]
    llm = one_rank_llm(path, monkeypatch, max_num_batched_tokens=48)
    assert llm.engine.model.config.tensor_parallel is not None      # the split graph ran
    assert [list(o.token_ids) for o in greedy(llm, prompts)] == plain
    second = prompts[2] + plain[2] + random_prompts(6, (9,))[0]
    assert greedy(llm, [second])[0].token_ids == greedy(plain_llm, [second])[0].token_ids
    assert llm.engine.block_pool.num_snapshot_restores == 1
