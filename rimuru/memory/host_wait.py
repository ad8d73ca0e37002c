"""The engine thread's waits for the device, without giving the GIL away when there is nothing to wait for.

`torch.cuda.Event.synchronize()` releases the GIL while it blocks; `query()` does not. In the server the event
loop's thread (HTTP, streaming) waits for the GIL whenever it has work, so each release hands it over, and the engine
thread gets it back only when the loop drops it: after up to one switch interval (server/async_engine.py sets
0.5 ms), even when the event had completed long before. A step that waits on an already finished copy pays that
for nothing; `wait_for` asks first and blocks only on work still in flight.
"""

from __future__ import annotations

from typing import Protocol


class DeviceEvent(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def wait_for(event: DeviceEvent) -> None:
    """Returns once the work recorded before `event` has completed; blocks (and releases the GIL) only if it has
    not yet."""
    if not event.query():
        event.synchronize()
