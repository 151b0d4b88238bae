"""Data parallel across machines (issue 28): `--data-parallel-size 2 --distributed-executor ray`
places each replica as a Ray actor in a placement group of its own over the Ray cluster
(engine/parallel/ray_replicas.py), behind the one API server. A two-node cluster simulated on this
machine (ray.cluster_utils.Cluster), one CPU on each node, so the replicas land one on each:

- concurrent requests spread over both replicas and give a single-replica server's greedy outputs;
- the replica on the other "node" killed mid-stream fails only its request, with an error naming
  it, while the other stream completes and new requests are served;
- the actors do not outlive the server;
- replicas of tensor parallel 2 start their worker ranks in their own placement groups and give
  one process's greedy tokens.

A cluster too small for the replicas is a clear start-up error. Ray is the `ray` extra; without
it the tests are skipped.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from server_fakes import LiveServer, http_request
from test_data_parallel import (PROMPTS, alive, chat, chat_reply, concurrently,
                                generation_tokens_by_replica, stream_completion)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    worker = c.add_node(num_cpus=1)
    try:
        yield c.address, c.head_node.node_id, worker.node_id, c
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from server.demo_model import write_demo_checkpoint
    return write_demo_checkpoint(str(tmp_path_factory.mktemp("raydp") / "demo"))


def placed(server) -> dict[int, tuple[str, int]]:
    """Each replica's (node id prefix, pid) from the server's log."""
    return {int(i): (node, int(pid)) for i, node, pid in re.findall(
        r"data-parallel replica (\d+): a Ray actor on node (\w+) \(pid (\d+)", server.log())}


def test_replicas_on_two_nodes_serve_like_one_and_a_killed_one_fails_only_its_requests(
        tmp_path, cluster, demo):
    address, head, second, _ = cluster
    one = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo")
    try:
        want = [chat(one.port, p) for p in PROMPTS]
    finally:
        one.close()
    server = LiveServer(tmp_path, demo, "--mem", "64", "--served-model-name", "demo",
                        "--data-parallel-size", "2", "--distributed-executor", "ray",
                        env={"RAY_ADDRESS": address})
    try:
        where = placed(server)
        assert sorted(node for node, _ in where.values()) == sorted([head[:12], second[:12]])
        replies = concurrently(chat_reply, [(server.port, p) for p in PROMPTS])
        assert [r.choices[0].message.content for r in replies] == want
        generated = sum(r.usage.completion_tokens for r in replies)
        deadline = time.time() + 10            # each replica's counts come with its next load
        while True:
            tokens = generation_tokens_by_replica(server.port)
            if sum(tokens.values()) == generated or time.time() > deadline:
                break
            time.sleep(0.2)
        assert set(tokens) == {"0", "1"} and all(tokens.values()), tokens     # both served

        # one stream on each replica, then the one on the second node killed
        (far,) = [i for i, (node, _) in where.items() if node == second[:12]]
        results = []
        thread = threading.Thread(target=lambda: results.extend(concurrently(
            stream_completion, [(server.port, 0), (server.port, 1)])))
        before = generation_tokens_by_replica(server.port)
        thread.start()
        deadline = time.time() + 60
        while min(generation_tokens_by_replica(server.port)[k] - before[k]
                  for k in ("0", "1")) < 20:
            assert time.time() < deadline, server.log()
            time.sleep(0.1)
        os.kill(where[far][1], signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "a stream hung after its replica died"
        failed = [r for r in results if isinstance(r, Exception)]
        assert len(failed) == 1, results
        assert re.search(rf"The engine failed: data-parallel replica {far} \(pid \d+\) died "
                         rf"\(its Ray actor on node {second[:12]}\); its requests failed "
                         rf"\(1 of 2 replicas serve on\)", str(failed[0])), str(failed[0])
        completed = [r for r in results if not isinstance(r, Exception)]
        assert completed and completed[0] > 100
        assert len(chat(server.port, "Still there?")) > 0         # the other serves on
        assert http_request(server.port, "GET", "/health")[0] == 200
        assert set(generation_tokens_by_replica(server.port)) == {str(1 - far)}
    finally:
        server.close()              # SIGKILL: Ray ends the actors of a driver that has gone
    deadline = time.time() + 30
    while alive(where[1 - far][1]) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(where[1 - far][1]), "a replica's actor outlived its killed server"


def test_a_cluster_too_small_for_the_replicas_is_a_clear_error(tmp_path, cluster, demo):
    address = cluster[0]
    server = LiveServer(tmp_path, demo, "--mem", "64", "--data-parallel-size", "3",
                        "--distributed-executor", "ray", wait_ready=False,
                        env={"RAY_ADDRESS": address})
    try:
        assert server.proc.wait(120) != 0
    finally:
        server.close()
    assert ("--distributed-executor ray: 3 data-parallel replicas of 1 rank need 3 CPUs in the "
            "Ray cluster, which has 2 (2 nodes)") in server.log()


def test_tensor_parallel_replicas_place_their_ranks_in_their_own_groups(cluster, monkeypatch,
                                                                         tmp_path):
    """Two replicas of tensor parallel 2 (4 ranks on 4 CPUs: a third node with 2 added), each
    replica's worker taking its replica's placement group's second bundle (a worker placed
    outside its replica's group would find no free CPU: the two groups hold all 4, and the
    replica would fail to start): the same greedy tokens as one process. Runs last: it grows
    the module's cluster."""
    from checkpoints import tiny_checkpoint
    from model_cases import GEN, prompts_for
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig
    from engine.parallel.data_parallel import RoutedEngine
    c_address, c = cluster[0], cluster[3]
    c.add_node(num_cpus=2)
    model = tiny_checkpoint(str(tmp_path / "llama"), arch="llama")
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    llm = LLM(model, num_kv_blocks=64)
    try:
        want = [list(o.token_ids) for o in llm.generate(prompts_for(), params)]
    finally:
        llm.engine.shutdown()
    monkeypatch.setenv("RAY_ADDRESS", c_address)
    config = EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=2,
                          data_parallel_size=2, distributed_executor="ray")
    engine = RoutedEngine(config, 2)
    try:
        for i, prompt in enumerate(prompts_for()):
            engine.add_request(str(i), prompt, params)
        got, deadline = {}, time.time() + 120
        while len(got) < len(want):
            assert time.time() < deadline, "the replicas did not finish"
            for o in engine.step():
                assert not isinstance(o, Exception), o
                if o.finished:
                    got[int(o.request_id)] = list(o.token_ids)
        assert [got[i] for i in range(len(want))] == want
    finally:
        engine.shutdown()
