"""Batch invariance on the CPU backend (issue 14, item 5; README "Batch invariance").

With `batch_invariant=True` a request's raw logits at every output position, and so its greedy and
its seeded sampled tokens and its logprobs, are the same bits whether it runs alone or beside 16
other requests, whatever prefill chunk size the scheduler uses, and with or without a prefix-cache
hit. The reference is the request alone in a fresh engine, its whole prompt in one step. With the
switch off, this machine's kernels give different bits in some of those runs (the small-T GEMM and
the prefill attention kernel sum in other orders), which shows the comparison can fail.

Checkpoints: the tiny family (head_dim 24: the portable attention kernel; f32 weights), tiny-256
(head_dim 64: the AVX-512 attention kernels; bf16 weights) and a tiny Mistral (sliding window 16,
head_dim 16), with room for 1024 positions so a long prompt's decode rows are split across threads
(split-K) when the switch is off.
"""
from __future__ import annotations

import numpy as np
import pytest

from checkpoints import tiny256_checkpoint, tiny_checkpoint
from engine import LLM, SamplingParams

GEN = 8
PROMPT_LEN = 560            # > 2 x 256 keys: the default attention splits a lone decode row
SHARED = 512                # the prefix a warm-up request leaves in the prefix cache
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, top_k=60, seed=1234, max_tokens=GEN,
                         ignore_eos=True, logprobs=5)
GREEDY = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=5)

# name -> LLM arguments beyond the model: how the target request's prompt is scheduled
SCENARIOS = {
    "alone, chunks of 16": dict(prefill_chunk_size=16, max_num_batched_tokens=64),
    "batch of 17, whole prompts": dict(max_num_batched_tokens=8192),
    "batch of 17, chunks of 16": dict(prefill_chunk_size=16, max_num_batched_tokens=96),
    "prefix-cache hit, alone": dict(max_num_batched_tokens=8192),
    "prefix-cache hit, batch of 17, chunks of 64": dict(prefill_chunk_size=64,
                                                        max_num_batched_tokens=300),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    long = dict(max_position_embeddings=1024)
    return {
        "tiny f32 head_dim 24": tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", **long),
        "tiny-256 bf16 head_dim 64": tiny256_checkpoint(tmp_path_factory.mktemp("t256"), "llama",
                                                        **long),
        "mistral window 16": tiny_checkpoint(tmp_path_factory.mktemp("mistral"), "mistral",
                                             **long),
    }


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(14)
    target = rng.integers(3, 512, PROMPT_LEN).tolist()
    warm = target[:SHARED] + rng.integers(3, 512, 20).tolist()   # shares SHARED tokens
    others = [rng.integers(3, 512, int(n)).tolist() for n in rng.integers(5, 200, 16)]
    return target, warm, others


def other_params(i: int) -> SamplingParams:
    """Differing requests: greedy and sampled, penalties, different lengths."""
    if i % 3 == 0:
        return SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True)
    return SamplingParams(temperature=0.7 + 0.05 * i, top_p=0.95, seed=i, max_tokens=1 + i,
                          presence_penalty=0.5 * (i % 2), ignore_eos=True)


