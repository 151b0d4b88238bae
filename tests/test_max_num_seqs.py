"""The default --max-num-seqs (issue 13, item 4): what the KV pool holds at a typical sequence
length, capped at 256 and at the step's token budget; an explicit value wins; CUDA graphs are
captured for every bucket up to it (checked on the CPU through the CUDA engine's wiring)."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from engine.runner import cuda_memory
from engine.config import EngineConfig
from engine.runner.cuda_graph import capture_sizes, estimate_graph_memory_bytes
from engine.core.llm_engine import LLMEngine
from engine.core.max_num_seqs import MAX_NUM_SEQS_CAP, TYPICAL_SEQ_LEN, default_max_num_seqs
from engine.runner.model_runner import ModelRunner
from engine.loader.model_loader import load_model
from pyx.cpu_backend import CpuBackend
from test_cuda_engine_wiring import CpuAsCuda


def test_default_is_what_the_pool_holds_up_to_256():
    assert TYPICAL_SEQ_LEN == 1024 and MAX_NUM_SEQS_CAP == 256
    # Qwen2.5-0.5B in f32 on the CPU's default 1 GiB: 24,576 bytes a token, 43,690 tokens
    n, why = default_max_num_seqs(43_690, 32_768, 2048)
    assert n == 42 and "43690 tokens hold 42 sequences of 1024 tokens" in why
    n, why = default_max_num_seqs(2_000_000, 131_072, 2048)      # a 1B model on an H100
    assert n == 256 and why.startswith("the cap")
    assert default_max_num_seqs(2_000_000, 131_072, 100) == (
        100, "the step's token budget, max_num_batched_tokens (the KV pool's 2000000 tokens "
             "hold 1953 sequences of 1024 tokens)")
    assert default_max_num_seqs(4096, 256, 2048)[0] == 16        # a short context: 256 a seq
    assert default_max_num_seqs(100, 100, 2048)[0] == 1          # never 0


def test_an_explicit_value_must_fit_the_token_budget():
    assert EngineConfig(model="m").max_num_seqs is None
    assert EngineConfig(model="m", max_num_seqs=512, max_num_batched_tokens=512).max_num_seqs == 512
    with pytest.raises(ValueError, match=r"max_num_seqs \(300\) must be at most "
                                         r"max_num_batched_tokens \(256\)"):
        EngineConfig(model="m", max_num_seqs=300, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig(model="m", max_num_seqs=0)


def test_capture_buckets_reach_256():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert len(capture_sizes(256)) == 35


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from checkpoints import tiny_checkpoint
    return tiny_checkpoint(tmp_path_factory.mktemp("max_num_seqs"))


def engine(model_dir, backend, **config):
    model, model_config = load_model(model_dir, backend, progress=False)
    cfg = EngineConfig(model=model_dir, enable_prefix_caching=False,
                       backend="cuda" if isinstance(backend, CpuAsCuda) else "cpu", **config)
    return LLMEngine(cfg, loaded=(backend, model, model_config))


def test_engine_sizes_it_from_the_pool_and_logs_why(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="taper.engine"):
        e = engine(model_dir, CpuBackend(), num_kv_blocks=64, max_model_len=128)
    # 64 blocks of 16 = 1024 tokens, 128 a sequence (the context is shorter than 1024)
    assert e.config.max_num_seqs == e.scheduler.max_num_seqs == 8
    assert ("max_num_seqs 8: the KV pool's 1024 tokens hold 8 sequences of 128 tokens; "
            "--max-num-seqs sets it") in caplog.text
    big = engine(model_dir, CpuBackend(), num_kv_blocks=4096, max_model_len=128)
    assert big.scheduler.max_num_seqs == 256
    explicit = engine(model_dir, CpuBackend(), num_kv_blocks=64, max_model_len=128,
                      max_num_seqs=5)
    assert explicit.scheduler.max_num_seqs == 5


class BigCpuAsCuda(CpuAsCuda):
    def memory_info(self):
        return 2 << 30, 8 << 30


def test_cuda_graphs_are_captured_up_to_the_default(model_dir):
    backend = BigCpuAsCuda()
    e = engine(model_dir, backend, kv_fraction=0.05, cuda_graph=True, max_model_len=128)
    runner = e.runner.graph_runner
    assert e.config.max_num_seqs == 256
    assert runner.sizes == capture_sizes(256) and backend.captures == 35
    # The graphs' memory was reserved for the cap, before the pool (and so the default) existed
    mc, bs = e.model_config, e.config.block_size
    reserved = estimate_graph_memory_bytes(256, -(-mc.max_model_len // bs), mc)
    budget, _ = cuda_memory.kv_budget_bytes(2 << 30, reserved, 0.05, None)
    assert e.block_pool.num_blocks == budget // ModelRunner.kv_bytes_per_block(mc, bs, np.float32)
