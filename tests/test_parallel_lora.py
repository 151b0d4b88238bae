"""LoRA adapters on a split engine (engine/lora/shards.py): requests naming two adapters and the
base model in one batch give, at tensor parallel 2 and pipeline parallel 2, the tokens of one
process and of transformers with peft's merged weights; a rank's share of an adapter is cut as
the base weight is (KV heads replicated past their count included); an adapter loaded at run time
reaches every rank (through the engine, and through a live server's route), and one a rank cannot
read is an error naming that rank, the engine serving on; data-parallel replicas each serve every
adapter, those given at start and those loaded through the server."""
from __future__ import annotations

import numpy as np
import pytest

from engine import LLM
from engine.lora.adapter import LoraError, read_adapter
from engine.lora.shards import AdapterShard
from engine.models.model_config import ModelConfig
from engine.parallel.sharding import ShardPlan
from hf_oracle import assert_matches, hf_greedy, load_hf
from lora_fixtures import merged, write_adapter
from server_fakes import LiveServer, http_request
from test_lora import PROMPTS, N, adapters, base, greedy  # noqa: F401 (fixtures)
from test_lora_server import PROMPT, complete, demo  # noqa: F401 (fixture)
from test_data_parallel import concurrently, generation_tokens_by_replica
from test_tensor_parallel import wait_for_workers_gone, worker_pids

pytestmark = pytest.mark.timeout(600)

NAMES = (None, "alpha", "gamma")        # the base model and two adapters, in one batch
CASES = [(prompt, name) for prompt in PROMPTS for name in NAMES]


def mixed_batch(base, adapters, **config):
    """(token ids, logprobs) of every case, generated together; the engine shut down after."""
    llm = LLM(base, num_kv_blocks=64, max_num_batched_tokens=32,
              lora=dict(modules={n: adapters[n] for n in NAMES if n}, max_loras=2,
                        max_lora_rank=8), **config)
    try:
        outs = llm.generate([p for p, _ in CASES], [greedy(n, logprobs=0) for _, n in CASES])
    finally:
        llm.engine.shutdown()
    return ([list(o.token_ids) for o in outs],
            [np.array([lp.logprob for lp in o.logprobs]) for o in outs])


@pytest.fixture(scope="module")
def one(base, adapters):
    return mixed_batch(base, adapters)


def assert_same(one, split, label):
    for (prompt, name), a, b in zip(CASES, one[0], split[0]):
        assert a == b, f"{label} {name} {prompt[:3]}: one process {a}, split {b}"
    for a, b in zip(one[1], split[1]):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-4)


@pytest.mark.parametrize("split", [dict(tensor_parallel_size=2),
                                   dict(pipeline_parallel_size=2, pipeline_micro_batches=2),
                                   dict(tensor_parallel_size=2, pipeline_parallel_size=2,
                                        pipeline_micro_batches=2)],
                         ids=["tp2", "pp2", "pp2xtp2"])
def test_mixed_batch_matches_one_process_and_peft(base, adapters, one, split):
    before = worker_pids()
    got = mixed_batch(base, adapters, **split)
    assert_same(one, got, str(split))
    oracles = {None: load_hf(base), **{n: merged(base, adapters[n]) for n in NAMES if n}}
    for (prompt, name), tokens in zip(CASES, got[0]):
        assert_matches(tokens, hf_greedy(oracles[name], prompt, N), label=f"{name} {prompt[:3]}")
    assert len({tuple(t) for t in got[0][:len(NAMES)]}) == len(NAMES)   # three models
    wait_for_workers_gone(before)


def test_a_rank_holds_the_base_weights_cut(base, adapters):
    """Tensor parallel 4 over 4 query and 2 KV heads: each rank's B rows are its q heads' and
    its (replicated) KV head's, its A columns (o, down) its input columns; the shares put back
    together are the whole adapter."""
    config = ModelConfig.from_pretrained(base)
    whole = read_adapter("alpha", adapters["alpha"], config, 8,
                         {layer: {"qkv", "o", "gate_up", "down"} for layer in range(2)})
    shares = [read_adapter("alpha", adapters["alpha"], config, 8,
                           {layer: {"qkv", "o", "gate_up", "down"} for layer in range(2)},
                           AdapterShard(ShardPlan(config, rank, 4)))
              for rank in range(4)]
    d = config.head_dim
    for key, parts in whole.deltas.items():
        for i, part in enumerate(parts):
            mine = [share.deltas[key][i] for share in shares]
            if key[1] in ("o", "down"):          # row-parallel: A's columns, B whole
                np.testing.assert_array_equal(np.concatenate([m.a for m in mine], 1), part.a)
                assert all(np.array_equal(m.bt, part.bt) for m in mine)
                continue
            assert all(np.array_equal(m.a, part.a) for m in mine)
            if key[1] == "qkv" and part.part > 0:     # k or v: KV head rank // 2, replicated
                for rank, m in enumerate(mine):
                    head = rank // 2
                    np.testing.assert_array_equal(m.bt, part.bt[:, head * d:(head + 1) * d])
            else:
                np.testing.assert_array_equal(np.concatenate([m.bt for m in mine], 1), part.bt)


