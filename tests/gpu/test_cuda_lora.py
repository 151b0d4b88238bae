"""LoRA on the CUDA backend (issue 34): `lora_linear` (pyx/cuda_lora.pxi) against the float64
oracle for each activation dtype, and the engine with adapters written by `peft` on a bf16
tiny-256 Llama: greedy tokens of a batch mixing the base and two adapters equal the CPU engine's
up to the CPU's first near-tie (test_cuda_model.py's rule), with CUDA graphs on (base-only decode
steps replay them, steps with adapter rows run eagerly) and off."""
from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from test_cuda_ops import ACT, DTYPES, TOL, to_dev, to_host
from test_cuda_model import compare, random_prompts


def lora_case(dtype, seed=0, T=37, K=256, part_sizes=(256, 128, 128), R=16, S=3):
    """Slots in the activation dtype with zeros past each part's rank; rows in three segments
    (one empty), some rows in none."""
    rng = np.random.default_rng(seed)
    P = len(part_sizes)
    parts = np.concatenate([[0], np.cumsum(part_sizes)]).astype(np.int32)
    N = int(parts[-1])
    ranks = rng.integers(1, R + 1, size=(S, P)).astype(np.int32)
    ranks[1, 0] = 0
    a = np.zeros((S, P * R, K), np.float32)
    b = np.zeros((S, R, N), np.float32)
    for s in range(S):
        for p in range(P):
            r = ranks[s, p]
            a[s, p * R:p * R + r] = rng.standard_normal((r, K)) / np.sqrt(K)
            b[s, :r, parts[p]:parts[p + 1]] = rng.standard_normal((r, part_sizes[p]))
    x = rng.standard_normal((T, K))
    out = rng.standard_normal((T, N))
    rows = rng.permutation(T)[:30].astype(np.int32)
    seg_offsets = np.array([0, 12, 12, 30], np.int32)
    seg_slots = np.array([2, 0, 1], np.int32)
    act = ACT[dtype]
    return (x.astype(act), a.astype(act), b.astype(act), ranks, parts, rows, seg_offsets,
            seg_slots, out.astype(act))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_matches_reference(make_cuda, dtype):
    be = make_cuda(dtype)
    x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out = lora_case(dtype)
    want = ref.lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out)
    dout = to_dev(be, out)
    be.lora_linear(to_dev(be, x), to_dev(be, a), to_dev(be, b), ranks, parts, to_dev(be, rows),
                   seg_offsets, seg_slots, dout)
    got = to_host(be, dout).astype(np.float64)
    untouched = np.setdiff1d(np.arange(len(out)), rows)
    assert (got[untouched] == ref.to_f64(out)[untouched]).all()
    delta_got, delta_want = got[rows] - ref.to_f64(out)[rows], want[rows] - ref.to_f64(out)[rows]
    err = np.linalg.norm(delta_got - delta_want) / np.linalg.norm(delta_want)
    # the deltas carry the rounding of the shrink's result and of the output in the dtype
    assert err < 4 * TOL[dtype], err


def test_lora_linear_matches_the_cpu_backend(make_cuda, cpu):
    be = make_cuda("f32")
    x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out = lora_case("f32", seed=1)
    want = out.copy()
    cpu.lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots, want)
    dout = to_dev(be, out)
    be.lora_linear(to_dev(be, x), to_dev(be, a), to_dev(be, b), ranks, parts, to_dev(be, rows),
                   seg_offsets, seg_slots, dout)
    np.testing.assert_allclose(to_host(be, dout), want, rtol=1e-4, atol=1e-4)


# ---- the engine


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    """(bf16 tiny-256 Llama, {name: adapter dir}) with adapters by peft."""
    pytest.importorskip("peft", reason="could not import peft, which writes the adapters")
    from checkpoints import tiny256_checkpoint
    from hf_oracle import load_hf
    from lora_fixtures import write_adapter

    root = tmp_path_factory.mktemp("lora")
    base = tiny256_checkpoint(str(root / "base"), "llama", dtype="bfloat16")
    hf = load_hf(base)
    adapters = {
        "alpha": write_adapter(hf, root / "alpha", seed=1, r=16, lora_alpha=16,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"]),
        "beta": write_adapter(hf, root / "beta", seed=2, r=8, lora_alpha=8, use_rslora=True,
                              target_modules=["q_proj", "v_proj", "down_proj"]),
    }
    return base, adapters


def lora_llm(base, adapters, backend, **config):
    from engine import LLM
    return LLM(base, backend=backend, dtype="bf16", num_kv_blocks=256, max_num_seqs=8,
               lora=dict(modules=adapters, max_loras=2, max_lora_rank=16), **config)


def cpu_margins_lora(cpu_llm, prompt, tokens, name):
    """test_cuda_model.cpu_margins for a request of adapter `name`."""
    from engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=len(tokens), ignore_eos=True,
                            logprobs=2, lora_name=name)
    out = cpu_llm.generate([prompt], params)[0]
    top = np.array([lp.top_logprobs[:2] for lp in out.logprobs], np.float64)
    margins = top[:, 0] - top[:, 1]
    differ = np.flatnonzero(np.asarray(out.token_ids) != np.asarray(tokens))
    if differ.size:
        margins[int(differ[0]):] = 0.0
    return margins


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_mixed_adapter_batch_matches_cpu(lora_model, cuda_graph):
    from engine import SamplingParams

    base, adapters = lora_model
    cuda = lora_llm(base, adapters, "cuda", cuda_graph=cuda_graph)
    cpu = lora_llm(base, adapters, "cpu")
    prompts = random_prompts(7, (9, 30, 17, 44, 12, 25))
    names = [None, "alpha", "beta", "alpha", None, "beta"]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, lora_name=n)
              for n in names]
    got = cuda.generate(prompts, params)
    want = cpu.generate(prompts, params)
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        margins = cpu_margins_lora(cpu, prompts[i], w.token_ids, names[i])
        compared += compare(f"{names[i]} prompt {i}", g.token_ids, w.token_ids, margins)
    assert compared >= 24, f"only {compared} tokens compared: near-ties everywhere"
    by_name = {n: w.token_ids for n, w in zip(names, want)}
    assert len({tuple(t) for t in by_name.values()}) == 3       # the adapters change the tokens
    assert cuda.engine.lora.num_swaps == 2
    if cuda_graph:
        # steps with adapter rows ran eagerly; the base model's decode steps replay the graphs
        graphs = cuda.engine.runner.graph_runner
        assert graphs is not None and graphs.num_replays == 0
        cuda.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        assert graphs.num_replays > 0
