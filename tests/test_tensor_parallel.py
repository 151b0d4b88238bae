"""Tensor parallel on the CPU backend (issue 28): the model split across MPI processes that rank 0
spawns (engine/parallel/), each rank holding its heads, its intermediate slice and its share of
the vocabulary.

- Greedy tokens with tensor_parallel_size 2 equal transformers' (up to a near-tie, as the family
  tests) and the single-process engine's, whose logprobs they equal within float tolerance (the
  row-parallel sums add the ranks' partial products in another order). Dense (Llama with tied
  embeddings and GQA, Qwen3 with q/k norm, Gemma-2's sandwich norms and soft-caps, Phi-2's
  parallel residual, dense biases and biased LM head, StableLM's per-head q/k LayerNorms, also
  on 4 ranks with its 2 KV heads replicated, Gemma 4's per-layer head sizes with a replicated
  full-layer KV head) and MoE (Gemma 4 26B-A4B's GeGLU experts beside the dense MLP, each branch
  all-reduced before its post-norm; Mixtral, experts split within), with chunked prefill so that
  block tables grow over steps;
  Llama on 4 ranks replicates its 2 KV heads. A q8_0 GGUF (Qwen2; Phi-3 with fused qkv and
  gate_up) and --isq q8_0 split along whole blocks and give the single process's tokens; so do
  GPTQ (groups of 128) and AWQ (per channel) int4 checkpoints.
- A rank reads only its share: tracemalloc's peak while rank 0 of 2 loads a checkpoint whose
  embedding is nearly all of it stays near half of that embedding.
- Clear errors: heads not divisible, formats that cannot be split (a Q4_K GGUF or a GPTQ
  checkpoint whose row-parallel shares are not whole blocks or groups, an act-order g_idx, --isq
  blocks), mpi4py missing. (compressed-tensors int4 and Marlin-format checkpoints:
  tests/test_tensor_parallel_int4_formats.py)
- The live server with --tensor-parallel-size 2 streams a chat through the official openai client,
  and its worker does not outlive it, even killed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest

from checkpoints import tiny256_checkpoint, tiny_checkpoint
from hf_oracle import assert_matches
from model_cases import GEN, Cases, prompts_for

pytestmark = pytest.mark.timeout(300)

DATA = os.path.join(os.path.dirname(__file__), "data", "gguf")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"llama": (dict(arch="llama"), None), "qwen3": (dict(arch="qwen3"), None),
         "gemma2": (dict(arch="gemma2"), None), "mixtral": (dict(arch="mixtral"), None),
         # Phi-2: partial rotary, parallel attention + MLP, dense biases (o_proj's `dense`, fc1,
         # fc2, a biased vocab-parallel lm_head), LayerNorm
         "phi": (dict(arch="phi", seed=4), None),
         # StableLM-2 12B's per-head q/k LayerNorms (qk_layernorm), held with their heads
         "stablelm_qk": (dict(arch="stablelm", qk_layernorm=True, use_parallel_residual=True,
                              use_qkv_bias=False), None),
         # Gemma 4 26B-A4B's shape: GeGLU experts (router scale, per-expert scales) beside each
         # layer's dense MLP, both post-normed; full layers with their own head size and one KV
         # head (replicated), values equal to keys
         "gemma4": (dict(arch="gemma4"), None),
         "gemma4_moe": (dict(arch="gemma4", enable_moe_block=True, num_experts=4,
                             top_k_experts=2, moe_intermediate_size=32), None)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return Cases(str(tmp_path_factory.mktemp("tp")), CASES)


def worker_pids() -> set[int]:
    """The MPI workers of this checkout: their PYTHONPATH starts with the tree rank 0 imported
    Taper from (engine/parallel/mpi.py puts it first), so the workers of other checkouts' tests
    on the same machine are not counted."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    pids = {int(line.split()[0]) for line in out.splitlines()
            if "engine.parallel.worker" in line and "ps -eo" not in line}
    return {pid for pid in pids if _python_path_root(pid) == REPO}


