"""Start-up: from an EngineConfig to a model whose routed experts and KV cache live in one page pool.

The engine (engine/llm_engine.py) calls these in order:
    resolve_device / resolve_dtype / load_tokenizer
    build_model (models/registry.py): non-expert weights on the device, no pool yet
    measure the workspace (engine/workspace_profile.py: the model's largest step and its CUDA graphs over a
                    one-page scratch pool; on the CPU, workspace_bytes' bound)
    plan_memory     budget = non-expert weights (normal tensors, never move)
                           + activation workspace (as measured)
                           + pool (whole huge pages: routed experts + KV cache)
                    and the offload mode when none was given
    the pool; the model bound to its KV view; the expert runtime of the mode (experts/runtime_builders.py),
                    which attaches its provider to the model
    load_weights    non-expert weights into the model, routed experts through the runtime
    resolve_max_model_len
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from rimuru.config import EngineConfig, format_bytes
from rimuru.engine.sampler import SAMPLE_ROWS_PER_CHUNK, SAMPLER_BYTES_PER_ENTRY
from rimuru.experts.popularity import ExpertPopularity
from rimuru.experts.runtime import ExpertRuntime
from rimuru.memory.geometry import PageGeometry
from rimuru.model_spec import ModelSpec, dtype_bytes
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.dummy_routing import set_dummy_routing
from rimuru.models.loader import init_dummy_weights, load_checkpoint

_Built = TypeVar("_Built")


def start_or_exit(start: Callable[[], _Built]) -> _Built:
    """For the command line: a start-up the settings make impossible (ValueError: a budget too small for the
    weights, a length the model cannot serve, ...) ends the command with its message instead of a traceback."""
    try:
        return start()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

logger = logging.getLogger("rimuru")

# The fixed scratch of the analytic workspace bound on the CPU (host memory: nothing there is measured); on a GPU
# the workspace is measured before the pool is sized (engine/workspace_profile.py).
CPU_WORKSPACE_SCRATCH = 16 * 2**20

# With no offload mode given, static mode is picked when every routed expert fits and leaves at least this share of
# the pool to KV cache; elastic otherwise.
STATIC_KV_SHARE = 0.10

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class MemoryPlan:
    """How the budget is split before anything is allocated."""

    budget: int
    non_expert_weights: int
    workspace: int
    pool_bytes: int  # asked for; the pool takes whole huge pages of it
    mode: str  # the offload mode in force


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in bf16 are slow and lose precision; run CPU models in fp32
    dtype = _DTYPES.get(str(spec.torch_dtype), torch.bfloat16)
    return torch.bfloat16 if dtype == torch.float32 else dtype


def load_tokenizer(path: str | None) -> Any:
    if path is None:
        return None
    files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((Path(path) / f).exists() for f in files):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def workspace_bytes(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, scratch: int) -> int:
    """An upper bound of the activations of one forward pass and its sampling at the batch limits, for where
    nothing can be measured (the CPU; the simulator's modelled GPU, whose hardware profile gives `scratch`).

    Per token: hidden states and residual, q/k/v/o, the MLP intermediates (routed: top-k copies of
    2f; shared expert: 2 * its width), the router logits, and for a hybrid model one gated DeltaNet layer's
    chunk-form intermediates. Per sampled sequence: the lm-head output (dtype)
    and the float32 logits; plus one sampler chunk's working copies (engine/sampler.py samples
    SAMPLE_ROWS_PER_CHUNK rows at a time; a chunk's penalty counts are built inside them, engine/penalties.py); a
    hybrid model's states of one layer, three copies per sequence.
    Plus `scratch`: what does not shrink with the step (kernel scratch,
    library workspaces, graph pools, fragmentation).
    """
    T, S = config.max_num_batched_tokens, config.max_num_seqs
    d, el = spec.hidden_size, dtype_bytes(dtype)
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.head_dim
    mlp = max(spec.num_experts_per_tok * 3 * spec.moe_intermediate_size,
              3 * spec.shared_expert_intermediate_size, 3 * spec.intermediate_size)
    per_token = (6 * d + 2 * qkv + mlp + spec.num_experts) * el + spec.num_experts_per_tok * 16
    if spec.is_hybrid:  # gated DeltaNet, chunk form: its projections, fp32 q/k/v, and four [Hv, C, C] fp32 blocks
        hv, c = spec.linear_num_value_heads, 64
        per_token += (2 * spec.linear_conv_dim + 2 * spec.linear_value_dim) * el
        per_token += 4 * (2 * hv * spec.linear_key_head_dim + 2 * spec.linear_value_dim + 4 * hv * c)
    logits = S * spec.vocab_size * (el + 4) + min(S, SAMPLE_ROWS_PER_CHUNK) * spec.vocab_size * SAMPLER_BYTES_PER_ENTRY
    # hybrid models: one layer's states of every sequence, gathered, selected and final (models/state_cache.py)
    states = 3 * S * spec.state_bytes_per_request(dtype) // max(1, len(spec.linear_layer_ids))
    return T * per_token + logits + states + scratch


DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of the GPU's memory


def resolve_budget(config: EngineConfig, device: torch.device, spec: ModelSpec, dtype: torch.dtype, work: int) -> int:
    """Bytes the engine may use: gpu_memory_budget, else gpu_memory_utilization (vLLM's flag: a share of the GPU's
    memory, default 0.9). On the CPU the default is every weight plus room for 64k tokens of KV cache."""
    if config.budget_bytes is not None:
        if device.type == "cpu":
            return _cpu_budget(config, spec, dtype, work, config.budget_bytes)
        return config.budget_bytes
    if device.type == "cuda":
        share = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        return int(torch.cuda.get_device_properties(device).total_memory * share)
    if config.gpu_memory_utilization is not None:
        raise ValueError("gpu_memory_utilization is a share of a GPU's memory and this engine runs on the CPU: "
                         "give gpu_memory_budget (bytes) instead")
    weights = spec.non_expert_bytes(dtype) + spec.routed_expert_bytes(dtype)
    return _cpu_budget(config, spec, dtype, work, weights + work + 65536 * spec.kv_bytes_per_token(dtype))


def _cpu_budget(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, work: int, asked: int) -> int:
    """On the CPU the pool is host memory: a budget sized for a GPU (32 GiB for a 3 MB model) is capped at what the
    model can use (every weight, the workspace, KV and a hybrid model's state for max_num_seqs sequences of the
    longest context), and one the
    machine's memory cannot hold is refused."""
    context = config.max_model_len or spec.max_position_embeddings
    need = (spec.non_expert_bytes(dtype) + spec.routed_expert_bytes(dtype) + work
            + config.max_num_seqs * (context * spec.kv_bytes_per_token(dtype) + spec.state_bytes_per_request(dtype)))
    budget = min(asked, need)
    if budget < asked and config.budget_bytes is not None:
        logger.info("on the CPU the budget %s is capped at what the model can use: %s", format_bytes(asked),
                    format_bytes(budget))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if budget > host:
        what = (f"gpu_memory_budget {format_bytes(budget)} is" if config.budget_bytes is not None else
                f"on the CPU this model needs {format_bytes(budget)} (its weights in float32, the workspace and KV "
                "cache), which is")
        raise ValueError(f"{what} more than this machine's memory ({format_bytes(host)}); on the CPU the pool is "
                         "host memory: give a smaller budget, or run on a GPU")
    return budget


def resolve_load_format(config: EngineConfig) -> str:
    load_format = config.load_format
    if load_format == "auto":
        is_dir = os.path.isdir(config.model)
        load_format = "safetensors" if is_dir and any(Path(config.model).glob("*.safetensors")) else "dummy"
        if load_format == "dummy":
            logger.warning("no safetensors in %s: using random weights (load_format='dummy')", config.model)
    if config.dummy_routing is not None and load_format != "dummy":
        raise ValueError("dummy_routing applies to random weights only (load_format='dummy')")
    return load_format


def plan_memory(spec: ModelSpec, config: EngineConfig, geometry: PageGeometry, dtype: torch.dtype,
                device: torch.device, workspace: int, mode: str | None = None,
                non_expert_weights: int | None = None) -> MemoryPlan:
    """The budget split around `workspace` (measured on a GPU, bounded on the CPU) and the non-expert weights (what
    their tensors took, where measured; else their bytes), and the offload mode: `mode`, else the one asked for,
    else static when every expert fits with room for KV cache and elastic otherwise."""
    non_expert = spec.non_expert_bytes(dtype) if non_expert_weights is None else non_expert_weights
    if config.pool_bytes is not None:  # the pool's size given: the budget is what it adds up to
        pool_bytes = config.pool_bytes
        budget = non_expert + workspace + pool_bytes
    else:
        budget = resolve_budget(config, device, spec, dtype, workspace)
        pool_bytes = budget - non_expert - workspace
    if pool_bytes < geometry.huge_size:
        raise ValueError(
            f"page_pool_memory_bytes {format_bytes(pool_bytes)} is smaller than one huge page "
            f"({format_bytes(geometry.huge_size)})" if config.pool_bytes is not None else
            f"gpu_memory_budget {format_bytes(budget)} is too small: non-expert weights take "
            f"{format_bytes(non_expert)} and the activation workspace {format_bytes(workspace)}, leaving no page pool")
    mode = mode or config.offload_mode
    if mode is None:
        expert_bytes = spec.routed_expert_bytes(dtype) // geometry.tp_size  # this rank's slices
        whole_pool = pool_bytes // geometry.huge_size * geometry.huge_size
        mode = "static" if expert_bytes <= (1 - STATIC_KV_SHARE) * whole_pool else "elastic"
        logger.info("offload_mode not given: %s (routed experts %s, pool %s)", mode, format_bytes(expert_bytes),
                    format_bytes(whole_pool))
    return MemoryPlan(budget=budget, non_expert_weights=non_expert, workspace=workspace, pool_bytes=pool_bytes,
                      mode=mode)


def load_popularity(config: EngineConfig, spec: ModelSpec) -> ExpertPopularity:
    """The expert ranking of `--expert-ranking`, or uniform order."""
    if config.expert_ranking is not None:
        return ExpertPopularity.load(config.expert_ranking, spec.num_moe_layers, spec.num_experts)
    return ExpertPopularity.uniform(config.model, spec.num_moe_layers, spec.num_experts)


def load_weights(model: MoECausalLM, spec: ModelSpec, config: EngineConfig, load_format: str,
                 runtime: ExpertRuntime, device: torch.device) -> None:
    """Non-expert weights into the model; routed experts through the runtime (its pages, or its host store and the
    resident pages). Dummy weights draw the same numbers in every mode."""
    if load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
        if config.dummy_routing is not None and config.dummy_routing.startswith("zipf:"):
            skew = ExpertPopularity.zipf(config.model, spec.num_moe_layers, spec.num_experts,
                                         float(config.dummy_routing.split(":")[1]), seed=config.seed)
            set_dummy_routing(model, skew.probabilities, seed=config.seed)
        runtime.fill_random_experts(seed=config.seed + 1)
    else:
        load_checkpoint(model, spec, config.model, runtime.write_expert)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every non-blocking copy into expert pages has landed


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec, kv_tokens: int, pool_bytes: int) -> int:
    if kv_tokens < config.block_size:
        state = " and one request's state pages" if spec.is_hybrid else ""
        raise ValueError(f"after the experts{state}, the pool ({format_bytes(pool_bytes)}) has no room for KV cache; "
                         "raise gpu_memory_budget or use an offload mode")
    if config.max_model_len is not None and config.max_model_len > spec.max_position_embeddings:
        # as vLLM: positions past the trained range are not something the engine can promise to serve
        raise ValueError(f"max_model_len={config.max_model_len} is longer than the model's "
                         f"max_position_embeddings={spec.max_position_embeddings}")
    max_model_len = config.max_model_len or spec.max_position_embeddings
    if config.max_model_len is None and max_model_len > kv_tokens:
        return kv_tokens
    if max_model_len > kv_tokens:
        raise ValueError(f"max_model_len={max_model_len} does not fit: the KV cache holds {kv_tokens} tokens")
    return max_model_len
