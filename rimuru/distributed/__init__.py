"""Tensor parallelism over torch.distributed: one rank's group and its collectives (parallel_state.py). The worker
processes that hold the other ranks are the engine's (engine/tp_workers.py)."""
