"""--distributed-executor ray (issue 28): the worker ranks as Ray actors placed over a Ray cluster
(engine/parallel/ray_executor.py). A two-node cluster simulated on this machine with Ray's own
test utilities (ray.cluster_utils.Cluster): the head node with no CPUs for actors, a second node
with one, so the pipeline's second stage runs on the other "node"; greedy tokens equal one
process's, and no worker outlives the engine. A cluster too small for the ranks, and Ray not
installed, are clear start-up errors.

Ray is the `ray` extra (pip install 'taper[ray]', ray==2.52.0); without it the cluster tests are
skipped."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from model_cases import GEN, prompts_for

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    worker = c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    try:
        # (the driver may attach to either node's raylet: the nodes are told apart by id)
        yield c.head_node.node_id, worker.node_id
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from checkpoints import tiny_checkpoint
    return tiny_checkpoint(str(tmp_path_factory.mktemp("ray") / "llama"), arch="llama")


def ray_workers() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines()
            if "engine.parallel.worker --connect" in line and "ps -eo" not in line
            and not line.split()[1].startswith("Z")}


def greedy(model, **kwargs):
    from engine import LLM, SamplingParams
    llm = LLM(model, num_kv_blocks=64, max_num_batched_tokens=32, **kwargs)
    try:
        outs = llm.generate(prompts_for(), SamplingParams(temperature=0, max_tokens=GEN,
                                                          ignore_eos=True, logprobs=0))
        group = llm.engine.runner.peers.group if llm.engine.runner.peers else None
        nodes = None if group is None else group.nodes
    finally:
        llm.engine.shutdown()
    return ([list(o.token_ids) for o in outs],
            [np.array([lp.logprob for lp in o.logprobs]) for o in outs], nodes)


def test_pipeline_stages_on_two_nodes_match_one_process(cluster, llama):
    head, second = cluster
    before = ray_workers()
    one = greedy(llama)
    two = greedy(llama, pipeline_parallel_size=2, distributed_executor="ray")
    assert two[0] == one[0]
    for a, b in zip(one[1], two[1]):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-4)
    (worker_node,) = two[2]
    assert worker_node[0] == second != head    # the rank with the CPU: the other "node"
    deadline = time.time() + 15
    while ray_workers() - before and time.time() < deadline:
        time.sleep(0.2)
    assert not ray_workers() - before, "a Ray worker rank outlived its engine"


def test_a_cluster_too_small_is_a_clear_error(cluster, llama):
    from engine import LLM
    with pytest.raises(RuntimeError, match=r"--distributed-executor ray: 3 worker ranks need 3 "
                                           r"CPUs in the Ray cluster, which has 1 \(2 nodes\)"):
        LLM(llama, pipeline_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=64,
            distributed_executor="ray")


def test_ray_missing_is_named(monkeypatch):
    from engine.parallel.ray_executor import import_ray
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"--distributed-executor ray needs Ray: pip install "
                                          r"'taper\[ray\]' \(ray==2\.52\.0\)"):
        import_ray()


def test_unknown_executor_is_refused():
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match="distributed_executor must be mp or ray, got 'slurm'"):
        EngineConfig(model="x", distributed_executor="slurm")