def _python_path_root(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:             # gone, or another user's
        return None
    return environ.get(b"PYTHONPATH", b"").decode().split(os.pathsep)[0] or None


def greedy(model, tp: int = 1, inspect=None, prompts=None, **kwargs):
    """(token ids, logprobs) of each prompt (prompts_for()'s unless given), the engine shut down
    (its workers stopped) after; with `inspect`, (that, inspect(rank 0's model)). kwargs: more
    EngineConfig, e.g. pipeline_parallel_size."""
    from engine import LLM, SamplingParams
    llm = LLM(model, tensor_parallel_size=tp, num_kv_blocks=64, max_num_batched_tokens=32,
              **kwargs)
    try:
        seen = inspect(llm.engine.model) if inspect else None
        outs = llm.generate(prompts or prompts_for(), SamplingParams(temperature=0, max_tokens=GEN,
                                                          ignore_eos=True, logprobs=0))
    finally:
        llm.engine.shutdown()
    result = ([list(o.token_ids) for o in outs],
              [np.array([lp.logprob for lp in o.logprobs]) for o in outs])
    return (result, seen) if inspect else result


def assert_same_as_one_process(one, split, label):
    """Tokens equal; logprobs within float tolerance of the single process's."""
    for i, (a, b) in enumerate(zip(one[0], split[0])):
        assert a == b, f"{label} prompt {i}: one process {a}, split {b}"
    for a, b in zip(one[1], split[1]):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-4)


def wait_for_workers_gone(before: set[int], message: str = "") -> None:
    """The workers started since `before` exit within 10 s (shutdown, or rank 0 killed)."""
    deadline = time.time() + 10
    while worker_pids() - before and time.time() < deadline:
        time.sleep(0.1)
    assert not worker_pids() - before, message


@pytest.mark.parametrize("name,tp", [("llama", 2), ("qwen3", 2), ("gemma2", 2), ("mixtral", 2),
                                     ("llama", 4), ("phi", 2), ("stablelm_qk", 2),
                                     ("stablelm_qk", 4), ("gemma4", 2),
                                     ("gemma4_moe", 2)])
def test_greedy_tokens_match_hf_and_one_process(cases, name, tp):
    check_split(cases, name, f"tp{tp}", tp=tp)


def check_split(cases, name, label, **split):
    """The split engine's greedy tokens (greedy's kwargs: split) equal transformers' and the
    single process's, and its workers exit after; what `inspect` (of rank 0's model, in split)
    saw is returned."""
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


@pytest.mark.parametrize("fixture", ["qwen2-q8_0", "phi3-q8_0"])
def test_gguf_splits_along_whole_blocks(fixture):
    kwargs = dict(weight_file=os.path.join(DATA, f"{fixture}.gguf"))
    assert_same_as_one_process(greedy(DATA, 1, **kwargs), greedy(DATA, 2, **kwargs), fixture)


def test_isq_quantizes_each_share(tmp_path):
    """With exact activations (act_split=on): the ranks' partial sums add in another order than
    one process's, and a last-bit difference can round an 8-bit activation of a later matmul the
    other way (one logprob moved 1.5e-3 under the default act_split=qkv), which is not the
    quantization of the shares this compares."""
    tiny256_checkpoint(str(tmp_path / "m"), arch="llama", dtype="float32")
    model = str(tmp_path / "m")
    how = dict(isq="q8_0", kernels="act_split=on")
    assert_same_as_one_process(greedy(model, 1, **how), greedy(model, 2, **how), "isq q8_0")


# ---- each rank reads only its share

def test_a_rank_reads_only_its_share(tmp_path):
    """The embedding (65,536 x 96 float32, 25 MB) is nearly the whole checkpoint; loading rank 0
    of 2 peaks near its half (a rank reading whole tensors and cutting them after would hold
    all of it at once)."""
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    tiny_checkpoint(str(tmp_path / "m"), arch="llama", vocab_size=65536)
    whole = 65536 * 96 * 4
    backend = CpuBackend(num_threads=1)
    tracemalloc.start()
    try:
        model, config = load_model(str(tmp_path / "m"), backend, progress=False,
                                   tensor_parallel=(0, 2, SingleProcess()))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert config.vocab_size == 65536 and model.config.vocab_size == 32768
    assert model.embed_tokens.shape == (32769, 96)      # the share and the zero row
    assert whole / 2 <= peak < 0.6 * whole, f"peak {peak / 1e6:.1f} MB, embedding {whole / 1e6} MB"


# ---- clear errors

