"""The release rule of the page pool, as one object: a page freed while a pass may still read it is written
by another stream only behind that pass.

Pages are freed at the end of a step (`PageAllocator.complete_forward`): an evicted expert's, a finished
request's KV pages, the load buffers' when they go idle. With async scheduling the pass launched in that
step may still be running on the GPU when the pages are handed out again:

    compute stream:  ... pass N (reads page p) ......................... pass N+1
    host:                 step N ends: p freed ─► step N+1: p allocated ─► consumer writes p
    copy stream:                                        wait(fence N) ──► copy into p

  * consumers on the compute stream (KV writes of the next pass) are ordered after pass N by the stream;
  * consumers on any other stream (a grow's copy into its reserved pages, the load buffers' copies after
    they take pages) call `order_after_launched_passes(stream)` before they write: the stream waits on the
    event recorded after the last launched pass. A page is handed out only after it was freed, which is
    after the pass that last read it was launched, so that event covers every pass that could read it.
Without CUDA every pass has finished when the host moves on: nothing to wait for; the calls are still made
(and counted), so the rule is tested on the CPU too. Events are recorded only once a consumer said it will write
freed pages while passes run (`watch`): in static and fixed mode nothing does, and a pass costs no event.
"""

from __future__ import annotations

import torch


class PassFence:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.recording = False  # set by watch()
        self.passes_launched = 0
        self._last: torch.cuda.Event | None = None  # recorded on the compute stream after the last launched pass
        self.covered = 0  # passes the latest consumer's wait covers (tests hold it to passes_launched)

    def watch(self) -> None:
        """A consumer on another stream will write pages freed while passes run: every pass from now on is
        recorded."""
        self.recording = self.cuda

    def pass_launched(self) -> None:
        """A forward pass has just been queued on the compute stream."""
        self.passes_launched += 1
        if self.recording:
            self._last = torch.cuda.Event()
            self._last.record()

    def order_after_launched_passes(self, stream: torch.cuda.Stream | None) -> None:
        """Work queued on `stream` from now on runs after every pass launched so far has finished."""
        self.covered = self.passes_launched
        if stream is not None and self._last is not None:
            stream.wait_event(self._last)
