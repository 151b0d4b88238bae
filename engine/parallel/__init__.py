"""Tensor parallel: the model split across processes (ranks), rank 0 scheduling and sampling and
the others running the same forward on their shares (README: tensor parallel). The communicator
interface (communicator.py) with MPI (mpi.py) and NCCL (nccl.py) behind it, each rank's cut of
the checkpoint (sharding.py), the collectives in the graph (layers.py), the step messages
(steps.py) and the start-up in step (launch.py, worker.py)."""
