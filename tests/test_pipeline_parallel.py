"""Pipeline parallel on the CPU backend (issue 28): the layers split into stages on MPI processes
that rank 0 spawns (engine/parallel/pipeline.py), alone and with tensor parallel inside each
stage, a step's sequences flowing through the stages in micro-batches.

- Greedy tokens with pipeline_parallel_size 2 equal transformers' (up to a near-tie, as the
  family tests) and the single-process engine's, whose logprobs they equal within float
  tolerance: dense (Llama with tied embeddings, Qwen3, Gemma-2's sandwich norms and soft-caps)
  and MoE (Mixtral), with chunked prefill so that steps hold several sequences' chunks; 2 x 2
  (tensor parallel within each of 2 stages, 4 processes); q8_0 GGUFs (Qwen2, Phi-3); a GPTQ
  int4 checkpoint; n-gram speculation's verify steps.
- Beam search's KV block copies, embeddings (pooled rows' hidden states) and prompt logprobs
  cross the stages and come back to rank 0 in the batch's order.
- Micro-batches: whole sequences, about equal in tokens; rows put back in the batch's order.
- TAPER_PIPELINE_PROFILE: each stage's step records (span, time waiting on the other stage).
- A rank reads only its stage: tracemalloc's peak while stage 0 of 2 loads a checkpoint whose
  layers are nearly all of it stays near half of them.
- Clear errors: more stages than layers, a family not split into stages.
- The live server with --pipeline-parallel-size 2 streams a chat through the official openai
  client.
"""
from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from model_cases import Cases, prompts_for
import test_tensor_parallel as tensor_parallel
from test_tensor_parallel import (CASES, assert_same_as_one_process, check_split,
                                  live_server_streams_a_chat)

pytestmark = pytest.mark.timeout(300)

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("pp")), CASES)


def greedy(model, pp: int = 1, tp: int = 1, **kwargs):
    return tensor_parallel.greedy(model, tp, pipeline_parallel_size=pp, **kwargs)


@pytest.mark.parametrize("name,pp,tp", [("llama", 2, 1), ("qwen3", 2, 1), ("gemma2", 2, 1),
                                        ("mixtral", 2, 1), ("llama", 2, 2)])
def test_greedy_tokens_match_hf_and_one_process(cases, name, pp, tp):
    check_split(cases, name, f"pp{pp} tp{tp}", tp=tp, pipeline_parallel_size=pp)


@pytest.mark.parametrize("fixture", ["qwen2-q8_0", "phi3-q8_0"])
def test_gguf_stages(fixture):
    kwargs = dict(weight_file=os.path.join(DATA, f"{fixture}.gguf"))
    assert_same_as_one_process(greedy(DATA, **kwargs), greedy(DATA, 2, **kwargs), fixture)


def test_gptq_int4_stages(tmp_path):
    """An int4 (GPTQ) checkpoint: each stage reads its layers' packed words, groups and zeros."""
    from test_int4_formats import CHECKPOINT, write_gptq_awq
    floats = tiny_checkpoint(str(tmp_path / "f32"), "llama", **CHECKPOINT)
    write_gptq_awq(floats, str(tmp_path / "q"), "gptq", sym=True, g=32)
    model = str(tmp_path / "q")
    assert_same_as_one_process(greedy(model), greedy(model, 2), "gptq int4")


def test_ngram_speculation_verifies_across_stages(cases):
    """Verify steps score several rows of a sequence; the last stage's logits come back to rank
    0 in the batch's order, so speculation accepts what one process accepts."""
    from engine import LLM, SamplingParams
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    outs = []
    for pp in (1, 2):
        llm = LLM(cases.dir("llama"), pipeline_parallel_size=pp, num_kv_blocks=64,
                  speculative_config=spec)
        try:
            outs.append([list(o.token_ids) for o in llm.generate(prompts_for(), SamplingParams(
                temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=0.2))])
            accepted = llm.engine.stats().spec_num_accepted_tokens
        finally:
            llm.engine.shutdown()
    assert outs[1] == outs[0]
    assert accepted > 0


def other_paths(model: str, pp: int):
    """Beam search, embeddings and prompt logprobs through one engine (as the tensor-parallel
    test's), with several requests in a step so that micro-batches cut them."""
    from engine import LLM, SamplingParams
    llm = LLM(model, pipeline_parallel_size=pp, num_kv_blocks=64, pipeline_micro_batches=4)
    try:
        prompts = prompts_for()
        beams = llm.generate([prompts[1]], SamplingParams(use_beam_search=True, n=3,
                                                          max_tokens=10, ignore_eos=True))[0]
        embeddings = np.array([o.embedding for o in llm.embed(prompts)])
        scored = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    finally:
        llm.engine.shutdown()
    return ([list(b.token_ids) for b in beams], embeddings,
            [np.array([lp.logprob for lp in s.prompt_logprobs if lp is not None])
             for s in scored])