def test_runtime_load_reaches_every_rank_and_a_rank_that_cannot_read_is_named(
        base, adapters, one, tmp_path):
    before = worker_pids()
    llm = LLM(base, tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=32,
              lora=dict(modules={}, max_loras=2, max_lora_rank=8))
    try:
        manager = llm.engine.lora
        manager.load("late", adapters["gamma"])
        late = [p for p, n in CASES if n == "gamma"]
        outs = llm.generate(late, greedy("late", logprobs=0))
        want = [t for (_, n), t in zip(CASES, one[0]) if n == "gamma"]
        assert [list(o.token_ids) for o in outs] == want
        # a rank that cannot read what rank 0 sends: an error naming it, the engine serving on
        with pytest.raises(LoraError, match=r"'lost'.*rank 1 could not read its share.*no such"):
            manager.peers.load_lora("lost", str(tmp_path / "gone"), 10**9)
        manager.unload("late")
        manager.load("late", adapters["alpha"])     # the name again, other weights
        outs = llm.generate(late, greedy("late", logprobs=0))
        want = [t for (_, n), t in zip(CASES, one[0]) if n == "alpha"]
        assert [list(o.token_ids) for o in outs] == want
    finally:
        llm.engine.shutdown()
    wait_for_workers_gone(before)


@pytest.fixture(scope="module")
def demo_adapters(demo, tmp_path_factory):
    """Two adapters on the demo checkpoint, and the one-process engine's greedy text of each
    (and of the base, under None)."""
    from engine import SamplingParams
    root, hf = tmp_path_factory.mktemp("demo_adapters"), load_hf(demo)
    paths = {"beta": write_adapter(hf, root / "beta", seed=2, r=4, lora_alpha=8,
                                   use_rslora=True, target_modules=[
                                       "q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]),
             "delta": write_adapter(hf, root / "delta", seed=5, r=8, lora_alpha=16,
                                    target_modules=["v_proj", "gate_proj"])}
    llm = LLM(demo, num_kv_blocks=64, lora=dict(modules=paths, max_loras=2, max_lora_rank=8))
    texts = {name: llm.generate([PROMPT], SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, lora_name=name))[0].text
        for name in (None, "beta", "delta")}
    assert len(set(texts.values())) == 3
    return paths, texts


def test_adapter_loaded_through_the_server_at_tensor_parallel_2(demo, demo_adapters, tmp_path):
    paths, texts = demo_adapters
    path, want, plain = paths["beta"], texts["beta"], texts[None]
    before = worker_pids()
    live = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo",
                      "--tensor-parallel-size", "2", "--enable-lora", "--max-lora-rank", "8",
                      "--allow-runtime-lora-updating")
    try:
        status, _, body = http_request(live.port, "POST", "/v1/load_lora_adapter",
                                       {"lora_name": "beta", "lora_path": path})
        assert status == 200, body
        assert complete(live.port, "beta") == want
        assert complete(live.port, "demo") == plain
    finally:
        live.close()
    wait_for_workers_gone(before)


def test_data_parallel_replicas_each_serve_every_adapter(demo, demo_adapters, tmp_path):
    """delta given at start, beta loaded through the route: requests for either (and the base),
    spread over both replicas, give the one-process engine's text; a load no replica can read is
    a 400 naming a replica, and the others keep what they had."""
    paths, texts = demo_adapters
    live = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo",
                      "--data-parallel-size", "2", "--enable-lora", "--lora-modules",
                      f"delta={paths['delta']}", "--max-loras", "2", "--max-lora-rank", "8",
                      "--allow-runtime-lora-updating")
    try:
        status, _, body = http_request(live.port, "POST", "/v1/load_lora_adapter",
                                       {"lora_name": "beta", "lora_path": paths["beta"]})
        assert status == 200, body
        names = ["beta", "delta", "demo"] * 3
        got = concurrently(lambda name: complete(live.port, name), [(n,) for n in names])
        assert got == [texts[None if n == "demo" else n] for n in names]
        assert set(generation_tokens_by_replica(live.port)) == {"0", "1"}
        status, _, body = http_request(live.port, "POST", "/v1/load_lora_adapter",
                                       {"lora_name": "gone", "lora_path": str(tmp_path / "x")})
        assert status == 400 and b"data-parallel replica" in body and b"no such" in body
        status, _, body = http_request(live.port, "POST", "/v1/unload_lora_adapter",
                                       {"lora_name": "beta"})
        assert status == 200, body
        assert complete(live.port, "delta") == texts["delta"]
    finally:
        live.close()
