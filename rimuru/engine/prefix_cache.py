"""Prefix caching: full KV blocks named by their token chain, kept after their requests end, reclaimed LRU.

A full block (`block_size` tokens; one KV page per attention layer, a row of `Request.kv_pages`) is named by
`hash_block(parent block's name, its token ids)`, so a name stands for the whole prefix up to the block's end:
a request whose tokens start as a cached chain's do reads that chain's pages instead of computing them.

The pages of one block move through these states (the allocator sees every one but `free` as USED pages):

                 allocate_small            offer (full and computed)         release (refs -> 0)
        free ─────────────────► private ─────────────────────────► cached ───────────────────► cached
         ▲                      (one request)                       refs >= 1 ◄──────────────── refs 0, in the LRU
         │                         │                                          lookup hit (refs 1)    │
         ├── the request ends ─────┘ (a partial last block, or a name cached                         │
         │                            already by another copy a request holds)                       │
         └──── reclaim: a KV allocation that free pages cannot serve (oldest block first), or ───────┘
               another kind wanting whole mid pages (mid pages used by refs-0 blocks alone): experts, a
               hybrid model's conv pages, and its ssm pages, which also take huge pages of another mid kind
               whose every mid page that is not free is whole

Invariants (`check`):
  * a name has at most one cached block; the refs-0 blocks are exactly the LRU's entries;
  * a cached block is never written: it is offered only once full and computed (its tokens are known and a
    launched pass wrote their KV), and a request that hits it computes only positions beyond it (a full hit's
    last token is recomputed without its KV write: ScheduledRequest.num_cached_writes);
  * per mid page m: `unref[m]` = pages of refs-0 blocks in m, and m is "whole" (an expert may take it) iff
    `unref[m]` equals the allocator's count of used small pages in m;
  * `num_unreferenced_pages` = num_layers x the LRU's length: what the allocator counts as reclaimable KV.
Dropping a block frees all its pages at once (a block missing one layer's page is of no use), so emptying a
mid page for an expert also frees the other pages of the blocks it drops; cached pages keep the mid page the
allocator placed them in (owner affinity keeps a request's blocks together), which is what lets whole mid pages
empty.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rimuru.memory.allocator import PageAllocator

KV = "kv"
BlockHash = bytes
ROOT = b""  # the parent name of every sequence's first block


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The name of a full block: SHA-256 over its parent's digest and its token ids as int64.

    A collision would give one request another prefix's KV: wrong tokens, and one client's prompt leaking into
    another's answer. Python's `hash` of a tuple is 64 bits and not built to resist crafted inputs, so a
    cryptographic digest names blocks; chaining the parent's digest makes one 32-byte name stand for the whole
    prefix. The first block's parent is empty, every other's 32 bytes, so no two chains hash the same bytes."""
    h = hashlib.sha256(parent)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass(eq=False)
class CachedBlock:
    name: BlockHash
    pages: tuple[int, ...]  # one KV page per attention layer
    mids: tuple[tuple[int, int], ...]  # (key of a mid page holding some of the pages, how many)
    refs: int = 1  # requests holding it (the one that offered it, to begin with)
    last_used: int = 0  # LRU clock when refs last fell to 0