def run_target(model_dir, prompts, params, scenario=None, batch_invariant=True):
    """The target request's tokens, its raw logits at every output position (copied before the
    sampler touches them), how many prompt tokens it found cached, and its logprobs (token,
    logprob, top 5 ids and logprobs per position)."""
    target, warm, others = prompts
    config = SCENARIOS.get(scenario, {})
    llm = LLM(model_dir, batch_invariant=batch_invariant, max_num_seqs=32, **config)
    eng = llm.engine
    assert eng.backend.batch_invariant == batch_invariant
    if scenario and scenario.startswith("prefix-cache hit"):
        llm.generate([warm], SamplingParams(temperature=0, max_tokens=1))
    logits_of = {}
    execute = eng.runner.execute

    def recording_execute(sched, *batch):
        logits, pooled = execute(sched, *batch)
        sampled = [seq for seq, last in zip(sched.seqs, sched.sample) if last]
        for row, seq in enumerate(sampled):
            logits_of.setdefault(seq.request_id, []).append(np.array(logits[row], copy=True))
        return logits, pooled

    eng.runner.execute = recording_execute
    batch = scenario is not None and "batch of 17" in scenario
    crowd = [(f"other-{i}", p, other_params(i)) for i, p in enumerate(others)] if batch else []
    requests = crowd[:8] + [("target", target, params)] + crowd[8:]
    for rid, prompt, p in requests:
        eng.add_request(rid, prompt, p)
    outputs, logprobs = {}, []
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == "target":
                logprobs += [(e.token_id, e.logprob, e.top_ids, e.top_logprobs)
                             for e in out.logprobs or []]
            if out.finished:
                outputs[out.request_id] = out
    out = outputs["target"]
    assert out.finish_reason == "length" and len(out.token_ids) == GEN
    assert [e[0] for e in logprobs] == list(out.token_ids)
    return list(out.token_ids), np.stack(logits_of["target"]), out.num_cached_tokens, logprobs


def differing_positions(a: np.ndarray, b: np.ndarray) -> list[int]:
    """Output positions whose logits differ in any bit."""
    return [i for i in range(len(a)) if not np.array_equal(a[i].view(np.uint32),
                                                           b[i].view(np.uint32))]


# (checkpoint, request kind) pairs under test: the seeded sampled request on every checkpoint,
# the greedy one on the two without a sliding window (kept short: the machine is shared)
TARGETS = [("tiny f32 head_dim 24", "sampled"), ("tiny f32 head_dim 24", "greedy"),
           ("tiny-256 bf16 head_dim 64", "sampled"), ("tiny-256 bf16 head_dim 64", "greedy"),
           ("mistral window 16", "sampled")]


@pytest.fixture(scope="module")
def alone(models, prompts):
    """Reference runs: the request alone, whole prompt in one step; switch off: greedy only."""
    runs = {(m, kind, True): run_target(models[m], prompts,
                                        SAMPLED if kind == "sampled" else GREEDY)
            for m, kind in TARGETS}
    runs.update({(m, "greedy", False): run_target(models[m], prompts, GREEDY,
                                                  batch_invariant=False) for m in models})
    return runs


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("model,kind", TARGETS)
def test_invariant_alone_vs_batch_chunks_prefix_cache(models, prompts, alone, model, kind,
                                                      scenario):
    ref_tokens, ref_logits, ref_cached, ref_logprobs = alone[(model, kind, True)]
    assert ref_cached == 0
    params = SAMPLED if kind == "sampled" else GREEDY
    tokens, logits, cached, logprobs = run_target(models[model], prompts, params, scenario)
    if scenario.startswith("prefix-cache hit"):
        assert cached == SHARED          # 32 full blocks of 16 came from the cache
    else:
        assert cached == 0
    assert differing_positions(logits, ref_logits) == []
    assert tokens == ref_tokens
    assert logprobs == ref_logprobs      # the same floats, exactly


def test_sampled_and_greedy_targets_differ(alone):
    """The two targets are not trivially the same sequence (the sampled one samples)."""
    m = "tiny f32 head_dim 24"
    assert alone[(m, "sampled", True)][0] != alone[(m, "greedy", True)][0]


def test_switch_off_is_not_invariant_here(models, prompts, alone):
    """Without the switch the same comparisons find differing logits on this machine, so the test
    above can fail. Where they differ depends on the CPU (ISA, threads); the chunked prefill in a
    batch does on every checkpoint here (the small-T GEMM of a 16-token chunk against the packed
    GEMM of the whole prompt, and the prefill attention kernel against the decode one)."""
    for model in models:
        ref_logits = alone[(model, "greedy", False)][1]
        logits = run_target(models[model], prompts, GREEDY, "batch of 17, chunks of 16",
                                  batch_invariant=False)[1]
        assert differing_positions(logits, ref_logits), \
            f"{model}: with the switch off the logits were the same bits in a batch, chunked"


