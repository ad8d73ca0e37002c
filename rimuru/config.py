"""Engine settings: one frozen dataclass with vLLM's names, and its command-line form.

`LLM(...)`, `rimuru generate` and `rimuru serve` all build an `EngineConfig`; the flags are the
field names in kebab case (`--gpu-memory-budget 32GiB`, `--offload-mode elastic`).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}

OFFLOAD_MODES = ("static", "fixed", "elastic")
ADJUSTERS = ("paper", "cost")  # elastic mode: the paper's threshold rules | the cost-aware adjuster
# how a pass reaches an offloaded expert: read by the MoE kernel from pinned host memory over PCIe | copied first
OFFLOAD_ACCESS = ("direct", "copy")
# fixed and elastic mode with copy access: routed offloaded experts computed on the host for their few tokens
# instead of copied (experts/expert_tiers.py): auto (by measured costs, where a GPU computes the rest; off under
# direct access) | off | on (every one it can; copy access only)
CPU_EXPERT_COMPUTE = ("auto", "off", "on")
# why cpu_expert_compute='on' and direct access do not go together
CPU_EXPERT_DIRECT_REFUSAL = (
    "cpu_expert_compute='on' computes offloaded experts on the host instead of copying them, and "
    "offload_access='direct' copies none (the MoE kernel reads them from the pinned host store): use "
    "--offload-access copy with --cpu-expert-compute on, or leave --cpu-expert-compute at auto (off under direct "
    "access)")


def parse_bytes(value: int | float | str) -> int:
    """`32GiB`, `32 GB`, `1.5GiB`, `1048576` -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, int | float):
        if value <= 0:
            raise ValueError(f"a byte size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {value!r} (use e.g. 32GiB, 500MB or a number of bytes)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"a byte size must be positive, got {value!r}")
    return n


def _is_float(text: str) -> bool:
    try:
        return float(text) >= 0
    except ValueError:
        return False


def format_bytes(n: int | float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# what expert parallelism runs in: each rank's pool holds its own experts for good (static), or keeps the first K of
# them and the kernel reads the rest from the rank's own host store (fixed, direct); nothing moves between ranks
EXPERT_PARALLEL_MODES = "runs in offload_mode='static', or 'fixed' with offload_access='direct'"


def expert_parallel_supported(offload_mode: str | None, offload_access: str) -> bool:
    return offload_mode in (None, "static") or offload_mode == "fixed" and offload_access == "direct"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tokenizer: str | None = None  # default: the model directory
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32 (auto: the config's dtype on GPU, float32 on CPU)
    gpu_memory_budget: int | str | None = None  # bytes the engine may use in all; default: 90 % of the GPU
    gpu_memory_utilization: float | None = None  # vLLM's flag: the same budget as a share of the GPU's memory
    # the page pool's bytes, given instead of a budget (vLLM's kv_cache_memory_bytes): the engine then holds the
    # non-expert weights, the workspace it measures and exactly this pool
    page_pool_memory_bytes: int | str | None = None
    offload_mode: str | None = None  # static | fixed | elastic; default static
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0
    enforce_eager: bool = False
    # the most rows (tokens of a step) a CUDA graph is captured for; larger steps run eagerly (vLLM's flag; its
    # default is min(2 max_num_seqs, 512)). None: every step up to max_num_batched_tokens (at most 8192) replays
    # a graph. The graphs' memory pool grows with it (engine/cuda_graphs.py).
    max_cudagraph_capture_size: int | None = None
    # schedule and launch step n+1 before step n's tokens are read (engine/llm_engine.py); None: on on a GPU
    async_scheduling: bool | None = None
    # keep finished requests' full KV blocks for later requests with the same prefix (engine/prefix_cache.py)
    enable_prefix_caching: bool = True
    resident_experts: float | None = None  # fixed mode: experts per layer (>= 1) or a fraction (< 1)
    expert_offload_limit: int | None = None  # the most experts one layer may have offloaded
    # fixed and elastic mode: how a pass reaches an offloaded expert. direct: the MoE kernel reads it from the pinned
    # host store over PCIe (no copy, no host decision, whole CUDA graphs); copy: copied into a load buffer first,
    # for the layers the routing picks (piecewise graphs)
    offload_access: str = "direct"
    expert_ranking: str | None = None  # JSON file from `rimuru profile`
    tensor_parallel_size: int = 1
    # routed experts whole on the ranks, E/N of each layer per rank, instead of cut along f (vLLM's flag; static mode,
    # or fixed with direct access; attention and the dense / shared MLPs stay tensor-parallel): parallel_state.py
    enable_expert_parallel: bool = False
    # load_format="dummy" only: "uniform" (random routers) or "zipf:S" — a seeded power-law expert popularity
    # (exponent S, a random expert order per layer) added to the routers as log-probability biases
    dummy_routing: str | None = None
    adjuster: str = "cost"  # elastic mode: cost | paper
    # elastic mode's latency targets (cost adjuster), in the terms the serving benchmarks judge by. TPOT: no split
    # whose modelled decode step exceeds it; TTFT: while the head of the queue has waited a quarter of it, evict
    # for the waiting requests beyond the throughput-best split (within the TPOT target). None: throughput alone.
    slo_ttft_p99_ms: float | None = None
    slo_tpot_p99_ms: float | None = None
    # the most top logprobs a request may ask for per token (vLLM's flag; -1: the whole vocabulary)
    max_logprobs: int = 20
    # fixed and elastic mode with offload_access="copy": compute routed offloaded experts on the host for the few
    # tokens routed to them, where that beats copying them (auto: by the costs measured at start-up, on a GPU; on:
    # every routed offloaded expert neither resident nor prefetched; off: copy them all). Under direct access the
    # kernel reads offloaded experts itself and nothing is copied: auto resolves off, on is refused.
    cpu_expert_compute: str = "auto"
    cpu_expert_threads: int | None = None  # the host compute's threads (torch intra-op); None: torch's default

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cuda", "cpu") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.offload_mode is not None and self.offload_mode not in OFFLOAD_MODES:
            raise ValueError(f"offload_mode must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload_mode!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size < 1:
            raise ValueError(f"max_cudagraph_capture_size must be at least 1, got {self.max_cudagraph_capture_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.dummy_routing is not None:
            kind, _, exponent = self.dummy_routing.partition(":")
            if kind not in ("uniform", "zipf") or (kind == "zipf" and not _is_float(exponent)):
                raise ValueError(f"dummy_routing must be 'uniform' or 'zipf:S' (S a number >= 0), "
                                 f"got {self.dummy_routing!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.gpu_memory_budget is not None:
            parse_bytes(self.gpu_memory_budget)
        if self.gpu_memory_utilization is not None:
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if self.gpu_memory_budget is not None:
                raise ValueError("give gpu_memory_budget or gpu_memory_utilization, not both (the same budget in "
                                 "bytes or as a share of the GPU's memory)")
        if self.page_pool_memory_bytes is not None:
            if parse_bytes(self.page_pool_memory_bytes) <= 0:
                raise ValueError(f"page_pool_memory_bytes must be positive, got {self.page_pool_memory_bytes}")
            if self.gpu_memory_budget is not None or self.gpu_memory_utilization is not None:
                raise ValueError("give page_pool_memory_bytes or a budget (gpu_memory_budget, "
                                 "gpu_memory_utilization), not both: the pool's size replaces the budget")
        if self.resident_experts is not None and self.resident_experts <= 0:
            raise ValueError(f"resident_experts must be positive, got {self.resident_experts}")
        if self.expert_offload_limit is not None and self.expert_offload_limit < 0:
            raise ValueError(f"expert_offload_limit must be >= 0, got {self.expert_offload_limit}")
        if self.offload_access not in OFFLOAD_ACCESS:
            raise ValueError(f"offload_access must be one of {', '.join(OFFLOAD_ACCESS)}, got {self.offload_access!r}")
        if self.adjuster not in ADJUSTERS:
            raise ValueError(f"adjuster must be one of {', '.join(ADJUSTERS)}, got {self.adjuster!r}")
        if self.cpu_expert_compute not in CPU_EXPERT_COMPUTE:
            raise ValueError(f"cpu_expert_compute must be one of {', '.join(CPU_EXPERT_COMPUTE)}, "
                             f"got {self.cpu_expert_compute!r}")
        if self.enable_expert_parallel and not expert_parallel_supported(self.offload_mode, self.offload_access):
            raise ValueError(f"enable_expert_parallel {EXPERT_PARALLEL_MODES} (got {self.offload_mode!r} with "
                             f"{self.offload_access!r}): elastic mode and copies under expert parallelism are not "
                             "built yet")
        if self.cpu_expert_compute == "on" and self.offload_mode == "static":
            raise ValueError("cpu_expert_compute='on' computes offloaded experts on the host, and "
                             "offload_mode='static' offloads none: use --offload-mode fixed or elastic")
        if self.cpu_expert_compute == "on" and self.offload_access == "direct":
            raise ValueError(CPU_EXPERT_DIRECT_REFUSAL)
        if self.cpu_expert_threads is not None and self.cpu_expert_threads < 1:
            raise ValueError(f"cpu_expert_threads must be at least 1, got {self.cpu_expert_threads}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (the whole vocabulary) or at least 0, got {self.max_logprobs}")
        for name in ("slo_ttft_p99_ms", "slo_tpot_p99_ms"):
            value = getattr(self, name)
            if value is None:
                continue
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
            if self.offload_mode != "elastic" or self.adjuster != "cost":
                raise ValueError(f"{name} steers elastic mode's cost adjuster: it needs --offload-mode elastic and "
                                 f"--adjuster cost (got offload_mode={self.offload_mode!r}, "
                                 f"adjuster={self.adjuster!r})")

    @property
    def budget_bytes(self) -> int | None:
        return None if self.gpu_memory_budget is None else parse_bytes(self.gpu_memory_budget)

    @property
    def pool_bytes(self) -> int | None:
        return None if self.page_pool_memory_bytes is None else parse_bytes(self.page_pool_memory_bytes)

    def with_(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of parsed command-line flags; a value the config refuses ends the command with its message
        (a user's mistake, no traceback)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        try:
            return cls(**values)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None


_FLAG_HELP = {
    "tokenizer": "tokenizer directory (default: the model directory)",
    "device": "auto | cuda | cpu",
    "dtype": "auto | bfloat16 | float16 | float32",
    "gpu_memory_budget": "bytes the engine may use on the device in all, e.g. 32GiB (default: 90%% of the GPU)",
    "gpu_memory_utilization": "the same budget as vLLM's share of the GPU's memory, e.g. 0.229 (default 0.9)",
    "page_pool_memory_bytes": "the page pool's size, e.g. 20GiB, instead of a budget (vLLM's "
                              "--kv-cache-memory-bytes): the engine takes the non-expert weights, its measured "
                              "workspace and exactly this pool",
    "offload_mode": "static (all experts resident) | fixed | elastic",
    "load_format": "auto | safetensors | dummy (random weights of the real shapes)",
    "resident_experts": "fixed mode: resident experts per layer (>= 1) or a fraction (< 1)",
    "expert_offload_limit": "the most experts one layer may have offloaded (fixed: E - resident; elastic: E/6, raised "
                            "until the pool can start)",
    "offload_access": "fixed and elastic mode: direct (the MoE kernel reads offloaded experts from pinned host memory; "
                      "default) | copy (copied to load buffers first)",
    "expert_ranking": "expert popularity JSON written by `rimuru profile`",
    "enforce_eager": "never capture CUDA graphs",
    "enable_expert_parallel": "with --tensor-parallel-size N: each rank holds E/N whole routed experts of every layer "
                              "instead of a 1/N slice of every expert (static mode, or fixed with direct access)",
    "max_cudagraph_capture_size": "the largest step (tokens) replayed from a CUDA graph; larger steps run eagerly "
                                  "(default: max_num_batched_tokens, at most 8192)",
    "async_scheduling": "launch step n+1 before reading step n's tokens (default: on on a GPU)",
    "enable_prefix_caching": "reuse the KV cache of prompt prefixes seen before (default: on)",
    "dummy_routing": "dummy weights only: uniform | zipf:S (a seeded power-law expert popularity)",
    "adjuster": "elastic mode: cost (offload only what PCIe can pay for; default) | paper (the paper's thresholds)",
    "slo_ttft_p99_ms": "elastic mode: TTFT target in ms; while the oldest waiting request has waited a quarter of it, "
                       "experts make room for the queue beyond the throughput-best split (default: none)",
    "slo_tpot_p99_ms": "elastic mode: TPOT target in ms; no split whose modelled decode step exceeds it (default: "
                       "none: offload only what costs no throughput)",
    "max_logprobs": "the most top logprobs a request may ask for per generated token (-1: the whole vocabulary; "
                    "default 20)",
    "cpu_expert_compute": "fixed/elastic mode with --offload-access copy: compute offloaded experts on the host (CPU) "
                          "for the few tokens routed to them instead of copying them over PCIe: auto (where the "
                          "costs measured at start-up say so; on a GPU; off under direct access; default) | off | "
                          "on (copy access only)",
    "cpu_expert_threads": "threads of the host expert compute (default: torch's, one per core)",
}

_FLAG_TYPES: dict[str, Any] = {
    "tokenizer": str, "device": str, "dtype": str, "gpu_memory_budget": str, "gpu_memory_utilization": float,
    "page_pool_memory_bytes": str, "offload_mode": str,
    "max_num_seqs": int, "max_model_len": int, "max_num_batched_tokens": int, "block_size": int,
    "max_cudagraph_capture_size": int,
    "load_format": str, "seed": int, "resident_experts": float, "expert_offload_limit": int, "offload_access": str,
    "expert_ranking": str, "tensor_parallel_size": int, "dummy_routing": str, "adjuster": str,
    "slo_ttft_p99_ms": float, "slo_tpot_p99_ms": float, "max_logprobs": int, "cpu_expert_compute": str,
    "cpu_expert_threads": int,
}
_FLAG_CHOICES: dict[str, tuple[str, ...]] = {"cpu_expert_compute": CPU_EXPERT_COMPUTE}


def add_engine_args(parser: argparse.ArgumentParser, *, with_model: bool = True) -> argparse.ArgumentParser:
    """Adds every EngineConfig field as a kebab-case flag (`model` as the positional argument)."""
    for f in fields(EngineConfig):
        if f.name == "model":
            if with_model:
                parser.add_argument("model", help="model directory (config.json + safetensors + tokenizer)")
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("enforce_eager", "enable_expert_parallel"):
            parser.add_argument(flag, action="store_true", help=_FLAG_HELP[f.name])
            continue
        if f.name in ("async_scheduling", "enable_prefix_caching"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                help=_FLAG_HELP[f.name])
            continue
        default = None if f.default is MISSING else f.default
        parser.add_argument(flag, type=_FLAG_TYPES[f.name], default=default, help=_FLAG_HELP.get(f.name),
                            choices=_FLAG_CHOICES.get(f.name))
    add_renamed_flags(parser)
    return parser


# flags that were renamed -> (the new name, why): given the old name, the parser stops with a message naming the new
RENAMED_FLAGS = {"--tpot-slo-ms": ("--slo-tpot-p99-ms", "the same per-step target, named as the TPOT p99 serving "
                                                         "is judged by")}


def add_renamed_flags(parser: argparse.ArgumentParser) -> None:
    """Every renamed flag, hidden from --help; given, it stops the parser with a message naming its new name."""
    for old, (new, why) in RENAMED_FLAGS.items():
        parser.add_argument(old, action=_RenamedFlag, message=f"{old} was renamed {new} ({why})",
                            help=argparse.SUPPRESS)


class _RenamedFlag(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, message: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "?")
        super().__init__(option_strings, dest=argparse.SUPPRESS, **kwargs)
        self.message = message

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(self.message)
