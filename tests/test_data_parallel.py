"""Data parallel (issue 28): --data-parallel-size N engine replicas, each a process with the whole
model, behind one API server (engine/parallel/data_parallel.py, engine/parallel/replica.py).

- The router: the replica with the most free KV blocks (less the prompts sent since its last
  count), a shared prompt prefix to the replica that saw it unless that one is full, dead
  replicas skipped.
- The live server with 2 replicas: concurrent requests spread over both (/metrics labels each
  replica's counters) and give the single-replica server's greedy outputs; a replica killed
  mid-stream fails its request with an error naming it, within seconds, while the other's
  stream completes and new requests are served; the replicas do not outlive a killed server.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from server_fakes import LiveServer, client_for, http_request

pytestmark = pytest.mark.timeout(300)


# ---- the router

class FakeReplica:
    def __init__(self, index, free, alive=True):
        from engine.parallel.data_parallel import Replica
        from engine.parallel.replica import Load
        self.r = Replica(index, None, None)
        self.r.alive = alive
        self.r.load = Load(0, free, None)


def router_and(*free, dead=()):
    from engine.parallel.data_parallel import Router
    replicas = [FakeReplica(i, f, i not in dead).r for i, f in enumerate(free)]
    return Router(block_size=16), replicas


def test_the_replica_with_the_most_free_kv_takes_a_request():
    router, replicas = router_and(10, 30, 20)
    assert router.choose(replicas, list(range(5))).index == 1
    # 40 tokens (3 blocks with the first generated token) sent to replica 1, not yet counted
    # by it: 27 free there now, 20 on replica 2
    router, replicas = router_and(10, 30, 20)
    assert [router.choose(replicas, list(range(100 + 40 * k, 140 + 40 * k))).index
            for k in range(4)] == [1, 1, 1, 1]
    assert replicas[1].free_blocks() == 30 - 4 * 3
    assert router.choose(replicas, [7] * 200).index == 2         # 18 free against 20
    # a count that has seen those adds replaces them
    from engine.parallel.replica import Load
    replicas[1].loaded(Load(4, 25, None))
    assert replicas[1].free_blocks() == 25


def test_a_shared_prefix_goes_where_it_went_before():
    system = list(range(1000, 1040))                  # two whole blocks and a part
    router, replicas = router_and(10, 30)
    first = router.choose(replicas, system + [1, 2, 3])
    assert first.index == 1
    replicas[1].load.free_kv_blocks = 8               # less the 3 sent: the fuller one
    assert router.choose(replicas, system + [4, 5, 6]).index == 1
    assert router.choose(replicas, [9] * 40).index == 0        # no shared prefix: most free
    # the prefix's replica too full for the prompt: the most free one takes it
    assert router.choose(replicas, system + list(range(200))).index == 0


def test_dead_replicas_take_nothing():
    router, replicas = router_and(10, 30, dead=(1,))
    assert router.choose(replicas, [1] * 20).index == 0


# ---- the live server

def replica_pids(server) -> dict[int, int]:
    return {int(i): int(pid) for i, pid in
            re.findall(r"data-parallel replica (\d+) \(pid (\d+)\)", server.log())}


def generation_tokens_by_replica(port) -> dict[str, float]:
    text = http_request(port, "GET", "/metrics")[2]
    if isinstance(text, bytes):
        text = text.decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'taper:generation_tokens_total\{model_name="demo",replica="(\d+)"\} (\S+)', text)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def concurrently(fn, args_list):
    results = [None] * len(args_list)

    def run(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:          # returned, for the test to look at
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


PROMPTS = [f"Tell me about the number {k} and its friends." for k in range(4)]


def chat_reply(port, prompt):
    return client_for(port).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": prompt}], max_tokens=12,
        temperature=0)


def chat(port, prompt):
    return chat_reply(port, prompt).choices[0].message.content


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("dp") / "demo"))


def test_requests_spread_over_replicas_with_one_replicas_outputs(tmp_path, demo):
    one = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo")
    try:
        want = [chat(one.port, p) for p in PROMPTS]
    finally:
        one.close()
    server = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo",
                        "--data-parallel-size", "2")
    try:
        replies = concurrently(chat_reply, [(server.port, p) for p in PROMPTS])
        assert [r.choices[0].message.content for r in replies] == want
        generated = sum(r.usage.completion_tokens for r in replies)
        assert "data parallel 2: one API server routing to 2 engine replicas" in server.log()
        deadline = time.time() + 10            # each replica's counts come with its next load
        while True:
            tokens = generation_tokens_by_replica(server.port)
            if sum(tokens.values()) == generated or time.time() > deadline:
                break
            time.sleep(0.2)
        assert set(tokens) == {"0", "1"} and all(tokens.values()), tokens     # both served
        assert sum(tokens.values()) == generated      # the last counts reach /metrics
        pids = replica_pids(server)
        assert len(pids) == 2
    finally:
        server.close()                 # SIGKILL: the replicas see the pipe close and exit
    deadline = time.time() + 10
    while any(alive(p) for p in pids.values()) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids.values()), "a replica outlived its killed server"


def stream_completion(port, k):
    stream = client_for(port).completions.create(
        model="demo", prompt=f"story number {k} " * 3, max_tokens=2000, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    return sum(1 for _ in stream)


def test_a_killed_replica_fails_its_requests_and_the_other_serves_on(tmp_path, demo):
    server = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo",
                        "--data-parallel-size", "2")
    try:
        pids = replica_pids(server)
        results = []
        thread = threading.Thread(target=lambda: results.extend(concurrently(
            stream_completion, [(server.port, 0), (server.port, 1)])))
        thread.start()
        deadline = time.time() + 30           # both streams running, one on each replica
        while (set(generation_tokens_by_replica(server.port)) != {"0", "1"}
               or min(generation_tokens_by_replica(server.port).values()) < 20):
            assert time.time() < deadline, server.log()
            time.sleep(0.1)
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "a stream hung after its replica died"
        failed = [r for r in results if isinstance(r, Exception)]
        assert len(failed) == 1, results
        assert re.search(r"The engine failed: data-parallel replica 1 \(pid \d+\) was killed; "
                         r"its requests failed \(1 of 2 replicas serve on\)", str(failed[0]))
        completed = [r for r in results if not isinstance(r, Exception)]
        assert completed and completed[0] > 100
        assert time.monotonic() - killed_at < 60
        assert len(chat(server.port, "Still there?")) > 0         # replica 0 serves on
        assert http_request(server.port, "GET", "/health")[0] == 200
        assert set(generation_tokens_by_replica(server.port)) == {"0"}
    finally:
        server.close()


def test_data_parallel_flag_is_checked():
    from server.__main__ import build_parser, check_args
    assert check_args(build_parser().parse_args(["--w", "x", "--dp", "0"])) == \
        "--data-parallel-size must be at least 1"
    assert check_args(build_parser().parse_args(["--w", "x", "--dp", "2", "--enable-lora"])) \
        is None     # (LoRA adapters over replicas: tests/test_parallel_lora.py)
