"""The CUDA engine's host-side wiring, run on the CPU (issue 4: memory planning, CUDA-graph capture
and replay inside the real engine loop).

`CpuAsCuda` is the CPU backend dressed with the members only the CUDA backend has (a device
memory report, a memory pool, graph capture that records the forward and replays it on launch).
The engine is built with backend "cuda" around it, so every CUDA-only branch of LLMEngine runs:
the profiling forward, the KV budget from free memory minus the graph reservation, capture of
every bucket, replay of decode steps. The kernels are the CPU's, so the tokens must equal a plain
CPU engine's exactly; a replay that fed a graph the wrong rows or padding would change them.
"""
from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest

from engine.runner import cuda_memory
from engine.config import EngineConfig
from engine.runner.cuda_graph import estimate_graph_memory_bytes
from engine.runner.device_block_tables import DeviceBlockTables
from engine.runner.input_buffers import BlockTables
from engine.core.llm_engine import LLMEngine
from engine.runner.model_runner import ModelRunner
from engine.core.builder import capture_cuda_graphs
from engine.loader.model_loader import load_model
from engine.sampling.sampling_params import SamplingParams
from pyx.cpu_backend import CpuBackend

FREE_BYTES = 256 << 20


def numpy_as_cupy():
    """NumPy's namespace plus the one CuPy call the engine makes outside the backend."""
    xp = types.ModuleType("numpy_as_cupy")
    xp.__dict__.update({k: v for k, v in np.__dict__.items() if not k.startswith("__")})
    xp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    return xp


class _Graph:
    def __init__(self, backend, fn):
        self.backend, self.fn = backend, fn

    def launch(self):
        self.backend.replays += 1
        self.fn()


class CpuAsCuda(CpuBackend):
    xp = numpy_as_cupy()

    def __init__(self, kernels=None, num_threads=None):
        super().__init__(kernels=kernels, num_threads=num_threads)
        self.replays = 0
        self.captures = 0
        self.max_context = 0

    def memory_info(self):
        return FREE_BYTES, 4 * FREE_BYTES

    def new_graph_pool(self):
        return types.SimpleNamespace(total_bytes=lambda: 0)

    @contextlib.contextmanager
    def use_graph_pool(self, pool):
        yield

    def capture_graph(self, fn):
        self.captures += 1
        fn()
        return _Graph(self, fn)

    def pinned_empty(self, n, dtype):
        return np.full(n, -7777, dtype)

    def copy_to_device_async(self, dst, src):
        np.copyto(dst, src)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from checkpoints import tiny_checkpoint
    return tiny_checkpoint(tmp_path_factory.mktemp("wiring"))


def engine_for(model_dir, backend, **config):
    model, model_config = load_model(model_dir, backend, progress=False)
    cfg = EngineConfig(model=model_dir, backend="cuda" if isinstance(backend, CpuAsCuda) else "cpu",
                       max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False,
                       **config)
    return LLMEngine(cfg, loaded=(backend, model, model_config))


def run_varied(engine, prompts, max_tokens):
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=n,
                                                      ignore_eos=True))
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def run(engine, prompts, n=12):
    return run_varied(engine, prompts, [n] * len(prompts))


PROMPTS = [list(np.random.default_rng(s).integers(3, 500, n)) for s, n in
           [(1, 7), (2, 30), (3, 3), (4, 19), (5, 11)]]


