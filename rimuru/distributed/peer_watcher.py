"""A watch on the other processes of a tensor-parallel group, for collectives that cannot notice a dead peer.

Under gloo a collective whose peer died fails within about a second: the peer's sockets close. Under NCCL a
surviving rank may block in a collective, or in a CUDA wait queued behind one, until the process group's timeout
(minutes), holding its GPU the whole time. A `PeerWatcher` is a daemon thread that waits on the peers' process
sentinels (the handles the OS signals when a process ends) and runs its `on_death` once when one ends:

    rank 0    watches its workers; on a death it aborts the NCCL communicators (`abort_device_groups`), so the
              collective it is blocked in returns an error at once and the engine raises WorkerFailed
    worker    watches rank 0 (its parent); on a death it ends its own process, whatever it is blocked in

`stop` ends the watch first wherever a peer ends on purpose (rank 0 telling its workers to exit, or killing them
after a failure it already reported), so that only unexpected deaths run `on_death`.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
from collections.abc import Callable, Sequence

import torch.distributed as dist

logger = logging.getLogger("rimuru")


class PeerWatcher:
    def __init__(self, sentinels: Sequence[int], on_death: Callable[[], None], name: str = "rimuru-peer-watcher"):
        """`sentinels`: the peers' `Process.sentinel`s; `on_death` runs on the watcher's thread, at most once."""
        self._on_death = on_death
        self._stop_read, self._stop_write = os.pipe()  # written by `stop`: a waitable the sentinels sit beside
        self.fired = threading.Event()  # set before `on_death` runs
        self._thread = threading.Thread(target=self._watch, args=(list(sentinels),), name=name, daemon=True)
        self._thread.start()

    def _watch(self, sentinels: list[int]) -> None:
        ready = multiprocessing.connection.wait([*sentinels, self._stop_read])
        if self._stop_read in ready:
            return
        self.fired.set()
        try:
            self._on_death()
        except Exception:  # noqa: BLE001 - the thread has no caller to raise to: say it, the engine goes on
            logger.exception("tensor parallelism: the action on a peer's death failed")

    def stop(self) -> None:
        """Ends the watch without running `on_death` (if it has not run); waits for an `on_death` already running.
        The pipe's two ends are closed here, after the thread ended, never by the thread."""
        if self._stop_write < 0:
            return
        os.write(self._stop_write, b"x")
        self._thread.join(timeout=30)
        os.close(self._stop_write)
        os.close(self._stop_read)
        self._stop_write = -1


def device_groups_need_abort() -> bool:
    """Whether this process's device collectives go through NCCL, whose blocked calls only an abort ends."""
    return dist.is_initialized() and dist.get_backend() == "nccl"


def abort_device_groups() -> None:
    """Aborts every process group of this process (the NCCL communicators and the gloo control group), so that a
    collective blocked on a dead peer raises; afterwards the process belongs to no group (`destroy` is a no-op)."""
    logger.error("tensor parallelism: a peer process ended; aborting the process groups")
    dist.distributed_c10d._abort_process_group()
