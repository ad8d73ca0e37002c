"""Start-up: from an EngineConfig to a model whose experts and KV cache live in one page pool.

The budget is split as
    budget = non-expert weights (normal tensors, never move)
           + activation workspace (bounded from the batch limits)
           + pool (whole huge pages: routed experts + KV cache)
and the split is logged. In `static` mode every routed expert is made resident first; what is left
of the pool is KV cache. In `fixed` mode every routed expert gets a home copy in (pinned) host memory,
the first K of each layer's ranking are made resident, and two load buffers of `expert_offload_limit`
experts each are reserved for the rest:

    pool = L_moe * K * 3 expert pages (resident) + 2 * limit * 3 expert pages (load buffers) + KV cache

`elastic` mode starts like `fixed` with as many experts resident as fit (at most all, at least E - limit
per layer) while leaving `ELASTIC_KV_RESERVE` of the pool to KV cache; from then on the adjuster
(experts/elastic.py) moves experts in and out every step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rimuru.config import EngineConfig, format_bytes
from rimuru.engine.kv_cache_manager import KVCacheManager
from rimuru.engine.sampler import SAMPLE_ROWS_PER_CHUNK, SAMPLER_BYTES_PER_ENTRY
from rimuru.experts.adjuster import Adjuster, AdjusterConfig, PaperAdjuster
from rimuru.experts.cache import (
    EXPERT,
    ExpertCache,
    PoolTooSmallError,
    resolve_offload_limit,
    resolve_resident_count,
)
from rimuru.experts.cost_adjuster import CostAdjuster, CostAdjusterConfig
from rimuru.experts.elastic import ElasticController, ElasticCounters
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.loader import BUFFER_OWNER, ExpertLoader, LoadCounters, lazy_load_buffers, load_buffer_pages
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.experts.popularity import ExpertPopularity, OnlinePopularity
from rimuru.experts.predictor import ExpertPredictor, moe_routers
from rimuru.experts.routing_counter import RoutingCounter
from rimuru.experts.step_cost import StepCostTracker
from rimuru.memory.geometry import PageGeometry
from rimuru.memory.pool import PagePool
from rimuru.model_spec import ModelSpec, dtype_bytes, load_model_spec
from rimuru.models.dummy_routing import set_dummy_routing
from rimuru.models.expert_provider import ExpertProvider, StaticExpertProvider
from rimuru.models.loader import init_dummy_weights, load_checkpoint
from rimuru.models.registry import build_model

logger = logging.getLogger("rimuru")

ELASTIC_KV_RESERVE = 0.10  # elastic start-up: share of the pool kept for KV cache when placing experts


def default_elastic_limit(num_experts: int) -> int:
    """The paper found about ten offloadable experts (of 60) near the throughput peak: E / 6."""
    return max(1, num_experts // 6)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


@dataclass
class EngineParts:
    spec: ModelSpec
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    geometry: PageGeometry
    pool: PagePool
    experts: ExpertCache
    kv: KVCacheManager
    model: torch.nn.Module
    max_model_len: int
    num_attention_layers: int
    budget_split: dict[str, int]
    provider: ExpertProvider
    host_store: HostExpertStore | None = None  # fixed mode: every expert's home copy
    loader: ExpertLoader | None = None  # fixed mode with offloaded experts
    elastic: ElasticController | None = None  # elastic mode
    max_kv_pages: int = 0  # KV pages requests could ever get: free now + what evicting allowed experts frees
    mode: str = "static"  # the offload mode in force

    def offload_stats(self) -> dict[str, float]:
        c = self.loader.counters if self.loader is not None else LoadCounters()
        e = self.elastic.counters if self.elastic is not None else ElasticCounters()
        return {"expert_bytes_loaded": c.bytes_loaded, "prefetch_hits": c.hits, "prefetch_misses": c.misses,
                "expert_evictions": e.evictions, "expert_grows": e.grows, "expert_reranks": e.reranks,
                **(self.elastic.cost_stats() if self.elastic is not None else {})}


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


def workspace_bytes(spec: ModelSpec, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """An upper bound of the activations of one forward pass and its sampling at the batch limits.

    Per token: hidden states and residual, q/k/v/o, the MLP intermediates (routed: top-k copies of
    2f; shared expert: 2 * its width), the router logits. Per sampled sequence: the lm-head output (dtype)
    and the float32 logits; plus one sampler chunk's working copies (engine/sampler.py samples
    SAMPLE_ROWS_PER_CHUNK rows at a time). Plus fixed scratch (896 MiB on a GPU, set from measurements;
    16 MiB on the CPU).
    benchmarks/probe_workspace.py measures the real peak against this bound on the GPU.
    """
    T, S = config.max_num_batched_tokens, config.max_num_seqs
    d, el = spec.hidden_size, dtype_bytes(dtype)
    qkv = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * spec.head_dim
    mlp = max(spec.num_experts_per_tok * 3 * spec.moe_intermediate_size,
              3 * spec.shared_expert_intermediate_size, 3 * spec.intermediate_size)
    per_token = (6 * d + 2 * qkv + mlp + spec.num_experts) * el + spec.num_experts_per_tok * 16
    logits = S * spec.vocab_size * (el + 4) + min(S, SAMPLE_ROWS_PER_CHUNK) * spec.vocab_size * SAMPLER_BYTES_PER_ENTRY
    # Kernel scratch, cuBLAS workspaces, loaded module images, the decode graphs' pool and fragmentation:
    # what does not shrink with T. Measured on the H200 (benchmarks/probe_workspace.py, Qwen1.5-MoE, 256
    # sequences, elastic): 1,620 MB at T = 4096 (2026-11-29-s6-probe-workspace-elastic-h200.json) and
    # 1,492 MB at T = 2048 (2026-11-30-s7-probe-workspace-elastic-mbt2048-h200.json), i.e. ~62 kB per
    # token (the per-token term above is 83 kB) on ~1.36 GB that does not shrink. The earlier bound, 2 T
    # per_token + logits + 512 MiB, fit the first point and fell 148 MB short of the second: with
    # --max-num-batched-tokens 2048 the engine ran past its budget. 896 MiB covers both with >= 5 % to spare
    # (1,747 and 1,577 MB).
    scratch = 896 * 2**20 if device.type == "cuda" else 16 * 2**20
    # --max-cudagraph-capture-size below T needs no extra charge: steps above the cap run eagerly, and their
    # activations take the room the smaller graph pool leaves. Measured (elastic, T = 4096, cap 512): 1,641 MB
    # against 1,625 MB uncapped (2026-11-30-s8-probe-workspace-elastic{-cap512,}-h200.json), both under this
    # bound (1,747 MB). So a cap does not buy KV room at this T either.
    return T * per_token + logits + scratch


def default_budget(device: torch.device, spec: ModelSpec, dtype: torch.dtype, work: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    # CPU: every weight plus room for 64k tokens of KV cache
    weights = spec.non_expert_bytes(dtype) + spec.routed_expert_bytes(dtype)
    return weights + work + 65536 * spec.kv_bytes_per_token(dtype)


def build_engine_parts(config: EngineConfig) -> EngineParts:
    model_path = config.model
    spec = load_model_spec(model_path)
    is_dir = os.path.isdir(model_path)
    load_format = config.load_format
    if load_format == "auto":
        load_format = "safetensors" if is_dir and any(Path(model_path).glob("*.safetensors")) else "dummy"
        if load_format == "dummy":
            logger.warning("no safetensors in %s: using random weights (load_format='dummy')", model_path)
    if config.dummy_routing is not None and load_format != "dummy":
        raise ValueError("dummy_routing applies to random weights only (load_format='dummy')")
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, spec, device)
    tokenizer = load_tokenizer(config.tokenizer or (model_path if is_dir else None))
    popularity = (ExpertPopularity.load(config.expert_ranking, spec.num_moe_layers, spec.num_experts)
                  if config.expert_ranking is not None
                  else ExpertPopularity.uniform(model_path, spec.num_moe_layers, spec.num_experts))

    geometry = PageGeometry.for_model(spec, dtype=dtype, block_size=config.block_size,
                                      tp_size=config.tensor_parallel_size)
    work = workspace_bytes(spec, config, dtype, device)
    budget = config.budget_bytes or default_budget(device, spec, dtype, work)
    non_expert = spec.non_expert_bytes(dtype)
    pool_bytes = budget - non_expert - work
    expert_bytes = spec.routed_expert_bytes(dtype)
    if pool_bytes < geometry.huge_size:
        raise ValueError(
            f"gpu_memory_budget {format_bytes(budget)} is too small: non-expert weights take "
            f"{format_bytes(non_expert)} and the activation workspace {format_bytes(work)}, leaving no page pool")
    mode = config.offload_mode
    if mode is None:  # static when every expert fits with room for KV cache, else elastic
        whole_pool = pool_bytes // geometry.huge_size * geometry.huge_size
        mode = "static" if expert_bytes <= (1 - ELASTIC_KV_RESERVE) * whole_pool else "elastic"
        logger.info("offload_mode not given: %s (routed experts %s, pool %s)", mode, format_bytes(expert_bytes),
                    format_bytes(whole_pool))
    if mode == "elastic":
        limit = config.expert_offload_limit
        limit = default_elastic_limit(spec.num_experts) if limit is None else limit
        if not 1 <= limit <= spec.num_experts:
            raise ValueError(f"expert_offload_limit must be in [1, {spec.num_experts}] in elastic mode, got {limit}")
    if mode == "fixed":
        resident = resolve_resident_count(config.resident_experts, spec.num_experts)
        limit = resolve_offload_limit(config.expert_offload_limit, spec.num_experts, resident)
    pool = PagePool(geometry, pool_bytes, device)
    expert_view = pool.expert_view(dtype)
    experts = ExpertCache(spec, pool.allocator, expert_view, device,
                          ranking=[popularity.ranking(layer) for layer in range(spec.num_moe_layers)])
    num_attn = len(spec.attention_layer_ids)
    kv_view = pool.kv_view(max(1, spec.num_key_value_heads // config.tensor_parallel_size), spec.head_dim,
                           dtype, config.block_size)
    store: HostExpertStore | None = None
    lazy = False  # elastic load buffers held only while an expert is offloaded (lazy_load_buffers)
    loader: ExpertLoader | None = None
    if mode == "static":
        try:
            experts.make_all_resident()
        except PoolTooSmallError as e:
            short = expert_bytes - pool.pool_bytes
            raise ValueError(
                f"offload_mode='static' needs every routed expert on the device ({format_bytes(expert_bytes)}), "
                f"but the page pool is {format_bytes(pool.pool_bytes)} ({e}); short by at least "
                f"{format_bytes(max(short, geometry.huge_size))}. Raise gpu_memory_budget or use "
                f"offload_mode='fixed' or 'elastic' to keep some experts in host memory") from None
        provider: ExpertProvider = StaticExpertProvider(expert_view, experts.tables)
    else:
        if mode == "elastic":
            resident = _elastic_start(experts, pool, limit)
        _check_offload_fits(mode, experts, geometry, pool, resident, limit)  # before the slow pinning
        experts.make_prefix_resident(resident)
        if limit == 0 and mode == "fixed":  # every expert resident for good: CUDA graphs stay possible
            provider = StaticExpertProvider(expert_view, experts.tables)
        else:
            store = HostExpertStore(spec.num_moe_layers, spec.num_experts, spec.moe_intermediate_size,
                                    spec.hidden_size, dtype, pin=device.type == "cuda")
            pages: list[int] = []
            lazy = mode == "elastic" and lazy_load_buffers(spec.num_moe_layers)
            if not lazy or resident < spec.num_experts:  # lazy buffers with every expert resident: none yet
                got = pool.allocator.allocate_mid(EXPERT, load_buffer_pages(limit), owner=BUFFER_OWNER)
                assert got is not None  # capacity was checked above
                pages = got
            loader = ExpertLoader(experts, store, pages, limit)
            provider = OffloadExpertProvider(experts, loader, top_k=spec.num_experts_per_tok)
            provider.popularity = lambda: popularity.probabilities  # fixed mode; elastic: the online estimate
    model = build_model(spec, dtype, device, provider, kv_view)
    if isinstance(provider, OffloadExpertProvider):
        provider.predictor = ExpertPredictor(moe_routers(model), spec.num_experts_per_tok)
    elastic = None
    if mode == "elastic":
        assert loader is not None
        counter = RoutingCounter(spec.num_moe_layers, spec.num_experts, device)
        provider.counter = counter  # type: ignore[attr-defined]
        adjuster: Adjuster = PaperAdjuster(AdjusterConfig())
        step_cost = None
        if config.adjuster == "cost":
            slo = None if config.tpot_slo_ms is None else config.tpot_slo_ms / 1e3
            cost_cfg = CostAdjusterConfig(tpot_slo_s=slo)
            step_cost = StepCostTracker(copy_overlap=cost_cfg.copy_overlap,  # measured forward times
                                         initial_overlap=cost_cfg.initial_copy_overlap)
            adjuster = CostAdjuster(cost_cfg, expert_bytes=3 * geometry.size(EXPERT), top_k=spec.num_experts_per_tok,
                                    compute_time=step_cost, copy_slowdown=step_cost.copy_slowdown,
                                    copy_overlap=step_cost.copy_overlap_share, copy_excess=step_cost.copy_excess)
        online = OnlinePopularity(popularity)
        provider.popularity = online.probabilities  # type: ignore[attr-defined]
        elastic = ElasticController(experts, loader, adjuster, online,
                                    offload_limit=limit, smalls_per_mid=geometry.smalls_per_mid("kv", EXPERT),
                                    counter=counter, step_cost=step_cost,
                                    pcie_bandwidth=CostAdjusterConfig().pcie_bandwidth, lazy_buffers=lazy)
    if load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
        if config.dummy_routing is not None and config.dummy_routing.startswith("zipf:"):
            skew = ExpertPopularity.zipf(model_path, spec.num_moe_layers, spec.num_experts,
                                         float(config.dummy_routing.split(":")[1]), seed=config.seed)
            set_dummy_routing(model, skew.probabilities, seed=config.seed)
        if store is None:
            experts.fill_random(seed=config.seed + 1)
        else:  # the same draws as static mode's pages, so every mode serves the same random model
            store.fill_random(seed=config.seed + 1, device=device)
            experts.load_from_store(store)
    elif store is None:
        load_checkpoint(model, spec, model_path, experts.write)
    else:
        def sink(layer: int, expert: int, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> None:
            store.write(layer, expert, w1, w3, w2)
            experts.write_if_resident(layer, expert, w1, w3, w2)

        load_checkpoint(model, spec, model_path, sink)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # every non-blocking copy into expert pages has landed
    model.eval()

    kv = KVCacheManager(pool.allocator, num_attn, config.block_size)
    max_kv_pages = kv.capacity_pages()
    if mode == "elastic":  # every layer may give up to `limit` experts (its resident ones beyond E - limit)
        evictable = 3 * sum(max(0, n - (spec.num_experts - limit)) for n in experts.resident_per_layer())
        if lazy and loader is not None and not loader.buffer_pages:  # offloading attaches the buffers
            evictable = max(0, evictable - load_buffer_pages(limit))
        max_kv_pages += evictable * geometry.smalls_per_mid("kv", EXPERT)
    kv_tokens = max_kv_pages // max(1, num_attn) * config.block_size
    if kv_tokens < config.block_size:
        raise ValueError(f"after the experts, the pool ({format_bytes(pool.pool_bytes)}) has no room for KV cache; "
                         "raise gpu_memory_budget or use an offload mode")
    max_model_len = config.max_model_len or spec.max_position_embeddings
    if config.max_model_len is None and max_model_len > kv_tokens:
        max_model_len = kv_tokens
    elif max_model_len > kv_tokens:
        raise ValueError(f"max_model_len={max_model_len} does not fit: the KV cache holds {kv_tokens} tokens")
    split = {"budget": budget, "non_expert_weights": non_expert, "workspace": work, "pool": pool.pool_bytes,
             "experts_resident": experts.num_resident * 3 * geometry.size("expert"),
             "load_buffers": len(loader.buffer_pages) * geometry.size("expert") if loader else 0,
             "host_experts": store.nbytes if store else 0,
             "kv_free": kv.capacity_pages() * geometry.size("kv")}
    logger.info("budget %s = non-expert weights %s + workspace %s + pool %s (experts %s, load buffers %s, "
                "KV %s = %d tokens); %s mode, %d of %d experts resident, host copies %s",
                format_bytes(budget), format_bytes(non_expert), format_bytes(work), format_bytes(pool.pool_bytes),
                format_bytes(split["experts_resident"]), format_bytes(split["load_buffers"]),
                format_bytes(split["kv_free"]), kv_tokens, mode, experts.num_resident, experts.total_experts,
                format_bytes(split["host_experts"]))
    return EngineParts(spec=spec, tokenizer=tokenizer, device=device, dtype=dtype, geometry=geometry, pool=pool,
                       experts=experts, kv=kv, model=model, max_model_len=max_model_len,
                       num_attention_layers=num_attn, budget_split=split, provider=provider, host_store=store,
                       loader=loader, elastic=elastic, max_kv_pages=max_kv_pages, mode=mode)


def _elastic_start(experts: ExpertCache, pool: PagePool, limit: int) -> int:
    """Experts per layer resident at start-up: as many as fit beside the load buffers while leaving
    ELASTIC_KV_RESERVE of the pool to KV cache, at most all and at least E - limit."""
    L, E = experts.num_layers, experts.num_experts
    have = pool.allocator.mid_capacity(EXPERT) - load_buffer_pages(limit)
    have -= int(ELASTIC_KV_RESERVE * pool.pool_bytes) // pool.geometry.size(EXPERT)
    return max(E - limit, min(E, have // (3 * L)))


def _check_offload_fits(mode: str, experts: ExpertCache, geometry: PageGeometry, pool: PagePool, resident: int,
                        limit: int) -> None:
    """`resident` experts per layer and two load buffers of `limit` experts must fit the pool."""
    L, E = experts.num_layers, experts.num_experts
    need_resident, need_buffers = 3 * L * resident, load_buffer_pages(limit)
    have = pool.allocator.mid_capacity(EXPERT)
    if need_resident + need_buffers > have:
        page = geometry.size(EXPERT)
        raise ValueError(
            f"offload_mode={mode!r} with resident_experts={resident} of {E} per layer and expert_offload_limit="
            f"{limit} needs {need_resident} expert pages for {L} x {resident} resident experts + {need_buffers} "
            f"for 2 load buffers of {limit} experts = {need_resident + need_buffers} pages "
            f"({format_bytes((need_resident + need_buffers) * page)}), but the page pool holds {have} "
            f"({format_bytes(have * page)}); lower resident_experts, raise expert_offload_limit or raise "
            "gpu_memory_budget")