def test_kv_budget_subtracts_the_graph_reservation(model_dir):
    backend = CpuAsCuda()
    engine = engine_for(model_dir, backend, kv_fraction=0.5, cuda_graph=True)
    mc, bs = engine.model_config, engine.config.block_size
    reserved = estimate_graph_memory_bytes(8, -(-mc.max_model_len // bs), mc)
    budget, _ = cuda_memory.kv_budget_bytes(FREE_BYTES, reserved, 0.5, None)
    assert engine.block_pool.num_blocks == budget // ModelRunner.kv_bytes_per_block(
        mc, bs, np.float32)
    # without graphs nothing is reserved: a larger pool
    plain = engine_for(model_dir, CpuAsCuda(), kv_fraction=0.5, cuda_graph=False)
    assert plain.block_pool.num_blocks > engine.block_pool.num_blocks
    assert plain.runner.graph_runner is None
    assert backend.max_context == engine.max_model_len


def test_decode_replays_graphs_and_matches_the_cpu_engine(model_dir):
    want = run(engine_for(model_dir, CpuBackend(), num_kv_blocks=64), PROMPTS)
    backend = CpuAsCuda()
    engine = engine_for(model_dir, backend, num_kv_blocks=64, cuda_graph=True)
    runner = engine.runner.graph_runner
    assert runner is not None and runner.captured and runner.sizes == [1, 2, 4, 8]
    assert backend.captures == 4
    got = run(engine, PROMPTS)
    assert got == want
    # 5 prompts of 12 tokens: the decode steps after the prefills went through the graphs
    assert backend.replays == runner.num_replays > 0


@pytest.mark.parametrize("moe", ["simple", "fused"])
def test_moe_models_capture_graphs_only_on_the_fused_path(tmp_path, moe):
    """moe=simple reads each step's expert counts on the host, which a captured graph would
    replay from its capture: such a model decodes eagerly; moe=fused captures (and matches)."""
    from checkpoints import tiny_checkpoint
    path = tiny_checkpoint(str(tmp_path / "mixtral"), arch="mixtral")
    want = run(engine_for(path, CpuBackend(), num_kv_blocks=64), PROMPTS[:3])
    backend = CpuAsCuda(kernels=f"moe={moe}")
    engine = engine_for(path, backend, num_kv_blocks=64, cuda_graph=True)
    assert (engine.runner.graph_runner is not None) == (moe == "fused")
    assert run(engine, PROMPTS[:3]) == want
    assert (backend.replays > 0) == (moe == "fused")


def test_eager_cuda_path_matches_too(model_dir):
    want = run(engine_for(model_dir, CpuBackend(), num_kv_blocks=64), PROMPTS[:2])
    backend = CpuAsCuda()
    got = run(engine_for(model_dir, backend, num_kv_blocks=64, cuda_graph=False), PROMPTS[:2])
    assert got == want and backend.replays == 0


MANY = [list(np.random.default_rng(10 + s).integers(3, 500, n))
        for s, n in enumerate([7, 30, 3, 19, 11, 25, 5, 14, 9, 22, 4, 17])]
LENGTHS = [40, 26, 53, 32, 23, 47, 36, 29, 50, 25, 44, 31]   # finishing at different steps


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_preemption_and_reused_rows_match_the_cpu_engine(model_dir, cuda_graph):
    """Twelve requests through eight sequence slots and a KV pool too small for them all: rows
    of finished sequences are reused, preempted sequences' rows are rewritten, and the device's
    block tables (engine/runner/device_block_tables.py), updated step by step, must give exactly the
    CPU engine's tokens, whose batches carry the host table itself. The tables start at 2 rows
    of 1 block: the eager path grows and widens them; the graphs reserve 8 rows (max_num_seqs)
    at capture and the twelve requests must fit them."""
    cpu = engine_for(model_dir, CpuBackend(), num_kv_blocks=10)
    want = run_varied(cpu, MANY, LENGTHS)
    assert cpu.scheduler.num_preemptions > 0
    backend = CpuAsCuda()
    engine = engine_for(model_dir, backend, num_kv_blocks=10, cuda_graph=False)
    runner = engine.runner
    runner.block_tables = BlockTables(num_rows=2, width=1)
    tables = runner.device_block_tables = DeviceBlockTables(backend, runner.block_tables)
    if cuda_graph:
        capture_cuda_graphs(engine.config, engine.model, backend, runner,   # as at start-up
                            engine.max_model_len)
        assert runner.block_tables.table.shape == (8, 10)    # 160 tokens of 16
    reallocations = tables.num_reallocations
    got = run_varied(engine, MANY, LENGTHS)
    assert got == want
    assert engine.scheduler.num_preemptions > 0
    assert np.array_equal(tables.table[:-1], runner.block_tables.table)
    if cuda_graph:
        # the reserved table held every running sequence: it never moved (rows were reused),
        # and decode steps kept replaying graphs to the end
        assert runner.block_tables.table.shape == (8, 10)
        assert tables.num_reallocations == reallocations
        assert backend.replays == runner.graph_runner.num_replays > 20
    else:
        assert tables.num_reallocations > reallocations and backend.replays == 0


# ---- graphs over verify steps and LoRA adapter rows (--kernels graphs_verify=on, graphs_lora=on)

LOOPY = dict(temperature=0, ignore_eos=True, repetition_penalty=0.2)   # outputs fall into loops
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def query_lens_replayed(engine) -> list:
    """The tokens per sequence of every batch the engine's graphs replay, recorded from now on."""
    from engine.runner.cuda_graph import uniform_query_len
    graphs = engine.runner.graph_runner
    replayed, run_graph = [], graphs.run

    def run_and_record(batch, key=None):
        replayed.append((uniform_query_len(batch), batch.lora is not None))
        return run_graph(batch, key)
    graphs.run = run_and_record
    return replayed


def generate(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("graphs_verify", ["on", "off"])
def test_verify_steps_replay_graphs_under_graphs_verify(model_dir, monkeypatch, graphs_verify):
    """n-gram speculation (k = 2) on the engine's CUDA path: verify steps of 3 rows for every
    sequence replay the (size, 3) graphs under graphs_verify=on, run eagerly under off, and the
    tokens equal the CPU engine's without speculation either way."""
    from engine.spec.costs import StepCost
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.0)   # drafts cost nothing
    rng = np.random.default_rng(3)
    motif = rng.integers(3, 500, 6).tolist()
    prompts = [motif * 4, rng.integers(3, 500, 9).tolist() * 2, motif[:4] * 5]
    params = [SamplingParams(max_tokens=24, **LOOPY)] * len(prompts)
    want = generate(engine_for(model_dir, CpuBackend(), num_kv_blocks=64), prompts, params)
    backend = CpuAsCuda(kernels=f"graphs_verify={graphs_verify}")
    engine = engine_for(model_dir, backend, num_kv_blocks=64, cuda_graph=True,
                        speculative_config=NGRAM)
    graphs = engine.runner.graph_runner
    assert graphs.query_lens == ([1, 3] if graphs_verify == "on" else [1])
    assert backend.captures == 4 * len(graphs.query_lens)
    replayed = query_lens_replayed(engine)
    assert generate(engine, prompts, params) == want
    verify_replays = sum(q == 3 for q, _ in replayed)
    if graphs_verify == "on":
        assert verify_replays > 0
    else:
        assert verify_replays == 0 and replayed       # decode steps still replay


def uneven_prompts_and_params(sampled: bool):
    """Prompts whose outputs the n-gram lookup matches only in part: two fall into loops (long
    matches), one loops on a short motif, one is random (misses, then rejections the adaptive
    policy answers with fewer drafts and pauses). Sampled: seeded, temperature 0.8."""
    rng = np.random.default_rng(7)
    motif = rng.integers(3, 500, 5).tolist()
    prompts = [motif * 3 + rng.integers(3, 500, 4).tolist(), rng.integers(3, 500, 13).tolist(),
               motif[:2] * 4, rng.integers(3, 500, 6).tolist() * 2]
    if sampled:
        return prompts, [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=30,
                                        ignore_eos=True) for i in range(len(prompts))]
    return prompts, [SamplingParams(max_tokens=30, **LOOPY), SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True)] * 2


