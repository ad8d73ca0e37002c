"""Page sizes of the unified pool and ALL page-id <-> byte-offset arithmetic.

Three levels of pages tile one byte range (per tensor-parallel rank):

    pool  |<------------------ huge 0 ------------------>|<------------------ huge 1 ---- ...
    mid   |  expert 0  |  expert 1  |  expert 2  |  ...  |     ssm 0     |     ssm 1     | ...
    small | kv0 kv1 kv2 ... kv(r-1) |                                       (one mid, split into one small kind)

A page of kind K (size S_K) starting at byte offset o has id o // S_K. Every mid size divides the huge
size (huge = lcm of the mid sizes) and every small size divides every mid size (small sizes are padded up
until they do), so page boundaries of every level line up and one id names the same bytes in every view
of its kind. Nothing outside this module multiplies or divides page ids by page sizes.

The `ssm` (mid) and `conv` (small) kinds hold hybrid models' per-request state: one page of each per request
and gated DeltaNet layer (its recurrent state [Hv, dk, dv] in fp32 and its conv state [conv_dim, kernel - 1]).
Sizes that do not nest are padded, never the other way round: a small kind up to a divisor of every mid size,
and the ssm kind, where lcm(expert, ssm) would make the huge page more than MAX_HUGE_FACTOR times the larger
mid page, up to a divisor or a multiple of the expert page (`padding` reports the waste of every kind).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from rimuru.model_spec import ModelSpec

Level = Literal["huge", "mid", "small"]
HUGE = "huge"
PRIMARY_MID = "expert"
SSM = "ssm"  # mid kind: one linear-attention layer's recurrent state of one request
CONV = "conv"  # small kind: one linear-attention layer's conv state of one request
# The most a huge page may exceed the larger mid page by before the ssm page is padded to nest with the expert page.
MAX_HUGE_FACTOR = 8

IdLike = int | np.ndarray


def _smallest_divisor_at_least(n: int, lower: int) -> int:
    """Smallest d with d | n and d >= lower (n itself when nothing smaller fits)."""
    best = n
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for cand in (d, n // d):
                if lower <= cand < best:
                    best = cand
    return best


def padded_ssm_size(expert: int, raw: int, smalls: tuple[int, ...], align: int = 4) -> int:
    """The ssm page size for a raw state of `raw` B beside an expert page of `expert` B: `raw` itself where the huge
    page, lcm(expert, raw), stays within MAX_HUGE_FACTOR x the larger of the two and every small kind (`smalls`,
    raw sizes) fits in gcd(expert, raw); else the candidate of least padding among the smallest divisor of the
    expert page >= raw and the smallest multiple of it >= raw (multiples of `align` B, the state's dtype)."""

    def fits(s: int) -> bool:
        return (s % align == 0 and math.lcm(expert, s) <= MAX_HUGE_FACTOR * max(expert, s)
                and all(m <= math.gcd(expert, s) for m in smalls))

    if fits(raw):
        return raw
    cands = [-(-raw // expert) * expert]
    if raw <= expert:
        cands.append(_smallest_divisor_at_least(expert, raw))
    good = [c for c in cands if fits(c)]
    if not good:
        raise ValueError(f"no ssm page size >= {raw:,} B nests with the expert page ({expert:,} B) and holds the "
                         f"small kinds ({', '.join(f'{m:,} B' for m in smalls)})")
    return min(good, key=lambda c: (c - raw, math.lcm(expert, c)))


@dataclass(frozen=True)
class PageGeometry:
    # (kind, bytes) of each mid kind; the first is the primary kind used when huge pages are split for smalls.
    mid: tuple[tuple[str, int], ...]
    # (kind, padded bytes, unpadded bytes) of each small kind.
    small: tuple[tuple[str, int, int], ...]
    huge_size: int
    # Tensor shape facts the views need (None for custom geometries).
    dtype: torch.dtype | None = None
    ssm_dtype: torch.dtype | None = None
    block_size: int | None = None
    tp_size: int = 1
    kv_heads_per_rank: int | None = None
    head_dim: int | None = None
    expert_numel: int | None = None
    ssm_shape: tuple[int, int, int] | None = None  # (value_heads / tp, key_head_dim, value_head_dim)
    conv_shape: tuple[int, int] | None = None  # (conv_dim / tp, kernel - 1)
    # (kind, unpadded bytes) of each mid kind padded up to nest with the others (the ssm kind of odd configs)
    mid_unpadded: tuple[tuple[str, int], ...] = ()
    _sizes: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)
    _levels: dict[str, Level] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.mid:
            raise ValueError("a geometry needs at least one mid kind")
        sizes: dict[str, int] = {HUGE: self.huge_size}
        levels: dict[str, Level] = {HUGE: "huge"}
        for kind, size in self.mid:
            if size <= 0 or self.huge_size % size:
                raise ValueError(f"mid kind {kind!r}: size {size} must be positive and divide huge {self.huge_size}")
            sizes[kind], levels[kind] = size, "mid"
        for kind, size, raw in self.small:
            bad = [m for m, ms in self.mid if ms % size]
            if size <= 0 or raw > size or bad:
                raise ValueError(f"small kind {kind!r}: padded size {size} must hold {raw} B and divide mids {bad}")
            if kind in sizes:
                raise ValueError(f"page kind {kind!r} defined twice")
            sizes[kind], levels[kind] = size, "small"
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_levels", levels)

    # ------------------------------------------------------------------ construction

    @classmethod
    def custom(
        cls, mid_sizes: Mapping[str, int], small_sizes: Mapping[str, int] | None = None
    ) -> PageGeometry:
        """A geometry from byte sizes (tests, simulators): mids as given, smalls padded. The first mid kind is
        primary."""
        mids = tuple((k, int(v)) for k, v in mid_sizes.items())
        huge = math.lcm(*(s for _, s in mids))
        g = math.gcd(*(s for _, s in mids))
        smalls = []
        for kind, raw in (small_sizes or {}).items():
            if raw > g:
                raise ValueError(f"small kind {kind!r} ({raw} B) is larger than the gcd of the mid sizes ({g} B)")
            smalls.append((kind, _smallest_divisor_at_least(g, int(raw)), int(raw)))
        return cls(mid=mids, small=tuple(smalls), huge_size=huge)

    @classmethod
    def for_model(
        cls,
        spec: ModelSpec,
        dtype: torch.dtype = torch.bfloat16,
        block_size: int = 16,
        tp_size: int = 1,
        ssm_dtype: torch.dtype = torch.float32,
        expert_parallel: bool = False,
    ) -> PageGeometry:
        if tp_size < 1 or block_size < 1:
            raise ValueError(f"tp_size ({tp_size}) and block_size ({block_size}) must be >= 1")
        item = dtype.itemsize

        def per_rank(n: int, what: str) -> int:
            if n % tp_size:
                raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}")
            return n // tp_size

        # an expert page is one matrix of one expert: this rank's f/N rows of it, or the whole under expert parallelism
        f = spec.moe_intermediate_size if expert_parallel else per_rank(spec.moe_intermediate_size,
                                                                        "moe_intermediate_size")
        expert_numel = f * spec.hidden_size
        mid: dict[str, int] = {PRIMARY_MID: expert_numel * item}
        small: dict[str, int] = {}
        kv_heads = None
        ssm_shape = conv_shape = None
        if spec.attention_layer_ids:
            # KV heads are replicated when there are fewer of them than ranks.
            kv_heads = max(1, spec.num_key_value_heads // tp_size)
            if spec.num_key_value_heads >= tp_size:
                per_rank(spec.num_key_value_heads, "num_key_value_heads")
            small["kv"] = block_size * 2 * kv_heads * spec.head_dim * item
        mid_unpadded: tuple[tuple[str, int], ...] = ()
        if spec.linear_layer_ids:
            ssm_shape = (
                per_rank(spec.linear_num_value_heads, "linear_num_value_heads"),
                spec.linear_key_head_dim,
                spec.linear_value_head_dim,
            )
            conv_shape = (per_rank(spec.linear_conv_dim, "linear conv dim"), spec.linear_conv_kernel_dim - 1)
            small[CONV] = math.prod(conv_shape) * item
            raw = math.prod(ssm_shape) * ssm_dtype.itemsize
            mid[SSM] = padded_ssm_size(mid[PRIMARY_MID], raw, tuple(small.values()), ssm_dtype.itemsize)
            if mid[SSM] != raw:
                mid_unpadded = ((SSM, raw),)
        base = cls.custom(mid, small)
        return cls(
            mid=base.mid,
            small=base.small,
            huge_size=base.huge_size,
            dtype=dtype,
            ssm_dtype=ssm_dtype if spec.linear_layer_ids else None,
            block_size=block_size,
            tp_size=tp_size,
            kv_heads_per_rank=kv_heads,
            head_dim=spec.head_dim,
            expert_numel=expert_numel,
            ssm_shape=ssm_shape,
            conv_shape=conv_shape,
            mid_unpadded=mid_unpadded,
        )

    # ------------------------------------------------------------------ kinds and sizes

    @property
    def mid_kinds(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.mid)

    @property
    def small_kinds(self) -> tuple[str, ...]:
        return tuple(k for k, _, _ in self.small)

    def level(self, kind: str) -> Level:
        self._check(kind)
        return self._levels[kind]

    def size(self, kind: str) -> int:
        try:
            return self._sizes[kind]
        except KeyError:
            self._check(kind)
            raise

    def unpadded_size(self, kind: str) -> int:
        for k, _, raw in self.small:
            if k == kind:
                return raw
        for k, raw in self.mid_unpadded:
            if k == kind:
                return raw
        return self.size(kind)

    def padding(self, kind: str) -> int:
        """Bytes at the end of each page of `kind` that hold nothing (small kinds, and a padded ssm kind)."""
        return self.size(kind) - self.unpadded_size(kind)

    def num_pages(self, kind: str, pool_bytes: int) -> int:
        return pool_bytes // self.size(kind)

    def _check(self, kind: str) -> None:
        if kind not in self._sizes:
            raise KeyError(f"unknown page kind {kind!r}; this geometry has {sorted(self._sizes)}")

    # ------------------------------------------------------------------ id <-> offset

    def offset(self, kind: str, page_id: IdLike) -> IdLike:
        return page_id * self.size(kind)

    def page_id(self, kind: str, offset: int) -> int:
        size = self.size(kind)
        if offset % size:
            raise ValueError(f"byte offset {offset} is not on a {kind!r} page boundary (size {size})")
        return offset // size

    def smalls_per_mid(self, small_kind: str, mid_kind: str) -> int:
        return self.size(mid_kind) // self.size(small_kind)

    def mids_per_huge(self, mid_kind: str) -> int:
        return self.huge_size // self.size(mid_kind)

    def smalls_per_huge(self, small_kind: str) -> int:
        return self.huge_size // self.size(small_kind)

    def smalls_of_mid(self, small_kind: str, mid_kind: str, mid_id: int) -> range:
        r = self.smalls_per_mid(small_kind, mid_kind)
        return range(mid_id * r, (mid_id + 1) * r)

    def huge_of_mid(self, mid_kind: str, mid_id: IdLike) -> IdLike:
        return mid_id * self.size(mid_kind) // self.huge_size

    def huge_of_small(self, small_kind: str, small_id: IdLike) -> IdLike:
        return small_id * self.size(small_kind) // self.huge_size

    def mids_of_huge(self, mid_kind: str, huge_id: int) -> range:
        r = self.mids_per_huge(mid_kind)
        return range(huge_id * r, (huge_id + 1) * r)

    def describe(self) -> str:
        mids = ", ".join(f"{k} {s:,} B" + (f" (pad {self.padding(k):,})" if self.padding(k) else "")
                         for k, s in self.mid)
        smalls = ", ".join(f"{k} {s:,} B (pad {s - raw:,})" for k, s, raw in self.small)
        return f"huge {self.huge_size:,} B; mid: {mids}; small: {smalls or 'none'}"
