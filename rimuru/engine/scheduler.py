"""Continuous batching with chunked prefill under a token budget.

Each step (vLLM v1 style, no separate prefill/decode phases):
  1. running requests first, in arrival order: each gets what it still needs (1 token when decoding,
     a chunk when its prefill was cut) within the token budget; when the pool can't give a running
     request its pages and evicting experts could (elastic mode: `reclaimable`), the request sits out
     this step and its missing pages join the shortfall, so the adjuster evicts experts whose pages
     are free from the next step; otherwise the most recently started running request is preempted
     (pages freed, back to the front of the queue, recomputed later) until it can;
  2. then waiting requests in FIFO order while budget, `max_num_seqs` and pages allow; the first one
     that does not fit stops admission and its missing pages are reported as the shortfall (the
     elastic adjuster turns this into expert evictions). Admissions leave `admission_reserve` pages
     free (elastic mode: pages the adjuster's grows wait for); a request held back only by the reserve
     reports no shortfall. A waiting request first takes the longest cached prefix of its tokens (prefix
     caching, engine/kv_cache_manager.py) and is scheduled from there; the cache's unreferenced pages count as
     free, so they go before any expert is evicted. A hybrid model's request also takes its state pages at
     admission (engine/state_cache_manager.py), counted in KV pages in its need and its shortfall; it keeps them
     until it ends or is preempted, so running requests only ever ask for KV pages.
The scheduler decides allocation and never touches tensors; the runner turns its output into tensors.
With async scheduling a running request may have a pending token (sampled by the step in flight, not read
yet): it is scheduled on as if known (its input comes from the device), unless that token is its last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rimuru.engine.kv_cache_manager import CachedPrefix, KVCacheManager
from rimuru.engine.kv_compaction import KVMoves
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.state_cache_manager import StateCacheManager, StateCopy, StateSnapshot, snapshot_points


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step
    num_new_tokens: int
    # leading tokens of this chunk whose KV a shared cached block holds already: computed (a full prefix hit
    # recomputes its last token for logits) but not written, since a cached page is never written
    num_cached_writes: int = 0
    # True when this step's chunk reaches the request's last known token, so a new token is sampled
    # (fixed when scheduled: read several times per step, before the step's token is appended)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        req = self.request
        self.samples = self.start + self.num_new_tokens == req.num_known_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    stalled: list[Request] = field(default_factory=list)  # running, waiting this step for evictions' pages
    # kv pages the stalled requests, or else the first waiting request that could not be admitted, still lack
    shortfall_pages: int = 0
    # hybrid models with prefix caching: state copies the pass runs before its forward, in order
    state_copies: list[StateCopy] = field(default_factory=list)
    # set by the engine: KV pages compaction moved (engine/kv_compaction.py), copied before the pass
    kv_moves: KVMoves | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 reclaimable: Callable[[], int] | None = None,
                 admission_reserve: Callable[[], int] | None = None,
                 state: StateCacheManager | None = None) -> None:
        self.kv = kv
        self.state = state  # hybrid models: the requests' state pages
        self.reclaimable = reclaimable  # KV pages that evicting experts could free (elastic mode)
        self.admission_reserve = admission_reserve  # KV pages admissions leave free (elastic mode: for grows)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def oldest_wait_s(self, now: float) -> float:
        """Seconds since the head of the waiting queue arrived (`now` on the requests' clock); 0 with no queue."""
        return max(0.0, now - self.waiting[0].arrival_time) if self.waiting else 0.0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        block_size = self.kv.block_size
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.state_snapshots:
                assert self.state is not None
                self.state.release_snapshots(req)  # their copies ran in a launched pass
            if req.num_pending_tokens and req.num_output_tokens + req.num_pending_tokens >= req.max_tokens:
                i += 1  # its last token is in flight: it finishes when that is read
                continue
            computed = req.num_computed_tokens
            n = self._to_boundary(req, computed, min(req.num_known_tokens - computed, budget))
            # the common decode case needs no new block: skip the allocator (same answer, no calls)
            got = computed + n <= len(req.kv_pages) * block_size or self.kv.allocate(req, n)
            while not got:
                missing = self.kv.pages_needed(req, n) - self.kv.capacity_pages()
                if self.reclaimable is not None and out.shortfall_pages + missing <= self.reclaimable():
                    out.stalled.append(req)
                    out.shortfall_pages += missing
                    break
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                got = self.kv.allocate(req, n)
            if got:
                self._maybe_snapshot(req)
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n))
                budget -= n
            if req.status == RequestStatus.RUNNING:
                i += 1
        # Admit waiting requests only when no running request lacked pages: then the pool is full.
        reserve = self.admission_reserve() if self.admission_reserve is not None and self.waiting else 0
        while (not out.preempted and not out.stalled and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            req = self.waiting[0]
            assert not req.num_pending_tokens  # a preempted request's token is read in the step that preempted it
            while True:
                prefix, snap = self._state_prefix(req, self.kv.lookup(req))
                n = min(req.num_tokens - req.num_computed_tokens - prefix.num_tokens, budget)
                n = self._to_boundary(req, req.num_computed_tokens + prefix.num_tokens, n)
                need = self.kv.pages_needed(req, n, prefix) + (self.state.pages_needed(req) if self.state else 0)
                # a hybrid model's state snapshots go before the reserve holds a request back (then look again:
                # the one this request would start from may be gone)
                if not (reserve and need > self.kv.capacity_pages() - reserve and self.kv.spill is not None
                        and self.kv.spill()):
                    break
            if reserve and need > self.kv.capacity_pages() - reserve:  # held back by the reserve alone: no shortfall
                out.shortfall_pages = max(0, need - self.kv.capacity_pages())
                break
            if not self._admit_pages(req, n, prefix, snap):
                out.shortfall_pages = self._admission_shortfall(req, need)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n, prefix.num_cached_writes))
            budget -= n
        if self.state is not None:
            out.state_copies = self.state.take_copies()
        return out

    # ------------------------------------------------------------------ hybrid models' prefix caching
    def _snapshots_on(self) -> bool:
        return self.state is not None and self.state.snapshots is not None

    def _to_boundary(self, req: Request, start: int, n: int) -> int:
        """`n` tokens from `start`, or fewer so that the chunk ends at the first of the request's snapshot points
        it crosses of which no snapshot exists (engine/state_cache_manager.py)."""
        if not self._snapshots_on():
            return n
        assert self.state is not None and self.state.snapshots is not None
        for b in snapshot_points(req, self.kv.block_size):
            if start < b < start + n and self.state.snapshots.get(self._block_name(req, b)) is None:
                return b - start
        return n

    def _maybe_snapshot(self, req: Request) -> None:
        """A running request scheduled from one of its snapshot points: the last pass ended there, so its state
        pages hold the state the snapshot keeps (copied before this step's forward)."""
        if not self._snapshots_on():
            return
        assert self.state is not None and self.state.snapshots is not None
        b = req.num_computed_tokens
        if b not in snapshot_points(req, self.kv.block_size):
            return
        name = self._block_name(req, b)
        if self.state.snapshots.get(name) is None:
            self.state.take_snapshot(req, name, b)

    def _block_name(self, req: Request, boundary: int) -> bytes:
        """The prefix cache's name of the request's block ending at `boundary` (a block boundary)."""
        return self.kv.block_hashes(req, boundary // self.kv.block_size)[-1]

    def _state_prefix(self, req: Request, prefix: CachedPrefix) -> tuple[CachedPrefix, StateSnapshot | None]:
        """A hybrid model's hit: the cached KV blocks up to the last boundary of `prefix` (leaving a token to
        compute) that has a state snapshot, and that snapshot; no prefix when none has."""
        req.kv_chain_boundary = 0
        if not self._snapshots_on() or not prefix.blocks:
            return prefix, None
        assert self.state is not None and self.state.snapshots is not None
        block = self.kv.block_size
        k = min(len(prefix.blocks), (req.num_tokens - 1) // block)
        # the chain's end inside the prompt, snapshotted by this request's prefill if no snapshot is there
        chain = min(len(prefix.blocks), (len(req.prompt_token_ids) - 1) // block) * block
        while k > 0:
            snap = self.state.snapshots.get(prefix.blocks[k - 1].name)
            if snap is not None:
                req.kv_chain_boundary = chain if chain > k * block else 0
                return self.kv.trim(prefix, k), snap
            k -= 1
        req.kv_chain_boundary = chain
        return self.kv.trim(prefix, 0), None

    def _admit_pages(self, req: Request, n: int, prefix: CachedPrefix, snap: StateSnapshot | None = None) -> bool:
        """A waiting request's state pages (hybrid models) and KV pages for its first `n` tokens, all or nothing;
        with a snapshot (a hybrid model's hit), taken first so that these allocations cannot reclaim it."""
        if snap is not None:
            assert self.state is not None and self.state.snapshots is not None
            self.state.snapshots.acquire(snap)
            req.state_snapshots.append(snap)
        if self.state is not None and not self.state.allocate(req):
            self.state.free(req)  # gives the snapshot back
            return False
        if self.kv.allocate(req, n, prefix):
            if snap is not None:
                assert self.state is not None
                self.state.restore(req, snap)
            return True
        if self.state is not None:
            self.state.free(req)  # no pass has seen them
        return False

    def _admission_shortfall(self, req: Request, need: int) -> int:
        """KV pages (state pages counted in them) a waiting request that could not be admitted lacks: what its need
        exceeds the capacity by, or what its state pages lack kind by kind, and at least one page (the kinds of a
        hybrid model's pages compete for the same free pages, so a need within the capacity may still not fit)."""
        short = need - self.kv.capacity_pages()
        if self.state is None:
            return max(0, short)
        return max(1, short, self.state.missing_kv_pages(req))

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        if self.state is not None:
            self.state.free(req)

    def _preempt(self, req: Request) -> None:
        self._free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Ends `req` (finished or aborted) wherever it is and frees its pages."""
        assert status.finished
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = status
        self._free(req)