@pytest.mark.parametrize("sampled", [False, True])
def test_uneven_verify_steps_replay_padded_graphs(model_dir, monkeypatch, sampled):
    """n-gram speculation (k = 3) whose sequences verify different draft counts in one step
    (lookup misses, the adaptive policy turning sequences down, plain decodes beside verifies):
    under graphs_verify=on those steps replay the (size, 4) graphs, each sequence's rows padded,
    and the tokens equal the eager CUDA path's (graphs_verify=off) exactly, greedy and seeded
    sampling alike, and greedy equals the CPU engine without speculation."""
    from engine.spec.adaptive import SpecState
    from engine.spec.costs import StepCost
    # a fixed worth threshold in place of the measured one: the same plans on every machine,
    # strict enough that the sequences whose drafts fail are turned down and paused
    monkeypatch.setattr(StepCost, "min_use", lambda self, rows: 0.5)
    wanted, want_drafts = [], SpecState.num_drafts_wanted

    def record(self, k, min_use, step):
        wanted.append(want_drafts(self, k, min_use, step))
        return wanted[-1]
    monkeypatch.setattr(SpecState, "num_drafts_wanted", record)
    spec = dict(NGRAM, num_speculative_tokens=3)
    prompts, params = uneven_prompts_and_params(sampled)
    eager = generate(engine_for(model_dir, CpuAsCuda(kernels="graphs_verify=off"),
                                num_kv_blocks=64, cuda_graph=True, speculative_config=spec),
                     prompts, params)
    if not sampled:                     # adaptive turned some sequences down
        assert 0 in wanted and any(0 < n < 3 for n in wanted)
    engine = engine_for(model_dir, CpuAsCuda(kernels="graphs_verify=on"), num_kv_blocks=64,
                        cuda_graph=True, speculative_config=spec)
    graphs, rows = engine.runner.graph_runner, []
    run_graph = graphs.run

    def run_and_record(batch, key=None):
        rows.append(np.diff(batch.query_start_loc).tolist())
        return run_graph(batch, key)
    graphs.run = run_and_record
    assert generate(engine, prompts, params) == eager
    uneven = [r for r in rows if len(set(r)) > 1]
    assert graphs.num_padded_replays >= len(uneven) > 0
    assert any(1 in r for r in uneven) and any(2 in r or 3 in r for r in uneven)
    if not sampled:
        assert eager == generate(engine_for(model_dir, CpuBackend(), num_kv_blocks=64), prompts,
                                 params)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    pytest.importorskip("peft", reason="peft writes the adapters")
    from hf_oracle import load_hf
    from lora_fixtures import ADAPTERS, write_adapter
    root = tmp_path_factory.mktemp("adapters")
    hf = load_hf(model_dir)
    return {name: write_adapter(hf, root / name, seed=i, **ADAPTERS[name])
            for i, name in enumerate(("alpha", "beta"))}


