"""`python -m engine.parallel.worker`: a tensor-parallel rank other than 0, started by rank 0's
MPI spawn (engine/parallel/mpi.py), or by a Ray actor with `--connect PORT --rank R --world-size
N` (engine/parallel/ray_executor.py), never by hand. It receives rank 0's EngineConfig, builds its
share of the engine (engine/core/builder.py: the same start-up as rank 0's, in step with it),
then runs each step rank 0 sends until rank 0 stops it (engine/parallel/steps.py).

Signals: a Ctrl-C in the server's terminal reaches every process of its group, and a SIGTERM
may be sent to all of them; rank 0 then drains its requests, which needs the workers to keep
running its steps. So a worker ignores both and ends on rank 0's stop, or when rank 0 is gone.
"""
from __future__ import annotations

import logging
import signal
import sys


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from engine.core.builder import build
    from engine.parallel.launch import WorkerStop
    from engine.parallel.mpi import MpiGroup
    from engine.parallel.steps import serve_steps

    if "--connect" in sys.argv:     # a Ray actor's rank (engine/parallel/ray_executor.py)
        args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
        group = MpiGroup.connect(args["--connect"], int(args["--rank"]),
                                 int(args["--world-size"]), int(args["--watch-pid"]))
    else:
        group = MpiGroup.from_parent()
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s rank {group.rank} %(name)s: "
                               "%(message)s")
    config = group.receive()
    try:
        parts = build(config, group=group)
    except WorkerStop:          # rank 0 says what failed
        return 1
    drafts = None
    if parts.draft is not None:     # an MTP head's shard: it drafts and mirrors with rank 0
        from engine.parallel.draft_steps import PeerDrafts
        drafts = PeerDrafts(parts.runner, parts.draft)
    serve_steps(parts.runner, group, drafts)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
