"""GPU model level for Gemma 4's E2B/E4B layers (engine/models/gemma4.py,
engine/models/gemma4_per_layer.py): per-layer input embeddings and KV-shared layers reading
their source layer's paged cache. Greedy tokens of the CUDA engine equal the CPU engine's on the
same bf16 weights of an E2B-shaped tiny-256 checkpoint, eager and with CUDA Graph replay, with
prompt chunks beside decodes; the pool allocates caches for the unshared layers only. The CPU
engine itself is checked against transformers in tests/test_models_quirk_families.py.

Pending: Gemma 4 refuses the CUDA backend until its CUDA side (families-cuda) lands; then this
checks that the E-shapes' layers (ops composed over the backend: embedding, linear, rms_norm,
fused add, gelu_tanh_and_mul, rotary, paged attention over a source layer's cache) run there.
"""
from __future__ import annotations

import pytest

from checkpoints import tiny256_checkpoint
from test_cuda_model import MIN_COMPARED, compare, cpu_margins, greedy, make_llm, random_prompts


@pytest.fixture(scope="module")
def gemma4_e2b(tmp_path_factory):
    return tiny256_checkpoint(tmp_path_factory.mktemp("gemma4_e2b"), arch="gemma4_e2b")


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gemma4_e2b_greedy_matches_cpu(gemma4_e2b, cuda_graph):
    common = dict(max_num_batched_tokens=48)    # chunked prefill mixed with decode rows
    cuda = make_llm(gemma4_e2b, "cuda", cuda_graph=cuda_graph, **common)
    cpu = make_llm(gemma4_e2b, "cpu", **common)
    s = cuda.engine.model_config.family
    caches = cuda.engine.runner.kv_caches
    assert len({id(k) for k, _ in caches}) == s.num_cache_layers == 3
    assert all(caches[i] is caches[src] for i, src in enumerate(s.kv_sources))
    prompts = random_prompts(1, (5, 23, 40, 70, 17, 33))
    got, want = greedy(cuda, prompts), greedy(cpu, prompts)
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        margins = cpu_margins(cpu, prompts[i], w.token_ids)
        compared += compare(f"gemma4_e2b prompt {i} (len {len(prompts[i])})", g.token_ids,
                            w.token_ids, margins)
    assert compared >= MIN_COMPARED, f"only {compared} tokens compared: near-ties everywhere"
