"""The step profile (engine/core/step_profile.py): each phase's time lands in that phase, the profile
changes nothing about the outputs, and the server logs it with --profile-steps."""
from __future__ import annotations

import statistics
import time

import pytest

from engine import LLM, SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer
from engine.core.step_profile import PHASES, ForwardTimeline, StepProfile
from server_fakes import LiveServer, client_for

DELAY_S = 0.05
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> str:
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("demo") / "demo"))


@pytest.fixture(scope="module")
def llm(demo_dir):
    return LLM(demo_dir, kv_cache_memory_mb=16, enable_prefix_caching=False)


def profiled(llm, prompts):
    profile = StepProfile.attach(llm.engine)
    try:
        outs = llm.generate(prompts, PARAMS)
    finally:
        profile.detach()
    return profile, outs


def test_every_step_is_split_into_its_phases(llm):
    plain = llm.generate([[5, 6, 7, 8], [9, 10]], PARAMS)
    profile, outs = profiled(llm, [[5, 6, 7, 8], [9, 10]])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]   # the profile is inert
    # One step computes both prompts and samples their first tokens; 7 decode steps follow.
    assert len(profile.records) == 8
    assert [r.num_tokens for r in profile.records] == [6] + [2] * 7
    assert len(profile.decode_summary()) and profile.decode_summary()["steps"] == 7
    for r in profile.records:
        assert set(PHASES) <= set(r.seconds)
        assert sum(r.seconds[p] for p in (*PHASES, "other")) == pytest.approx(r.seconds["step"])
    assert vars(llm.engine).get("step") is None           # detached: the class's own method


@pytest.mark.parametrize("phase", ["outputs", "forward"])
def test_a_slow_phase_shows_in_that_phase_alone(llm, monkeypatch, phase):
    """Attribution can be wrong: a delay added to the detokenizer must land in `outputs`, one
    added to the model's forward in `forward`, and in no other phase (medians over the steps,
    against a run without the delay)."""
    before = median_ms(profiled(llm, [[5, 6, 7, 8]])[0])
    if phase == "outputs":
        add_token = IncrementalDetokenizer.add_token

        def slow_add_token(self, token):
            time.sleep(DELAY_S)
            return add_token(self, token)
        monkeypatch.setattr(IncrementalDetokenizer, "add_token", slow_add_token)
    else:
        forward = llm.engine.model.forward

        def slow_forward(*args):
            time.sleep(DELAY_S)
            return forward(*args)
        monkeypatch.setattr(llm.engine.model, "forward", slow_forward)
    after = median_ms(profiled(llm, [[5, 6, 7, 8]])[0])
    assert after[phase] - before[phase] >= 1e3 * DELAY_S, (before, after)
    for other in (*PHASES, "other"):
        if other != phase:
            assert after[other] - before[other] < 1e3 * DELAY_S / 2, (other, before, after)


def median_ms(profile) -> dict:
    return {p: 1e3 * statistics.median(r.seconds[p] for r in profile.records)
            for p in (*PHASES, "other")}


def test_scheduling_ahead_keeps_the_host_off_the_forward_threads_path(demo_dir):
    """Host work slowed down (schedule and commit DELAY_S / 2 each) behind a slower forward
    (2 * DELAY_S): scheduled after the commit, the next forward waits for both; scheduled ahead,
    both run while a forward computes, so the forward thread goes from step to step with no gap
    and a step's sampling does not wait for the previous commit."""
    llm = LLM(demo_dir, kv_cache_memory_mb=16, enable_prefix_caching=False)
    engine = llm.engine
    expected = [o.token_ids for o in llm.generate([[5, 6, 7, 8], [9, 10]], PARAMS)]
    commit, schedule, execute = engine._commit, engine.scheduler.schedule, engine.runner.execute

    def slow(fn, seconds):
        def slowed(*args):
            time.sleep(seconds)
            return fn(*args)
        return slowed
    engine._commit = slow(commit, DELAY_S / 2)
    engine.scheduler.schedule = slow(schedule, DELAY_S / 2)
    engine.runner.execute = slow(execute, 2 * DELAY_S)
    summaries = {}
    for ahead in (False, True):
        engine.schedule_ahead = ahead
        timeline = ForwardTimeline.attach(engine)
        try:
            outs = llm.generate([[5, 6, 7, 8], [9, 10]], PARAMS)
        finally:
            timeline.detach()
        assert [o.token_ids for o in outs] == expected
        summaries[ahead] = timeline.decode_summary()
    assert vars(engine).get("_run_step") is None and vars(engine).get("_await_commit") is None
    after_commit, ahead = summaries[False], summaries[True]
    assert after_commit["pairs"] >= 5 and ahead["pairs"] >= 5
    assert after_commit["gap"] > 1e3 * DELAY_S
    assert ahead["gap"] < 1e3 * DELAY_S / 4 and ahead["commit_wait"] < 1e3 * DELAY_S / 4


def test_the_server_logs_the_profile(demo_dir, tmp_path):
    server = LiveServer(tmp_path, demo_dir, "--mem", "16", "--profile-steps", "4")
    try:
        client = client_for(server.port)
        client.completions.create(model=client.models.list().data[0].id, prompt="hello",
                                  max_tokens=8, extra_body={"ignore_eos": True})
    finally:
        server.close()
    lines = [line for line in server.log_path.read_text().splitlines() if "step profile:" in line]
    assert lines and "4 steps" in lines[0] and "forward" in lines[0], lines


def test_a_negative_profile_steps_is_refused():
    from server.__main__ import build_parser, check_args
    args = build_parser().parse_args(["--profile-steps", "-1"])
    assert "--profile-steps" in check_args(args)
