"""KV compaction: whole mid pages for experts coming home, made by moving the few live KV pages out of the emptiest.

An expert's three matrices need three whole mid pages, but KV lives in small pages (one block of one attention layer:
131 KB against a 5.8 MB mid page for Qwen1.5-MoE shapes). Once the pool has been full, the KV pages of many requests
share each mid page: a mid page merges back only when every request with a page in it has ended, and requests end
and start all the time, so while requests run few mid pages empty. On the H200 (Qwen1.5-MoE shapes, 32 GiB, 60 req/s)
three experts that the adjuster wanted home stayed out for the rest of the point, every step reading them from host
memory, while the free small pages would have held them several times over.

When the expert runtime's grows wait for whole mid pages (`mid_pages_awaited`), `compact_kv` takes the mid pages
split into KV pages with the fewest live pages (held by requests, or by cached blocks that requests hold). The engine
runs it after the step's pass is queued, in the GPU's shadow:

    1. refs-0 cached blocks with a page in them are dropped (the prefix cache reclaims them anyway);
    2. the allocator moves the remaining used pages into free small pages of other mid pages (`relocate_small`:
       destinations used, sources deferred and held);
    3. the holders are renamed: each running request's page grid (a new list; the runner takes the new array) and
       the cached blocks those requests hold;
    4. the returned `KVMoves` travel with the next step's pass: the runner copies the pages' bytes on the compute
       stream before it (after the pass in flight, which may still write the sources), tensor-parallel ranks do the
       same in their pools; a step with no pass queues the copies alone. Once the copies are queued the hold ends:
       at that step's end the sources are released and the mid pages merge; the next plan's grows take them (a
       grow's copy on the loader's stream waits for the passes launched before, the pass fence's rule, and the
       copies count as one).

Pages renamed in step n are read under their new names from pass n+1 on, and pass n+1 is queued behind the copies:
every reader of a destination comes after its bytes arrived. A destination freed before the copies run (its request
finished or was preempted) may be handed out again; its new owner writes it only in a later pass.

A step moves at most `max_pages_moved` KV pages (8 mid pages' worth: a D2D copy of 46 MB for Qwen1.5-MoE shapes) and
makes at most the mid pages asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rimuru.engine.kv_cache_manager import KV, KVCacheManager
from rimuru.engine.request import Request
from rimuru.memory.geometry import PageGeometry


class PageGrids(Protocol):
    """Requests' page grids as arrays, where a holder keeps them (the runner's, built for the pass just launched)."""

    def page_grid(self, req: Request) -> np.ndarray | None:
        """`req.kv_pages` as an int array [blocks, attention layers], None where none is kept."""
        ...

    def grid_renamed(self, req: Request, grid: np.ndarray) -> None:
        """`req.kv_pages` was just replaced by `grid` (int64 [blocks, attention layers]) as a new list."""
        ...


MAX_MID_PAGES_MOVED = 8  # a step moves at most this many mid pages' worth of KV pages (a few MB of device copies)


def max_pages_moved(geometry: PageGeometry, mid_kind: str) -> int:
    """The most KV pages one step's compaction moves (the engine's and the simulator's one bound)."""
    return MAX_MID_PAGES_MOVED * geometry.smalls_per_mid(KV, mid_kind)


@dataclass(frozen=True)
class KVMoves:
    """KV pages whose bytes move before the next pass: page src[i] -> dst[i] (int64, index-aligned)."""

    src: np.ndarray
    dst: np.ndarray

    def __len__(self) -> int:
        return int(self.src.size)


