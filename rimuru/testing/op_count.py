"""Counting what a forward pass asks of the device, on any device: torch ops that launch work, allocations, views,
host syncs and host->device copies, per named region of the pass (a layer kind), with rimuru's kernels counted as
the launches their GPU path makes.

    counter = OpCounter()
    with counter.counting(), counter.region("moe"):
        model(batch)
    counter.table()

A torch op is seen at the dispatcher (TorchDispatchMode) and classified:

    view      output aliases an input (view, slice, split, transpose, reshape of a viewable tensor, .to() of the same
              dtype): no launch
    alloc     empty / empty_strided / empty_like: host work in the caching allocator, no launch
    launch    everything else: one kernel (or copy) on a GPU
    sync      the host waits for the device: .item() / int() / bool() of a tensor, .tolist(), nonzero, boolean-mask
              indexing, repeat_interleave with tensor repeats (no output_size), unique, masked_select, a
              device->host copy
    h2d       a tensor made from host data (torch.tensor) or copied host->device

rimuru's kernel entry points (`box_kernels`) are counted as the launches and syncs of their CUDA path whatever
device runs them: on the CPU their torch references run, uncounted (their boolean indexing is the reference's, not
the GPU's). fla-core's chunk kernel, which the CPU cannot run, is modelled (`FLA_LAUNCHES`; its host sync per new
cu_seqlens tensor object emulates fla's identity cache) and computed by a torch stand-in. Counts are a model of a
GPU pass: a profiler on the GPU (benchmarks/count_hybrid_pass.py) checks them.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

_ALLOC_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
_VIEW_OPS = {"lift_fresh", "detach", "detach_", "resolve_conj", "resolve_neg", "alias", "_reshape_alias"}
_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "masked_select", "unique", "_unique",
             "_unique2", "unique_dim", "unique_consecutive", "argwhere"}

# fla-core's chunk_gated_delta_rule forward over packed rows (cu_seqlens): l2norm of q and k, the chunk-local
# cumsum of g, the scaled k k^T, solve_tril (16x16 blocks, their merge, the zero-filled output), the WY
# recompute, the state scan and the output: launches per call, plus our wrapper's cast of cu_seqlens and the
# contiguous state. Its chunk indices come from cu_seqlens on the host (prepare_chunk_indices: .tolist()), for chunk
# sizes 64 and 16, cached by the tensor object's identity (the last FLA_CACHE_SIZE calls).
FLA_LAUNCHES = 11
FLA_INDEX_LAUNCHES = 6  # per chunk-index build: the aranges' cat, stack, eq, cumsum, the copy to the device
FLA_CHUNK_SIZES = (64, 16)
FLA_CACHE_SIZE = 4


@dataclass
class Counts:
    launches: int = 0
    allocs: int = 0
    views: int = 0
    syncs: int = 0
    h2d: int = 0
    kernel_calls: int = 0  # rimuru kernel entry points, their launches included in `launches`
    entries: int = 0  # times the region was entered (layers of its kind, norms, ...)
    host_s: float = 0.0  # host time inside the region (wall; with counting on, the counter's own cost too)
    ops: Counter[str] = field(default_factory=Counter)  # launches by op name
    sync_sites: Counter[str] = field(default_factory=Counter)  # syncs by op name

    def add(self, other: Counts) -> None:
        for name in ("launches", "allocs", "views", "syncs", "h2d", "kernel_calls", "entries", "host_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ops.update(other.ops)
        self.sync_sites.update(other.sync_sites)

    def as_dict(self, top: int = 12) -> dict[str, Any]:
        return {"launches": self.launches, "allocs": self.allocs, "views": self.views, "syncs": self.syncs,
                "h2d": self.h2d, "kernel_calls": self.kernel_calls, "entries": self.entries,
                "top_ops": dict(self.ops.most_common(top)), "sync_sites": dict(self.sync_sites)}


def _is_bool_index(indices: Any) -> bool:
    return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (indices or ()))


def _shares_storage(out: Any, args: tuple) -> bool:
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, Tensor)), None)
    if not isinstance(out, Tensor):
        return True  # nothing made: no launch
    ptr = out.untyped_storage().data_ptr()
    return any(isinstance(a, Tensor) and a.untyped_storage().data_ptr() == ptr for a in args)


class _Mode(TorchDispatchMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        c = self.counter
        if c.suppress:
            return out
        counts = c.current()
        name = func.overloadpacket.__name__
        overload = func._overloadname
        if name in _ALLOC_OPS:
            counts.allocs += 1
            return out
        returns = func._schema.returns
        alias = returns[0].alias_info if returns else None
        # an op whose schema may alias its input (view, reshape, to, contiguous, ...) is a view when it did
        if name in _VIEW_OPS or (alias is not None and not alias.is_write and _shares_storage(out, args)):
            counts.views += 1
            if name == "lift_fresh":  # torch.tensor(host data): a host->device copy on a GPU
                counts.h2d += 1
            return out
        counts.launches += 1
        counts.ops[name] += 1
        sync = name in _SYNC_OPS
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            sync = _is_bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
        elif name == "repeat_interleave":
            sync = overload in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
        elif name in ("_to_copy", "copy_"):
            src = args[1] if name == "copy_" else args[0]
            dst_dev = args[0].device if name == "copy_" else kwargs.get("device")
            if isinstance(src, Tensor) and dst_dev is not None:
                dst = torch.device(dst_dev)
                sync = src.device.type == "cuda" and dst.type == "cpu"
                if src.device.type == "cpu" and dst.type == "cuda":
                    counts.h2d += 1
        if sync:
            counts.syncs += 1
            counts.sync_sites[f"{name}.{overload}"] += 1
        return out


class OpCounter:
    """Counts by region; regions nest (the innermost one counts). `counting()` turns the dispatcher hook on."""

    def __init__(self) -> None:
        self.regions: dict[str, Counts] = {}
        self._stack: list[tuple[str, float]] = [("other", 0.0)]
        self.suppress = 0
        self.active = False
        self._fla_cache: deque[tuple[int, int]] = deque(maxlen=FLA_CACHE_SIZE)
        self._fla_keep: deque[object] = deque(maxlen=FLA_CACHE_SIZE * len(FLA_CHUNK_SIZES))

    def current(self) -> Counts:
        return self.regions.setdefault(self._stack[-1][0], Counts())

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        self._push(name)
        try:
            yield
        finally:
            self._pop()

    def _push(self, name: str) -> None:
        now = time.perf_counter()
        outer = self._stack[-1][0]
        self.regions.setdefault(outer, Counts()).host_s += now - self._stack[-1][1]
        self.regions.setdefault(name, Counts()).entries += 1
        self._stack.append((name, now))

    def _pop(self) -> None:
        now = time.perf_counter()
        name, t0 = self._stack.pop()
        self.regions.setdefault(name, Counts()).host_s += now - t0
        self._stack[-1] = (self._stack[-1][0], now)

    @contextlib.contextmanager
    def counting(self) -> Iterator[OpCounter]:
        """The dispatcher hook and `.tolist()` counted as a sync, for the block."""
        original = torch.Tensor.tolist
        counter = self

        def tolist(t: Tensor) -> Any:
            if counter.active and not counter.suppress:
                counts = counter.current()
                counts.syncs += 1
                counts.sync_sites["tolist"] += 1
            return original(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        self._stack = [("other", time.perf_counter())]
        self.active = True
        try:
            with _Mode(self):
                yield self
        finally:
            self.active = False
            torch.Tensor.tolist = original  # type: ignore[method-assign]
            self._pop_to_base()

    def _pop_to_base(self) -> None:
        while len(self._stack) > 1:
            self._pop()
        now = time.perf_counter()
        self.regions.setdefault("other", Counts()).host_s += now - self._stack[0][1]
        self._stack[0] = ("other", now)

    def kernel(self, name: str, launches: int, syncs: int = 0, h2d: int = 0) -> None:
        """One rimuru kernel call: `launches` device launches (its CUDA path's), `syncs` host syncs."""
        if not self.active or self.suppress:
            return
        counts = self.current()
        counts.kernel_calls += 1
        counts.launches += launches
        counts.ops[name] += launches
        counts.syncs += syncs
        counts.h2d += h2d
        if syncs:
            counts.sync_sites[name] += syncs

    def fla_call(self, cu_seqlens: Tensor) -> None:
        """fla's chunk kernel once, called through kernels/fla_gated_delta.py with `cu_seqlens`: its launches, and
        its chunk-index builds (a sync each) where fla's identity cache (cu_seqlens object, chunk size) misses. The
        wrapper hands fla `cu_seqlens.long()`: a new object (and a cast launch) unless it is int64 already."""
        syncs = launches = 0
        seen: object = cu_seqlens
        if cu_seqlens.dtype != torch.int64:
            seen = object()
            launches += 1
        for size in FLA_CHUNK_SIZES:
            key = (id(seen), size)
            if key not in self._fla_cache:
                self._fla_cache.append(key)
                self._fla_keep.append(seen)  # fla's cache holds the tensor: its id stays unique
                syncs += 1
                launches += FLA_INDEX_LAUNCHES
        self.kernel("fla_chunk_gated_delta_rule", FLA_LAUNCHES + launches, syncs=syncs, h2d=syncs)

    def total(self) -> Counts:
        out = Counts()
        for c in self.regions.values():
            out.add(c)
        return out

    def reset(self) -> None:
        self.regions = {}
        self._fla_cache.clear()
        self._fla_keep.clear()


# ---------------------------------------------------------------------------------------------- kernel boxes

def _paged_attention_launches(q: Tensor, kv_cache: Tensor, block_table: Tensor, query_start_loc: Tensor,
                              seq_lens: Tensor, scale: float, max_query_len: int, max_seq_len: int,
                              q_tile_start: Tensor | None = None, **_: Any) -> int:
    from rimuru.kernels.paged_attention import plan_launch

    if q_tile_start is not None:
        return 2  # zeros_like + the tile-mapped launch (no split-K)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    plan = plan_launch(seq_lens.shape[0], q.shape[1], num_kv_heads, head_dim, block_size, max_query_len, 132,
                       elem_size=q.element_size())  # the H200's 132 SMs
    return 1 + (plan.num_splits > 1)


