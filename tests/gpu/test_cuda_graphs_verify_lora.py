"""CUDA graphs over LoRA adapter rows and speculative verify steps (KernelConfig graphs_lora=on,
graphs_verify=on; engine/runner/cuda_graph.py), on the GPU:

- `lora_linear_slots` (cuda/lora.cu: shrink and expand reading each row's adapter slot on the
  device) against the float64 oracle for each activation dtype and against the CPU backend's
  lora_linear (pyx/lora_kernels.c), rows of the base model (slot -1) left exactly as they were;
- the op captured in a CUDA graph once and replayed with other slots and other inputs written
  into its static buffers: each replay equals the eager op (graph-safe: nothing about the rows is
  baked in at capture);
- the graph runner on a bf16 tiny-256 Llama with random LoRA slots: decode and verify steps
  (k = 2) with and without adapter rows replayed against the eager forward, logits within bf16
  rounding (the CPU's version of this check: tests/test_cuda_graph_verify_lora.py); the same
  with an EAGLE-3 or MTP head's capture, the hidden states each replay hands over against the
  eager forward's;
- the engine, bf16 tiny-256 Llama: a batch mixing the base model and two peft adapters with
  graphs_lora=on replays graphs on steps with adapter rows, and n-gram speculation (k = 2) with
  graphs_verify=on replays the verify graphs; greedy tokens equal the CPU engine's up to its
  first near-tie (test_cuda_model.py's rule) and the emitted tokens' logprobs equal the eager
  CUDA path's (graphs off for those steps); EAGLE-3 (tiny-256 Llama) and MTP (DeepSeek-V3 tiny)
  with graphs_verify=on replay verify graphs, tokens and drafts as on the eager CUDA path;
- uneven verify steps (0 to k drafts a sequence) replayed on the (size, k + 1) graphs padded:
  the runner against the eager forward, and the engine (n-gram, k = 3, adaptive) against the
  eager CUDA path.

bench/gpu_check.sh runs this file in the first suite's switches step; bench/gpu_summary.py
credits its tests to the two switches (the runner's test to graphs_verify)."""
from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from test_cuda_lora import cpu_margins_lora, lora_case, lora_model  # noqa: F401 (fixture)
from test_cuda_model import compare, random_prompts
from test_cuda_ops import DTYPES, TOL, to_dev, to_host

# bf16 forwards on both sides; the LoRA deltas by other kernels (cuBLAS against cuda/lora.cu)
LOGPROB_TOL = 0.05


def slots_of(rows, seg_offsets, seg_slots, T):
    """lora_case's segments as one slot per row (-1: no adapter)."""
    out = np.full(T, -1, np.int32)
    for g, s in enumerate(seg_slots):
        out[rows[seg_offsets[g]:seg_offsets[g + 1]]] = s
    return out


# ---- the op

@pytest.mark.parametrize("K", [256, 100])    # the shrink's 16-byte loads; one element at a time
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_slots_matches_reference(make_cuda, dtype, K):
    be = make_cuda(dtype)
    x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out = lora_case(dtype, seed=3, K=K)
    want = ref.lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out)
    slot_of_row = slots_of(rows, seg_offsets, seg_slots, len(out))
    dout = to_dev(be, out)
    be.lora_linear_slots(to_dev(be, x), to_dev(be, a), to_dev(be, b), parts,
                         to_dev(be, slot_of_row), dout)
    got = to_host(be, dout).astype(np.float64)
    untouched = slot_of_row < 0
    assert untouched.any() and (got[untouched] == ref.to_f64(out)[untouched]).all()
    delta_got = got[~untouched] - ref.to_f64(out)[~untouched]
    delta_want = want[~untouched] - ref.to_f64(out)[~untouched]
    err = np.linalg.norm(delta_got - delta_want) / np.linalg.norm(delta_want)
    assert err < 4 * TOL[dtype], err


