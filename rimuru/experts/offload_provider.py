"""The expert provider of `fixed` and `elastic` mode: resident experts from their pages, the rest
from the load buffers, filled by prefetch (predictor) or on demand.

Per MoE layer l of a forward pass:

    before_layer(l, h)   predictor: scores of layer l+1's experts from h (queued on the device, no sync)
    table(l, topk_ids)   1. ONE device->host read: which experts the real routing picked (+ the scores)
                         2. routed & not resident: in the buffer already = hit, else load now = miss
                         3. the kernel of l waits for the buffer's copies; returns its table [E, 3]
                         4. prefetch layer l+1's predicted non-resident experts into the other buffer
    host_experts(l, ...) with a host tier (host_tier.py): the routed experts that step 2 left to the host (neither
                         resident nor prefetched, chosen by expert_tiers.py) start on the host; the layer joins
                         their outputs with its kernel's

The prefetch copies are issued at step 4 rather than in before_layer because the host only learns the
predicted ids at the one read of step 1 (a second sync per layer would stall the launch pipeline);
they still overlap layer l's MoE kernel and layer l+1's attention. That read makes this provider
unusable inside a CUDA graph: the engine captures piecewise graphs around it (engine/piecewise_graphs.py) and
replays this decision between the pieces.

Streaming layers (no routing read). In a large batch nearly every expert is routed to, so the read only
confirms "load them all" while the GPU idles waiting for the host. `begin_pass(num_tokens)` (once per
forward pass, before it is queued) marks a layer *streaming* when the expected number of its offloaded
experts that no token routes to is at most STREAM_MAX_UNUSED:

    sum over offloaded e of (1 - k * p[l, e]) ** T        p: the popularity estimate, k: top-k, T: tokens

A streaming layer's offloaded experts are all copied (layer 0's before the pass, layer l+1's at layer l's
boundary) and its table() returns without touching the device's routing: no host sync, so the host keeps
queueing ahead of the GPU. Loading a superset of the routed experts never changes the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from rimuru.experts.cache import ExpertCache
from rimuru.experts.host_tier import HostExpertJob, HostExpertTier
from rimuru.experts.loader import ExpertLoader, LoadBuffer, LoadCounters
from rimuru.experts.predictor import ExpertPredictor
from rimuru.experts.routing_counter import RoutingCounter

# A streaming layer may load, on average, at most this many offloaded experts that no token routes to.
STREAM_MAX_UNUSED = 0.5


class OffloadExpertProvider:
    def __init__(self, cache: ExpertCache, loader: ExpertLoader, predictor: ExpertPredictor | None,
                 top_k: int, popularity: Callable[[], np.ndarray], counter: RoutingCounter | None = None,
                 host_tier: HostExpertTier | None = None) -> None:
        self.cache = cache
        self.loader = loader
        self.expert_view = cache.expert_view  # [n_mid, f*d]
        self.predictor = predictor  # layer l+1's router applied at layer l (None: no prefetch)
        self._prediction: tuple[int, Tensor] | None = None  # (MoE layer, scores [E] on the device)
        self.counter = counter  # when set, every routing decision is counted (on the device)
        # [T] bool while a padded (CUDA-graph) batch is replayed (set by the piecewise replay): padding rows'
        # routing loads nothing
        self.row_mask: Tensor | None = None
        self.top_k = top_k
        # [L, E] routing probabilities for the streaming decision (fixed: the ranking's; elastic: the online estimate)
        self.popularity = popularity
        self.streaming = [False] * cache.num_layers  # this pass's streaming layers (begin_pass)
        self._planned: tuple[int, list[bool]] | None = None  # (num_tokens, streaming) from pass_reads_routing
        self.routing_reads = 0  # device->host routing reads (one per non-streaming layer with offloaded experts)
        self.streamed_layers = 0  # layers served without a routing read
        self.table_wait_s = 0.0  # host seconds inside table(): routing reads and on-demand copies
        self.host_tier = host_tier  # routed offloaded experts computed on the host instead of copied (None: never)
        self._host_plan: tuple[int, list[int]] | None = None  # (MoE layer, its experts the host computes)
        self._host_allowed = True  # False while a CUDA-graph replay asks: its pieces hold no host join

    def plan_streaming(self, num_tokens: int) -> tuple[list[bool], list[bool]]:
        """(streaming, offloaded) per MoE layer for a pass of `num_tokens` real tokens, from the tables as they
        are now (they do not change within a pass). Pure: nothing is copied or recorded."""
        absent = self.cache.absent_mask()  # [L, E]
        L, E = absent.shape
        probs = self.popularity()
        hit = np.clip(self.top_k * probs, 0.0, 1.0)
        unused = np.where(absent, (1.0 - hit) ** max(num_tokens, 0), 0.0).sum(axis=1)  # [L] expected
        offloaded = absent.any(axis=1)
        limit_ok = absent.sum(axis=1) <= self.loader.slots
        return ((unused <= STREAM_MAX_UNUSED) & offloaded & limit_ok).tolist(), offloaded.tolist()

    def pass_reads_routing(self, num_tokens: int) -> bool:
        """Whether a pass of `num_tokens` tokens will stop the host at some layer's routing read. The plan is kept
        for the begin_pass of that same pass (nothing changes the tables in between; a plan left over from a
        pass that was never launched can only cost loads, never correctness: a streaming layer copies whatever
        is offloaded when it runs)."""
        streaming, offloaded = self.plan_streaming(num_tokens)
        self._planned = (num_tokens, streaming)
        return any(o and not st for st, o in zip(streaming, offloaded, strict=True))

    def begin_pass(self, num_tokens: int) -> None:
        """Before a forward pass of `num_tokens` real tokens is queued: decides its streaming layers and starts
        copying layer 0's offloaded experts if it streams."""
        self.loader.fence_consumed()  # the previous pass's last buffers get their fences before any claim
        planned, self._planned = self._planned, None
        self.streaming = planned[1] if planned is not None and planned[0] == num_tokens \
            else self.plan_streaming(num_tokens)[0]
        if self.streaming and self.streaming[0]:
            self._stream_into(0, on_demand=False)

    def prefetch_next(self, moe_layer: int) -> None:
        """At layer `moe_layer`'s boundary: starts copying layer moe_layer+1's offloaded experts if it streams
        (whatever this layer did: streamed, read its routing, or was fully resident)."""
        nxt = moe_layer + 1
        if nxt < self.cache.num_layers and self.streaming[nxt]:
            self.loader.fence_consumed()  # the kernels queued since the last boundary fence their buffers
            self._stream_into(nxt, on_demand=False)

    def _stream_into(self, layer: int, on_demand: bool) -> LoadBuffer:
        """Claims `layer`'s buffer and copies every offloaded expert of the layer that it lacks."""
        buf = self.loader.claim(layer)
        absent = torch.nonzero(self.cache.host_tables[layer, :, 0] < 0).flatten().tolist()
        missing = [e for e in absent if e not in buf.slot_of]
        if on_demand:
            self.loader.counters.hits += len(absent) - len(missing)
            self.loader.counters.misses += len(missing)
        self.loader.load(buf, missing, keep=set(absent), prefetch=not on_demand)
        return buf

    def _streaming_table(self, moe_layer: int) -> tuple[Tensor, LoadBuffer]:
        loader = self.loader
        buf = self._stream_into(moe_layer, on_demand=True)
        loader.publish(buf)
        loader.wait_ready(buf)
        self.streamed_layers += 1
        self.prefetch_next(moe_layer)
        return buf.table, buf

    @property
    def counters(self) -> LoadCounters:
        return self.loader.counters

    def host_rows(self, moe_layer: int) -> Tensor | None:
        return None  # offloaded experts are copied into load buffers' pages first

    def before_layer(self, moe_layer: int, hidden: Tensor) -> None:
        self.loader.fence_consumed()
        nxt = moe_layer + 1
        if self.predictor is not None and nxt < self.cache.num_layers and not self.streaming[nxt]:
            self._prediction = (nxt, self.predictor.scores(nxt, hidden))
        else:
            self._prediction = None

    def replay_table(self, moe_layer: int, topk_ids: Tensor, prediction: tuple[int, Tensor] | None,
                     host_tier: bool = False) -> tuple[Tensor, bool]:
        """`table` for a piecewise CUDA-graph replay, with the prediction the captured piece computed; also says
        whether the host read the routing (False: the layer streamed). `host_tier`: the graph was captured with a
        host join after this layer's kernel, so the host tier may take routed experts (`host_experts` then starts
        their job); without it every routed expert goes to the GPU."""
        self._prediction = prediction
        reads = self.routing_reads
        self._host_allowed = host_tier
        try:
            return self.table(moe_layer, topk_ids), self.routing_reads > reads
        finally:
            self._prediction = None
            self._host_allowed = True

    def host_experts(self, moe_layer: int, hidden: Tensor, topk_weights: Tensor,
                     topk_ids: Tensor) -> HostExpertJob | None:
        """Starts the host work that table(moe_layer) left to the host tier (None: every routed expert is in the
        table). Called by the MoE layer right after table(), before its kernel is queued."""
        plan, self._host_plan = self._host_plan, None
        if plan is None or plan[0] != moe_layer or self.host_tier is None:
            return None
        return self.host_tier.start(moe_layer, hidden, topk_weights, topk_ids, plan[1])

    def table(self, moe_layer: int, topk_ids: Tensor) -> Tensor:
        """The expert table layer `moe_layer`'s kernel reads: the resident one, or a load buffer's holding the routed
        offloaded experts. A buffer is marked consumed only here, after every other decision of the call: its
        kernel is queued once this returns, so a fence recorded during the call (`fence_consumed`, e.g. when the
        next layer streams) must not count as one recorded after that kernel; the next entry records it."""
        t0 = time.perf_counter()
        try:
            table, handed = self._table(moe_layer, topk_ids)
            if handed is not None:
                handed.consumed = True
            return table
        finally:
            self.table_wait_s += time.perf_counter() - t0

    def _table(self, moe_layer: int, topk_ids: Tensor) -> tuple[Tensor, LoadBuffer | None]:
        """(table, the load buffer handed to the kernel or None) for `table`."""
        loader, E = self.loader, self.cache.num_experts
        self._host_plan = None
        if not 0 <= moe_layer < self.cache.num_layers:
            raise IndexError(f"MoE layer {moe_layer} is outside [0, {self.cache.num_layers})")
        if self.counter is not None:
            self.counter.record(moe_layer, topk_ids)
        loader.fence_consumed()
        if self.streaming[moe_layer]:
            self._prediction = None
            return self._streaming_table(moe_layer)
        if not bool((self.cache.host_tables[moe_layer, :, 0] < 0).any()):
            # every expert of the layer is resident: nothing to decide, no read (as the piecewise replay does;
            # a prediction for the next layer is dropped rather than paid for with a sync)
            self._prediction = None
            self.prefetch_next(moe_layer)
            return self.cache.tables[moe_layer], None
        flat = topk_ids.reshape(-1).long()
        flat = torch.where((flat >= 0) & (flat < E), flat, E)  # out-of-range ids counted in bin E
        if self.row_mask is None:
            counts = torch.bincount(flat, minlength=E + 1).float()  # [E + 1]
        else:
            mask = self.row_mask[:, None].expand(topk_ids.shape).reshape(-1).to(torch.float32)
            counts = torch.bincount(flat, weights=mask, minlength=E + 1)  # [E + 1]
        pred, self._prediction = self._prediction, None
        if pred is not None and pred[0] != moe_layer + 1:
            pred = None
        both = counts if pred is None else torch.cat([counts, pred[1]])  # [E + 1 (+ E)]
        host = both.cpu()  # the one device->host sync of this layer
        self.routing_reads += 1
        if host[E] > 0:
            raise ValueError(f"routed expert ids of MoE layer {moe_layer} must be in [0, {E})")
        absent = self.cache.host_tables[moe_layer, :, 0] < 0  # [E] not resident
        needed = torch.nonzero((host[:E] > 0) & absent).flatten().tolist()

        buf = loader.claim(moe_layer)
        if self.host_tier is not None and self._host_allowed:
            # the third tier: of the routed experts a copy would bring, those the host computes for their tokens
            # (prefetched ones are on the GPU already); their table rows stay -1
            on_host = self.host_tier.choose([e for e in needed if e not in buf.slot_of], host[:E])
            if on_host:
                self._host_plan = (moe_layer, on_host)
                skip = set(on_host)
                needed = [e for e in needed if e not in skip]
        hits = sum(1 for e in needed if e in buf.slot_of)
        loader.counters.hits += hits
        loader.counters.misses += len(needed) - hits
        loader.load(buf, needed, keep=set(needed), prefetch=False)
        if needed:
            loader.publish(buf)
            loader.wait_ready(buf)
            table = buf.table
        else:
            table = self.cache.tables[moe_layer]  # every routed expert is resident

        if pred is not None and loader.slots > 0 and not self.streaming[moe_layer + 1]:
            scores = host[E + 1 :]
            cand = torch.nonzero((scores > 0) & self.cache.host_tables[moe_layer + 1, :, 0].lt(0)).flatten()
            order = torch.argsort(scores[cand], descending=True, stable=True)
            picked = cand[order][: loader.slots].tolist()
            if picked and self.host_tier is not None and self._host_allowed:
                # no copy ahead for an expert the host tier would compute for its tokens: a token's top-k
                # probabilities sum to at most 1, so score x top_k estimates the tokens that pick the expert
                guess = {e: max(1, round(float(scores[e]) * self.top_k)) for e in picked}
                on_host = set(self.host_tier.choose(picked, guess))
                picked = [e for e in picked if e not in on_host]
            if picked:
                nxt = loader.claim(moe_layer + 1)
                loader.load(nxt, picked, keep=set(), prefetch=True)
        self.prefetch_next(moe_layer)
        return table, buf  # [E, 3]; buf: claimed for this layer, consumed once the call returns