def _fused_moe_launches(hidden: Tensor, topk_weights: Tensor, topk_ids: Tensor, *args: Any, **kwargs: Any) -> int:
    from rimuru.kernels.moe_align import SINGLE_PROGRAM_MAX

    n = topk_ids.numel()
    align = 1 if n <= SINGLE_PROGRAM_MAX else 3  # above one program: the chunked count, scan and scatter
    return align + 2 + (topk_ids.shape[1] > 1)  # + gate/up and down GEMMs, + the top-k sum


# (module, function, launches of its CUDA path: an int or a function of the call's arguments)
KERNELS: tuple[tuple[str, str, int | Callable[..., int]], ...] = (
    ("rimuru.models.layers", "rms_norm", 1),
    ("rimuru.models.layers", "fused_add_rms_norm", 1),
    ("rimuru.models.layers", "silu_and_mul", 1),
    ("rimuru.models.moe", "sigmoid_mul_add", 1),
    ("rimuru.models.moe", "route_topk", 1),
    ("rimuru.models.moe", "fused_moe", _fused_moe_launches),
    ("rimuru.models.rotary", "cos_sin", 1),
    ("rimuru.models.rotary", "apply_rotary_qk", 1),
    ("rimuru.models.attention", "rotary_write_kv", 1),
    ("rimuru.models.attention", "paged_attention", _paged_attention_launches),
    ("rimuru.models.gated_attention", "write_kv", 1),
    ("rimuru.models.gated_attention", "paged_attention", _paged_attention_launches),
    ("rimuru.models.gated_deltanet", "rms_norm_gated", 1),
    ("rimuru.models.gated_deltanet", "causal_conv1d_update", 2),  # has_state's int32 cast + the kernel
    ("rimuru.models.gated_deltanet", "gated_delta_decode", 2),
)


