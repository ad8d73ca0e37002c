"""Copies non-resident experts from the host store into two load buffers on a dedicated copy stream.

A load buffer is `slots` expert slots of reserved expert pages (3 mid pages per slot) plus its own
device expert table [E, 3] that the MoE kernel reads: the layer's resident rows, plus one row per
expert copied into a slot. Consecutive MoE layers alternate buffers, so layer l computes from one
while layer l+1's experts arrive in the other:

    buffer 0: layers 0, 2, 4, ...      slots: | s0: p1 p3 p2 | s1: p1 p3 p2 | ... | s(slots-1) |
    buffer 1: layers 1, 3, 5, ...      table: [E, 3] int32, resident rows + slot rows, -1 elsewhere

Ordering on a GPU (all host-side decisions; the device only sees events):

    compute stream:  ... MoE(l-2)[reads buf b] --fence(b)--> attn(l-1) MoE(l-1) ... wait ready(b) MoE(l)
    copy stream:            wait fence(b) --> copies into b, table(b) update --> ready(b)

  * fence(b): recorded on the compute stream at the first provider call after the kernel that read
    buffer b was queued; the copy stream waits on it before the buffer's pages or table are rewritten,
    so a buffer is never overwritten while the layer using it may still run.
  * ready(b): recorded on the copy stream after the last copy into b; the compute stream waits on it
    before the layer's kernel, so a kernel never reads a half-copied expert.
  * pages the buffers or a grow take may have been read by a pass still in flight (async scheduling): copies
    into them go behind the pass fence (memory/pass_fence.py).
Without CUDA the same calls run as plain synchronous copies and the events are absent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rimuru.experts.cache import ExpertCache
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.residency import load_buffer_pages
from rimuru.memory.pass_fence import PassFence


@dataclass
class LoadCounters:
    experts_loaded: int = 0  # experts copied host -> device, prefetched or on demand
    bytes_loaded: int = 0
    prefetched: int = 0  # of experts_loaded, copied ahead of their layer by the predictor
    on_demand: int = 0  # of experts_loaded, copied when the real routing asked for them
    grown: int = 0  # of experts_loaded, copied into their own pages to become resident (elastic grows)
    hits: int = 0  # routed non-resident experts found already prefetched
    misses: int = 0  # routed non-resident experts loaded on demand


@dataclass
class LoadBuffer:
    index: int
    slot_pages: list[tuple[int, int, int]]  # slot -> (p_W1, p_W3, p_W2)
    table: Tensor  # [E, 3] int32 on the device: what the kernel of `layer` reads
    host_table: Tensor  # [E, 3] int32 on the host: the same numbers, edited here then pushed
    layer: int = -1  # MoE layer whose experts the slots hold; -1 = none yet
    slot_of: dict[int, int] = field(default_factory=dict)  # expert -> slot
    consumed: bool = True  # handed to `layer`'s kernel: reusable only behind a fence
    dirty: bool = False  # host_table differs from table
    fence: torch.cuda.Event | None = None
    ready: torch.cuda.Event | None = None


class ExpertLoader:
    def __init__(self, cache: ExpertCache, store: HostExpertStore, buffer_pages: list[int],
                 fence: PassFence) -> None:
        """`buffer_pages`: 6 x slots pages for the two buffers, or none: detached (elastic mode while every expert
        is resident; `add_slots` gives them pages before an offloaded expert can be routed)."""
        if (store.num_layers, store.num_experts) != (cache.num_layers, cache.num_experts):
            raise ValueError(f"host store ({store.num_layers} x {store.num_experts}) does not match the expert "
                             f"cache ({cache.num_layers} x {cache.num_experts})")
        self.cache = cache
        self.store = store
        self.expert_view = cache.expert_view  # [n_mid, f*d]
        device = cache.tables.device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.counters = LoadCounters()
        self.fence = fence  # copies into pages that were KV or an evicted expert wait for the passes in flight
        E = cache.num_experts
        self.buffers = [LoadBuffer(index=b, slot_pages=[], host_table=torch.full((E, 3), -1, dtype=torch.int32),
                                   table=torch.full((E, 3), -1, dtype=torch.int32, device=device)) for b in range(2)]
        if buffer_pages:
            self.add_slots(buffer_pages)

    @property
    def buffer_pages(self) -> list[int]:
        return [p for buf in self.buffers for slot in buf.slot_pages for p in slot]

    @property
    def slots(self) -> int:
        """Expert slots of each buffer: the most offloaded experts of one layer the buffers can hold."""
        return len(self.buffers[0].slot_pages)

    def add_slots(self, pages: list[int]) -> None:
        """Each buffer grows by len(pages) / 6 slots (buffer b takes the b-th half, 3 pages a slot). Slots in use
        keep their experts; a pass in flight reads none of the new pages (they were free)."""
        if not pages or len(pages) % load_buffer_pages(1):
            raise ValueError(f"load buffer slots come in {load_buffer_pages(1)} pages (3 per slot, two buffers), "
                             f"got {len(pages)}")
        # the pages may have been read by a pass still in flight (an evicted expert's, freed at the end of the
        # step that launched it): copies into them go behind it
        self.fence.order_after_launched_passes(self.copy_stream)
        half = len(pages) // 2
        for b, buf in enumerate(self.buffers):
            own = pages[b * half : (b + 1) * half]
            buf.slot_pages += [(own[s], own[s + 1], own[s + 2]) for s in range(0, half, 3)]

    def detach(self) -> None:
        """Forgets the buffers' pages and what they held (their owner, the elastic core, frees them). Only while no
        pass can read them: every expert resident in the pass launched last, and nothing prefetched for the next."""
        if self.copy_stream is not None:
            # a prefetch the routing did not pick was never waited for by a kernel: the compute stream (and the
            # KV writes that may take these pages next) goes behind every copy queued into the buffers
            torch.cuda.current_stream().wait_stream(self.copy_stream)
        for buf in self.buffers:
            buf.slot_pages, buf.slot_of, buf.layer = [], {}, -1
            buf.consumed, buf.dirty, buf.fence, buf.ready = True, False, None, None
            buf.host_table.fill_(-1)

    def _copy_stream(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(self.copy_stream) if self.copy_stream is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ ordering

    def fence_consumed(self) -> None:
        """Called at every provider entry: every buffer whose kernel has been queued since the last call
        gets its fence, recorded on the compute stream right after that kernel."""
        for buf in self.buffers:
            if buf.consumed and buf.fence is None and buf.layer >= 0 and self.copy_stream is not None:
                buf.fence = torch.cuda.Event()
                buf.fence.record()

    def claim(self, layer: int) -> LoadBuffer:
        """The buffer of MoE layer `layer`: as is when it holds this layer's unconsumed prefetch, otherwise
        emptied for it (the copy stream first waits until its previous layer's kernel is done)."""
        buf = self.buffers[layer % 2]
        if buf.layer == layer and not buf.consumed:
            return buf
        if buf.fence is not None and self.copy_stream is not None:
            self.copy_stream.wait_event(buf.fence)
        buf.layer, buf.consumed, buf.fence = layer, False, None
        buf.slot_of = {}
        buf.host_table.copy_(self.cache.host_tables[layer])  # resident rows only
        buf.dirty = True
        return buf

    def wait_ready(self, buf: LoadBuffer) -> None:
        """The compute stream will not run past this point until every copy into `buf` has landed."""
        if buf.ready is not None:
            torch.cuda.current_stream().wait_event(buf.ready)

    # ------------------------------------------------------------------ copies

    def load(self, buf: LoadBuffer, experts: Iterable[int], keep: set[int], prefetch: bool) -> None:
        """Copies `experts` of `buf.layer` into free slots of `buf`; slots of experts not in `keep` are reused
        when no slot is free. Then pushes the buffer's table and records its ready event."""
        experts = [e for e in experts if e not in buf.slot_of]
        if not experts:
            return
        if not buf.slot_pages:
            raise RuntimeError(f"MoE layer {buf.layer} loads experts into detached load buffers (no pages)")
        used = set(buf.slot_of.values())
        free = [s for s in range(self.slots) if s not in used]
        if len(free) < len(experts):  # reuse slots of prefetched experts the routing did not pick
            stale = [e for e in buf.slot_of if e not in keep]
            for e in stale[: len(experts) - len(free)]:
                free.append(buf.slot_of.pop(e))
                buf.host_table[e] = -1
        if len(free) < len(experts):
            raise RuntimeError(f"MoE layer {buf.layer} needs {len(experts)} more experts in a load buffer of "
                               f"{self.slots} slots holding {len(buf.slot_of)} still needed; the buffers hold fewer "
                               "slots than the experts a layer has offloaded")
        layer_store = self.store.layers[buf.layer]  # [E, 3, f*d] host
        with self._copy_stream():
            for e, slot in zip(experts, free, strict=False):
                pages = buf.slot_pages[slot]
                for j, page in enumerate(pages):
                    self.expert_view[page].copy_(layer_store[e, j], non_blocking=True)
                buf.slot_of[e] = slot
                buf.host_table[e] = torch.tensor(pages, dtype=torch.int32)
            self._publish(buf)
        n = len(experts)
        c = self.counters
        c.experts_loaded += n
        c.bytes_loaded += n * self.store.expert_bytes
        if prefetch:
            c.prefetched += n
        else:
            c.on_demand += n

    def copy_to_pages(self, layer: int, expert: int, pages: tuple[int, int, int]) -> torch.cuda.Event | None:
        """Elastic grow: copies an expert's home copy into its newly reserved pages on the copy stream, ahead
        of any prefetch the coming forward pass queues. Returns the event that marks the copy complete (None
        on the CPU, where the copy is done on return). The caller must not publish the pages before it."""
        src = self.store.layers[layer][expert]  # [3, f*d]
        done = None
        self.fence.order_after_launched_passes(self.copy_stream)  # the pages may be read by a pass in flight
        with self._copy_stream():
            for j, page in enumerate(pages):
                self.expert_view[page].copy_(src[j], non_blocking=True)
            if self.copy_stream is not None:
                done = torch.cuda.Event()
                done.record(self.copy_stream)
        c = self.counters
        c.experts_loaded += 1
        c.bytes_loaded += self.store.expert_bytes
        c.grown += 1
        return done

    def publish(self, buf: LoadBuffer) -> None:
        """Pushes `buf`'s host table to its device table (after the copy stream's fence wait)."""
        if buf.dirty:
            with self._copy_stream():
                self._publish(buf)

    def _publish(self, buf: LoadBuffer) -> None:
        if self.copy_stream is None:
            buf.table.copy_(buf.host_table)
        else:
            # a pinned staging copy from the caching host allocator: it is not reused before this copy ends
            buf.table.copy_(buf.host_table.pin_memory(), non_blocking=True)
            buf.ready = torch.cuda.Event()
            buf.ready.record(self.copy_stream)
        buf.dirty = False


def measure_copy_bandwidth(store: HostExpertStore, device: torch.device, experts: int = 8, reps: int = 3) -> float:
    """Bytes/s of expert copies host -> device as the loader issues them (pinned source, a side stream), timed
    with CUDA events over `experts` experts of layer 0 into a scratch buffer, best of `reps`."""
    n = min(experts, store.num_experts)
    src = store.layers[0][:n]  # [n, 3, f*d]
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    stream = torch.cuda.Stream(device)
    best = float("inf")
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)  # warm-up
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    del dst
    return n * store.expert_bytes / max(best, 1e-9)