class PrefixCache:
    """The cached blocks of one KV cache manager; the allocator's reclaimer (memory/allocator.py PageReclaimer)."""

    def __init__(self, allocator: PageAllocator, num_layers: int) -> None:
        self.allocator = allocator
        self.num_layers = num_layers
        self._blocks: dict[BlockHash, CachedBlock] = {}
        self._lru: OrderedDict[BlockHash, CachedBlock] = OrderedDict()  # refs 0, least recently used first
        self._unref: dict[int, int] = {}  # mid page key -> pages of refs-0 blocks in it
        self._unref_blocks: dict[int, dict[BlockHash, CachedBlock]] = {}  # mid page key -> its refs-0 blocks
        self._whole: dict[int, str] = {}  # mid page key -> its mid kind, for mid pages used by refs-0 blocks alone
        self._whole_count: dict[str, int] = {}  # by mid kind
        self._whole_by_huge: dict[int, set[int]] = {}  # huge page -> the whole mid pages in it (keys)
        self._whole_changes = 0
        self._whole_huge_counted: dict[str, tuple[tuple[int, int], int]] = {}  # kind -> (version, count)
        self._clock = 0
        self.num_unreferenced_pages = 0

    # ------------------------------------------------------------------ requests' side
    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def get(self, name: BlockHash) -> CachedBlock | None:
        return self._blocks.get(name)

    def longest_prefix(self, names: Sequence[BlockHash]) -> list[CachedBlock]:
        """The cached blocks of the longest prefix of `names` (a chain: it stops at the first name not cached)."""
        out: list[CachedBlock] = []
        for name in names:
            block = self._blocks.get(name)
            if block is None:
                break
            out.append(block)
        return out

    def offer(self, name: BlockHash, pages: Sequence[int]) -> bool:
        """Caches a request's full, computed block under `name`, held by that request (refs 1). False when the
        name is cached already by another copy that a request holds: then these pages stay the request's own. A
        copy no request holds is dropped for this one (it would be reclaimed before this one's chain, leaving
        the chain a hole: a hybrid model's request that found no state snapshot computes blocks cached already)."""
        old = self._blocks.get(name)
        if old is not None:
            if old.refs:
                return False
            self._drop(old)
        keys, counts = np.unique(self.allocator.parent_keys(KV, np.asarray(pages, dtype=np.int64)),
                                 return_counts=True)
        self._blocks[name] = CachedBlock(name, tuple(pages), tuple(zip(keys.tolist(), counts.tolist(), strict=True)))
        return True

    def acquire(self, blocks: Sequence[CachedBlock]) -> None:
        """A request takes cached blocks (a hit): refs-0 ones leave the LRU and stop being reclaimable."""
        for b in blocks:
            if b.refs == 0:
                del self._lru[b.name]
                self._unlink(b)
                for key, _ in b.mids:
                    self._recheck(key)
            b.refs += 1

    def release(self, blocks: Sequence[CachedBlock]) -> None:
        """A request lets go of cached blocks, in the order they should be reclaimed (first = first reclaimed)."""
        for b in blocks:
            b.refs -= 1
            if b.refs:
                continue
            self._clock += 1
            b.last_used = self._clock
            self._lru[b.name] = b
            self.num_unreferenced_pages += len(b.pages)
            for key, n in b.mids:
                self._unref[key] = self._unref.get(key, 0) + n
                self._unref_blocks.setdefault(key, {})[b.name] = b
                self._recheck(key)

    def pages_changed(self, pages: Sequence[int] | np.ndarray, keys: np.ndarray | None = None) -> None:
        """A request's own pages were allocated or freed: the used count of their mid pages changed, which may
        make one whole or stop it being whole. `keys` (the pages' parent_keys) when the pages are already free."""
        if not self._unref:
            return
        if keys is None:
            keys = self.allocator.parent_keys(KV, np.asarray(pages, dtype=np.int64))
        for key in set(keys.tolist()):
            if key in self._unref:
                self._recheck(key)

    def clear(self) -> int:
        """Drops every refs-0 block (vLLM's reset_prefix_cache); returns the pages freed."""
        pages = self.num_unreferenced_pages
        while self._lru:
            self._drop(next(iter(self._lru.values())))
        return pages

    # ------------------------------------------------------------------ the allocator's reclaimer
    # Other kinds than KV (a hybrid model's ssm and conv state, experts) reclaim whole mid pages: a small kind takes
    # an emptied mid page of any kind apart; a mid kind takes its own kind's whole mid pages, and huge pages of
    # another mid kind in which every mid page that is not free is whole (emptied, the huge page merges).
    def reclaimable_small(self, kind: str) -> int:
        if kind == KV:
            return self.num_unreferenced_pages
        g = self.allocator.geometry
        return sum(n * g.smalls_per_mid(kind, m) for m, n in self._whole_count.items())

    def reclaim_small(self, kind: str, count: int) -> None:
        """KV: drops refs-0 blocks, least recently used first, until `count` pages are free. Another small kind:
        empties whole mid pages of any kind, least recently used first, until `count` more of its pages are free."""
        if kind != KV:
            alloc = self.allocator
            target = alloc.free_small_capacity(kind) + count
            self._empty_whole(list(self._whole), lambda: alloc.free_small_capacity(kind) >= target)
            return
        assert count <= self.num_unreferenced_pages
        freed = 0
        while freed < count:
            block = next(iter(self._lru.values()))
            self._drop(block)
            freed += len(block.pages)

    def reclaimable_mid(self, kind: str) -> int:
        # the huge pages' count is cached until a mid page or the whole set changes: the adjusters ask every step
        version = (self.allocator.mid_changes, self._whole_changes)
        cached = self._whole_huge_counted.get(kind)
        if cached is None or cached[0] != version:
            cached = self._whole_huge_counted[kind] = (version, len(self._whole_huge_pages(kind)))
        return self._whole_count.get(kind, 0) + self.allocator.geometry.mids_per_huge(kind) * cached[1]

    def reclaim_mid(self, kind: str, count: int) -> None:
        """Empties whole mid pages of `kind`, then whole huge pages of other kinds, the least recently used first (a
        mid page is as recent as its most recently released block), until `count` more mid pages of `kind` are
        free: every block with a page in one is dropped, so the mid page merges."""
        alloc = self.allocator
        target = alloc.free_mid_capacity(kind) + count

        def done() -> bool:
            return alloc.free_mid_capacity(kind) >= target

        self._empty_whole([key for key, k in self._whole.items() if k == kind], done)
        if not done():
            huge = self._whole_huge_pages(kind)
            huge.sort(key=lambda h: max(self._last_used(key) for key in self._whole_by_huge[h]))
            for h in huge:
                if done():
                    break
                for key in list(self._whole_by_huge.get(h, ())):
                    if key in self._whole:
                        self.drop_unreferenced_in(key)

    def _whole_huge_pages(self, kind: str) -> list[int]:
        """Huge pages split into another mid kind than `kind` whose every mid page that is not free is whole."""
        if len(self.allocator.geometry.mid_kinds) == 1:
            return []  # no other kind: the whole mid pages of `kind` are counted as such
        out = []
        for h, keys in self._whole_by_huge.items():
            split_into, busy = self.allocator.huge_page_use(h)
            if split_into != kind and busy == len(keys):
                out.append(h)
        return out

    def _huge_of(self, key: int) -> int:
        """The huge page holding the mid page at byte offset `key`."""
        return key // self.allocator.geometry.huge_size

    def _last_used(self, key: int) -> int:
        return max(b.last_used for b in self._unref_blocks[key].values())

    def _empty_whole(self, keys: list[int], done: Callable[[], bool]) -> None:
        keys.sort(key=self._last_used)
        for key in keys:
            if done():
                break
            if key in self._whole:  # an earlier drop may have emptied it already
                self.drop_unreferenced_in(key)

    # ------------------------------------------------------------------ KV compaction (engine/kv_compaction.py)
    def unreferenced_in(self, key: int) -> int:
        """Pages of refs-0 blocks in the mid page at byte offset `key`."""
        return self._unref.get(key, 0)

    def unreferenced_by_key(self) -> dict[int, int]:
        """Pages of refs-0 blocks per mid page key, for mid pages that hold any (read-only: the cache's own map)."""
        return self._unref

    def whole_keys(self) -> list[int]:
        """Byte offsets of the mid pages used by refs-0 blocks alone (reclaimable whole)."""
        return list(self._whole)

    def drop_unreferenced_in(self, key: int) -> None:
        """Drops every refs-0 block with a page in the mid page at byte offset `key` (their other pages are freed
        too: a block missing one layer's page is of no use)."""
        for block in list(self._unref_blocks.get(key, {}).values()):
            self._drop(block)

    def move_block(self, b: CachedBlock, pages: Sequence[int]) -> None:
        """A held block's pages were moved (compaction copies their bytes): the block names the new pages."""
        assert b.refs > 0, "refs-0 blocks are dropped, not moved"
        keys, counts = np.unique(self.allocator.parent_keys(KV, np.asarray(pages, dtype=np.int64)),
                                 return_counts=True)
        b.pages = tuple(int(p) for p in pages)
        b.mids = tuple(zip(keys.tolist(), counts.tolist(), strict=True))

    # ------------------------------------------------------------------ bookkeeping
    def _drop(self, b: CachedBlock) -> None:
        assert b.refs == 0
        del self._lru[b.name]
        del self._blocks[b.name]
        self._unlink(b)
        self.allocator.free_small(KV, b.pages)
        for key, _ in b.mids:
            self._recheck(key)

    def _unlink(self, b: CachedBlock) -> None:
        """Takes a block that leaves refs 0 out of the per-mid-page counts (the caller rechecks its mid pages)."""
        self.num_unreferenced_pages -= len(b.pages)
        for key, n in b.mids:
            left = self._unref[key] - n
            if left:
                self._unref[key] = left
                del self._unref_blocks[key][b.name]
            else:
                del self._unref[key]
                del self._unref_blocks[key]

    def _recheck(self, key: int) -> None:
        unref = self._unref.get(key, 0)
        info = self.allocator.parent_used(key) if unref else None
        whole = info is not None and info[1] == unref
        was = self._whole.get(key)
        if whole != (was is not None):
            self._whole_changes += 1
        if whole and was is None:
            assert info is not None
            self._whole[key] = info[0]
            self._whole_count[info[0]] = self._whole_count.get(info[0], 0) + 1
            self._whole_by_huge.setdefault(self._huge_of(key), set()).add(key)
        elif not whole and was is not None:
            del self._whole[key]
            self._whole_count[was] -= 1
            h = self._huge_of(key)
            self._whole_by_huge[h].discard(key)
            if not self._whole_by_huge[h]:
                del self._whole_by_huge[h]

    def check(self) -> None:
        """The invariants of the module docstring, recounted from the blocks and the allocator."""
        unref: dict[int, int] = {}
        for name, b in self._blocks.items():
            assert b.name == name and b.refs >= 0
            assert (b.refs == 0) == (name in self._lru), f"block {name.hex()[:8]}: refs {b.refs} vs the LRU"
            if b.refs == 0:
                for key, n in b.mids:
                    unref[key] = unref.get(key, 0) + n
                    assert self._unref_blocks[key][name] is b
        assert len(self._lru) <= len(self._blocks) and all(n in self._blocks for n in self._lru)
        assert unref == self._unref, "per-mid-page counts of refs-0 pages drifted"
        assert self._unref_blocks.keys() == unref.keys()
        assert self.num_unreferenced_pages == self.num_layers * len(self._lru)
        whole = {}
        for key, n in unref.items():
            info = self.allocator.parent_used(key)
            assert info is not None, f"mid page {key}: cached pages in a mid page that is not split"
            assert info[1] >= n
            if info[1] == n:
                whole[key] = info[0]
        assert whole == self._whole, "whole mid pages drifted"
        counts: dict[str, int] = {}
        for k in whole.values():
            counts[k] = counts.get(k, 0) + 1
        assert {k: c for k, c in self._whole_count.items() if c} == counts
        by_huge: dict[int, set[int]] = {}
        for key in whole:
            by_huge.setdefault(self._huge_of(key), set()).add(key)
        assert by_huge == self._whole_by_huge, "whole mid pages by huge page drifted"
        version = (self.allocator.mid_changes, self._whole_changes)
        for kind, (seen, count) in self._whole_huge_counted.items():
            assert seen != version or count == len(self._whole_huge_pages(kind)), f"stale count for {kind!r}"