@pytest.mark.parametrize("graphs_lora", ["on", "off"])
def test_adapter_rows_replay_graphs_under_graphs_lora(model_dir, adapters, graphs_lora):
    """A batch mixing the base model and two adapters on the engine's CUDA path: under
    graphs_lora=on its decode steps replay the graphs over the adapter slots, under off they run
    eagerly; the tokens equal the CPU engine's either way."""
    lora = dict(modules=adapters, max_loras=2, max_lora_rank=8)
    names = [None, "alpha", "beta", "alpha", None]
    prompts = PROMPTS
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, lora_name=n)
              for n in names]
    want = generate(engine_for(model_dir, CpuBackend(), num_kv_blocks=64, lora=lora), prompts,
                    params)
    base = generate(engine_for(model_dir, CpuBackend(), num_kv_blocks=64), prompts,
                    [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)] * 5)
    assert want[1] != base[1] and want[2] != base[2]       # the adapters change the tokens
    backend = CpuAsCuda(kernels=f"graphs_lora={graphs_lora}")
    engine = engine_for(model_dir, backend, num_kv_blocks=64, cuda_graph=True, lora=lora)
    assert engine.runner.graph_runner.covers_lora == (graphs_lora == "on")
    replayed = query_lens_replayed(engine)
    assert generate(engine, prompts, params) == want
    with_adapters = sum(has_lora for _, has_lora in replayed)
    if graphs_lora == "on":
        assert with_adapters > 0
    else:
        assert with_adapters == 0 and replayed      # base-only decode steps still replay


