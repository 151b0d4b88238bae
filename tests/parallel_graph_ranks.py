"""One rank of a tensor- or pipeline-parallel engine on CpuAsCuda (the CPU backend dressed as
CUDA: graph capture records the forward, a replay calls it), started by `mpiexec -n N` from
tests/test_parallel_graphs.py: the builder's own start-up and step loop over MPI_COMM_WORLD
(rank 0 builds the engine and generates, the others serve its steps), so the CUDA graph paths of
every rank run with their collectives and hand-overs between real processes.

    python tests/parallel_graph_ranks.py MODEL OUT_DIR JSON_OPTIONS

Options: tp, pp, micro_batches, graphs (KernelConfig graphs_parallel on/off), block_size,
num_kv_blocks, prompts (lists of ids), max_tokens, stuck_rank (that rank's device block table is moved after capture, so it
cannot replay rank 0's bucket: it must run the bucket's padded rows eagerly in step).
Each rank writes OUT_DIR/rank{r}.json: its replays and eager fallbacks; rank 0 also its tokens
and every step message it sent (pickled bytes, the block-table update's entries, sequences)."""
from __future__ import annotations

import json
import os
import pickle
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]


def main() -> int:
    from mpi4py import MPI
    import engine.core.builder as builder
    import engine.core.llm_engine as llm_engine
    from engine.config import EngineConfig
    from engine.parallel.mpi import MpiGroup
    from engine.parallel.steps import StepInputs, serve_steps
    from engine.sampling.sampling_params import SamplingParams
    from test_cuda_engine_wiring import CpuAsCuda

    model, out_dir, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    group = MpiGroup(MPI.COMM_WORLD.Dup())
    backends = []

    def make_backend(config, rank=0):
        backends.append(CpuAsCuda(kernels=config.kernels, num_threads=1))
        return backends[-1]
    builder.make_backend = make_backend

    def build(config, loaded=None):
        group.send(config)          # as launch.start_group does after its spawn
        return builder.build(config, loaded, group=group)

    def stuck(runner):
        """The device table moved under this rank's graphs (CudaGraphRunner._table_unmoved)."""
        if options.get("stuck_rank") == group.rank:
            tables = runner.device_block_tables
            tables.table = tables.table.copy()

    def report(runner, **more):
        graphs = runner.graph_runner
        with open(os.path.join(out_dir, f"rank{group.rank}.json"), "w") as f:
            json.dump(dict(captured=graphs is not None,
                           replays=graphs.num_replays if graphs else 0,
                           fallbacks=graphs.num_eager_fallbacks if graphs else 0,
                           backend_replays=backends[0].replays, **more), f)

    if group.rank != 0:
        config = group.receive()
        parts = builder.build(config, group=group)
        stuck(parts.runner)
        serve_steps(parts.runner, group)
        report(parts.runner)
        group.close()
        return 0

    llm_engine.build = build
    config = EngineConfig(
        model=model, backend="cuda", tensor_parallel_size=options.get("tp", 1),
        pipeline_parallel_size=options.get("pp", 1), block_size=options.get("block_size", 16),
        num_kv_blocks=options.get("num_kv_blocks", 64), max_num_seqs=8,
        max_num_batched_tokens=64, enable_prefix_caching=False, cuda_graph=True,
        pipeline_micro_batches=options.get("micro_batches", 0),
        kernels=f"graphs_parallel={options.get('graphs', 'on')}")
    engine = llm_engine.LLMEngine(config)
    stuck(engine.runner)
    sent, send = [], group.send

    def record(message):
        if isinstance(message, StepInputs):
            batch, update = message.batch, message.batch.block_table_update
            sent.append(dict(bytes=len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)),
                             seqs=batch.num_seqs, tokens=batch.num_tokens,
                             whole_table=update is not None and update.table is not None,
                             entries=0 if update is None else len(update.packed),
                             table_shape=None if update is None else list(update.shape),
                             graphs=message.graphs))
        send(message)
    group.send = record
    for i, prompt in enumerate(options["prompts"]):
        engine.add_request(f"r{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=options.get("max_tokens", 12), ignore_eos=True))
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
    report(engine.runner, tokens=[tokens[f"r{i}"] for i in range(len(options["prompts"]))],
           sent=sent)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
