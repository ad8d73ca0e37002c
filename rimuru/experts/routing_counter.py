"""Routing counts on the device: how many (token, expert) assignments each MoE layer gave each expert.

    counts [L_moe, E] float32 on the model's device
    record(l, topk_ids)     counts[l][e] += number of times e appears in topk_ids   (no host sync)
    snapshot_and_reset()    copies counts to the host and zeroes them                (one sync; rare)
    snapshot_and_reset_async()  the same without a host wait, into one of HOST_BUFFERS pinned host buffers (every
                            step)

`record` is a single `scatter_add_` of a stride-0 view of one constant `1.0` into a fixed-size row,
so it allocates nothing, never reads a value back and has no data-dependent shape (`torch.bincount`
would: its output length depends on the largest id). It can therefore run inside a captured CUDA graph,
provided the graph was captured with this counter attached (a graph replays the tensors it recorded).
Padded rows of a CUDA graph's batch route too: the graph sets `row_mask` ([T] bool, True = a real token) for
the duration of its forward pass, and `record` then counts real rows only. The mask's weights per assignment
([T * k] float32: 1 for a real row's picks, 0 for padding's) are built by the pass's first `record` and reused by
every later layer, so a counted layer costs one kernel (the scatter) in the pass, not three.

Counts are exact while every entry stays below 2**24 (float32 integers); callers that count for long
take `snapshot_and_reset()` at least every `exact_limit // assignments_per_step` steps and sum on the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

EXACT_LIMIT = 2**24  # float32 represents every integer up to this exactly
# snapshot_and_reset_async's pinned buffers, taken in turn: a snapshot stays intact for HOST_BUFFERS - 1 more calls
# (the elastic runtime reads a pass's counts up to two steps after it was launched)
HOST_BUFFERS = 3


class RoutingCounter:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"a routing counter needs >= 1 layer and >= 1 expert, got {num_layers} x {num_experts}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=device)  # [L_moe, E]
        self._one = torch.ones(1, dtype=torch.float32, device=device)  # expanded, never materialised
        self._row_mask: Tensor | None = None  # [T] bool while a padded (CUDA-graph) batch runs, else None
        # the mask's weights per assignment, built by the first record() after the mask was set: (topk shape, [T*k])
        self._mask_weights: tuple[torch.Size, Tensor] | None = None
        # snapshot_and_reset_async's pinned host buffers and their copies' events, used in turn (made on first use)
        self._host_buffers: list[tuple[Tensor, torch.cuda.Event]] = []
        self._next_buffer = 0

    @property
    def device(self) -> torch.device:
        return self.counts.device

    @property
    def row_mask(self) -> Tensor | None:
        return self._row_mask

    @row_mask.setter
    def row_mask(self, mask: Tensor | None) -> None:
        self._row_mask = mask
        self._mask_weights = None  # weights of another mask (or of none)

    def record(self, moe_layer: int, topk_ids: Tensor) -> None:
        """Adds one count per entry of `topk_ids` [T, k] (expert ids in [0, E)) to row `moe_layer`.

        Ids are not range-checked (that would need a host read); out-of-range ids raise on the CPU and
        trip a device-side assert on CUDA."""
        flat = topk_ids.reshape(-1)
        if flat.dtype != torch.int64:
            flat = flat.long()
        if self._row_mask is None:
            src = self._one.expand(flat.numel())
        else:  # padding rows add 0
            src = self._weights_of_mask(topk_ids.shape)
        self.counts[moe_layer].scatter_add_(0, flat, src)

    def _weights_of_mask(self, shape: torch.Size) -> Tensor:
        """[T * k] float32: 1 where the assignment's row is real, 0 for padding (every layer of a pass routes the
        same [T, k] rows, so the first layer's weights serve the rest; inside a capture they are a graph tensor)."""
        cached = self._mask_weights
        if cached is None or cached[0] != shape:
            assert self._row_mask is not None
            weights = self._row_mask[:, None].expand(shape).reshape(-1).to(torch.float32)
            self._mask_weights = cached = (shape, weights)
        return cached[1]

    def snapshot_and_reset_async(self) -> tuple[Tensor, torch.cuda.Event | None]:
        """Starts copying the counts so far to the host (pinned, non-blocking) and zeroes the device counts,
        both in the compute stream's order. Returns (host tensor, event): read the tensor after
        `event.synchronize()` (no event on the CPU: it is ready). For loops that must not wait for the GPU.

        The host tensor is one of HOST_BUFFERS pinned buffers taken in turn (no allocation per step): it holds this
        snapshot until the HOST_BUFFERS-th call after this one overwrites it, so read it before that."""
        if self.counts.device.type != "cuda":
            return self.snapshot_and_reset(), None
        if len(self._host_buffers) < HOST_BUFFERS:
            host = torch.empty(self.counts.shape, dtype=self.counts.dtype, pin_memory=True)
            self._host_buffers.append((host, torch.cuda.Event()))
        host, done = self._host_buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % HOST_BUFFERS
        # the buffer's last snapshot was read (the rule above), and its copy was awaited then: it is free to refill
        host.copy_(self.counts, non_blocking=True)
        done.record()
        self.counts.zero_()
        return host, done

    def snapshot_and_reset(self) -> Tensor:
        """The counts so far as a host float32 tensor [L_moe, E]; the device counts restart from zero."""
        host = self.counts.to("cpu", copy=True)
        self.counts.zero_()
        return host