def fla_packed_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                         cu_seqlens: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """What fla_chunk_gated_delta_rule computes (packed rows, q and k raw), by the torch chunk form one sequence at
    a time: for CPU runs of the fla path. q, k [T, H, dk], v [T, H, dv], g, beta [T, H], state [N, H, dk, dv]."""
    from rimuru.models.gated_deltanet import chunk_gated_delta_rule, l2_normalize

    bounds = [int(b) for b in cu_seqlens.cpu()]
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]

        def head_major(t: Tensor, a: int = a, b: int = b) -> Tensor:
            return t[a:b].float().transpose(0, 1)[None]  # [1, H, L, ...]

        qn = l2_normalize(head_major(q)) * scale
        kn = l2_normalize(head_major(k))
        o, s = chunk_gated_delta_rule(qn, kn, head_major(v), head_major(g), head_major(beta),
                                      state[n : n + 1].float())
        outs.append(o[0].transpose(0, 1))
        finals.append(s)
    o = torch.cat(outs) if outs else v.new_zeros(0, *v.shape[1:]).float()
    return o.to(q.dtype), torch.cat(finals) if finals else state.float()


@contextlib.contextmanager
def box_kernels(counter: OpCounter, emulate_fla: bool = False) -> Iterator[None]:
    """rimuru's kernel entry points, as the models call them, counted as their CUDA path's launches (their own ops
    uncounted). `emulate_fla`: the gated DeltaNet takes the fla-core prefill path (as on a GPU in bf16 with fla
    installed), computed by `fla_packed_reference` and counted as fla's launches and syncs."""
    import importlib

    replacements: list[tuple[Any, str, Any]] = []

    def box(fn: Callable[..., Any], name: str, launches: int | Callable[..., int]) -> Callable[..., Any]:
        def boxed(*args: Any, **kwargs: Any) -> Any:
            n = launches(*args, **kwargs) if callable(launches) else launches
            counter.kernel(name, n)
            counter.suppress += 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter.suppress -= 1

        return boxed

    for module_name, fn_name, launches in KERNELS:
        module = importlib.import_module(module_name)
        if hasattr(module, fn_name):
            replacements.append((module, fn_name, box(getattr(module, fn_name), fn_name, launches)))
    if emulate_fla:
        gdn = importlib.import_module("rimuru.models.gated_deltanet")

        def fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cu_seqlens: Tensor,
                scale: float) -> tuple[Tensor, Tensor]:
            counter.fla_call(cu_seqlens)
            counter.suppress += 1
            try:
                return fla_packed_reference(q, k, v, g, beta, state, cu_seqlens, scale)
            finally:
                counter.suppress -= 1

        replacements += [(gdn, "fla_chunk_applies", lambda x: True), (gdn, "fla_chunk_gated_delta_rule", fla)]
    with _replaced(replacements):
        yield


