"""The pool tensor: one contiguous uint8 buffer of whole huge pages, and typed views over its bytes.

Every view is `buffer.view(dtype).view(n_pages, page_elems)` (no copy), so row i of a view is page i of
that kind as the allocator numbers it. A padded small kind is viewed at its padded width and then sliced:

    conv view, page = 65,536 B, state = 49,152 B (bf16: 24,576 elements of 32,768)
    row i: | conv_dim x (kernel-1) state ........................ | padding (unused) |
           |<----------- [:, :state_elems] ------------------->|
"""

from __future__ import annotations

import math

import torch

from rimuru.memory.allocator import PageAllocator
from rimuru.memory.geometry import PageGeometry


class PagePool:
    def __init__(self, geometry: PageGeometry, budget_bytes: int, device: str | torch.device = "cpu") -> None:
        num_huge = budget_bytes // geometry.huge_size
        if num_huge <= 0:
            raise ValueError(
                f"budget {budget_bytes:,} B is smaller than one huge page ({geometry.huge_size:,} B)"
            )
        self.geometry = geometry
        self.num_huge_pages = num_huge
        self.pool_bytes = num_huge * geometry.huge_size
        self.buffer = torch.zeros(self.pool_bytes, dtype=torch.uint8, device=device)
        self.allocator = PageAllocator(geometry, num_huge)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def view(self, kind: str, dtype: torch.dtype, page_shape: tuple[int, ...]) -> torch.Tensor:
        """[num_pages(kind), *page_shape] of `dtype` over the pool's bytes; row i is page i of `kind`."""
        size = self.geometry.size(kind)
        item = dtype.itemsize
        need = math.prod(page_shape) * item
        if size % item:
            raise ValueError(f"{kind} page size {size} B is not a multiple of {dtype} ({item} B)")
        if need > size:
            raise ValueError(f"shape {page_shape} of {dtype} needs {need:,} B, a {kind} page has {size:,} B")
        n = self.geometry.num_pages(kind, self.pool_bytes)
        rows = self.buffer.view(dtype).view(n, size // item)  # [n, page_elems]
        return rows[:, : math.prod(page_shape)].view(n, *page_shape)

    def kv_view(
        self,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """[n_kv_pages, 2 (K, V), block_size, kv_heads, head_dim]."""
        g = self.geometry
        heads = num_kv_heads or g.kv_heads_per_rank
        hd = head_dim or g.head_dim
        bs = block_size or g.block_size
        if heads is None or hd is None or bs is None:
            raise ValueError("this geometry has no KV shape: pass num_kv_heads, head_dim and block_size")
        return self.view("kv", dtype or g.dtype or torch.bfloat16, (2, bs, heads, hd))

    def expert_view(self, dtype: torch.dtype | None = None, numel: int | None = None) -> torch.Tensor:
        """[n_expert_pages, moe_intermediate/tp * hidden]: one W1, W3 or W2 matrix per row."""
        n = numel or self.geometry.expert_numel
        if n is None:
            raise ValueError("this geometry has no expert shape: pass numel")
        return self.view("expert", dtype or self.geometry.dtype or torch.bfloat16, (n,))

    def ssm_view(self, dtype: torch.dtype | None = None, shape: tuple[int, int, int] | None = None) -> torch.Tensor:
        """[n_ssm_pages, value_heads/tp, key_head_dim, value_head_dim] (fp32 by default): one linear-attention
        layer's recurrent state of one request per row; a padded ssm page's padding is not in the view."""
        s = shape or self.geometry.ssm_shape
        if s is None:
            raise ValueError("this geometry has no SSM state shape: pass shape")
        return self.view("ssm", dtype or self.geometry.ssm_dtype or torch.float32, s)

    def conv_view(self, dtype: torch.dtype | None = None, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """[n_conv_pages, conv_dim/tp, kernel-1]: one linear-attention layer's conv state of one request per row;
        the padding at the end of each page is not in the view."""
        s = shape or self.geometry.conv_shape
        if s is None:
            raise ValueError("this geometry has no conv state shape: pass shape")
        return self.view("conv", dtype or self.geometry.dtype or torch.bfloat16, s)
