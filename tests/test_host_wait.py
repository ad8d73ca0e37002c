"""memory/host_wait.py: the engine thread blocks on a device event (and gives the GIL away) only while the work
behind it is still running."""

from __future__ import annotations

import pytest

from rimuru.memory.host_wait import wait_for


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


@pytest.mark.parametrize("done", [True, False])
def test_wait_for_blocks_only_on_unfinished_work(done: bool) -> None:
    event = _Event(done)
    wait_for(event)
    assert event.done and event.synchronized == (0 if done else 1)


@pytest.mark.gpu
def test_wait_for_a_cuda_event() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.ones(4096, 4096, device="cuda")
    y = x @ x
    event = torch.cuda.Event()
    event.record()
    wait_for(event)
    assert event.query() and float(y[0, 0]) == 4096.0