def test_lora_linear_slots_matches_the_cpu_kernel(make_cuda, cpu):
    be = make_cuda("f32")
    x, a, b, ranks, parts, rows, seg_offsets, seg_slots, out = lora_case("f32", seed=4)
    want = out.copy()
    cpu.lora_linear(x, a, b, ranks, parts, rows, seg_offsets, seg_slots, want)
    dout = to_dev(be, out)
    be.lora_linear_slots(to_dev(be, x), to_dev(be, a), to_dev(be, b), parts,
                         to_dev(be, slots_of(rows, seg_offsets, seg_slots, len(out))), dout)
    np.testing.assert_allclose(to_host(be, dout), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_lora_linear_slots_replays_in_a_graph(make_cuda, dtype):
    """Captured once on static buffers, replayed with three other slot assignments (all base
    rows, every row one adapter, a mix) and new inputs: each replay equals the eager op."""
    be = make_cuda(dtype)
    x0, a, b, ranks, parts, rows, seg_offsets, seg_slots, out0 = lora_case(dtype, seed=5)
    T = len(out0)
    da, db = to_dev(be, a), to_dev(be, b)
    sx, sout, sslots = to_dev(be, x0), to_dev(be, out0), to_dev(be, np.full(T, -1, np.int32))
    pool = be.new_graph_pool()
    with be.use_graph_pool(pool):
        be.lora_linear_slots(sx, da, db, parts, sslots, sout)      # warm-up, eagerly
        graph = be.capture_graph(lambda: be.lora_linear_slots(sx, da, db, parts, sslots, sout))
    rng = np.random.default_rng(6)
    S = a.shape[0]
    for slot_of_row in (np.full(T, -1, np.int32), np.full(T, 2, np.int32),
                        rng.integers(-1, S, T).astype(np.int32)):
        x = rng.standard_normal(x0.shape).astype(x0.dtype)
        out = rng.standard_normal(out0.shape).astype(out0.dtype)
        with be.stream:
            sx[...] = to_dev(be, x)
            sout[...] = to_dev(be, out)
            sslots[...] = to_dev(be, slot_of_row)
        graph.launch()
        got = to_host(be, sout)
        eager = to_dev(be, out)
        be.lora_linear_slots(to_dev(be, x), da, db, parts, to_dev(be, slot_of_row), eager)
        np.testing.assert_array_equal(got, to_host(be, eager))
        base = slot_of_row < 0
        assert (got[base] == out[base]).all()
        if not base.all():
            assert not np.array_equal(got[~base], out[~base])


# ---- the graph runner against the eager forward

def replay_against_eager(backend, checkpoint_dir, rel_tol, lora_scale=0.05, new_capture=None,
                         uneven=False):
    """tests/test_cuda_graph_verify_lora.py's replay check on `backend` (one with graph capture:
    CudaBackend here): eight prefilled sequences, then decode and verify steps with and without
    adapter rows (STEPS), each run eagerly (adapter rows by lora_linear's segments, as
    ModelRunner runs them) and by replaying the runner's graph on a copy of the KV cache;
    returns how many steps' logits were compared. The logits must agree within rel_tol of the
    largest eager logit (tol) and pick the same token wherever the eager top-two margin is over
    4 tol. lora_scale: the adapters' random A and B entries' scale. new_capture: makes a
    speculative head's capture (AuxCapture, FinalCapture): the graphs are captured with one,
    and the states each replay hands over must agree with the eager forward's, within rel_tol
    of their largest. uneven: the steps are decode-only steps of 0 to K drafts a sequence
    (UNEVEN), which the runner (given the block size) replays on its (size, K + 1) graphs, padded."""
    from engine.loader.model_loader import load_model
    from engine.runner.cuda_graph import CudaGraphRunner
    from engine.runner.model_runner import ModelRunner
    from test_cuda_graph import make_seq, schedule
    from test_cuda_graph_verify_lora import (K, STEPS, UNEVEN, lora_batch, random_adapters,
                                             verify_schedule)

    def host(a):
        return np.asarray(backend.to_host(a), np.float32)
    model, config = load_model(checkpoint_dir, backend, progress=False)
    rng = np.random.default_rng(9)
    step = random_adapters(model, config, backend, getattr(backend, "act_dtype", np.float32),
                           rng, scale=lora_scale)
    block_size, max_blocks = 16, 6
    eager = ModelRunner(model, config, backend, block_size, num_blocks=64)
    graphed = ModelRunner(model, config, backend, block_size, num_blocks=64)
    free = list(rng.permutation(np.arange(1, 64)))
    seqs = []
    for n in [5, 13, 8, 21, 3, 17, 9, 11]:
        table = [int(free.pop()) for _ in range(-(-(n + 24) // block_size))]
        seqs.append(make_seq(rng.integers(3, 500, n).tolist(), 0, table))
    batch = eager.prepare(schedule(seqs, [len(s.token_ids) for s in seqs]))
    logits = host(model.forward(eager.to_device(batch), eager.kv_caches))
    for seq, row in zip(seqs, logits):
        seq.num_computed_tokens = len(seq.token_ids)
        seq.append_token(int(np.argmax(row)))
    for (ka, va), (kb, vb) in zip(eager.kv_caches, graphed.kv_caches):
        backend.xp.copyto(kb, ka)
        backend.xp.copyto(vb, va)
    # one device table for both: the graphs gather the rows the eager batches gather
    capture = eager_capture = None
    if new_capture is not None:
        capture, eager_capture = new_capture(), new_capture()
    graphs = CudaGraphRunner(model, backend, graphed.kv_caches, 8, max_blocks,
                             eager.device_block_tables, (1, K + 1), step, capture,
                             block_size if uneven else None)
    graphs.capture()
    compared = 0
    steps = UNEVEN if uneven else [(m, None if k is None else [k] * len(m), s)
                                   for m, k, s in STEPS]
    for members, ks, slots in steps:
        group = [seqs[i] for i in members]
        sched = (schedule(group, [1] * len(group)) if ks is None else
                 verify_schedule(group, [rng.integers(3, 500, k).tolist() for k in ks]))
        rows = [1] * len(group) if ks is None else [k + 1 for k in ks]
        ends = np.cumsum(rows)
        batch = eager.prepare(sched)
        if slots is not None:
            batch.lora = lora_batch(slots, rows)
        dev = eager.to_device(batch)        # applies the table's update for both
        assert graphs.can_run(batch), members
        if batch.lora is not None:
            step.rows = backend.asarray(batch.lora.rows)
            step.seg_offsets, step.seg_slots = batch.lora.seg_offsets, batch.lora.seg_slots
        try:
            want = host(model.forward(dev, eager.kv_caches, **(
                {} if eager_capture is None else {"capture": eager_capture})))
        finally:
            step.rows = None
        got = host(graphs.run(batch))
        backend.synchronize()
        if capture is not None:
            got_states, want_states = host(capture.states), host(eager_capture.states)
            assert got_states.shape == want_states.shape == (sum(rows), want_states.shape[1])
            np.testing.assert_allclose(got_states, want_states, rtol=0,
                                       atol=rel_tol * np.abs(want_states).max(),
                                       err_msg=f"states {members}")
            capture.states = eager_capture.states = None
        assert got.shape == want.shape == (sum(rows), want.shape[1])
        assert np.isfinite(got).all(), members
        tol = rel_tol * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=str(members))
        top2 = np.sort(want, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 4 * tol
        assert (got.argmax(1)[clear] == want.argmax(1)[clear]).all(), members
        for i, seq in enumerate(group):     # every draft accepted, then the next token
            for t in (sched.drafts[i] if ks is not None else []):
                seq.append_token(int(t))
            seq.num_computed_tokens += rows[i]
            seq.append_token(int(np.argmax(want[ends[i] - 1])))
        compared += 1
    assert graphs.num_replays == len(steps)
    assert graphs.num_padded_replays == (len(steps) if uneven else 0)
    return compared


def test_runner_replays_verify_and_adapter_steps_like_eager(make_cuda, tmp_path):
    """bf16 tiny-256 Llama (head_dim 64: the verify graphs' attention is the fa3 / fa2 prefill
    kernel): decode and verify graphs over LoRA slots against the eager forward, logits within
    bf16 rounding."""
    from checkpoints import tiny256_checkpoint
    path = tiny256_checkpoint(str(tmp_path / "llama"), "llama", dtype="bfloat16")
    assert replay_against_eager(make_cuda("bf16"), path, rel_tol=0.03) == 8


@pytest.mark.parametrize("kind", [None, "final"])
def test_runner_replays_uneven_verify_steps_padded(make_cuda, tmp_path, kind):
    """Decode-only steps whose sequences verify 0 to K drafts (some with adapter rows; with an
    MTP head's FinalCapture, its states too) replayed on the (size, K + 1) graphs, each
    sequence's rows padded with filler rows that write no KV and are never handed back: the
    real rows' logits (and states) against the eager forward's within bf16 rounding."""
    from checkpoints import tiny256_checkpoint
    from engine.models.llama import FinalCapture
    path = tiny256_checkpoint(str(tmp_path / "llama"), "llama", dtype="bfloat16")
    assert replay_against_eager(make_cuda("bf16"), path, rel_tol=0.03, uneven=True,
                                new_capture=FinalCapture if kind else None) == 5


@pytest.mark.parametrize("kind", ["aux", "final"])
def test_runner_hands_over_the_heads_hidden_states(make_cuda, tmp_path, kind):
    """The same replay with an EAGLE-3 head's AuxCapture (the residual streams entering layers
    0 and 1) or an MTP head's FinalCapture (every row's final-norm state): the states each
    decode and verify replay hands over equal the eager forward's within bf16 rounding."""
    from checkpoints import tiny256_checkpoint
    from engine.models.llama import AuxCapture, FinalCapture
    path = tiny256_checkpoint(str(tmp_path / "llama"), "llama", dtype="bfloat16")
    new = (lambda: AuxCapture((0, 1))) if kind == "aux" else FinalCapture
    assert replay_against_eager(make_cuda("bf16"), path, rel_tol=0.03, new_capture=new) == 8


# ---- the engine

def replays(llm):
    """(tokens per sequence, has adapter rows) of every batch the engine's graphs replay from
    now on."""
    from engine.runner.cuda_graph import uniform_query_len
    graphs = llm.engine.runner.graph_runner
    seen, run_graph = [], graphs.run

    def run_and_record(batch, key=None):
        seen.append((uniform_query_len(batch), batch.lora is not None))
        return run_graph(batch, key)
    graphs.run = run_and_record
    return seen


def compare_logprobs(label, got, want):
    """The emitted tokens' logprobs of two CUDA runs, over their common prefix of tokens."""
    n = 0
    while n < min(len(got.token_ids), len(want.token_ids)) and \
            got.token_ids[n] == want.token_ids[n]:
        n += 1
    a = np.array([lp.logprob for lp in got.logprobs[:n]])
    b = np.array([lp.logprob for lp in want.logprobs[:n]])
    assert np.abs(a - b).max(initial=0.0) < LOGPROB_TOL, (label, a, b)
    return n


def test_adapter_rows_replay_graphs_under_graphs_lora(lora_model):  # noqa: F811
    from engine import LLM, SamplingParams

    base, adapters = lora_model
    lora = dict(modules=adapters, max_loras=2, max_lora_rank=16)

    def llm(backend, **config):
        return LLM(base, backend=backend, dtype="bf16", num_kv_blocks=256, max_num_seqs=8,
                   lora=lora, **config)
    graphed = llm("cuda", cuda_graph=True, kernels="graphs_lora=on")
    eager = llm("cuda", cuda_graph=False)
    cpu = llm("cpu")
    assert graphed.engine.runner.graph_runner.covers_lora
    seen = replays(graphed)
    prompts = random_prompts(8, (9, 30, 17, 44, 12, 25))
    names = [None, "alpha", "beta", "alpha", None, "beta"]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, lora_name=n,
                             logprobs=1) for n in names]
    got = graphed.generate(prompts, params)
    eager_out = eager.generate(prompts, params)
    want = cpu.generate(prompts, params)
    compared = same = 0
    for i, (g, e, w) in enumerate(zip(got, eager_out, want)):
        margins = cpu_margins_lora(cpu, prompts[i], w.token_ids, names[i])
        compared += compare(f"{names[i]} prompt {i}", g.token_ids, w.token_ids, margins)
        same += compare_logprobs(f"{names[i]} prompt {i}", g, e)
    assert compared >= 24 and same >= 24, (compared, same)
    assert sum(has_lora for _, has_lora in seen) > 0, "no step with adapter rows replayed"


def test_verify_steps_replay_graphs_under_graphs_verify(monkeypatch, tmp_path):
    from checkpoints import tiny256_checkpoint
    from engine import LLM, SamplingParams
    from engine.spec.costs import StepCost

    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)   # drafts cost nothing
    path = tiny256_checkpoint(str(tmp_path / "llama"), "llama", dtype="bfloat16")
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}

    def llm(backend, **config):
        return LLM(path, backend=backend, dtype="bf16", num_kv_blocks=256, max_num_seqs=8,
                   **config)
    graphed = llm("cuda", cuda_graph=True, kernels="graphs_verify=on", speculative_config=spec)
    eager = llm("cuda", cuda_graph=False, speculative_config=spec)
    cpu = llm("cpu", logprobs_mode="processed")    # margins of the penalized logits, as sampled
    assert graphed.engine.runner.graph_runner.query_lens == [1, 3]
    seen = replays(graphed)
    rng = np.random.default_rng(12)
    motif = rng.integers(3, 500, 6).tolist()
    prompts = [motif * 5, rng.integers(3, 500, 9).tolist() * 3, motif[:4] * 6]
    # repetition_penalty < 1: the random model's output loops, which prompt lookup predicts
    loopy = dict(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=0.2)
    got = graphed.generate(prompts, SamplingParams(**loopy, logprobs=1))
    eager_out = eager.generate(prompts, SamplingParams(**loopy, logprobs=1))
    compared = same = 0
    for i, (prompt, g, e) in enumerate(zip(prompts, got, eager_out)):
        w = cpu.generate([prompt], SamplingParams(**loopy, logprobs=2))[0]
        top = np.array([lp.top_logprobs[:2] for lp in w.logprobs], np.float64)
        compared += compare(f"prompt {i}", g.token_ids, w.token_ids, top[:, 0] - top[:, 1])
        same += compare_logprobs(f"prompt {i}", g, e)
    assert sum(q == 3 for q, _ in seen) > 0, "no verify step replayed a graph"
    assert compared >= 24 and same >= 24, (compared, same)


