"""The recurrent and conv state of every linear-attention layer, per request, as plain tensors.

    conv       [L_lin, N, conv_dim, K-1]  model dtype   the last K-1 pre-conv inputs (GatedDeltaNet)
    recurrent  [L_lin, N, Hv, dk, dv]     fp32          the delta rule's state S
    slots      [B] int64                                batch sequence b owns state slot slots[b]

L_lin counts linear-attention layers (indexed by their ordinal among them, as attention layers index
block tables), N is the number of request slots. A pass gathers its sequences' states by `slots`, runs,
and scatters the final states back to the same slots; a sequence with no context before this pass starts
from zero (selected inside GatedDeltaNet), so a slot's previous contents never matter.

This is the stand-in that lets the model run and be tested with state carried across prefill chunks and
decode steps. The pool integration replaces it: the state then lives in SSM and conv pages of the one page
pool, `slots` become per-request page ids in the ForwardBatch, and the engine allocates and frees them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rimuru.model_spec import ModelSpec


@dataclass
class LinearAttentionState:
    conv: Tensor  # [L_lin, N, conv_dim, K-1] model dtype
    recurrent: Tensor  # [L_lin, N, Hv, dk, dv] fp32
    slots: Tensor  # [B] int64: the state slot of each sequence of the pass

    @classmethod
    def allocate(
        cls, spec: ModelSpec, num_slots: int, dtype: torch.dtype, device: torch.device | str = "cpu",
        fill: float | None = None,
    ) -> LinearAttentionState:  # fmt: skip
        """Storage for `num_slots` requests; uninitialised (or `fill`ed, e.g. NaN to prove it is never read)."""
        L = len(spec.linear_layer_ids)
        conv_shape = (L, num_slots, spec.linear_conv_dim, spec.linear_conv_kernel_dim - 1)
        rec_shape = (L, num_slots, spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim)
        conv = torch.empty(conv_shape, dtype=dtype, device=device)
        recurrent = torch.empty(rec_shape, dtype=torch.float32, device=device)  # fp32 even in a bf16 model
        if fill is not None:
            conv.fill_(fill)
            recurrent.fill_(fill)
        return cls(conv, recurrent, torch.zeros(0, dtype=torch.int64, device=device))

    def for_batch(self, slots: Sequence[int] | Tensor) -> LinearAttentionState:
        """The same storage with `slots` [B] naming the state slot of each sequence of the next pass."""
        ids = torch.as_tensor(slots, dtype=torch.int64, device=self.conv.device).reshape(-1)
        return dataclasses.replace(self, slots=ids)

    def read(self, linear_idx: int) -> tuple[Tensor, Tensor]:
        """This pass's (conv [B, conv_dim, K-1], recurrent [B, Hv, dk, dv]) of one layer: gathered copies."""
        return self.conv[linear_idx, self.slots], self.recurrent[linear_idx, self.slots]

    def write(self, linear_idx: int, conv: Tensor, recurrent: Tensor) -> None:
        """Store one layer's final states [B, ...] of this pass at the sequences' slots."""
        self.conv[linear_idx].index_copy_(0, self.slots, conv.to(self.conv.dtype))
        self.recurrent[linear_idx].index_copy_(0, self.slots, recurrent.float())
