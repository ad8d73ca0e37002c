"""KV pages of requests: how many each needs, and asking the page allocator for them.

A block of `block_size` tokens needs one small page of kind "kv" in EVERY attention layer, so a
request's pages form a [num_blocks, num_attention_layers] grid (Request.kv_pages). The pages of one
request are asked for in one call with the request as owner, so that the allocator's affinity
places them in the same mid pages and they merge back when the request ends.
"""

from __future__ import annotations

from rimuru.engine.request import Request
from rimuru.memory.allocator import PageAllocator

KV = "kv"


class KVCacheManager:
    def __init__(self, allocator: PageAllocator, num_attention_layers: int, block_size: int) -> None:
        self.allocator = allocator
        self.num_layers = num_attention_layers
        self.block_size = block_size
        self.pages_in_use = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pages_needed(self, request: Request, num_new_tokens: int) -> int:
        blocks = self.blocks_for(request.num_computed_tokens + num_new_tokens) - request.num_blocks
        return max(0, blocks) * self.num_layers

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Gives `request` the pages to hold `num_new_tokens` more tokens; False (nothing taken) if the pool can't."""
        n = self.pages_needed(request, num_new_tokens)
        if n == 0:
            return True
        pages = self.allocator.allocate_small(KV, n, owner=request.seq_id)
        if pages is None:
            return False
        L = self.num_layers
        request.kv_pages.extend(pages[i : i + L] for i in range(0, n, L))
        self.pages_in_use += n
        return True

    def free(self, request: Request) -> None:
        if not request.kv_pages:
            return
        pages = [p for block in request.kv_pages for p in block]
        self.allocator.free_small(KV, pages)
        self.pages_in_use -= len(pages)
        request.kv_pages = []

    def capacity_pages(self) -> int:
        return self.allocator.small_capacity(KV)