def test_uneven_verify_steps_replay_padded_graphs(monkeypatch, tmp_path):
    """n-gram speculation (k = 3) where sequences verify different draft counts in one step
    (lookup misses, the adaptive policy turning sequences down, plain decodes beside verifies):
    under graphs_verify=on those steps replay the (size, 4) graphs padded; greedy tokens equal
    the eager CUDA path's up to its near-ties, and the emitted tokens' logprobs equal it.
    tests/test_cuda_engine_wiring.py is the CPU's version (exact there)."""
    from checkpoints import tiny256_checkpoint
    from engine import LLM, SamplingParams
    from engine.spec.costs import StepCost

    # a fixed worth threshold: sequences whose drafts fail are turned down and paused
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.5)
    path = tiny256_checkpoint(str(tmp_path / "llama"), "llama", dtype="bfloat16")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}

    def llm(**config):      # logprobs (and margins) of the penalized logits, as sampled
        return LLM(path, backend="cuda", dtype="bf16", num_kv_blocks=256, max_num_seqs=8,
                   speculative_config=spec, logprobs_mode="processed", **config)
    graphed = llm(cuda_graph=True, kernels="graphs_verify=on")
    eager = llm(cuda_graph=False)
    graphs = graphed.engine.runner.graph_runner
    assert graphs.query_lens == [1, 4] and graphs.pad_query_len == 4
    rng = np.random.default_rng(7)
    motif = rng.integers(3, 500, 5).tolist()
    prompts = [motif * 3 + rng.integers(3, 500, 4).tolist(), rng.integers(3, 500, 13).tolist(),
               motif[:2] * 4, rng.integers(3, 500, 6).tolist() * 2]
    loopy = dict(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=0.2)
    plain = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
    params = [SamplingParams(**loopy, logprobs=2), SamplingParams(**plain, logprobs=2)] * 2
    got = graphed.generate(prompts, params)
    want = eager.generate(prompts, params)
    compared = same = 0
    for i, (g, w) in enumerate(zip(got, want)):
        top = np.array([lp.top_logprobs[:2] for lp in w.logprobs], np.float64)
        compared += compare(f"prompt {i}", g.token_ids, w.token_ids, top[:, 0] - top[:, 1])
        same += compare_logprobs(f"prompt {i}", g, w)
    assert graphs.num_padded_replays > 3, "too few uneven verify steps replayed a graph"
    assert compared >= 32 and same >= 32, (compared, same)