def test_switch_changes_no_greedy_token_of_this_prompt(alone):
    """Both modes compute the same function up to float32 rounding: the greedy tokens agree and
    the logits are close (the invariant GEMM and attention are not a different model)."""
    for model in {m for m, kind in TARGETS if kind == "greedy"}:
        on_tokens, on_logits = alone[(model, "greedy", True)][:2]
        off_tokens, off_logits = alone[(model, "greedy", False)][:2]
        np.testing.assert_allclose(on_logits[0], off_logits[0], rtol=0, atol=1e-3)
        assert on_tokens[:4] == off_tokens[:4]


def test_cuda_backend_refuses_the_switch():
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="CPU backend only"):
        EngineConfig(model="x", backend="cuda", batch_invariant=True)


def test_server_flag_sets_the_engine_config(models):
    from server.__main__ import build_parser, engine_config
    args = build_parser().parse_args(["--cpu", "--w", models["tiny f32 head_dim 24"],
                                      "--batch-invariant"])
    assert engine_config(args).batch_invariant is True
    args = build_parser().parse_args(["--cpu", "--w", models["tiny f32 head_dim 24"]])
    assert engine_config(args).batch_invariant is False


# ---- op level: one row alone vs. inside larger calls, for every weight format `linear` takes

ROWS = (2, 5, 16, 17, 33, 65)     # token rows around the small-T / packed switch points