def test_beams_embeddings_and_prompt_logprobs_equal_one_process(cases):
    one, split = other_paths(cases.dir("llama"), 1), other_paths(cases.dir("llama"), 2)
    assert split[0] == one[0]
    np.testing.assert_allclose(split[1], one[1], rtol=0, atol=1e-5)
    for a, b, prompt in zip(one[2], split[2], prompts_for()):
        assert len(b) == len(prompt) - 1
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-4)


# ---- micro-batches

def test_micro_batches_cut_whole_sequences_and_keep_the_order():
    from engine.parallel.pipeline import in_batch_order, micro_batches
    from engine.runner.forward_batch import ForwardBatch
    lens = np.array([5, 1, 1, 9, 1, 3], np.int32)            # tokens of 6 sequences
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(qsl[-1])
    # sampled rows (each sequence's last) then two prompt-logprob rows of sequence 3
    logits_rows = np.concatenate([qsl[1:] - 1, [11, 12]]).astype(np.int32)
    batch = ForwardBatch(np.arange(T, dtype=np.int32), np.arange(T, dtype=np.int32),
                         np.arange(T, dtype=np.int32), qsl, lens + 2, None, logits_rows,
                         np.arange(6, dtype=np.int32), 4)
    pooled = np.array([0, 4, 16, 19], np.int32)
    pieces = micro_batches(batch, pooled, 3)
    assert len(pieces) == 3
    seqs = [p[0].num_seqs for p in pieces]
    assert sum(seqs) == 6 and all(seqs)
    assert [p[0].num_tokens for p in pieces] == [7, 9, 4]      # about T / 3 each
    start = 0
    for piece, _, _, _ in pieces:            # each a whole run of sequences, offsets rebased
        assert piece.query_start_loc[0] == 0
        np.testing.assert_array_equal(piece.token_ids, np.arange(start, start +
                                                                 piece.num_tokens))
        start += piece.num_tokens
    # each piece's rows, as the model would give them (the row's global token id), put back
    logits = in_batch_order(np, [p[0].token_ids[p[0].logits_indices].reshape(-1, 1)
                                 for p in pieces], [p[2] for p in pieces], len(logits_rows))
    np.testing.assert_array_equal(logits[:, 0], logits_rows)
    hidden = in_batch_order(np, [p[0].token_ids[p[1]].reshape(-1, 1) for p in pieces],
                            [p[3] for p in pieces], len(pooled))
    np.testing.assert_array_equal(hidden[:, 0], pooled)
    assert micro_batches(batch, None, 1)[0][0] is batch


def test_automatic_micro_batches_leave_small_steps_whole():
    """Automatic micro-batches: twice the stages for a long prefill, none for a decode step of a
    few sequences (each micro-batch re-reads the stage's weights); a set count is kept."""
    from engine.parallel.pipeline import PipelineRunner, PipelineStage
    stage = PipelineStage(0, 2, 0, 4, 0, 256, 64, False, None)
    auto, four = PipelineRunner(stage, 0), PipelineRunner(stage, 4)
    assert [auto.micro_batch_count(t) for t in (8, 64, 130, 512, 4096)] == [1, 1, 2, 4, 4]
    assert four.micro_batch_count(8) == 4


def test_stages_overlap_over_micro_batches(cases, monkeypatch):
    """With 4 micro-batches a step, rank 0 sends the first micro-batch on before it computes
    the second: counted on rank 0's sends and forwards (the stages run concurrently)."""
    from engine.parallel import pipeline
    events = []
    real = pipeline.PipelineStage.send_stream

    def send(self, residual):
        events.append(("send", len(residual)))
        real(self, residual)

    monkeypatch.setattr(pipeline.PipelineStage, "send_stream", send)
    from engine import LLM, SamplingParams
    llm = LLM(cases.dir("llama"), pipeline_parallel_size=2, num_kv_blocks=64,
              pipeline_micro_batches=4)
    try:
        model = llm.engine.runner.model
        real_forward = model.forward

        def forward(batch, *args, **kwargs):
            events.append(("forward", batch.num_tokens))
            return real_forward(batch, *args, **kwargs)

        model.forward = forward
        prompts = [p[:12] for p in prompts_for()] * 2
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2))
    finally:
        llm.engine.shutdown()
    first_step = events[:8]
    assert [e[0] for e in first_step] == ["forward", "send"] * 4, events[:8]
    assert [e[1] for e in first_step] == [12] * 8


