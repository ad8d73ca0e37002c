"""State pages of requests of a hybrid model: one ssm and one conv page per linear-attention layer.

A gated DeltaNet layer keeps per request a recurrent state (an `ssm` mid page) and a conv state (a `conv` small
page) instead of KV, of a fixed size whatever the request's length. A request takes all of them at admission, in
one all-or-nothing allocation with the request as owner (so its conv pages share mid pages and merge back when
it ends), keeps them across every prefill chunk and decode step, and gives them back when it finishes, is aborted
or is preempted. A preempted request recomputes its state from its tokens when it is admitted again, as it
recomputes its KV: nothing is swapped out. The pages are freed at once, exactly as KV pages are: the next pass
that writes them runs behind the pass in flight on the compute stream, and a copy-stream writer (an expert's
grow, the load buffers) waits on the pass fence first (memory/pass_fence.py). What a page held before is garbage
to its next request, whose first pass selects a zero state instead of reading it (models/gated_deltanet.py).

The scheduler counts state in KV pages (`kv_pages`: the state's bytes over a KV page's, rounded up), the unit of
its admission test and its shortfall, so the adjusters evict experts for a request's state as for its KV. Where
the ssm page is the expert page (Qwen3.5-35B-A3B) an evicted expert's page is one ssm page; where it is not, a
freed expert page becomes ssm pages only once its whole huge page is free, so the shortfall is a lower bound and
the next step reports what is still missing.
"""

from __future__ import annotations

from rimuru.engine.request import Request
from rimuru.memory.allocator import PageAllocator
from rimuru.memory.geometry import CONV, SSM


class StateCacheManager:
    def __init__(self, allocator: PageAllocator, num_linear_layers: int, kv_page_bytes: int) -> None:
        if num_linear_layers < 1 or kv_page_bytes < 1:
            raise ValueError(f"need num_linear_layers >= 1 and kv_page_bytes >= 1, got {num_linear_layers}, "
                             f"{kv_page_bytes}")
        g = allocator.geometry
        self.allocator = allocator
        self.num_layers = num_linear_layers
        self._ssm_kv = -(-g.size(SSM) // kv_page_bytes)  # one ssm page, in KV pages
        self._conv_kv = -(-g.size(CONV) // kv_page_bytes)
        self.request_bytes = num_linear_layers * (g.size(SSM) + g.size(CONV))  # one request's state pages
        self.kv_pages = -(-self.request_bytes // kv_page_bytes)  # the same, in KV pages: the scheduler's unit
        self.num_holders = 0  # requests holding state pages

    def pages_needed(self, request: Request) -> int:
        """KV pages' worth of state `allocate(request)` takes: none when the request holds its state already."""
        return 0 if request.ssm_pages else self.kv_pages

    def missing_kv_pages(self, request: Request) -> int:
        """KV pages' worth of the request's state pages that the allocator cannot give now, kind by kind (0 when
        each kind alone fits; the kinds compete for the same free pages, so together they may still not)."""
        if request.ssm_pages:
            return 0
        a, L = self.allocator, self.num_layers
        return (max(0, L - a.mid_capacity(SSM)) * self._ssm_kv
                + max(0, L - a.small_capacity(CONV)) * self._conv_kv)

    def allocate(self, request: Request) -> bool:
        """Gives `request` its state pages, all or nothing (False: nothing taken); True when it holds them."""
        if request.ssm_pages:
            return True
        a, L = self.allocator, self.num_layers
        ssm = a.allocate_mid(SSM, L, owner=request.seq_id)
        if ssm is None:
            return False
        conv = a.allocate_small(CONV, L, owner=request.seq_id)
        if conv is None:
            a.free_mid(SSM, ssm)  # no pass has seen them: back at once
            return False
        request.ssm_pages, request.conv_pages = ssm, conv
        self.num_holders += 1
        return True

    def free(self, request: Request) -> None:
        """The request ends or is preempted: its state pages go back to the pool (module docstring)."""
        if not request.ssm_pages:
            return
        self.allocator.free_mid(SSM, request.ssm_pages)
        self.allocator.free_small(CONV, request.conv_pages)
        request.ssm_pages, request.conv_pages = [], []
        self.num_holders -= 1

    @property
    def pages_in_use(self) -> int:
        """ssm + conv pages requests hold."""
        return 2 * self.num_layers * self.num_holders

    @property
    def bytes_in_use(self) -> int:
        return self.num_holders * self.request_bytes

    def check(self) -> None:
        """Every state page is held by a request: the allocator's counts = L per holder, for each kind."""
        a, want = self.allocator, self.num_layers * self.num_holders
        assert a.num_used(SSM) == want and a.num_used(CONV) == want, (a.num_used(SSM), a.num_used(CONV), want)
