"""Three-level page allocator (huge -> mid -> small) over one pool, with affinity and deferred release.

Pure Python + numpy: it hands out page ids and never touches device memory. Bytes of page `i` of kind K
are `geometry.offset(K, i)`; all such arithmetic lives in `geometry.py`.

State (one numpy int8 array per kind, indexed by page id of that kind):

    huge_kind[h]        -1 = free (in the root pool), else index of the mid kind h is split into
    huge_busy[h]        mids of h that are not free (allocated, deferred or split); 0 -> h merges back
    mid_state[M][m]     ABSENT (its huge is not split into M) | FREE | USED | DEFERRED | SPLIT
    small_state[S][s]   ABSENT (its mid is not split into S)  | FREE | USED | DEFERRED

Invariants (checked by `check_invariants`):
  * every byte of the pool is in exactly one of: a free huge page, a free mid page, a free small page,
    or a used (allocated or deferred) page of some kind;
  * a split mid page always has at least one used small page (when its last one is freed it merges);
  * a split huge page always has at least one non-free mid page (likewise).
Hence every free small page is "trapped": it sits in a mid page that cannot merge yet.

Reclaim: a holder of used pages that it can give back on demand (the prefix cache's unreferenced KV blocks,
engine/prefix_cache.py) registers as `reclaimer`. Its pages stay USED here, but the capacities count them as
obtainable, and an allocation that free pages cannot serve asks the reclaimer to free what is missing first
(`reclaim_small`; for mid pages `reclaim_mid`, which empties whole mid pages, of the kind asked for or, merging
them, whole huge pages of another kind), so a request never fails while reclaimable pages would make it fit.

Free lists: huge and mid pages are min-heaps (lowest address first). A mid page leaves its heap lazily:
entries are checked against `mid_state` when popped, because a merge of its huge page removes free mids
without touching the heap. Free small pages live in their parent mid page's list (`_Parent.free`), so a
bulk request takes whole runs of ids with list slicing instead of per-page bookkeeping objects.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rimuru.memory.geometry import PageGeometry

ABSENT, FREE, USED, DEFERRED, SPLIT = 0, 1, 2, 3, 4


class AllocatorError(ValueError):
    """Bad use of the allocator: the request names pages or kinds that do not fit its state."""


class DoubleFreeError(AllocatorError):
    """A page freed (or deferred) twice."""


class WrongKindError(AllocatorError):
    """A page id given with a kind it was not allocated as."""


@dataclass(frozen=True)
class AllocatorStats:
    pool_bytes: int
    free_bytes: dict[str, int]  # by level: huge, mid, small
    used_pages: dict[str, int]  # by kind, allocated + pending deferred
    used_bytes: dict[str, int]  # by kind (small pages count their padded size)
    trapped_bytes: int  # free small pages inside mid pages that cannot merge yet
    padding_bytes: int  # padding inside used pages (small kinds, and a padded ssm kind)
    pending_deferred: int  # pages waiting for complete_forward()
    num_free_huge: int

    @property
    def total_free_bytes(self) -> int:
        return sum(self.free_bytes.values())

    @property
    def total_used_bytes(self) -> int:
        return sum(self.used_bytes.values())


class PageReclaimer(Protocol):
    """Used pages whose holder frees them (through `free_small`) when the allocator asks."""

    def reclaimable_small(self, kind: str) -> int:
        """Small pages of `kind` that reclaim_small could free."""
        ...

    def reclaim_small(self, kind: str, count: int) -> None:
        """Free at least `count` small pages of `kind` (count <= reclaimable_small(kind))."""
        ...

    def reclaimable_mid(self, kind: str) -> int:
        """Mid pages of `kind` that reclaim_mid could empty (every used small page in them is reclaimable)."""
        ...

    def reclaim_mid(self, kind: str, count: int) -> None:
        """Empty at least `count` mid pages of `kind` (count <= reclaimable_mid(kind)): free all their used smalls."""
        ...


class _Parent:
    """A mid page split into small pages of one kind: the free ones and the owner they are kept for."""

    __slots__ = ("key", "small_kind", "mid_kind", "mid_id", "owner", "free")

    def __init__(
        self, key: int, small_kind: str, mid_kind: str, mid_id: int, owner: Hashable, free: list[int]
    ) -> None:
        self.key = key  # byte offset of the mid page: unique among live mid pages of every kind
        self.small_kind = small_kind
        self.mid_kind = mid_kind
        self.mid_id = mid_id
        self.owner = owner
        self.free = free


class PageAllocator:
    def __init__(self, geometry: PageGeometry, num_huge_pages: int) -> None:
        if num_huge_pages <= 0:
            raise AllocatorError(f"num_huge_pages must be positive, got {num_huge_pages}")
        g = self.geometry = geometry
        self.num_huge_pages = num_huge_pages
        self.pool_bytes = num_huge_pages * g.huge_size
        self._mid_kinds = g.mid_kinds
        self._mid_size_table = np.array([g.size(m) for m in self._mid_kinds], dtype=np.int64)

        self._huge_kind = np.full(num_huge_pages, -1, dtype=np.int8)
        self._huge_busy = [0] * num_huge_pages  # a list: read and written one element at a time
        self.mid_changes = 0  # counts every mid page taken or released: a reclaimer's cached counts' version
        self._huge_heap = list(range(num_huge_pages))  # sorted, hence already a heap
        self._free_huge = num_huge_pages

        # bytearray for fast one-element access; a numpy view of the same memory for slices and checks.
        self._mid_bytes = {m: bytearray(g.num_pages(m, self.pool_bytes)) for m in self._mid_kinds}
        self._mid_state = {m: np.frombuffer(b, dtype=np.int8) for m, b in self._mid_bytes.items()}
        self._mid_heap: dict[str, list[int]] = {m: [] for m in self._mid_kinds}
        self._free_mids = dict.fromkeys(self._mid_kinds, 0)

        kinds = g.small_kinds
        # Ratios from the geometry, cached: they are read on every request.
        self._spm = {(s, m): g.smalls_per_mid(s, m) for s in kinds for m in self._mid_kinds}
        self._sph = {s: g.smalls_per_huge(s) for s in kinds}
        self._small_state = {s: np.zeros(g.num_pages(s, self.pool_bytes), dtype=np.int8) for s in kinds}
        self._parents: dict[int, _Parent] = {}  # every split mid page, by byte offset
        self._partial: dict[str, dict[int, _Parent]] = {s: {} for s in kinds}  # parents with free smalls
        self._by_owner: dict[str, dict[Hashable, dict[int, _Parent]]] = {s: {} for s in kinds}
        self._free_smalls = dict.fromkeys(kinds, 0)

        self._used = dict.fromkeys((*self._mid_kinds, *kinds), 0)
        self._pending: list[tuple[str, np.ndarray]] = []  # released by the next complete_forward()
        self._held: list[tuple[str, np.ndarray]] = []  # deferred too, but released only after release_held()
        self.reclaimer: PageReclaimer | None = None  # see the module docstring

    # ================================================================== queries

    @property
    def num_free_huge(self) -> int:
        return self._free_huge

    def small_capacity(self, kind: str) -> int:
        """Small pages of `kind` obtainable now, counting splits of free mid and huge pages and reclaimable pages."""
        cap = self.free_small_capacity(kind)
        if self.reclaimer is not None:
            cap += self.reclaimer.reclaimable_small(kind)
        return cap

    def free_small_capacity(self, kind: str) -> int:
        """Small pages of `kind` obtainable without reclaiming: free smalls and splits of free mid and huge pages."""
        if kind not in self._sph:
            self._check_level(kind, "small")
        cap = self._free_smalls[kind] + self._free_huge * self._sph[kind]
        for m in self._mid_kinds:
            cap += self._free_mids[m] * self._spm[kind, m]
        return cap

    def mid_capacity(self, kind: str) -> int:
        """Mid pages of `kind` obtainable now: free ones, splits of free huge pages, and whole reclaimable ones."""
        cap = self.free_mid_capacity(kind)
        if self.reclaimer is not None:
            cap += self.reclaimer.reclaimable_mid(kind)
        return cap

    def free_mid_capacity(self, kind: str) -> int:
        """Mid pages of `kind` obtainable without reclaiming."""
        self._check_level(kind, "mid")
        return self._free_mids[kind] + self._free_huge * self.geometry.mids_per_huge(kind)

    def num_reclaimable(self, kind: str) -> int:
        """Used small pages of `kind` that the reclaimer would give back (counted as obtainable by small_capacity)."""
        return self.reclaimer.reclaimable_small(kind) if self.reclaimer is not None else 0

    def parent_keys(self, kind: str, ids: np.ndarray) -> np.ndarray:
        """Byte offset of the mid page holding each used small page in `ids` (the key of its split mid page)."""
        g = self.geometry
        off = g.offset(kind, ids)
        if len(self._mid_kinds) == 1:
            mid_size = self._mid_size_table[0]
        else:
            mid_size = self._mid_size_table[self._huge_kind[g.huge_of_small(kind, ids)]]
        return off - off % mid_size

    def parent_used(self, key: int) -> tuple[str, int] | None:
        """(mid kind, used small pages) of the split mid page at byte offset `key`; None when it is not split."""
        p = self._parents.get(key)
        if p is None:
            return None
        return p.mid_kind, self._spm[p.small_kind, p.mid_kind] - len(p.free)

    def huge_page_use(self, h: int) -> tuple[str | None, int]:
        """(the mid kind huge page `h` is split into, None when free; its mid pages that are not free)."""
        k = int(self._huge_kind[h])
        return (None if k < 0 else self._mid_kinds[k]), self._huge_busy[h]

    def num_used(self, kind: str) -> int:
        self.geometry.size(kind)
        return self._used[kind]

    @property
    def pending_deferred(self) -> int:
        """Deferred pages not yet released: pending for the next complete_forward() or held."""
        return sum(len(ids) for _, ids in (*self._pending, *self._held))

    def stats(self) -> AllocatorStats:
        g = self.geometry
        free_small = sum(n * g.size(s) for s, n in self._free_smalls.items())
        used_bytes = {k: n * g.size(k) for k, n in self._used.items()}
        return AllocatorStats(
            pool_bytes=self.pool_bytes,
            free_bytes={
                "huge": self._free_huge * g.huge_size,
                "mid": sum(n * g.size(m) for m, n in self._free_mids.items()),
                "small": free_small,
            },
            used_pages=dict(self._used),
            used_bytes=used_bytes,
            trapped_bytes=free_small,
            padding_bytes=sum(n * g.padding(k) for k, n in self._used.items()),
            pending_deferred=self.pending_deferred,
            num_free_huge=self._free_huge,
        )

    # ================================================================== small pages

    def allocate_small(self, kind: str, count: int, owner: Hashable = None) -> list[int] | None:
        """`count` small pages of `kind`, all or nothing (None, with no side effects, when they do not fit).

        Order of sources: free smalls in mid pages already serving `owner`; free smalls elsewhere;
        free mid pages (primary kind first); huge pages split into primary-kind mid pages.
        """
        self._check_count(count)
        free = self.free_small_capacity(kind)
        if count > free:
            r = self.reclaimer
            if r is None or count > free + r.reclaimable_small(kind):
                return None
            r.reclaim_small(kind, count - free)  # before any change here: it frees through free_small
            assert self.free_small_capacity(kind) >= count, "the reclaimer freed less than it promised"
        if count == 0:
            return []
        out: list[int] = []
        need = count
        if owner is not None and (owned := self._by_owner[kind].get(owner)):
            need = self._take_from_parents(kind, owned, need, out, owner)
        if need:
            need = self._take_from_parents(kind, self._partial[kind], need, out, owner)
        while need:
            mid_kind, mid_id = self._obtain_mid_for_split()
            parent = self._split_mid(kind, mid_kind, mid_id, owner)
            need = self._take(kind, parent, need, out, owner)
        ids = np.fromiter(out, dtype=np.int64, count=count)
        self._small_state[kind][ids] = USED
        self._used[kind] += count
        return out

    def free_small(self, kind: str, ids: Iterable[int]) -> None:
        self._check_level(kind, "small")
        arr = self._validated(kind, ids, USED, self._small_state[kind])
        if arr.size:
            self._release_smalls(kind, arr)

    # ================================================================== compaction

    def split_parents(self, kind: str, mid_kind: str) -> tuple[np.ndarray, np.ndarray]:
        """Every `mid_kind` mid page split into small pages of `kind`: (byte offsets ascending, used small pages in
        each: allocated or deferred), int64 arrays. Read from the small pages' states (the small pages of mid page m
        are ids m*spm .. m*spm+spm-1, split ones are never ABSENT), over the huge pages split into `mid_kind`."""
        g = self.geometry
        spm = self._spm[kind, mid_kind]
        state = self._small_state[kind]
        rows = state[: state.size // spm * spm].reshape(-1, spm)  # row m: the small pages of mid page m
        split = (rows[:, 0] != ABSENT) & np.repeat(self._huge_kind == self._mid_kinds.index(mid_kind),
                                                    g.mids_per_huge(mid_kind))[: rows.shape[0]]
        ids = np.flatnonzero(split)
        used = spm - (rows[ids] == FREE).sum(axis=1, dtype=np.int64)
        return g.offset(mid_kind, ids.astype(np.int64)), used

    def used_smalls_in(self, kind: str, key: int) -> np.ndarray:
        """The used (not deferred) small pages of `kind` in the split mid page at byte offset `key`."""
        p = self._parents[key]
        r = self.geometry.smalls_of_mid(kind, p.mid_kind, p.mid_id)
        return r.start + np.flatnonzero(self._small_state[kind][r.start : r.stop] == USED)

    def relocate_small(self, kind: str, keys: Iterable[int], avoid: Iterable[int] = (), hold: bool = False
                       ) -> tuple[np.ndarray, np.ndarray] | None:
        """Moves every used small page of `kind` out of the split mid pages at byte offsets `keys` into free small
        pages of other split mid pages, not those at `avoid` (never a free mid or huge page: a compaction that splits
        one gains nothing):
        returns (sources, destinations), index-aligned. The destinations are USED; the sources DEFERRED, released
        by complete_forward() so that the mid pages merge once the copy that moves their bytes has run; with `hold`
        not before release_held() (the copy is queued later than the pass in flight: with the next one). A mid page
        holding deferred pages is left out (it merges once they are released). None, with nothing changed, when the
        free small pages elsewhere cannot hold them.

            mid page A (source)   [u . u . . . u .]  ->  [d . d . . . d .]   d: deferred until complete_forward
            mid page B            [u u . u u . u u]  ->  [u u x u u x u u]   x: a destination, now used
        """
        self._check_level(kind, "small")
        keys = list(dict.fromkeys(keys))
        srcs: list[np.ndarray] = []
        for key in keys:
            p = self._parents.get(key)
            if p is None or p.small_kind != kind:
                raise AllocatorError(f"no mid page split into {kind!r} pages at byte offset {key}")
            r = self.geometry.smalls_of_mid(kind, p.mid_kind, p.mid_id)
            states = self._small_state[kind][r.start : r.stop]
            if not (states == DEFERRED).any():
                srcs.append(r.start + np.flatnonzero(states == USED))
        src = np.concatenate(srcs) if srcs else np.zeros(0, dtype=np.int64)
        excluded = set(keys) | set(avoid)
        others = [p for p in self._partial[kind].values() if p.key not in excluded]
        if sum(len(p.free) for p in others) < src.size:
            return None
        out: list[int] = []
        need = int(src.size)
        for p in sorted(others, key=lambda p: len(p.free)):  # the fullest first: they stay full
            if not need:
                break
            need = self._take(kind, p, need, out, p.owner)
        dst = np.asarray(out, dtype=np.int64)
        self._small_state[kind][dst] = USED
        self._used[kind] += dst.size
        self.defer_free(kind, src, hold=hold)
        return src, dst

    def _take_from_parents(
        self, kind: str, parents: dict[int, _Parent], need: int, out: list[int], owner: Hashable
    ) -> int:
        chosen: list[_Parent] = []
        have = 0
        for p in parents.values():  # collect first: taking mutates the dict
            chosen.append(p)
            have += len(p.free)
            if have >= need:
                break
        for p in chosen:
            need = self._take(kind, p, need, out, owner)
        return need

    def _take(self, kind: str, p: _Parent, need: int, out: list[int], owner: Hashable) -> int:
        k = min(need, len(p.free))
        out.extend(p.free[:k])
        del p.free[:k]
        self._free_smalls[kind] -= k
        if p.owner != owner:
            self._set_owner(kind, p, owner)
        if not p.free:
            del self._partial[kind][p.key]
            self._unlink_owner(kind, p)
        return need - k

    def _set_owner(self, kind: str, p: _Parent, owner: Hashable) -> None:
        # The last request that took pages from a mid page is the one most likely to fill it up.
        self._unlink_owner(kind, p)
        p.owner = owner
        if p.free and owner is not None:
            self._by_owner[kind].setdefault(owner, {})[p.key] = p

    def _unlink_owner(self, kind: str, p: _Parent) -> None:
        owned = self._by_owner[kind].get(p.owner)
        if owned is not None:
            owned.pop(p.key, None)
            if not owned:
                del self._by_owner[kind][p.owner]

    def _obtain_mid_for_split(self) -> tuple[str, int]:
        for m in self._mid_kinds:  # an existing free mid page first, primary kind first
            if self._free_mids[m]:
                return m, self._take_free_mid(m, SPLIT)
        m = self._mid_kinds[0]
        self._split_huge(m)
        return m, self._take_free_mid(m, SPLIT)

    def _split_mid(self, kind: str, mid_kind: str, mid_id: int, owner: Hashable) -> _Parent:
        g = self.geometry
        r = g.smalls_of_mid(kind, mid_kind, mid_id)
        self._small_state[kind][r.start : r.stop] = FREE
        key = g.offset(mid_kind, mid_id)
        p = _Parent(key, kind, mid_kind, mid_id, owner, list(r))
        self._parents[key] = p
        self._partial[kind][key] = p
        if owner is not None:
            self._by_owner[kind].setdefault(owner, {})[key] = p
        self._free_smalls[kind] += len(r)
        return p

    def _release_smalls(self, kind: str, ids: np.ndarray) -> None:
        """Free validated small pages (sorted, unique); merge parents whose pages are all free."""
        state = self._small_state[kind]
        state[ids] = FREE
        self._used[kind] -= ids.size
        self._free_smalls[kind] += ids.size
        # Parent key = byte offset of the enclosing mid page; ids are sorted so keys are non-decreasing.
        keys = self.parent_keys(kind, ids)
        cuts = (np.flatnonzero(keys[1:] != keys[:-1]) + 1).tolist()
        starts = [0, *cuts]
        ends = [*cuts, ids.size]
        id_list = ids.tolist()
        key_list = keys[starts].tolist()
        partial = self._partial[kind]
        for key, a, b in zip(key_list, starts, ends, strict=True):
            p = self._parents[key]
            p.free.extend(id_list[a:b])
            if len(p.free) == self._spm[kind, p.mid_kind]:
                self._merge_parent(kind, p)
            elif key not in partial:
                partial[key] = p
                if p.owner is not None:
                    self._by_owner[kind].setdefault(p.owner, {})[key] = p

    def _merge_parent(self, kind: str, p: _Parent) -> None:
        r = self.geometry.smalls_of_mid(kind, p.mid_kind, p.mid_id)
        self._small_state[kind][r.start : r.stop] = ABSENT
        self._free_smalls[kind] -= len(r)
        self._partial[kind].pop(p.key, None)
        self._unlink_owner(kind, p)
        del self._parents[p.key]
        self._release_mid(p.mid_kind, p.mid_id)

    # ================================================================== mid pages

    def allocate_mid(self, kind: str, count: int, owner: Hashable = None) -> list[int] | None:
        """`count` mid pages of `kind`, all or nothing. Free ones first (lowest id), then split huge pages."""
        self._check_count(count)
        free = self.free_mid_capacity(kind)
        if count > free:
            r = self.reclaimer
            if r is None or count > free + r.reclaimable_mid(kind):
                return None
            r.reclaim_mid(kind, count - free)
            assert self.free_mid_capacity(kind) >= count, "the reclaimer emptied fewer mid pages than it promised"
        out = []
        for _ in range(count):
            if not self._free_mids[kind]:
                self._split_huge(kind)
            out.append(self._take_free_mid(kind, USED))
        self._used[kind] += count
        return out

    def free_mid(self, kind: str, ids: Iterable[int]) -> None:
        self._check_level(kind, "mid")
        arr = self._validated(kind, ids, USED, self._mid_state[kind])
        self._used[kind] -= arr.size
        for m in arr.tolist():
            self._release_mid(kind, m)

    def _split_huge(self, kind: str) -> None:
        g = self.geometry
        h = heapq.heappop(self._huge_heap)
        self._free_huge -= 1
        self._huge_kind[h] = self._mid_kinds.index(kind)
        self._huge_busy[h] = 0
        r = g.mids_of_huge(kind, h)
        self._mid_state[kind][r.start : r.stop] = FREE
        heap = self._mid_heap[kind]
        for m in r:
            heapq.heappush(heap, m)
        self._free_mids[kind] += len(r)

    def _take_free_mid(self, kind: str, new_state: int) -> int:
        heap, state = self._mid_heap[kind], self._mid_bytes[kind]
        while True:
            m = heapq.heappop(heap)
            if state[m] == FREE:  # otherwise a stale entry left by a merge (see module docstring)
                break
        state[m] = new_state
        self._free_mids[kind] -= 1
        self.mid_changes += 1
        self._huge_busy[self.geometry.huge_of_mid(kind, m)] += 1
        return m

    def _release_mid(self, kind: str, m: int) -> None:
        g = self.geometry
        self._mid_bytes[kind][m] = FREE
        self._free_mids[kind] += 1
        self.mid_changes += 1
        heap = self._mid_heap[kind]
        heapq.heappush(heap, m)
        h = g.huge_of_mid(kind, m)
        self._huge_busy[h] -= 1
        if self._huge_busy[h] == 0:  # every mid of h is free: h goes back to the root pool
            r = g.mids_of_huge(kind, h)
            self._mid_state[kind][r.start : r.stop] = ABSENT
            self._free_mids[kind] -= len(r)
            self._huge_kind[h] = -1
            heapq.heappush(self._huge_heap, h)
            self._free_huge += 1
            if len(heap) > 2 * self._free_mids[kind] + 1024:  # drop stale entries now and then
                state = self._mid_bytes[kind]
                self._mid_heap[kind] = [x for x in heap if state[x] == FREE]
                heapq.heapify(self._mid_heap[kind])

    # ================================================================== deferred release

    def defer_free(self, kind: str, ids: Iterable[int], hold: bool = False) -> None:
        """Mark pages for release after the forward pass in flight; they stay unusable until then (with `hold`,
        until the complete_forward() after release_held())."""
        state = self._state_of(kind)
        arr = self._validated(kind, ids, USED, state)
        state[arr] = DEFERRED
        if arr.size:
            (self._held if hold else self._pending).append((kind, arr))

    def release_held(self) -> None:
        """The copies that read the held pages are queued: they go with the next complete_forward()."""
        self._pending += self._held
        self._held = []

    def complete_forward(self) -> None:
        """The forward pass that could read deferred pages has ended: release them."""
        pending, self._pending = self._pending, []
        for kind, arr in pending:
            if self.geometry.level(kind) == "small":
                self._release_smalls(kind, arr)
            else:
                self._used[kind] -= arr.size
                for m in arr.tolist():
                    self._release_mid(kind, m)

    # ================================================================== validation

    def _check_count(self, count: int) -> None:
        if not isinstance(count, (int, np.integer)) or count < 0:
            raise AllocatorError(f"page count must be a non-negative int, got {count!r}")

    def _check_level(self, kind: str, level: str) -> None:
        try:
            actual = self.geometry.level(kind)
        except KeyError as e:
            raise AllocatorError(e.args[0]) from None
        if actual != level:
            raise AllocatorError(f"{kind!r} is a {actual} page kind, not a {level} one")

    def _state_of(self, kind: str) -> np.ndarray:
        try:
            level = self.geometry.level(kind)
        except KeyError as e:
            raise AllocatorError(e.args[0]) from None
        if level == "small":
            return self._small_state[kind]
        if level == "mid":
            return self._mid_state[kind]
        raise AllocatorError("huge pages are never handed out; free small or mid pages")

    def _validated(self, kind: str, ids: Iterable[int], expect: int, state: np.ndarray) -> np.ndarray:
        arr = np.sort(np.asarray(ids if isinstance(ids, np.ndarray) else list(ids), dtype=np.int64))
        if arr.size == 0:
            return arr
        if arr[0] < 0 or arr[-1] >= state.size:
            bad = int(arr[0] if arr[0] < 0 else arr[-1])
            raise AllocatorError(f"{kind} page id {bad} is out of range 0..{state.size - 1}")
        if arr.size > 1 and (dup := np.flatnonzero(arr[1:] == arr[:-1])).size:
            raise DoubleFreeError(f"{kind} page {int(arr[dup[0]])} appears twice in one call")
        st = state[arr]
        bad_at = np.flatnonzero(st != expect)
        if bad_at.size:
            self._raise_bad_page(kind, int(arr[bad_at[0]]), int(st[bad_at[0]]))
        return arr

    def _raise_bad_page(self, kind: str, page: int, st: int) -> None:
        if st == FREE:
            raise DoubleFreeError(f"{kind} page {page} is already free (double free)")
        if st == DEFERRED:
            raise DoubleFreeError(f"{kind} page {page} is already pending deferred release")
        if st == SPLIT:
            raise AllocatorError(f"{kind} page {page} is split into small pages; free those instead")
        holder = self._holder_of(self.geometry.offset(kind, page))
        if holder is not None:
            raise WrongKindError(f"{kind} page {page} was never allocated as {kind!r}: its bytes belong to {holder}")
        raise AllocatorError(f"{kind} page {page} is not allocated (never allocated, or freed and merged)")

    def _holder_of(self, offset: int) -> str | None:
        """The used page of another kind covering `offset`, for error messages."""
        g = self.geometry
        h = offset // g.huge_size
        k = int(self._huge_kind[h])
        if k < 0:
            return None
        m_kind = self._mid_kinds[k]
        m = offset // g.size(m_kind)
        st = int(self._mid_state[m_kind][m])
        if st in (USED, DEFERRED):
            return f"{m_kind} page {m}"
        if st == SPLIT:
            p = self._parents[g.offset(m_kind, m)]
            for s in g.small_kinds:
                sid = offset // g.size(s)
                if sid < self._small_state[s].size and self._small_state[s][sid] in (USED, DEFERRED):
                    if p.key <= g.offset(s, sid) < p.key + g.size(m_kind):
                        return f"{s} page {sid}"
        return None

    # ================================================================== invariants

    def check_invariants(self) -> None:
        """Recount every page from the state arrays; raise AssertionError if any byte is lost or doubled."""
        g = self.geometry
        free_huge = 0
        free_mids = dict.fromkeys(self._mid_kinds, 0)
        free_smalls = dict.fromkeys(g.small_kinds, 0)
        used = dict.fromkeys(self._used, 0)
        parents_seen = 0
        for h in range(self.num_huge_pages):
            k = int(self._huge_kind[h])
            for i, m_kind in enumerate(self._mid_kinds):
                r = g.mids_of_huge(m_kind, h)
                states = self._mid_state[m_kind][r.start : r.stop]
                if i != k:
                    assert (states == ABSENT).all(), f"huge {h} not split into {m_kind} but has {m_kind} pages"
            if k < 0:
                free_huge += 1
                self._assert_smalls_absent(g.offset("huge", h), g.huge_size)
                continue
            m_kind = self._mid_kinds[k]
            r = g.mids_of_huge(m_kind, h)
            states = self._mid_state[m_kind][r.start : r.stop]
            assert (states != ABSENT).all(), f"huge {h} is split into {m_kind} but has absent mids"
            busy = int((states != FREE).sum())
            assert busy == self._huge_busy[h] and busy > 0, f"huge {h}: busy {self._huge_busy[h]} != {busy}"
            for m, st in zip(r, states.tolist(), strict=True):
                key = g.offset(m_kind, m)
                if st == FREE:
                    free_mids[m_kind] += 1
                elif st in (USED, DEFERRED):
                    used[m_kind] += 1
                if st != SPLIT:
                    assert key not in self._parents, f"{m_kind} {m} is not split but has a parent record"
                    self._assert_smalls_absent(key, g.size(m_kind))
                    continue
                parents_seen += 1
                p = self._parents[key]
                s_kind = p.small_kind
                sr = g.smalls_of_mid(s_kind, m_kind, m)
                sst = self._small_state[s_kind][sr.start : sr.stop]
                free_ids = [sr.start + int(i) for i in np.flatnonzero(sst == FREE)]
                assert sorted(p.free) == free_ids, f"{m_kind} {m}: free list {p.free} != {free_ids}"
                assert 0 < len(sst) - len(free_ids), f"{m_kind} {m}: all smalls free but not merged"
                assert (sst != ABSENT).all()
                free_smalls[s_kind] += len(free_ids)
                used[s_kind] += len(sst) - len(free_ids)
                assert (key in self._partial[s_kind]) == bool(free_ids), f"{m_kind} {m}: partial index wrong"
                self._assert_smalls_absent(key, g.size(m_kind), except_kind=s_kind)
        assert parents_seen == len(self._parents), "parent records for mid pages that are not split"
        for s_kind in g.small_kinds:  # the vectorised view of the parents agrees with their records
            for m_kind in self._mid_kinds:
                offsets, n_used = self.split_parents(s_kind, m_kind)
                want = sorted((p.key, self._spm[s_kind, m_kind] - len(p.free)) for p in self._parents.values()
                              if p.small_kind == s_kind and p.mid_kind == m_kind)
                assert list(zip(offsets.tolist(), n_used.tolist(), strict=True)) == want, f"split {s_kind} in {m_kind}"
        assert free_huge == self._free_huge, f"free huge {self._free_huge} != {free_huge}"
        assert free_mids == self._free_mids, f"free mids {self._free_mids} != {free_mids}"
        assert free_smalls == self._free_smalls, f"free smalls {self._free_smalls} != {free_smalls}"
        assert used == self._used, f"used {self._used} != {used}"
        total = free_huge * g.huge_size
        total += sum(n * g.size(k) for k, n in (*free_mids.items(), *free_smalls.items(), *used.items()))
        assert total == self.pool_bytes, f"free + used = {total} B, pool = {self.pool_bytes} B"
        assert self.pending_deferred == sum(
            int((self._state_of(k) == DEFERRED).sum()) for k in self._used
        ), "pending list and DEFERRED states disagree"

    def _assert_smalls_absent(self, offset: int, nbytes: int, except_kind: str | None = None) -> None:
        g = self.geometry
        for s in g.small_kinds:
            if s != except_kind:
                a, b = offset // g.size(s), (offset + nbytes) // g.size(s)
                assert (self._small_state[s][a:b] == ABSENT).all(), f"stray {s} pages in bytes {offset}+{nbytes}"