def drafts_of(llm) -> list:
    """Every step's drafts (one list per sequence), recorded from now on."""
    spec, proposed = llm.engine.speculator, []
    draft = spec.draft

    def draft_and_record(runner, sched, batch, structured):
        probs = draft(runner, sched, batch, structured)
        proposed.append([list(d) for d in sched.drafts])
        return probs
    spec.draft = draft_and_record
    return proposed


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_head_targets_replay_graphs_under_graphs_verify(monkeypatch, tmp_path, method):
    """EAGLE-3 (bf16 tiny-256 Llama, a random head over layers 0 and 1) and MTP (DeepSeek-V3
    tiny, its random MTP layer: the verify graphs' attention is MLA's) with k = 2 drafts every
    step under graphs_verify=on: decode and verify steps replay graphs that hand the head the
    hidden states; greedy tokens equal the eager CUDA path's up to its near-ties (that path
    against the CPU: test_cuda_features.py, test_cuda_mla.py), and the heads draft what they
    draft there (bf16 near-ties of the head's argmax aside).
    tests/test_cuda_engine_wiring.py is the CPU's version (exact there)."""
    from checkpoints import tiny256_checkpoint
    from engine import LLM, SamplingParams
    from engine.spec.adaptive import SpecState

    monkeypatch.setattr(SpecState, "num_drafts_wanted", lambda self, k, min_use, step: k)
    if method == "eagle3":
        from eagle3_heads import HEAD, draft_vocab, random_weights, write_head
        path = tiny256_checkpoint(str(tmp_path / "llama"), "llama", dtype="bfloat16")
        cfg = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64)
        head = write_head(tmp_path / "head", random_weights({**HEAD, **cfg}, num_aux=2),
                          draft_vocab(512, 384, seed=1), eagle_aux_hidden_state_layer_ids=[0, 1],
                          **cfg)
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 2}
    else:
        from mtp_heads import mtp_checkpoint
        path = mtp_checkpoint(tmp_path / "deepseek")
        spec = {"method": "mtp", "num_speculative_tokens": 2}

    def llm(backend, **config):
        return LLM(path, backend=backend, dtype="bf16", num_kv_blocks=256, max_num_seqs=8,
                   **config)
    # DeepSeek-V3's experts take the fused path (moe=simple decodes without graphs)
    graphed = llm("cuda", cuda_graph=True, kernels="graphs_verify=on,moe=fused",
                  speculative_config=spec)
    # margins of the penalized logits, as sampled
    eager = llm("cuda", cuda_graph=False, speculative_config=spec, logprobs_mode="processed",
                kernels="moe=fused")
    graphs = graphed.engine.runner.graph_runner
    assert graphs.query_lens == [1, 3] and graphs.hidden_capture is not None
    seen = replays(graphed)
    graphed_drafts, eager_drafts = drafts_of(graphed), drafts_of(eager)
    prompts = random_prompts(21, (9, 30, 17))
    # repetition_penalty < 1 widens the random model's margins
    loopy = dict(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=0.2)
    got = graphed.generate(prompts, SamplingParams(**loopy))
    want = eager.generate(prompts, SamplingParams(**loopy, logprobs=2))
    compared = 0
    for i, (g, w) in enumerate(zip(got, want)):
        top = np.array([lp.top_logprobs[:2] for lp in w.logprobs], np.float64)
        compared += compare(f"{method} prompt {i}", g.token_ids, w.token_ids,
                            top[:, 0] - top[:, 1])
    assert compared >= 24, f"only {compared} tokens compared: near-ties everywhere"
    assert sum(q == 3 for q, _ in seen) > 3, "too few verify steps replayed a graph"
    steps = min(len(graphed_drafts), len(eager_drafts))
    same = sum(a == b for a, b in zip(graphed_drafts, eager_drafts))
    assert steps >= 8 and same >= 0.8 * steps, (same, steps, graphed_drafts, eager_drafts)
