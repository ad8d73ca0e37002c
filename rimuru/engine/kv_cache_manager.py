"""KV pages of requests: how many each needs, asking the page allocator for them, and the prefix cache.

A block of `block_size` tokens needs one small page of kind "kv" in EVERY attention layer, so a
request's pages form a [num_blocks, num_attention_layers] grid (Request.kv_pages). The pages of one
request are asked for in one call with the request as owner, so that the allocator's affinity
places them in the same mid pages and they merge back when the request ends.

With prefix caching (engine/prefix_cache.py) a request's full, computed blocks are offered to the cache as they
fill (when its next block is allocated, and when it ends), a waiting request starts with the longest cached
prefix of its tokens (`lookup`, then `allocate(..., prefix)`), and a request that ends or is preempted releases its
cached blocks instead of freeing them. The cache is the allocator's reclaimer: its unreferenced pages count as
free in `capacity_pages` (so the scheduler admits against them, and experts are evicted only for what they
cannot give) and are reclaimed, least recently used first, by any allocation that free pages cannot serve.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rimuru.engine.prefix_cache import ROOT, CachedBlock, PrefixCache, hash_block
from rimuru.engine.request import Request
from rimuru.memory.allocator import PageAllocator

KV = "kv"


@dataclass(frozen=True)
class CachedPrefix:
    """The cached blocks a waiting request can start from (found by `lookup`; nothing is taken until `allocate`)."""

    blocks: list[CachedBlock] = field(default_factory=list)
    num_tokens: int = 0  # tokens the request skips: the blocks' tokens, less one when they hold every token
    num_unreferenced_pages: int = 0  # pages of `blocks` held by no request: capacity that taking them uses
    num_block_tokens: int = 0  # tokens the blocks hold

    @property
    def num_cached_writes(self) -> int:
        """Tokens computed again although the blocks hold their KV: 1 on a full hit (its last token, for logits),
        whose KV the pass must not write (the page is shared), else 0."""
        return self.num_block_tokens - self.num_tokens


NO_PREFIX = CachedPrefix()


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, num_attention_layers: int, block_size: int,
                 enable_prefix_caching: bool = False) -> None:
        self.allocator = allocator
        self.num_layers = num_attention_layers
        self.block_size = block_size
        self.pages_in_use = 0  # KV pages requests hold (a shared page once): the cache's refs-0 pages are not
        self.cache: PrefixCache | None = None
        if enable_prefix_caching:
            if allocator.reclaimer is not None:
                raise ValueError("the allocator already has a reclaimer: one prefix cache per page pool")
            self.cache = PrefixCache(allocator, num_attention_layers)
            allocator.reclaimer = self.cache
        # hybrid models' state snapshots (engine/state_cache_manager.py): drops the least recently used one no request
        # holds, False when there is none; a KV allocation that cannot be served otherwise calls it before failing
        self.spill: Callable[[], bool] | None = None
        # vLLM's prefix-cache counters, in tokens: prompt tokens looked up at admission, and those found cached
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pages_needed(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> int:
        """Capacity (`capacity_pages`) that `allocate` with the same arguments uses."""
        if prefix.blocks:
            blocks = self.blocks_for(prefix.num_tokens + num_new_tokens) - len(prefix.blocks)
            return max(0, blocks) * self.num_layers + prefix.num_unreferenced_pages
        blocks = self.blocks_for(request.num_computed_tokens + num_new_tokens) - request.num_blocks
        return max(0, blocks) * self.num_layers

    def capacity_pages(self) -> int:
        """KV pages obtainable now: free ones, splits of free mid and huge pages, the cache's refs-0 pages."""
        return self.allocator.small_capacity(KV)

    # ------------------------------------------------------------------ prefix caching
    def lookup(self, request: Request) -> CachedPrefix:
        """The longest cached prefix of a waiting request's tokens. At least its last token is left to compute, so
        the first sampled token has logits; on a full hit that token's KV is already in the last cached block.

        A request asking for prompt logprobs takes no cached prefix, as vLLM's (it skips reading the cache): the
        logits of every prompt position are computed, and a cached block's positions would have none. Its blocks are
        still offered to the cache for others."""
        if self.cache is None or request.num_computed_tokens or request.kv_pages or _skips_reading(request):
            return NO_PREFIX
        n = request.num_tokens
        blocks = self.cache.longest_prefix(self._block_hashes(request, n // self.block_size))
        if not blocks:
            return NO_PREFIX
        covered = len(blocks) * self.block_size
        unref = sum(len(b.pages) for b in blocks if b.refs == 0)
        return CachedPrefix(blocks, min(covered, n - 1), unref, covered)

    def trim(self, prefix: CachedPrefix, num_blocks: int) -> CachedPrefix:
        """The first `num_blocks` blocks of a `lookup`'s prefix, all their tokens skipped (none is the last)."""
        if num_blocks == 0:
            return NO_PREFIX
        blocks = prefix.blocks[:num_blocks]
        covered = num_blocks * self.block_size
        return CachedPrefix(blocks, covered, sum(len(b.pages) for b in blocks if b.refs == 0), covered)

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The names of the request's first `num_blocks` blocks (all full and known)."""
        return self._block_hashes(request, num_blocks)

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The names of the request's first `num_blocks` blocks (all full and known), extending its hash chain."""
        hashes = request.block_hashes
        bs = self.block_size
        if len(hashes) < num_blocks:
            p = len(request.prompt_token_ids)
            a = len(hashes) * bs
            # the tokens from the first block not hashed yet, without copying the whole sequence
            tokens = (request.prompt_token_ids[a:] + request.output_token_ids if a < p
                      else request.output_token_ids[a - p :])
            parent = hashes[-1] if hashes else ROOT
            for j in range(num_blocks - len(hashes)):
                parent = hash_block(parent, tokens[j * bs : (j + 1) * bs])
                hashes.append(parent)
        return hashes[:num_blocks] if len(hashes) > num_blocks else hashes

    def _offer_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Offers the request's blocks that `num_tokens` (known and computed, or being computed by the pass this
        allocation is for) fill, from the first not offered yet."""
        assert self.cache is not None
        nb = min(num_tokens // self.block_size, len(request.kv_pages))
        if nb <= request.num_offered_blocks:
            return
        hashes = self._block_hashes(request, nb)
        for i in range(request.num_offered_blocks, nb):
            self.cache.offer(hashes[i], request.kv_pages[i])  # False: the name is cached by a copy; ours stays ours
        request.num_offered_blocks = nb

    # ------------------------------------------------------------------ pages
    def allocate(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = NO_PREFIX) -> bool:
        """Gives `request` the pages to hold `num_new_tokens` more tokens; False (nothing taken) if the pool can't.

        With a `prefix` (a waiting request's `lookup`), the request first takes those cached blocks and starts at
        `prefix.num_tokens` computed tokens; `num_new_tokens` count from there."""
        first = request.num_cached_tokens is None  # its admission (a preempted request is admitted again)
        if prefix.blocks:
            assert self.cache is not None and not request.kv_pages and not request.num_computed_tokens
            while self.pages_needed(request, num_new_tokens, prefix) > self.capacity_pages():
                if self.spill is None or not self.spill():
                    return False
            # taken before the new pages: the allocator would otherwise reclaim them for those
            self.cache.acquire(prefix.blocks)
            self.pages_in_use += prefix.num_unreferenced_pages
            request.kv_pages = [list(b.pages) for b in prefix.blocks]
            request.num_computed_tokens = prefix.num_tokens
            request.num_offered_blocks = len(prefix.blocks)
        n = self.pages_needed(request, num_new_tokens)
        if n:
            pages = self.allocator.allocate_small(KV, n, owner=request.seq_id)
            while pages is None and self.spill is not None and self.spill():
                pages = self.allocator.allocate_small(KV, n, owner=request.seq_id)
            if pages is None:
                assert not prefix.blocks, "capacity was checked with the prefix taken into account"
                return False
            L = self.num_layers
            request.kv_pages.extend(pages[i : i + L] for i in range(0, n, L))
            self.pages_in_use += n
            if self.cache is not None:
                self.cache.pages_changed(pages)
        if first:
            request.num_cached_tokens = prefix.num_tokens
            if self.cache is not None and not _skips_reading(request):  # vLLM counts no lookup it skipped
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += prefix.num_tokens
        if self.cache is not None:
            # Blocks this step's pass fills are offered now, so requests admitted after this one can share them
            # (every layer writes the whole batch's KV before it attends). Tokens not known yet (a pending token)
            # are left out; a request dropped from the launch after this (it finished while draining the last
            # pass) has only its pending token in this chunk, so everything offered was computed already.
            self._offer_full_blocks(request, min(request.num_computed_tokens + num_new_tokens, request.num_tokens))
        return True

    def free(self, request: Request) -> None:
        """The request ends or is preempted: cached blocks are released to the cache (its computed full blocks
        are offered first), the others' pages freed."""
        if not request.kv_pages:
            return
        if self.cache is None:
            pages = [p for block in request.kv_pages for p in block]
            self.allocator.free_small(KV, pages)
            self.pages_in_use -= len(pages)
            request.kv_pages = []
            return
        cache = self.cache
        self._offer_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        shared: list[CachedBlock] = []
        private: list[int] = []
        hashes = request.block_hashes
        for i, block in enumerate(request.kv_pages):
            cached = cache.get(hashes[i]) if i < request.num_offered_blocks else None
            if cached is not None and cached.pages[0] == block[0]:  # a page id is held by one block only
                shared.append(cached)
            else:
                private.extend(block)
        unref = sum(len(b.pages) for b in shared if b.refs == 1)
        cache.release(shared[::-1])  # the tail first: reclaimed before the prefix other requests may share
        self.pages_in_use -= unref
        if private:
            arr = np.asarray(private, dtype=np.int64)
            keys = self.allocator.parent_keys(KV, arr)
            self.allocator.free_small(KV, arr)
            self.pages_in_use -= len(private)
            cache.pages_changed(arr, keys)
        request.kv_pages = []
        request.num_offered_blocks = 0

    def reset_prefix_cache(self) -> int:
        """Frees every cached page no request holds (vLLM's reset_prefix_cache); returns how many."""
        return self.cache.clear() if self.cache is not None else 0

    @property
    def num_cached_pages(self) -> int:
        """KV pages the prefix cache holds for no request (reclaimable; counted in capacity_pages)."""
        return self.cache.num_unreferenced_pages if self.cache is not None else 0

    def check(self) -> None:
        """Every KV page is held by requests or the cache: allocator's count = held + refs-0 cached."""
        assert self.allocator.num_used(KV) == self.pages_in_use + self.num_cached_pages, (
            self.allocator.num_used(KV), self.pages_in_use, self.num_cached_pages)
        if self.cache is not None:
            self.cache.check()


def _skips_reading(request: Request) -> bool:
    """A request whose prompt positions all need logits: no cached prefix may stand in for them."""
    return request.params.prompt_logprobs is not None