@contextlib.contextmanager
def _replaced(replacements: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each (module, name, new) set for the block, the originals put back after it (in reverse order)."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in replacements]
    try:
        for module, name, new in replacements:
            setattr(module, name, new)
        yield
    finally:
        for module, name, fn in reversed(originals):
            setattr(module, name, fn)


# ---------------------------------------------------------------------------------------------- kernel stubs

def _like(*shapes_of: int) -> Callable[..., Any]:
    """A stand-in returning new tensors shaped as the call's arguments at positions `shapes_of` (one: the tensor)."""
    def stub(*args: Any, **_: Any) -> Any:
        outs = tuple(torch.empty_like(args[i]) for i in shapes_of)
        return outs[0] if len(outs) == 1 else outs

    return stub


def _route_stub(logits: Tensor, bias: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    T = logits.shape[0]
    return (torch.empty(T, top_k, dtype=torch.float32, device=logits.device),
            torch.zeros(T, top_k, dtype=torch.int64, device=logits.device))  # valid ids for the routing counter


def _cos_sin_stub(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    shape = (positions.shape[0], inv_freq.shape[0])
    return (torch.empty(shape, dtype=dtype, device=positions.device),
            torch.empty(shape, dtype=dtype, device=positions.device))


# (module, function, stand-in): rimuru's kernels as a host sees a launch (outputs allocated, nothing computed)
STUBS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("rimuru.models.layers", "rms_norm", _like(0)),
    ("rimuru.models.layers", "fused_add_rms_norm", _like(0, 0)),
    ("rimuru.models.layers", "silu_and_mul", _like(0)),
    ("rimuru.models.moe", "sigmoid_mul_add", _like(1)),
    ("rimuru.models.moe", "route_topk", _route_stub),
    ("rimuru.models.moe", "fused_moe", _like(0)),
    ("rimuru.models.rotary", "cos_sin", _cos_sin_stub),
    ("rimuru.models.rotary", "apply_rotary_qk", _like(0, 1)),
    ("rimuru.models.attention", "rotary_write_kv", _like(0)),
    ("rimuru.models.attention", "paged_attention", _like(0)),
)


@contextlib.contextmanager
def stub_kernels() -> Iterator[None]:
    """rimuru's kernel entry points (non-hybrid layers) replaced by stand-ins that allocate their outputs and compute
    nothing: a CPU pass's host time without the kernels' torch references (which are not what a GPU host runs).
    The outputs hold garbage: for timing the host, not for results."""
    import importlib

    modules = [(importlib.import_module(module_name), fn_name, stub) for module_name, fn_name, stub in STUBS]
    with _replaced([(module, fn_name, stub) for module, fn_name, stub in modules if hasattr(module, fn_name)]):
        yield


__all__ = ["Counts", "OpCounter", "box_kernels", "fla_packed_reference", "stub_kernels"]
