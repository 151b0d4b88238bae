"""AsyncEngine: concurrent streams, abort at any point, bad requests isolated from good ones."""
import asyncio

import pytest

from checkpoints import tiny_checkpoint
from engine import AsyncEngine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = AsyncEngine(EngineConfig(model=tiny_checkpoint(tmp_path_factory.mktemp("m"), "llama"),
                                      num_kv_blocks=64, block_size=8))
    yield engine
    engine.shutdown()


async def collect(engine, request_id, prompt, params=GREEDY):
    return [out async for out in engine.add_request(request_id, prompt, params)]


def test_concurrent_streams_match_sequential(engine):
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [300, 301]]

    async def run():
        alone = [await collect(engine, f"a{i}", p) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(engine, f"b{i}", p)
                                          for i, p in enumerate(prompts)))
        return alone, together

    alone, together = asyncio.run(run())
    for a, b in zip(alone, together):
        assert [o.new_token_ids[0] for o in a] == [o.new_token_ids[0] for o in b]
        assert len(a) == 12 and a[-1].finished and a[-1].finish_reason == "length"
        assert a[-1].token_ids == [o.new_token_ids[0] for o in a]


def test_consumer_leaving_early_frees_blocks(engine):
    pool, runner = engine.engine.block_pool, engine.engine.runner
    total = pool.num_blocks
    computed_before = runner.num_forward_tokens

    async def run():
        stream = engine.add_request("leaver", list(range(40)),
                                    SamplingParams(max_tokens=None, ignore_eos=True))
        async for out in stream:
            if out.num_output_tokens == 3:
                break
        await stream.aclose()
        for _ in range(200):  # the abort is applied by the engine thread
            if pool.num_free_blocks == total:
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert pool.num_free_blocks == total
    assert not engine.engine.has_unfinished()
    # Aborted within a few steps, not run on to the model's maximum length (256).
    assert runner.num_forward_tokens - computed_before < 40 + 50


def test_bad_request_fails_alone(engine):
    async def run():
        bad = collect(engine, "bad", [10**9])
        good = collect(engine, "good", [1, 2, 3])
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, ValueError) and "token ids" in str(bad)
    assert good[-1].finished and len(good) == 12
    assert engine.is_running


def test_shutdown_fails_open_streams_and_refuses_new_ones(tmp_path):
    engine = AsyncEngine(EngineConfig(model=tiny_checkpoint(tmp_path, "llama"), num_kv_blocks=64,
                                      block_size=8))
    long = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)

    async def run():
        stream = engine.add_request("open", [5, 6, 7], long)
        await anext(stream)                       # generating
        engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in stream:
                pass
        assert not engine.is_running
        with pytest.raises(RuntimeError, match="not running"):
            engine.add_request("late", [5], GREEDY)
    asyncio.run(run())


def test_queued_sequences_count_choices_forks_beams_and_requests_on_their_way(tmp_path):
    """What --max-queued-requests counts: every sequence not yet running, so a request's n
    choices (or beams) count n, whether still on the command queue, waiting, or waiting to fork
    from choice 0."""
    engine = AsyncEngine(EngineConfig(model=tiny_checkpoint(tmp_path, "llama"), num_kv_blocks=64,
                                      block_size=8))
    engine.shutdown()             # the engine thread stopped: its state changes only here
    core = engine.engine
    core.add_request("a", [5, 6, 7], SamplingParams(n=4, max_tokens=4))   # 1 waits, 3 forks
    # a beam search waits as 1 sequence: its beams fork once it runs
    core.add_request("b", [5, 6, 7], SamplingParams(n=2, best_of=3, use_beam_search=True,
                                                    max_tokens=4))
    assert (core.scheduler.num_waiting, len(core.requests["a"].forks)) == (2, 3)
    engine._commands.put(("add", "c", [1], SamplingParams(n=5)))
    engine._commands.put(("add", "d", [1], SamplingParams(best_of=6, use_beam_search=True)))
    engine._commands.put(("abort", "a"))
    assert engine.num_queued_sequences() == 4 + 1 + 5 + 6