# ---- graphs over an EAGLE-3 or MTP target (the head reads every step's hidden states)

@pytest.fixture(scope="module")
def head_targets(tmp_path_factory):
    """{method: (target directory, speculative config)}: an 8-layer Llama with a random EAGLE-3
    head (aux layers 2, 4, 5), a tiny DeepSeek-V3 with its random MTP layer. Random heads: their
    drafts depend on the target's hidden states, so states handed over wrong change them."""
    from checkpoints import tiny_checkpoint
    from eagle3_heads import HEAD, draft_vocab, random_weights, write_head
    from mtp_heads import mtp_checkpoint
    root = tmp_path_factory.mktemp("heads")
    head = write_head(root / "head", random_weights(HEAD), draft_vocab(512, 384, seed=1))
    return {"eagle3": (tiny_checkpoint(root / "llama8", "llama", num_hidden_layers=8),
                       {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}),
            "mtp": (mtp_checkpoint(root / "deepseek"),
                    {"method": "mtp", "num_speculative_tokens": 2})}


def drafts_proposed(engine) -> list:
    """Every step's drafts, recorded from now on."""
    spec, proposed = engine.speculator, []
    draft = spec.draft

    def draft_and_record(runner, sched, batch, structured):
        probs = draft(runner, sched, batch, structured)
        proposed.append([list(d) for d in sched.drafts])
        return probs
    spec.draft = draft_and_record
    return proposed


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_head_targets_replay_graphs_with_their_hidden_states(head_targets, monkeypatch, method):
    """EAGLE-3 and MTP (k = 2) on the engine's CUDA path under graphs_verify=on: decode and
    verify steps replay graphs that hand the head the rows' hidden states, so the head drafts
    exactly what it drafts on the eager CUDA path, and the tokens are the CPU engine's without
    speculation."""
    from engine.spec.adaptive import SpecState
    # every sequence drafts k every step, however few a random head gets accepted
    monkeypatch.setattr(SpecState, "num_drafts_wanted", lambda self, k, min_use, step: k)
    directory, spec = head_targets[method]
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 500, n).tolist() for n in (6, 21, 13)]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts)
    want = generate(engine_for(directory, CpuBackend(), num_kv_blocks=64), prompts, params)
    # (DeepSeek-V3's experts take the fused path: moe=simple decodes without graphs)
    eager = engine_for(directory, CpuAsCuda(kernels="moe=fused"), num_kv_blocks=64,
                       cuda_graph=False, speculative_config=spec)
    eager_drafts = drafts_proposed(eager)
    assert generate(eager, prompts, params) == want
    backend = CpuAsCuda(kernels="graphs_verify=on,moe=fused")
    engine = engine_for(directory, backend, num_kv_blocks=64, cuda_graph=True,
                        speculative_config=spec)
    graphs = engine.runner.graph_runner
    assert graphs.hidden_capture is engine.runner.aux_capture is not None
    assert graphs.query_lens == [1, 3]
    replayed = query_lens_replayed(engine)
    got_drafts = drafts_proposed(engine)
    assert generate(engine, prompts, params) == want
    assert got_drafts == eager_drafts and any(any(d) for d in got_drafts)
    assert engine.speculator.stats.num_drafts > 0
    verify_replays = sum(q == 3 for q, _ in replayed)
    assert verify_replays > 3 and backend.replays == len(replayed)
    assert any(q == 1 for q, _ in replayed)       # the last token, with no room for drafts: a decode graph


def test_head_targets_capture_no_graphs_under_graphs_verify_off(head_targets):
    """Until a GPU window has checked the graphs' hand-over, EAGLE-3 and MTP targets run every
    step eagerly unless graphs_verify=on."""
    directory, spec = head_targets["mtp"]
    backend = CpuAsCuda(kernels="moe=fused")
    engine = engine_for(directory, backend, num_kv_blocks=64, cuda_graph=True,
                        speculative_config=spec)
    assert engine.runner.graph_runner is None and backend.captures == 0
