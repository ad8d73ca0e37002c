"""The home copy of every routed expert: host memory, pinned when a GPU will read it.

Layout: one tensor per MoE layer (the allocation chunk), experts contiguous, matrices in the same
row-major forms as the expert pages, so an expert page and its host slot are byte-identical:

    layers[l]   [E, 3, f*d]   dtype of the model
    layers[l][e, 0]  W1 (gate) [f, d]      layers[l][e, 1]  W3 (up) [f, d]      layers[l][e, 2]  W2 (down) [d, f]

Under expert parallelism a rank's store holds only its experts [first_expert, first_expert + E): slot e of a
layer is expert first_expert + e (`expert()` and `write()` take the model's expert ids).

Pinning is what lets the loader's copies run asynchronously at full PCIe speed (pageable host memory
goes through a staging buffer at a third of the bandwidth), and it is slow (~26 s for 32 GiB on the
GPU machine): it is done one layer at a time behind a progress bar. Without CUDA the store is plain
CPU memory. The store is filled by the weight loader's expert sink as each expert is read, so the
checkpoint and the store never both sit fully in host memory.
"""

from __future__ import annotations

import torch
from torch import Tensor
from tqdm import tqdm


class HostExpertStore:
    def __init__(self, num_layers: int, num_experts: int, intermediate_size: int, hidden_size: int,
                 dtype: torch.dtype, pin: bool | None = None, progress: bool = True, first_expert: int = 0) -> None:
        if min(num_layers, num_experts, intermediate_size, hidden_size) < 1:
            raise ValueError(f"host expert store needs positive sizes, got layers={num_layers} "
                             f"experts={num_experts} f={intermediate_size} d={hidden_size}")
        self.num_layers = num_layers
        self.num_experts = num_experts  # experts held per layer
        self.first_expert = first_expert  # the model's id of slot 0
        self.f, self.d = intermediate_size, hidden_size
        self.dtype = dtype
        # asked every step (bytes read and loaded): a plain int, not a tensor op (which gives the GIL away)
        self._expert_bytes = 3 * intermediate_size * hidden_size * torch.empty((), dtype=dtype).element_size()
        self.pinned = torch.cuda.is_available() if pin is None else pin
        if self.pinned and not torch.cuda.is_available():
            raise ValueError("pinned host memory needs CUDA; pass pin=False on a CPU-only machine")
        self.layers: list[Tensor] = []  # each [E, 3, f*d]
        shape = (num_experts, 3, intermediate_size * hidden_size)
        layer_bytes = num_experts * self.expert_bytes
        bar = tqdm(total=layer_bytes * num_layers, unit="B", unit_scale=True, leave=False,
                   desc="pinning host experts" if self.pinned else "host experts",
                   disable=not progress or layer_bytes * num_layers < 2**30)
        for _ in range(num_layers):
            self.layers.append(torch.empty(shape, dtype=dtype, pin_memory=self.pinned))
            bar.update(layer_bytes)
        bar.close()

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's three matrices (= 3 expert pages, unpadded)."""
        return self._expert_bytes

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_experts * self.expert_bytes

    def holds(self, expert: int) -> bool:
        return self.first_expert <= expert < self.first_expert + self.num_experts

    def slot(self, layer: int, expert: int) -> int:
        """The index of the model's `expert` in `layers[layer]`."""
        if not (0 <= layer < self.num_layers and self.holds(expert)):
            held = f"experts {self.first_expert}..{self.first_expert + self.num_experts - 1}"
            raise IndexError(f"expert {expert} of MoE layer {layer} is outside the store "
                             f"({self.num_layers} layers x {held})")
        return expert - self.first_expert

    def expert(self, layer: int, expert: int) -> Tensor:
        """[3, f*d] view of one expert's W1, W3, W2 (no copy)."""
        return self.layers[layer][self.slot(layer, expert)]

    def write(self, layer: int, expert: int, w1: Tensor, w3: Tensor, w2: Tensor) -> None:
        """The weight loader's sink: one expert's W1 [f, d], W3 [f, d], W2 [d, f], cast to the store dtype."""
        slot = self.slot(layer, expert)
        f, d = self.f, self.d
        for name, w, want in (("w1", w1, (f, d)), ("w3", w3, (f, d)), ("w2", w2, (d, f))):
            if tuple(w.shape) != want:
                raise ValueError(f"expert {expert} of MoE layer {layer}: {name} has shape {tuple(w.shape)}, "
                                 f"expected {want}")
        dst = self.layers[layer][slot]  # [3, f*d]
        with torch.no_grad():
            for j, w in enumerate((w1, w3, w2)):
                dst[j].copy_(w.reshape(-1))

    def fill_random(self, seed: int, std: float = 0.02, device: torch.device | str = "cpu") -> None:
        """Dummy weights (load_format="dummy"): N(0, std) per matrix, drawn on `device` in the order
        (layer, expert, W1/W3/W2) with one generator, exactly as ExpertCache.fill_random draws them
        into pages. So a `fixed`-mode engine holds the same random experts as a `static` one."""
        device = torch.device(device)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        staging = torch.empty(self.f * self.d, dtype=self.dtype, device=device)  # one matrix
        bar = tqdm(total=self.nbytes, unit="B", unit_scale=True, leave=False, desc="random host experts",
                   disable=self.nbytes < 2**30)
        for layer in self.layers:
            for e in range(self.num_experts):
                for j in range(3):
                    staging.normal_(0.0, std, generator=gen)
                    layer[e, j].copy_(staging)
                bar.update(self.expert_bytes)
        bar.close()
