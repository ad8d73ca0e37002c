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

Prefix caching (`StateSnapshots`): the state after a request's first `b` tokens, for the boundaries `b` that
`snapshot_points` names (the last block boundary before its prompt's last token, and where its cached KV chain
ended at admission when no snapshot was there: the end of a shared system prompt, seen by the second request that
shares it, so that the third one hits), is copied into state pages of the cache (a snapshot) named by the prefix
cache's name of the block ending at `b`. The scheduler ends a prefill chunk at `b` when no snapshot of that name
exists, and takes the snapshot when it schedules the
request's next chunk: the copy runs at the start of that pass, behind the pass that wrote the state, on the same
stream. A waiting request whose cached KV chain reaches a snapshotted boundary takes the KV blocks up to it and
a copy of the snapshot into its own state pages (a snapshot is never written after its copy-in, so it is shared
read-only like a cached KV block), and starts computing at the boundary. A snapshot is held (refs) by the request
that took it and by every request that copied it, from the schedule that queues the copy to the request's next
schedule (the copy's pass is launched by then) or its end; held by none, it waits in an LRU, reclaimable: the
allocator's ssm and conv allocations reclaim it (`StateSnapshots` serves the reclaimer for those kinds; a
request's state allocation that fails kind by kind drops snapshots one at a time and tries again), and a KV
allocation that the free pages and the cached KV blocks cannot serve drops snapshots, oldest first, before it
fails (so before experts are evicted for it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from rimuru.engine.request import Request
from rimuru.memory.allocator import PageAllocator, PageReclaimer
from rimuru.memory.geometry import CONV, SSM


@dataclass(eq=False)
class StateSnapshot:
    name: bytes  # the prefix cache's name of the block that ends at the snapshot's token position
    num_tokens: int  # that position: the state after the first num_tokens tokens of the chain
    ssm_pages: list[int]  # one per linear-attention layer
    conv_pages: list[int]
    refs: int = 1


# (source ssm pages, destination ssm pages, source conv pages, destination conv pages): one state copy
StateCopy = tuple[list[int], list[int], list[int], list[int]]


class StateSnapshots:
    """The cached state snapshots of one pool; the allocator's reclaimer for the ssm and conv kinds, and for
    another mid kind where unheld snapshots alone use a huge page."""

    def __init__(self, allocator: PageAllocator, num_layers: int) -> None:
        self.allocator = allocator
        self.num_layers = num_layers
        self._snaps: dict[bytes, StateSnapshot] = {}
        self._lru: OrderedDict[bytes, StateSnapshot] = OrderedDict()  # refs 0, least recently used first
        self._unheld_by_huge: dict[int, int] = {}  # huge page -> ssm pages of the LRU's snapshots in it
        self._unheld_changes = 0
        self._whole_counted: tuple[tuple[int, int], int] | None = None  # (version, huge pages unheld ones alone use)

    @property
    def num_snapshots(self) -> int:
        return len(self._snaps)

    @property
    def num_unreferenced(self) -> int:
        return len(self._lru)

    def get(self, name: bytes) -> StateSnapshot | None:
        return self._snaps.get(name)

    def create(self, name: bytes, num_tokens: int) -> StateSnapshot | None:
        """New snapshot pages under `name`, held by their taker (refs 1); None when the pool cannot give them."""
        assert name not in self._snaps
        a, L = self.allocator, self.num_layers
        ssm = a.allocate_mid(SSM, L)
        if ssm is None:
            return None
        conv = a.allocate_small(CONV, L)
        if conv is None:
            a.free_mid(SSM, ssm)
            return None
        snap = StateSnapshot(name, num_tokens, ssm, conv)
        self._snaps[name] = snap
        return snap

    def acquire(self, snap: StateSnapshot) -> None:
        if snap.refs == 0:
            del self._lru[snap.name]
            self._count_unheld(snap, -1)
        snap.refs += 1

    def release(self, snap: StateSnapshot) -> None:
        snap.refs -= 1
        if snap.refs == 0:
            self._lru[snap.name] = snap
            self._count_unheld(snap, +1)

    def _count_unheld(self, snap: StateSnapshot, sign: int, by_huge: dict[int, int] | None = None) -> None:
        """Adds (sign +1) or takes (-1) the snapshot's ssm pages to / from the per-huge-page count of the LRU's."""
        if by_huge is None:
            by_huge = self._unheld_by_huge
            self._unheld_changes += 1
        g = self.allocator.geometry
        for page in snap.ssm_pages:
            h = g.huge_of_mid(SSM, page)
            n = by_huge.get(h, 0) + sign
            if n:
                by_huge[h] = n
            else:
                del by_huge[h]

    def drop_lru(self) -> bool:
        """Frees the least recently used snapshot no request holds; False when there is none."""
        if not self._lru:
            return False
        _, snap = self._lru.popitem(last=False)
        self._count_unheld(snap, -1)
        del self._snaps[snap.name]
        self.allocator.free_mid(SSM, snap.ssm_pages)
        self.allocator.free_small(CONV, snap.conv_pages)
        return True

    def clear(self) -> int:
        """Drops every snapshot no request holds; returns the pages freed."""
        n = 2 * self.num_layers * len(self._lru)
        while self.drop_lru():
            pass
        return n

    # the allocator's reclaimer, for the ssm (mid) and conv (small) kinds
    def reclaimable_small(self, kind: str) -> int:
        return self.num_layers * len(self._lru) if kind == CONV else 0

    def reclaim_small(self, kind: str, count: int) -> None:
        if kind == CONV:
            self._drop_until(self.allocator.free_small_capacity, kind, count)

    def reclaimable_mid(self, kind: str) -> int:
        """ssm pages: every unheld snapshot's. Another mid kind (experts): the huge pages split into ssm pages that
        unheld snapshots alone use (dropped, they merge), each that kind's mids per huge page (at Qwen3.5-35B-A3B an
        ssm page is a huge page, so a dropped snapshot gives one expert page a linear-attention layer)."""
        if kind == SSM:
            return self.num_layers * len(self._lru)
        a = self.allocator
        version = (a.mid_changes, self._unheld_changes)  # cached until a mid page or the LRU changes
        if self._whole_counted is None or self._whole_counted[0] != version:
            self._whole_counted = (version, self._huge_pages_alone(self._unheld_by_huge))
        return self._whole_counted[1] * a.geometry.mids_per_huge(kind)

    def _huge_pages_alone(self, by_huge: dict[int, int]) -> int:
        """Huge pages split into ssm pages whose every used ssm page is one of `by_huge`'s count there."""
        return sum(1 for h, n in by_huge.items() if self.allocator.huge_page_use(h) == (SSM, n))

    def reclaim_mid(self, kind: str, count: int) -> None:
        self._drop_until(self.allocator.free_mid_capacity, kind, count)

    def _drop_until(self, free_capacity: Callable[[str], int], kind: str, count: int) -> None:
        """Drops unheld snapshots, least recently used first, until `count` more pages of `kind` are free."""
        target = free_capacity(kind) + count
        while free_capacity(kind) < target and self.drop_lru():
            pass

    def check(self) -> None:
        assert all(s.refs >= 0 and s.name == n for n, s in self._snaps.items())
        assert set(self._lru) == {n for n, s in self._snaps.items() if s.refs == 0}
        by_huge: dict[int, int] = {}
        for snap in self._lru.values():
            self._count_unheld(snap, +1, by_huge)
        assert by_huge == self._unheld_by_huge, "unheld snapshot pages by huge page drifted"
        if self._whole_counted is not None and self._whole_counted[0] == (self.allocator.mid_changes,
                                                                          self._unheld_changes):
            assert self._whole_counted[1] == self._huge_pages_alone(by_huge), \
                "stale count of huge pages unheld snapshots alone use"


class Reclaimers:
    """The allocator's one reclaimer over two: the state snapshots first (for the ssm and conv kinds, and huge pages
    they alone use for another mid kind), then the prefix cache's KV blocks (its KV pages, whole mid pages emptied
    of refs-0 blocks, and huge pages of whole ones)."""

    def __init__(self, kv: PageReclaimer, state: StateSnapshots) -> None:
        self.kv, self.state = kv, state

    def reclaimable_small(self, kind: str) -> int:
        return self.state.reclaimable_small(kind) + self.kv.reclaimable_small(kind)

    def reclaim_small(self, kind: str, count: int) -> None:
        a = self.state.allocator
        target = a.free_small_capacity(kind) + count
        self.state.reclaim_small(kind, count)
        left = target - a.free_small_capacity(kind)
        if left > 0 and self.kv.reclaimable_small(kind):
            self.kv.reclaim_small(kind, left)

    def reclaimable_mid(self, kind: str) -> int:
        return self.state.reclaimable_mid(kind) + self.kv.reclaimable_mid(kind)

    def reclaim_mid(self, kind: str, count: int) -> None:
        a = self.state.allocator
        target = a.free_mid_capacity(kind) + count
        self.state.reclaim_mid(kind, count)
        left = target - a.free_mid_capacity(kind)
        if left > 0:
            self.kv.reclaim_mid(kind, min(left, self.kv.reclaimable_mid(kind)))


def snapshot_boundary(request: Request, block_size: int) -> int:
    """The token position whose state every request's prefill snapshots: the last block boundary before its
    prompt's last token (0: none; a hit must leave at least one token to compute, for the first logits)."""
    return (len(request.prompt_token_ids) - 1) // block_size * block_size


def snapshot_points(request: Request, block_size: int) -> list[int]:
    """The token positions whose state the request's prefill snapshots, in order: where its cached KV chain
    ended at admission without a snapshot (`Request.kv_chain_boundary`), and `snapshot_boundary`."""
    last = snapshot_boundary(request, block_size)
    chain = request.kv_chain_boundary
    return [b for b in sorted({chain, last}) if 0 < b <= last]


class StateCacheManager:
    def __init__(self, allocator: PageAllocator, num_linear_layers: int, kv_page_bytes: int,
                 enable_prefix_caching: bool = False) -> None:
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
        self.snapshots: StateSnapshots | None = None  # prefix caching: see the module docstring
        self._copies: list[StateCopy] = []  # for the next pass, in order
        if enable_prefix_caching:
            if allocator.reclaimer is None:
                raise ValueError("state snapshots need the prefix cache: enable it on the KV cache manager first")
            self.snapshots = StateSnapshots(allocator, num_linear_layers)
            allocator.reclaimer = Reclaimers(allocator.reclaimer, self.snapshots)

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
        while True:
            ssm = a.allocate_mid(SSM, L, owner=request.seq_id)
            conv = a.allocate_small(CONV, L, owner=request.seq_id) if ssm is not None else None
            if conv is not None:
                break
            if ssm is not None:
                a.free_mid(SSM, ssm)  # no pass has seen them: back at once
            # the snapshots' pages count as obtainable only kind by kind; freeing them may merge pages of others
            if self.snapshots is None or not self.snapshots.drop_lru():
                return False
        request.ssm_pages, request.conv_pages = ssm, conv
        self.num_holders += 1
        return True

    # ------------------------------------------------------------------ prefix caching
    def take_snapshot(self, request: Request, name: bytes, num_tokens: int) -> bool:
        """Copies the request's state (after its first `num_tokens` tokens, the last pass's) into a new snapshot
        named `name`, held by the request; False when the pool cannot give its pages (then there is none)."""
        assert self.snapshots is not None and request.ssm_pages
        snap = self.snapshots.create(name, num_tokens)
        if snap is None:
            return False
        self._copies.append((request.ssm_pages, snap.ssm_pages, request.conv_pages, snap.conv_pages))
        request.state_snapshots.append(snap)
        return True

    def restore(self, request: Request, snap: StateSnapshot) -> None:
        """A hit: the request (holding its state pages and `snap`, acquired) starts from a copy of the snapshot."""
        assert request.ssm_pages and snap in request.state_snapshots
        self._copies.append((snap.ssm_pages, request.ssm_pages, snap.conv_pages, request.conv_pages))

    def take_copies(self) -> list[StateCopy]:
        """The state copies the next pass runs before its forward, in order (then forgotten here)."""
        out, self._copies = self._copies, []
        return out

    def reset_prefix_cache(self) -> int:
        return self.snapshots.clear() if self.snapshots is not None else 0

    @property
    def num_cached_pages(self) -> int:
        """ssm + conv pages of every snapshot (held by requests or not)."""
        return 2 * self.num_layers * self.snapshots.num_snapshots if self.snapshots is not None else 0

    def release_snapshots(self, request: Request) -> None:
        """Gives back the snapshots the request holds (their copies are queued or launched: nothing reclaims them
        before that pass is ordered, by the stream or by the pass fence)."""
        if self.snapshots is not None:
            for snap in request.state_snapshots:
                self.snapshots.release(snap)
        request.state_snapshots = []

    def free(self, request: Request) -> None:
        """The request ends or is preempted: its state pages go back to the pool (module docstring), the
        snapshots it still holds to the cache."""
        self.release_snapshots(request)
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
        """Bytes of requests' state pages and of the snapshots."""
        snaps = self.snapshots.num_snapshots if self.snapshots is not None else 0
        return (self.num_holders + snaps) * self.request_bytes

    def check(self) -> None:
        """Every state page is held by a request or a snapshot: the allocator's counts = L per holder and per
        snapshot, for each kind."""
        snaps = self.snapshots.num_snapshots if self.snapshots is not None else 0
        a, want = self.allocator, self.num_layers * (self.num_holders + snaps)
        assert a.num_used(SSM) == want and a.num_used(CONV) == want, (a.num_used(SSM), a.num_used(CONV), want)
        if self.snapshots is not None:
            self.snapshots.check()
