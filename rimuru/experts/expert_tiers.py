"""Where a routed expert that is not resident on the GPU runs this step: copied to the GPU, or computed on the host.

The three tiers of an expert in one step:

    resident   its pages are in the pool (or a prefetch already brought it): the GPU computes it, nothing to choose
    copy       its weights cross PCIe into a load buffer before the layer's kernel (expert bytes / PCIe bandwidth)
    host       the host computes it from the host store for the tokens routed to it (host_compute.py), while the
               GPU computes the resident experts; only the tokens' activations cross PCIe

For one MoE layer, given the routed tokens of each candidate (routed, not resident, not prefetched), the layer
is modelled as

    time(H) = copy_s x |C - H|  +  max(overlap_s, [H non-empty] layer_fixed_s + sum over e in H of host_s(n_e) / S(|H|))

copies on demand come before the kernel; the host part runs beside the GPU's kernel (`overlap_s` of GPU work
hides it; 0 counts none hidden, the safe side) and pays, once per layer, the activations' round trip and its
syncs (`layer_fixed_s`). host_s is one expert alone on every host thread; the host computes a layer's experts
together, spread over its threads, S(m) times faster than one after another (`spread`, measured at start-up;
1 where not measured). For a given |H| the experts with the fewest tokens are the cheapest on the host, so the
best H is a prefix of the candidates sorted by tokens: every prefix is evaluated and the fastest one is taken
(the smallest on a tie). So a decode step's experts with one or two tokens go to the host, and a prefill chunk's,
routed by hundreds of tokens, are copied: at n tokens an expert's host time grows with n while its copy does not.
All costs are measured on this machine at start-up (host_profile.py, the loader's PCIe probe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from rimuru.config import CPU_EXPERT_COMPUTE, CPU_EXPERT_DIRECT_REFUSAL


@dataclass(frozen=True)
class TierCosts:
    copy_s: float  # one expert host -> device: expert bytes / measured PCIe bandwidth (0 on the CPU: no link)
    host_s: Callable[[float], float]  # one expert on the host at n routed tokens (HostExpertTimes)
    layer_fixed_s: float = 0.0  # once per layer with host work: activations device -> host -> device, two syncs
    spread: Callable[[float], float] = lambda m: 1.0  # S(m): m experts in one call, speedup (HostSpread)

    def __post_init__(self) -> None:
        if self.copy_s < 0 or self.layer_fixed_s < 0:
            raise ValueError(f"need copy_s >= 0 and layer_fixed_s >= 0, got {self.copy_s}, {self.layer_fixed_s}")


def resolve_cpu_expert_compute(setting: str, device_type: str, offload_access: str) -> bool:
    """Whether the host tier exists: `on` always, `off` never, `auto` where a GPU computes the resident experts
    (on the CPU device host and device are one memory: nothing crosses a link, so the tier saves nothing). The tier
    acts on the copy path only: with direct access the kernel reads offloaded experts from the host store itself,
    no copy waits to be saved, so `auto` resolves off there and `on` is refused."""
    if setting not in CPU_EXPERT_COMPUTE:
        raise ValueError(f"cpu_expert_compute must be one of {', '.join(CPU_EXPERT_COMPUTE)}, got {setting!r}")
    if offload_access != "copy":
        if setting == "on":
            raise ValueError(CPU_EXPERT_DIRECT_REFUSAL)
        return False
    return setting == "on" or (setting == "auto" and device_type == "cuda")


def layer_time(tokens: Sequence[int], host: int, costs: TierCosts, overlap_s: float = 0.0) -> float:
    """time(H) of the module docstring, H = the first `host` of `tokens` (routed tokens per candidate)."""
    if not 0 <= host <= len(tokens):
        raise ValueError(f"host experts must be in [0, {len(tokens)}], got {host}")
    host_part = 0.0 if host == 0 else (costs.layer_fixed_s
                                       + sum(costs.host_s(n) for n in tokens[:host]) / costs.spread(host))
    return costs.copy_s * (len(tokens) - host) + max(overlap_s, host_part)


def choose_host_experts(candidates: Sequence[tuple[int, int]], costs: TierCosts, mode: str = "auto",
                        overlap_s: float = 0.0) -> list[int]:
    """The experts of (expert, routed tokens) `candidates` that the host computes this step: every one (`on`), none
    (`off`), or the fastest prefix by tokens (`auto`, module docstring). Ascending expert ids."""
    if mode not in CPU_EXPERT_COMPUTE:
        raise ValueError(f"cpu_expert_compute must be one of {', '.join(CPU_EXPERT_COMPUTE)}, got {mode!r}")
    for e, n in candidates:
        if n < 1:
            raise ValueError(f"expert {e} is a candidate with {n} routed tokens; candidates are routed experts")
    if mode == "off" or not candidates:
        return []
    if mode == "on":
        return sorted(e for e, _ in candidates)
    ranked = sorted(candidates, key=lambda c: (c[1], c[0]))  # fewest tokens first
    tokens = [n for _, n in ranked]
    host = np.fromiter((costs.host_s(n) for n in tokens), dtype=np.float64, count=len(tokens))
    # time(prefix of h) for h = 0..m, vectorised: copies of the rest + max(overlap, fixed + host times so far)
    h = np.arange(len(tokens) + 1)
    spread = np.fromiter((costs.spread(m) for m in h[1:]), dtype=np.float64, count=len(tokens))
    host_part = np.concatenate([[0.0], costs.layer_fixed_s + np.cumsum(host) / spread])
    times = costs.copy_s * (len(tokens) - h) + np.maximum(overlap_s, host_part)
    best = int(np.argmin(times))  # the first minimum: the fewest host experts among equals
    return sorted(e for e, _ in ranked[:best])