def test_heads_not_divisible(tmp_path):
    from engine import LLM
    tiny_checkpoint(str(tmp_path / "m"), arch="qwen2")        # 3 query heads
    with pytest.raises(ValueError, match="has 3 attention heads, not divisible by 2"):
        LLM(str(tmp_path / "m"), tensor_parallel_size=2)


# ---- GPTQ / AWQ int4 (tests/test_int4_formats.py's packers and tiny-256 checkpoint)

@pytest.fixture(scope="module")
def int4_float_dir(tmp_path_factory):
    from test_int4_formats import CHECKPOINT
    return tiny_checkpoint(tmp_path_factory.mktemp("int4f32"), "llama", **CHECKPOINT)


@pytest.mark.parametrize("case", ["gptq-v1-asym-g128", "awq-channel"])
def test_gptq_awq_split_along_whole_groups(int4_float_dir, tmp_path, case):
    """q/k/v and gate/up cut along output columns (whole 8-code words of qzeros and AWQ's
    qweight), o_proj (128 of 256 input rows) and down_proj (384 of 768) along whole 128-row
    groups, or the one group per row replicated (per channel)."""
    from test_int4_formats import GPTQ_AWQ_CASES, write_gptq_awq
    qdir, _ = write_gptq_awq(int4_float_dir, tmp_path / case, *GPTQ_AWQ_CASES[case])
    assert_same_as_one_process(greedy(qdir, 1), greedy(qdir, 2), case)


def int4_rank0(qdir):
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    return load_model(qdir, CpuBackend(num_threads=1), progress=False,
                      tensor_parallel=(0, 2, SingleProcess()))


def test_gptq_row_shares_must_be_whole_groups(int4_float_dir, tmp_path):
    """Groups of 256 along K: down_proj's share of 384 input rows (of 768) is 1.5 groups (the
    first tensor the loader meets; o_proj's 128 would be half of one)."""
    from test_int4_formats import write_gptq_awq
    qdir, _ = write_gptq_awq(int4_float_dir, tmp_path / "g256", "gptq", False, 256)
    with pytest.raises(ValueError, match=r"tensor parallel 2: model\.layers\.0\.mlp\."
                                         r"down_proj\.(qweight|qzeros|scales|g_idx): the rank's "
                                         r"input columns \[0, 384\) are not whole 256-element "
                                         r"quantization groups"):
        int4_rank0(qdir)


def test_gptq_act_order_g_idx_cannot_be_cut(int4_float_dir, tmp_path):
    from safetensors.numpy import load_file, save_file
    from test_int4_formats import write_gptq_awq
    qdir, _ = write_gptq_awq(int4_float_dir, tmp_path / "actorder", "gptq", False, 128)
    path = os.path.join(qdir, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = np.ascontiguousarray(tensors[name][::-1])     # groups out of order
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.g_idx is an "
                                         r"act-order g_idx .* its input rows cannot be cut"):
        int4_rank0(qdir)


def test_q4_k_shares_must_be_whole_blocks():
    """Qwen2's o_proj has 256 input columns: a share of 128 is not a whole 256-element Q4_K
    block. Every rank fails the same way; rank 0 says so, and no worker is left behind."""
    from engine import LLM
    before = worker_pids()
    with pytest.raises(ValueError, match=r"GGUF Q4_K model\.layers\.0\.self_attn\.o_proj\.weight:"
                                         r" the rank's columns \[0, 128\) are not whole "
                                         r"256-element blocks"):
        LLM(DATA, weight_file=os.path.join(DATA, "qwen2-q4_k_m.gguf"), tensor_parallel_size=2)
    time.sleep(1)
    assert not worker_pids() - before


def test_isq_shares_must_be_whole_blocks(tmp_path):
    """The tiny model's o_proj has 96 input columns (three 32-element blocks): a share of 48 is
    not whole blocks."""
    from engine.loader.model_loader import load_model
    from engine.parallel.communicator import SingleProcess
    from pyx.cpu_backend import CpuBackend
    tiny_checkpoint(str(tmp_path / "m"), arch="llama")
    with pytest.raises(ValueError, match=r"--isq q8_0: model\.layers\.0\.self_attn\.o_proj\.weight"
                                         r"'s share of 48 columns \(of 96\) is not whole"):
        load_model(str(tmp_path / "m"), CpuBackend(num_threads=1), progress=False, isq="q8_0",
                   tensor_parallel=(0, 2, SingleProcess()))


