"""Engine-level behaviour on the CPU backend: batching, chunked prefill, preemption, prefix caching
and abort must not change a request's tokens, which must equal transformers' greedy tokens."""
import random
import subprocess
import sys

import numpy as np
import pytest

from checkpoints import tiny_checkpoint
from hf_oracle import assert_matches, hf_greedy, load_hf
from engine import LLM, SamplingParams

GEN = 16
GREEDY = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    lengths = [5, 70, 17, 33, 1, 48, 16, 61]
    return [rng.integers(0, 500, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    model = load_hf(model_dir)
    return [hf_greedy(model, p, GEN) for p in prompts]


def test_alone_equals_transformers(model_dir, prompts, reference):
    llm = LLM(model_dir)
    for prompt, ref in zip(prompts, reference):
        assert_matches(llm.generate([prompt], GREEDY)[0].token_ids, ref)


class StressRunner:
    """Wraps the model runner: before each step, every KV block outside the step's block tables
    (as prepared: with async scheduling the engine may already have preempted a sequence of
    this step and given its blocks to the next one, which runs after it) is filled with NaN
    (except blocks the prefix cache holds, and the previous step's, which the engine's commit
    may be registering in the prefix cache meanwhile), so reading a stray block poisons the
    logits; records each step."""

    def __init__(self, runner, block_pool):
        self.runner = runner
        self.steps = []  # (rows in the forward call, scheduled tokens, has decode, has prefill chunk)
        self.previous_blocks = set()
        execute = runner.execute

        def stressed_execute(sched, *batch):
            seqs, num_new_tokens = sched.seqs, sched.num_new_tokens
            tables = batch[0].block_tables if batch else runner.prepare(sched).block_tables
            bs = runner.block_size
            step_blocks = {int(b) for row, start, n in zip(tables, sched.num_computed,
                                                           num_new_tokens)
                           for b in row[:-(-(start + n) // bs)]}
            live = step_blocks | self.previous_blocks
            live |= {block.block_id for block in list(block_pool.cached_blocks.values())}
            self.previous_blocks = step_blocks
            dead = np.array(sorted(set(range(runner.num_blocks)) - live), dtype=np.int64)
            for k, v in runner.kv_caches:
                k[dead] = np.nan
                v[dead] = np.nan
            calls = runner.num_forward_calls
            logits = execute(sched, *batch)
            assert runner.num_forward_calls == calls + 1
            decode = any(sched.is_decode)
            prefill = any(a < s.num_prompt_tokens for s, a in zip(seqs, sched.num_computed))
            self.steps.append((len(seqs), sum(num_new_tokens), decode, prefill))
            return logits

        runner.execute = stressed_execute


def test_batch_chunked_preempted_equals_transformers(model_dir, prompts, reference):
    # 24 blocks of 8 tokens cannot hold all eight sequences (~400 tokens): preemption must happen.
    llm = LLM(model_dir, block_size=8, num_kv_blocks=24, prefill_chunk_size=16,
              max_num_batched_tokens=64, enable_prefix_caching=False, max_num_seqs=8)
    llm.engine.block_pool.shuffle_free_blocks(random.Random(3))
    stress = StressRunner(llm.engine.runner, llm.engine.block_pool)
    outs = llm.generate(prompts, GREEDY)
    for out, ref in zip(outs, reference):
        assert_matches(out.token_ids, ref)
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(decode and prefill for _, _, decode, prefill in stress.steps)
    assert llm.engine.block_pool.num_free_blocks == 24


@pytest.fixture(scope="module")
def shared_prefix_prompts(prompts):
    """Eight prompts opening with the same 24 tokens (three 8-token blocks)."""
    return [prompts[1][:24] + p for p in prompts]


def test_preemption_with_prefix_caching_equals_transformers(model_dir, shared_prefix_prompts):
    model = load_hf(model_dir)
    reference = [hf_greedy(model, p, GEN) for p in shared_prefix_prompts]
    llm = LLM(model_dir, block_size=8, num_kv_blocks=32, prefill_chunk_size=16,
              max_num_batched_tokens=64, max_num_seqs=8)
    llm.engine.block_pool.shuffle_free_blocks(random.Random(5))
    StressRunner(llm.engine.runner, llm.engine.block_pool)
    outs = llm.generate(shared_prefix_prompts, GREEDY)
    for out, ref in zip(outs, reference):
        assert_matches(out.token_ids, ref)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_pool.prefix_cache_hits > 0
    assert sum(out.num_cached_tokens for out in outs) > 0


def test_one_forward_call_per_step(model_dir, prompts):
    llm = LLM(model_dir, prefill_chunk_size=16)
    rows = []
    forward = llm.engine.model.forward

    def counting_forward(batch, kv_caches):
        rows.append(batch.num_tokens)
        return forward(batch, kv_caches)

    llm.engine.model.forward = counting_forward
    engine = llm.engine
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=4))
    scheduled = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        if out.seqs:   # scheduled ahead while every sequence was ending: nothing to run
            scheduled.append(sum(out.num_new_tokens))
        return out

    engine.scheduler.schedule = recording_schedule
    while engine.has_unfinished():
        engine.step()
    assert rows == scheduled
    assert sum(rows) == sum(len(p) for p in prompts[:4]) + 4 * 3


def test_prefix_cache_prefills_only_uncached_tokens(model_dir, prompts, reference):
    llm = LLM(model_dir, block_size=16)
    prompt = prompts[1]  # 70 tokens: 4 full blocks of 16 are cacheable
    first = llm.generate([prompt], GREEDY)[0]
    before = llm.engine.runner.num_forward_tokens
    second = llm.generate([prompt], GREEDY)[0]
    assert second.num_cached_tokens == 64
    assert llm.engine.runner.num_forward_tokens - before == (70 - 64) + (GEN - 1)
    assert second.token_ids == first.token_ids
    assert_matches(second.token_ids, reference[1])


def test_prefix_cache_off_recomputes_everything(model_dir, prompts):
    llm = LLM(model_dir, enable_prefix_caching=False)
    llm.generate([prompts[1]], GREEDY)
    before = llm.engine.runner.num_forward_tokens
    out = llm.generate([prompts[1]], GREEDY)[0]
    assert out.num_cached_tokens == 0
    assert llm.engine.runner.num_forward_tokens - before == 70 + GEN - 1


def test_abort_frees_blocks_at_any_stage(model_dir, prompts):
    llm = LLM(model_dir, block_size=8, num_kv_blocks=64, prefill_chunk_size=8)
    engine = llm.engine
    total = engine.block_pool.num_free_blocks
    engine.add_request("running", prompts[1], GREEDY)
    engine.step()  # first 8-token chunk of the prompt: blocks held mid-prefill
    engine.add_request("waiting", prompts[5], GREEDY)
    assert engine.block_pool.num_free_blocks < total
    assert engine.abort("running") and engine.abort("waiting")
    assert not engine.abort("unknown")
    assert not engine.has_unfinished()
    assert engine.block_pool.num_free_blocks == total


def test_max_model_len_beyond_kv_pool_fails_at_start(model_dir):
    with pytest.raises(ValueError, match="max-model-len"):
        LLM(model_dir, block_size=8, num_kv_blocks=4, max_model_len=64)


def test_max_model_len_beyond_the_models_context_fails_at_start(model_dir):
    with pytest.raises(ValueError, match="model's context"):
        LLM(model_dir, max_model_len=4096)  # the tiny model has 256 positions


def test_bad_prompt_leaves_nothing_behind(model_dir, prompts):
    llm = LLM(model_dir)
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([prompts[0], [10**6]], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks
    assert len(llm.generate([prompts[0]], GREEDY)[0].token_ids) == GEN


def test_failed_step_fails_only_its_requests(model_dir, prompts, reference):
    llm = LLM(model_dir)
    engine = llm.engine
    execute = engine.runner.execute

    def broken_execute(sched, *batch):
        engine.runner.execute = execute  # fail once
        raise RuntimeError("kernel exploded")

    engine.runner.execute = broken_execute
    engine.add_request("victim", prompts[0], GREEDY)
    outs = engine.step() or engine.step()   # async scheduling: the step's outputs come next
    assert [(o.request_id, o.finish_reason) for o in outs] == [("victim", "error")]
    assert "kernel exploded" in outs[0].error
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    assert_matches(llm.generate([prompts[0]], GREEDY)[0].token_ids, reference[0])


def test_request_ids_are_unique_while_unfinished(model_dir):
    engine = LLM(model_dir).engine
    engine.add_request("a", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [4, 5], GREEDY)


def test_max_tokens_and_stop_token_ids(model_dir, prompts, reference):
    llm = LLM(model_dir)
    tokens, trusted, _ = reference[2]
    stop = tokens[3]
    out = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=GEN,
                                                    stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == tokens[:tokens.index(stop) + 1]
    out = llm.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


# transformers 5.17's tokenizer import chain, replayed on any release: before
# transformers.tokenization_utils_tokenizers runs, the statement its import of
# modeling_gguf_pytorch_utils executed at module level there. Torch must be installed (it is the
# test oracle), so this imports it unless Taper's guard (engine/text/hf_tokenizers.py) stops it.
TRANSFORMERS_517_TORCH_IMPORT = """
import importlib.abc, importlib.machinery, sys
class ImportsTorchLike517(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "transformers.tokenization_utils_tokenizers":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run_module = spec.loader.exec_module
        def exec_module(module):
            exec("from transformers.utils import is_torch_available\\n"
                 "if is_torch_available():\\n    import torch", module.__dict__)
            run_module(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, ImportsTorchLike517())
"""


@pytest.mark.parametrize("transformers_like", ["installed", "5.17"])
def test_engine_never_imports_torch(model_dir, transformers_like):
    setup = TRANSFORMERS_517_TORCH_IMPORT if transformers_like == "5.17" else ""
    code = (setup + "import sys; from engine import LLM, SamplingParams; "
            f"LLM({str(model_dir)!r}).generate([[1, 2, 3]], SamplingParams(max_tokens=2)); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_517_replay_imports_torch_without_the_guard():
    """The replay above does what 5.17 did: a plain import of transformers' fast tokenizer class
    pulls in torch. So the test above fails if the guard is removed."""
    code = (TRANSFORMERS_517_TORCH_IMPORT + "import sys; "
            "from transformers import PreTrainedTokenizerFast; "
            "assert 'torch' in sys.modules, 'the replay did not import torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kv_budget_mem_wins_over_fraction_of_free_memory(model_dir, monkeypatch):
    import engine.core.builder as builder
    from engine.runner.model_runner import ModelRunner
    monkeypatch.setattr(builder, "mem_available_bytes", lambda: 2**30)
    llm = LLM(model_dir, block_size=8, kv_fraction=0.01)
    per_block = ModelRunner.kv_bytes_per_block(llm.engine.model_config, 8)
    assert llm.engine.block_pool.num_blocks == int(2**30 * 0.01) // per_block
    llm = LLM(model_dir, block_size=8, kv_fraction=0.01, kv_cache_memory_mb=1)
    assert llm.engine.block_pool.num_blocks == 2**20 // per_block