PROFILED_RUN = """
import sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], pipeline_parallel_size=2, num_kv_blocks=64, pipeline_micro_batches=2)
try:
    llm.generate([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]],
                 SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.generate([[15, 16]], SamplingParams(temperature=0, max_tokens=1))   # flushes the last
finally:
    llm.engine.shutdown()
"""


def test_stage_profile_records_every_step_on_every_stage(cases, tmp_path):
    """TAPER_PIPELINE_PROFILE (engine/parallel/pipeline_profile.py, what bench/pipeline_bubble.py
    reads): a line per step on each stage, the waits inside the step's span. In a process of its
    own: MPI fixes the workers' environment at the first spawn of the test session's."""
    import glob
    import json
    import subprocess
    import sys
    prefix = str(tmp_path / "pp")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", PROFILED_RUN, cases.dir("llama")], check=True,
                   cwd=root, env={**os.environ, "TAPER_PIPELINE_PROFILE": prefix}, timeout=240)
    files = sorted(glob.glob(prefix + ".*.jsonl"))
    assert [os.path.basename(f) for f in files] == ["pp.stage0.tp0.jsonl", "pp.stage1.tp0.jsonl"]
    steps = []
    for stage, path in enumerate(files):
        with open(path) as f:
            mine = [json.loads(line) for line in f]
        # the 2-prompt generation: its prefill (10 tokens, 2 micro-batches), 2 decode steps of 2
        # sequences; the last generation's step is written before the shutdown reaches the rank
        assert [(r["tokens"], r["micro_batches"]) for r in mine[:3]] == [(10, 2), (2, 2), (2, 2)]
        assert all(r["stage"] == stage and 0 <= r["waited"] <= r["end"] - r["start"]
                   for r in mine)
        steps.append(mine)
    # the same steps on both stages, overlapping in time; stage 1 waits for stage 0's stream
    for a, b in zip(steps[0][:3], steps[1][:3]):
        assert a["start"] < b["end"] and b["start"] < a["end"]
        assert b["waited"] > 0


# ---- each rank reads only its stage

def test_a_stage_reads_only_its_layers(tmp_path):
    """The two layers (MLPs of 8,192 columns) are nearly the whole checkpoint; loading stage 0
    of 2 allocates about half of what loading the whole model does (a stage reading every
    layer and dropping the others after would allocate as much), and builds one layer, the
    embedding and no LM head (stage 1 the other layer, the final norm and the head)."""
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    tiny_checkpoint(str(tmp_path / "m"), arch="llama", intermediate_size=8192,
                    tie_word_embeddings=False)
    backend = CpuBackend(num_threads=1)

    def peak_loading(pipeline):
        tracemalloc.start()
        try:
            model, config = load_model(str(tmp_path / "m"), backend, progress=False,
                                       pipeline=pipeline)
            return model, config, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    whole = peak_loading(None)[2]
    model, config, peak = peak_loading((0, 2, 0, SingleProcess()))
    assert config.num_hidden_layers == 2 and len(model.layers) == 1
    assert model.embed_tokens is not None and model.lm_head is None and model.norm is None
    assert 0.4 * whole < peak < 0.6 * whole, f"stage 0 {peak / 1e6:.1f} MB, whole {whole / 1e6}"
    last, _, _ = peak_loading((1, 2, 0, SingleProcess()))
    assert len(last.layers) == 1 and last.embed_tokens is None
    assert last.lm_head is not None and last.norm is not None


# ---- clear errors

def test_more_stages_than_layers(cases):
    from engine import LLM
    with pytest.raises(ValueError, match="pipeline parallel 3: the model has 2 layers, fewer "
                                         "than the stages"):
        LLM(cases.dir("llama"), pipeline_parallel_size=3)


def test_a_family_not_split_into_stages(tmp_path, monkeypatch):
    """(The list narrowed to Llama: every family may be staged by now.)"""
    from engine import LLM
    from engine.parallel import pipeline
    monkeypatch.setattr(pipeline, "STAGED_ARCHITECTURES", ("LlamaForCausalLM",))
    tiny_checkpoint(str(tmp_path / "m"), arch="deepseek_v2_lite")
    with pytest.raises(ValueError, match="pipeline parallel: DeepseekV2ForCausalLM is not yet "
                                         "split into stages"):
        LLM(str(tmp_path / "m"), pipeline_parallel_size=2)


def test_server_pp_flag_is_checked():
    from server.__main__ import build_parser, check_args
    args = build_parser().parse_args(["--w", "x", "--pipeline-parallel-size", "0"])
    assert check_args(args) == "--pipeline-parallel-size must be at least 1"


# ---- the live server

def test_live_server_streams_a_chat(tmp_path):
    live_server_streams_a_chat(tmp_path, "--pipeline-parallel-size", "pipeline")