def test_mpi4py_missing(tmp_path, monkeypatch):
    from engine import LLM
    tiny_checkpoint(str(tmp_path / "m"), arch="llama")
    monkeypatch.setitem(sys.modules, "mpi4py", None)       # `import mpi4py` fails
    with pytest.raises(ImportError, match=r"tensor parallel needs mpi4py and an MPI library: "
                                          r"pip install 'taper\[mpi\]'"):
        LLM(str(tmp_path / "m"), tensor_parallel_size=2)


# ---- the live server

def live_server_streams_a_chat(tmp_path, parallel_flag: str, kind: str) -> None:
    """The demo checkpoint served with `parallel_flag 2` (rank 0 and one worker process) streams
    the one-process server's greedy chat answer, and the worker exits when rank 0 is killed."""
    from server.demo_model import write_demo_checkpoint
    from server_fakes import LiveServer, client_for
    demo = write_demo_checkpoint(str(tmp_path / "demo"))
    before = worker_pids()
    one = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo")
    try:
        messages = [{"role": "user", "content": "Say something about parallel worlds."}]
        want = client_for(one.port).chat.completions.create(
            model="demo", messages=messages, max_tokens=12, temperature=0)
    finally:
        one.close()
    server = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo",
                        parallel_flag, "2")
    try:
        assert len(worker_pids() - before) == 1
        stream = client_for(server.port).chat.completions.create(
            model="demo", messages=messages, max_tokens=12, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices)
        assert text == want.choices[0].message.content
        assert f"{kind} parallel 2: rank 0 schedules and samples" in server.log()
    finally:
        server.close()             # SIGKILL: the worker sees rank 0 gone and exits
    wait_for_workers_gone(before, "a worker outlived its killed rank 0")


def test_live_server_streams_a_chat(tmp_path):
    live_server_streams_a_chat(tmp_path, "--tensor-parallel-size", "tensor")


def test_nccl_missing_is_named(monkeypatch):
    """The CUDA communicator's module imports anywhere; using it without CuPy's NCCL says what
    to install."""
    from engine.parallel.nccl import import_nccl
    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    with pytest.raises(ImportError, match=r"tensor parallel on CUDA needs NCCL through CuPy "
                                          r"\(cupy.cuda.nccl\): install the nvidia-nccl-cu12"):
        import_nccl()


FAULT = """
import os, signal, sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=64)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
os.kill(llm.engine.runner.peers.worker_pids[0], signal.SIGKILL)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4000, ignore_eos=True))
print("generated without the worker")
"""


def test_a_dead_worker_ends_rank_0_with_an_error(tmp_path):
    """MPI collectives have no timeout: without the watchdog rank 0 would wait for the killed
    worker forever (this test's timeout)."""
    tiny_checkpoint(str(tmp_path / "m"), arch="llama", max_position_embeddings=8192)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", FAULT, str(tmp_path / "m")], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "tensor parallel rank 1 (pid" in proc.stderr
    assert "has died; the model cannot run without it: exiting" in proc.stderr
    assert "generated without the worker" not in proc.stdout
    assert time.monotonic() - start < 60


def other_paths(model: str, tp: int):
    """Beam search (KV block copies of its forks, sent with the next step), embeddings (the
    pooled rows' hidden states) and prompt logprobs, through one engine."""
    from engine import LLM, SamplingParams
    llm = LLM(model, tensor_parallel_size=tp, num_kv_blocks=64)
    try:
        prompt = prompts_for()[1]
        beams = llm.generate([prompt], SamplingParams(use_beam_search=True, n=3, max_tokens=10,
                                                      ignore_eos=True))[0]
        embedding = np.array(llm.embed([prompt])[0].embedding)
        scored = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    finally:
        llm.engine.shutdown()
    return ([list(b.token_ids) for b in beams], embedding,
            np.array([lp.logprob for lp in scored.prompt_logprobs if lp is not None]))


def test_beams_embeddings_and_prompt_logprobs_equal_one_process(cases):
    one, split = other_paths(cases.dir("llama"), 1), other_paths(cases.dir("llama"), 2)
    assert split[0] == one[0]
    np.testing.assert_allclose(split[1], one[1], rtol=0, atol=1e-5)
    assert len(split[2]) == len(prompts_for()[1]) - 1
    np.testing.assert_allclose(split[2], one[2], rtol=0, atol=2e-4)