def compact_kv(kv: KVCacheManager, running: Sequence[Request], mid_kind: str, mid_pages: int,
               max_pages: int, hold: bool = False, grids: PageGrids | None = None) -> KVMoves | None:
    """Empties up to `mid_pages` mid pages of `mid_kind` split into KV pages, moving at most `max_pages` KV pages;
    returns the moves (None when nothing moved). `running`: every request that holds KV pages. `hold`: the sources
    stay deferred until `allocator.release_held()` (the caller queues the copies after the pass in flight).
    `grids`: the requests' grids as arrays where they are kept (the runner's), told of the renamed ones."""
    if mid_pages <= 0:
        return None
    alloc, cache = kv.allocator, kv.cache
    spm = alloc.geometry.smalls_per_mid(KV, mid_kind)
    offsets, used = alloc.split_parents(KV, mid_kind)  # the split mid pages' byte offsets (ascending), used pages
    # refs-0 pages per mid page (most hold none: the map names only those that do); read-only until drops below
    unref = dict(cache.unreferenced_by_key()) if cache is not None else {}
    live = used.copy()
    if unref:
        uk = np.fromiter(unref, dtype=np.int64, count=len(unref))
        at = np.searchsorted(offsets, uk)
        found = (at < offsets.size) & (offsets[np.minimum(at, offsets.size - 1)] == uk)
        live[at[found]] -= np.fromiter(unref.values(), dtype=np.int64, count=len(unref))[found]
    order = np.lexsort((offsets, live))  # the emptiest first
    # a mid page of refs-0 cached blocks alone (live 0) is reclaimable whole already: mid_capacity counts it
    candidates = order[live[order] > 0]
    moved_by = np.cumsum(live[candidates])
    take = min(mid_pages, int(np.searchsorted(moved_by, max_pages, side="right")))
    if take == 0:
        return None
    picked = candidates[:take]
    chosen = offsets[picked].tolist()
    moved = int(moved_by[take - 1])
    if cache is not None:
        # room for the moved pages: free pages of the other mid pages, and where they are short the refs-0 blocks of
        # the densest mid pages that hold live pages too (they cannot empty soon; the mid pages of cached blocks
        # alone are left whole)
        room = int((spm - used).sum() - (spm - used[picked]).sum())
        taken = set(chosen)
        if room < moved:
            for i in order[::-1].tolist():
                if room >= moved:
                    break
                key = int(offsets[i])
                if key not in taken and live[i] > 0 and unref.get(key, 0):
                    room += unref[key]
                    cache.drop_unreferenced_in(key)
        for key in chosen:
            cache.drop_unreferenced_in(key)
    keys = [key for key in chosen if alloc.parent_used(key) is not None]  # the drops merged the others already
    relocated = None
    while keys and relocated is None:  # fewer mid pages when the free pages elsewhere cannot hold all
        # not into mid pages of refs-0 blocks alone: they count as whole already
        relocated = alloc.relocate_small(KV, keys, avoid=cache.whole_keys() if cache is not None else (), hold=hold)
        keys = keys[: len(keys) // 2]
    if relocated is None or not relocated[0].size:
        return None
    src, dst = relocated
    _rename(kv, running, src, dst, grids)
    return KVMoves(src, dst)


def _rename(kv: KVCacheManager, running: Sequence[Request], src: np.ndarray, dst: np.ndarray,
            grids: PageGrids | None) -> None:
    """Every holder of a page in `src` names its `dst` instead: requests' page grids and the cached blocks they hold
    (a cached block is held by the requests whose rows carry its pages; refs-0 blocks were dropped)."""
    order = np.argsort(src)
    s, d = src[order], dst[order]
    # membership by a mask over the KV page ids (one gather per request), the new name by a search of the few hits
    moving = np.zeros(int(s[-1]) + 1, dtype=bool)
    moving[s] = True
    cache = kv.cache
    for req in running:
        if not req.kv_pages:
            continue
        grid = grids.page_grid(req) if grids is not None else None  # [blocks, attention layers]
        if grid is None:
            grid = np.asarray(req.kv_pages, dtype=np.int64)
        hit = moving[np.minimum(grid, moving.size - 1)] & (grid < moving.size)
        if not hit.any():
            continue
        new = grid.astype(np.int64)
        new[hit] = d[np.searchsorted(s, new[hit])]
        if cache is not None:
            for i in np.flatnonzero(hit.any(axis=1)).tolist():
                if i >= req.num_offered_blocks:
                    break
                block = cache.get(req.block_hashes[i])
                if block is not None and block.pages == tuple(grid[i].tolist()):  # the cached block, not a copy
                    cache.move_block(block, new[i].tolist())
        req.kv_pages = new.tolist()  # a new list: the runner's page array is replaced
        if grids is not None:
            grids.grid_renamed(req, new)
    if cache is not None:
        cache.pages_changed(dst)  # their mid pages hold more used pages now