def weights(rng, N=384, K=512):
    """(name, weight) for each format of the CPU backend's `linear`."""
    import ml_dtypes
    from gguf import GGMLQuantizationType as QT

    from pyx.cpu_backend import quantize_weight
    from pyx.weights.fp8 import Fp8Weight
    from pyx.weights.int4 import Int4Part, Int4Weight
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    codes = rng.integers(0, 16, (N, K)).astype(np.uint8)
    int4 = Int4Weight([Int4Part.from_codes(codes, rng.uniform(0.01, 0.02, (N, K // 128)),
                                           np.full((N, K // 128), 8.0), 128)], K)
    # e4m3 codes without NaN (0x7f, 0xff), either sign; blocks of 128 x 128
    fp8_codes = rng.integers(0, 0x7f, (N, K)).astype(np.uint8) | \
        (rng.integers(0, 2, (N, K)).astype(np.uint8) << 7)
    fp8 = Fp8Weight(fp8_codes, rng.uniform(0.01, 0.02, (N // 128, K // 128)), (128, 128))
    return [("f32", w), ("bf16", w.astype(ml_dtypes.bfloat16)), ("f16", w.astype(np.float16)),
            ("q8_0", quantize_weight(w, QT.Q8_0)), ("q4_k", quantize_weight(w, QT.Q4_K)),
            ("int4", int4),
            ("fp8 block", fp8)]


def linear_row_differs(backend, weight, x) -> list[int]:
    """Token counts T for which row 0 of linear(x[:T]) differs in any bit from linear(x[:1])."""
    N = weight.shape[0]
    ref = np.empty((1, N), np.float32)
    backend.linear(x[:1], weight, None, ref)
    bad = []
    for T in ROWS:
        out = np.empty((T, N), np.float32)
        backend.linear(np.ascontiguousarray(x[:T]), weight, None, out)
        if not np.array_equal(out[:1].view(np.uint32), ref.view(np.uint32)):
            bad.append(T)
    return bad


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
def test_linear_row_is_invariant_in_every_format(isa):
    from pyx.cpu_backend import CpuBackend, isa_supported
    if not isa_supported(isa):
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(5)
    x = rng.standard_normal((max(ROWS), 512)).astype(np.float32)
    on, off = CpuBackend(isa=isa, batch_invariant=True), CpuBackend(isa=isa)
    differs_off = []
    for name, w in weights(rng):
        assert linear_row_differs(on, w, x) == [], f"{name} ({isa}) with the switch on"
        if linear_row_differs(off, w, x):
            differs_off.append(name)
    # Switched off, the SIMD paths change kernels with T in every format; the scalar path's float
    # and fp8 loops are the same for every T (invariant already), its ggml and int4 ones are not.
    scalar_off = ["q8_0", "q4_k", "int4"]
    expected = scalar_off if isa == "scalar" else [n for n, _ in weights(rng)]
    # On AVX-512 the K types' int8 prefill (kernels quant_prefill=int8, the default) gives the
    # vec_dot loop's bits at every T (tests/test_quant_gemm.py): q4_k's row is invariant there
    # without the switch (q8_0's takes int8 only at every T under quant_prefill=int8_all).
    if isa == "avx512":
        expected.remove("q4_k")
    assert differs_off == expected


def test_fp8_kv_cache_attention_is_invariant():
    """paged_attention over an FP8 cache: a decode row alone, then the same query as the last row
    of a prefill and beside other sequences."""
    from pyx.cpu_backend import CpuBackend
    rng = np.random.default_rng(8)
    NB, BS, Hkv, Hq, D, L = 80, 16, 2, 4, 64, 600
    kc = rng.integers(0, 0x7e, (NB, BS, Hkv, D)).astype(np.uint8)
    vc = rng.integers(0, 0x7e, (NB, BS, Hkv, D)).astype(np.uint8)
    scales = np.array([0.02, 0.03], np.float32)
    tables = rng.permutation(np.arange(NB, dtype=np.int32))[:2 * 38].reshape(2, 38)
    q = rng.standard_normal((L, Hq, D)).astype(np.float32)
    q2 = rng.standard_normal((100, Hq, D)).astype(np.float32)

    def attend(b, queries, lens, seqs):
        qq = np.ascontiguousarray(np.concatenate(queries))
        qsl = np.concatenate([[0], np.cumsum([len(a) for a in queries])]).astype(np.int32)
        out = np.empty_like(qq)
        b.paged_attention(out, qq, kc, vc, np.ascontiguousarray(tables[seqs]),
                          np.array(lens, np.int32), qsl, D ** -0.5, 0, scales, scales)
        return out

    def runs(b):
        alone = attend(b, [q[-1:]], [L], [0])[-1]
        prefill = attend(b, [q], [L], [0])[-1]
        beside = attend(b, [q2, q[-1:]], [100, L], [1, 0])[-1]
        return [not np.array_equal(r.view(np.uint32), alone.view(np.uint32))
                for r in (prefill, beside)]

    assert runs(CpuBackend(batch_invariant=True)) == [False, False]
    assert any(runs(CpuBackend()))


# ---- through the HTTP API, with the official client

def test_http_seeded_request_alone_equals_in_a_crowd(tmp_path):
    """`python -m server --batch-invariant`: a seeded sampled completion gives the same text and
    logprobs alone and while 16 other requests run beside it (the server batches them; prompts
    chunked by 16)."""
    from concurrent.futures import ThreadPoolExecutor

    from server.demo_model import write_demo_checkpoint
    from server_fakes import LiveServer, client_for
    demo = write_demo_checkpoint(str(tmp_path / "demo"))
    server = LiveServer(tmp_path, demo, "--mem", "64", "--batch-invariant",
                        "--prefill-chunk-size", "16", "--max-num-batched-tokens", "64")
    try:
        client = client_for(server.port)
        model = client.models.list().data[0].id

        def complete(prompt, seed, max_tokens=16):
            r = client.completions.create(model=model, prompt=prompt, seed=seed, temperature=0.9,
                                          top_p=0.95, max_tokens=max_tokens, logprobs=3)
            lp = r.choices[0].logprobs
            return (r.choices[0].text, r.usage.completion_tokens, lp.token_logprobs,
                    lp.top_logprobs)

        target = " ".join(f"word{i}" for i in range(60))
        alone = complete(target, 7)
        assert alone[1] > 0
        with ThreadPoolExecutor(17) as pool:
            crowd = [pool.submit(complete, f"other prompt {i} " * (i + 1), i, 8 + i)
                     for i in range(16)]
            crowded = pool.submit(complete, target, 7)
            assert crowded.result() == alone
            assert all(f.result()[1] > 0 for f in crowd)
    finally:
        server.close()
