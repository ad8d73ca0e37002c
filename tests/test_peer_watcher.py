"""The watch on a tensor-parallel group's peer processes (distributed/peer_watcher.py): its action runs once when a
watched process ends unexpectedly, never after the watch was stopped, and a failing action does not escape its
thread. The engine's use of it (rank 0 aborting the groups on a worker's death) is in test_tensor_parallel.py."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from rimuru.distributed.peer_watcher import PeerWatcher


def _sleeper() -> None:
    time.sleep(60)


@pytest.fixture
def sleeper():
    p = mp.get_context("spawn").Process(target=_sleeper, daemon=True)
    p.start()
    yield p
    if p.is_alive():
        p.kill()
    p.join(timeout=5)


def test_the_action_runs_once_soon_after_a_watched_process_dies(sleeper) -> None:
    calls: list[float] = []
    ran = threading.Event()

    def on_death() -> None:
        calls.append(time.monotonic())
        ran.set()

    watcher = PeerWatcher([sleeper.sentinel], on_death)
    time.sleep(0.2)
    assert not watcher.fired.is_set() and calls == []  # alive: nothing runs
    t0 = time.monotonic()
    os.kill(sleeper.pid, signal.SIGKILL)
    assert ran.wait(timeout=5)
    assert calls[0] - t0 < 2 and watcher.fired.is_set()
    watcher.stop()
    assert len(calls) == 1


def test_a_stopped_watch_runs_nothing_when_the_process_then_ends(sleeper) -> None:
    calls: list[int] = []
    watcher = PeerWatcher([sleeper.sentinel], lambda: calls.append(1))
    watcher.stop()
    sleeper.kill()
    sleeper.join(timeout=5)
    time.sleep(0.3)
    assert calls == [] and not watcher.fired.is_set()
    watcher.stop()  # a second stop is harmless


def test_a_failing_action_is_logged_not_raised(sleeper, caplog: pytest.LogCaptureFixture) -> None:
    def on_death() -> None:
        raise RuntimeError("abort failed")

    watcher = PeerWatcher([sleeper.sentinel], on_death)
    sleeper.kill()
    assert watcher.fired.wait(timeout=5)
    watcher.stop()  # joins the thread: its log is written
    assert "the action on a peer's death failed" in caplog.text and "abort failed" in caplog.text
