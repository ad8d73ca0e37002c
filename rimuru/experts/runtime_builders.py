"""One builder per offload mode: from the engine's settings, a pool and a built model to a typed expert runtime.

    static   every routed expert resident                                   -> StaticRuntime
    fixed    the first K of each layer's ranking resident; the rest read by   -> DirectRuntime
             the kernel from the pinned host store (offload_access direct), or
             copied into two load buffers of `limit` experts each (copy)      -> OffloadRuntime
             (K = E: StaticRuntime)
    elastic  as many resident as the start-up rule places (elastic_core.py), -> DirectElasticRuntime (direct)
             the adjuster moves the boundary every step                       -> ElasticRuntime (copy)

    pool = L_moe x K x 3 expert pages (resident) + 2 x limit x 3 (load buffers: copy access only) + KV cache

fixed and elastic mode with copy access get a host tier where `--cpu-expert-compute` resolves on (expert_tiers.py):
routed offloaded experts the host computes instead of copying (host_tier.py), its costs measured here at start-up
and logged. Direct access has none (the kernel reads offloaded experts itself; `auto` resolves off there).

Each builder makes the experts addressable (the residency, its device tables) before anything slow (pinning the
host store) and attaches its provider to the model; the weights come in afterwards through the runtime's
`write_expert` / `fill_random_experts`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rimuru.config import EXPERT_PARALLEL_MODES, expert_parallel_supported, format_bytes
from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.experts.adjuster import Adjuster, AdjusterConfig, PaperAdjuster
from rimuru.experts.cache import ExpertCache, resolve_offload_limit, resolve_resident_count
from rimuru.experts.cost_adjuster import CostAdjuster, CostAdjusterConfig
from rimuru.experts.direct_runtime import DirectElasticRuntime, DirectRuntime
from rimuru.experts.elastic_core import (
    ElasticCore,
    elastic_start_resident,
    resolve_elastic_limit,
    start_buffer_slots,
)
from rimuru.experts.elastic_runtime import ElasticRuntime
from rimuru.experts.expert_tiers import TierCosts, resolve_cpu_expert_compute
from rimuru.experts.host_compute import HostExpertCompute
from rimuru.experts.host_profile import available_host_bytes, profile_host
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.host_tier import HostExpertTier, measure_layer_fixed_s
from rimuru.experts.loader import ExpertLoader, measure_copy_bandwidth
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.experts.offload_runtime import OffloadRuntime
from rimuru.experts.popularity import ExpertPopularity, OnlinePopularity
from rimuru.experts.predictor import ExpertPredictor
from rimuru.experts.residency import BUFFER_OWNER, EXPERT, ExpertResidency, PoolTooSmallError, load_buffer_pages
from rimuru.experts.routing_counter import RoutingCounter
from rimuru.experts.runtime import ExpertRuntime, StaticRuntime
from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.experts.step_cost import StepCostTracker
from rimuru.memory.pass_fence import PassFence
from rimuru.memory.pool import PagePool
from rimuru.model_spec import ModelSpec
from rimuru.models.causal_lm import MoECausalLM

logger = logging.getLogger("rimuru")


@dataclass(frozen=True)
class RuntimeSettings:
    """The engine settings the expert runtimes read (from EngineConfig)."""

    mode: str  # static | fixed | elastic
    resident_experts: float | None = None  # fixed
    expert_offload_limit: int | None = None  # fixed, elastic
    adjuster: str = "cost"  # elastic: cost | paper
    slo_ttft_p99_ms: float | None = None  # elastic with the cost adjuster (EngineConfig)
    slo_tpot_p99_ms: float | None = None
    async_scheduling: bool = False  # elastic: how passes are timed
    offload_access: str = "direct"  # fixed, elastic: direct (the kernel reads the host store) | copy (load buffers)
    # fixed, elastic with copy access: auto | off | on, the host tier (expert_tiers.py; direct access: always off)
    cpu_expert_compute: str = "off"
    cpu_expert_threads: int | None = None  # the host tier's intra-op threads (None: torch's setting as it is)


def slo_config(slo_ttft_p99_ms: float | None, slo_tpot_p99_ms: float | None, offload_access: str = "direct",
               **fields: float) -> CostAdjusterConfig:
    """The cost adjuster's settings for the SLO flags (milliseconds, EngineConfig's names), the offload access and
    other fields; the engine's and the simulator's one source. The access decides what the adjuster allows without
    an SLO (CostAdjusterConfig.hide_copies_without_slo) and whether the bytes it models can hide at all: with copy
    access they are copies on a side stream, behind up to `copy_overlap` of compute; with direct access they are the
    MoE kernel's own reads of host memory, on the pass's path, so nothing hides them (copy_overlap 0). Learned
    instead, the overlap rose to 0.44 on the H200 (Qwen1.5-MoE shapes, uniform routing: passes that read every
    offloaded expert compared with a stale clean estimate) and the reads looked free to the model."""
    if offload_access == "direct":
        fields = {"copy_overlap": 0.0, "initial_copy_overlap": 0.0} | fields
    return CostAdjusterConfig(ttft_slo_s=None if slo_ttft_p99_ms is None else slo_ttft_p99_ms / 1e3,
                              tpot_slo_s=None if slo_tpot_p99_ms is None else slo_tpot_p99_ms / 1e3,
                              hide_copies_without_slo=offload_access == "copy", **fields)


def build_adjuster(kind: str, expert_bytes: int, top_k: int, cost: CostAdjusterConfig,
                   paper: AdjusterConfig | None = None) -> tuple[Adjuster, StepCostTracker | None]:
    """The elastic adjuster of `kind` (paper | cost) and, for the cost adjuster, the tracker of measured pass costs it
    reads (the engine and the simulator feed it). The one place both are wired, for the engine and the simulator."""
    if kind == "paper":
        return PaperAdjuster(paper or AdjusterConfig()), None
    if kind != "cost":
        raise ValueError(f"adjuster must be paper or cost, got {kind!r}")
    costs = StepCostTracker(copy_overlap=cost.copy_overlap, initial_overlap=cost.initial_copy_overlap)
    # offload_cost_factor: copy_excess, and with a host tier the host-computed share at its measured host time
    adjuster = CostAdjuster(cost, expert_bytes=expert_bytes, top_k=top_k, compute_time=costs,
                            copy_slowdown=costs.copy_slowdown, copy_overlap=costs.copy_overlap_share,
                            copy_excess=costs.offload_cost_factor, mixed_step_surcharge=costs.mixed_step_surcharge)
    return adjuster, costs


def needs_host_store(settings: RuntimeSettings, spec: ModelSpec, tp: TensorParallel = SINGLE) -> bool:
    """Whether the mode keeps experts in host memory (fixed with fewer resident than a layer holds on this rank,
    elastic)."""
    if settings.mode == "elastic":
        return True
    if settings.mode != "fixed":
        return False
    held = len(tp.local_experts(spec.num_experts))
    resident = resolve_resident_count(settings.resident_experts, held)
    return resolve_offload_limit(settings.expert_offload_limit, held, resident) > 0


# host memory a start-up leaves free beside the host store (the process, the checkpoint reader's buffers, the OS)
HOST_MEMORY_HEADROOM = 2 * 2**30


def build_host_store(spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                     tp: TensorParallel = SINGLE) -> HostExpertStore:
    """The home copy of every routed expert this rank holds, pinned for a GPU: under tensor parallelism this rank's
    f / N slice of each, under expert parallelism its E / N experts whole, as its pages hold. The engine makes it
    before the pool is sized: its device-side mappings are memory the workspace profile has to see. Refused, before
    anything is pinned, where the host's available memory cannot hold it and HOST_MEMORY_HEADROOM."""
    f = tp.expert_part(spec.moe_intermediate_size)
    local = tp.local_experts(spec.num_experts)
    element = torch.empty((), dtype=dtype).element_size()
    need = spec.num_moe_layers * len(local) * 3 * f * spec.hidden_size * element
    have = available_host_bytes()
    if need + HOST_MEMORY_HEADROOM > have:
        raise ValueError(f"the host expert store needs {format_bytes(need)} of host memory (every routed expert, "
                         f"{'pinned' if device.type == 'cuda' else 'in host memory'}) plus "
                         f"{format_bytes(HOST_MEMORY_HEADROOM)} of headroom, but only {format_bytes(have)} is "
                         "available; free host memory or use offload_mode='static' with a larger budget")
    return HostExpertStore(spec.num_moe_layers, len(local), f, spec.hidden_size, dtype, pin=device.type == "cuda",
                           first_expert=local.start)


def build_runtime(settings: RuntimeSettings, spec: ModelSpec, dtype: torch.dtype, pool: PagePool,
                  model: MoECausalLM, popularity: ExpertPopularity, fence: PassFence,
                  store: HostExpertStore | None = None) -> ExpertRuntime:
    """The runtime of `settings.mode`; `store` is the host store of a mode that needs one (made here when not
    given)."""
    tp = model.tp
    if store is None and needs_host_store(settings, spec, tp):
        store = build_host_store(spec, dtype, pool.device, tp)
    local = tp.local_experts(spec.num_experts)
    if tp.expert_parallel and not expert_parallel_supported(settings.mode, settings.offload_access):
        raise ValueError(f"expert parallelism {EXPERT_PARALLEL_MODES}, not {settings.mode!r} with "
                         f"{settings.offload_access!r}")
    ranking = [popularity.ranking(layer) for layer in range(spec.num_moe_layers)]
    if tp.expert_parallel:  # this rank's experts first, in popularity order: the only ones it makes resident
        ranking = [[*(e for e in order if e in local), *(e for e in order if e not in local)] for order in ranking]
    residency = ExpertResidency(pool.allocator, spec.num_moe_layers, spec.num_experts, ranking=ranking)
    cache = ExpertCache(residency, pool.expert_view(dtype), pool.device)
    if settings.mode == "static":
        runtime: ExpertRuntime = _static(cache, spec, pool, len(local))
    elif settings.mode == "fixed":
        runtime = _fixed(settings, cache, spec, pool, model, popularity, fence, store, len(local))
    elif settings.mode == "elastic":
        assert store is not None
        runtime = _elastic(settings, cache, spec, pool, model, popularity, fence, store)
    else:
        raise ValueError(f"offload_mode must be static, fixed or elastic, got {settings.mode!r}")
    model.attach_experts(runtime.provider)
    return runtime


def _static(cache: ExpertCache, spec: ModelSpec, pool: PagePool, per_layer: int) -> StaticRuntime:
    """Every routed expert this rank holds resident: all of them, or under expert parallelism its `per_layer` of
    each layer (the others' table rows stay absent, -1)."""
    try:
        cache.make_prefix_resident(per_layer)
    except PoolTooSmallError as e:
        need = cache.num_layers * per_layer * 3 * cache.expert_page_bytes
        short = need - pool.pool_bytes
        raise ValueError(
            f"offload_mode='static' needs every routed expert on the device ({format_bytes(need)}), "
            f"but the page pool is {format_bytes(pool.pool_bytes)} ({e}); short by at least "
            f"{format_bytes(max(short, pool.geometry.huge_size))}. Raise gpu_memory_budget or use "
            "offload_mode='fixed' or 'elastic' to keep some experts in host memory") from None
    return StaticRuntime(cache)


def _fixed(settings: RuntimeSettings, cache: ExpertCache, spec: ModelSpec, pool: PagePool, model: MoECausalLM,
           popularity: ExpertPopularity, fence: PassFence, store: HostExpertStore | None,
           held: int) -> ExpertRuntime:
    """The first K of each layer's ranking of the `held` experts this rank holds (all, or E/N under expert
    parallelism) resident, the rest read from the host store or copied."""
    resident = resolve_resident_count(settings.resident_experts, held)
    limit = resolve_offload_limit(settings.expert_offload_limit, held, resident)
    direct = settings.offload_access == "direct"
    _check_fits("fixed", cache, pool, resident, limit, buffer_slots=0 if direct else limit)
    cache.make_prefix_resident(resident)
    if limit == 0:  # every expert resident for good: whole CUDA graphs stay possible
        return StaticRuntime(cache, mode="fixed")
    assert store is not None
    if direct:
        return DirectRuntime(cache, store, cache.read_absent_from(store))
    pages = pool.allocator.allocate_mid(EXPERT, load_buffer_pages(limit), owner=BUFFER_OWNER)
    assert pages is not None  # _check_fits counted them
    loader = ExpertLoader(cache, store, pages, fence)
    tier = _host_tier(settings, store, pool.device, lambda: _copy_bandwidth(store, pool.device))
    provider = OffloadExpertProvider(cache, loader, _predictor(model, spec), spec.num_experts_per_tok,
                                     popularity=lambda: popularity.probabilities, host_tier=tier)
    return OffloadRuntime(cache, store, loader, provider)


def _elastic(settings: RuntimeSettings, cache: ExpertCache, spec: ModelSpec, pool: PagePool, model: MoECausalLM,
             popularity: ExpertPopularity, fence: PassFence, store: HostExpertStore) -> ElasticRuntime:
    E = spec.num_experts
    buffers = settings.offload_access == "copy"
    limit = resolve_elastic_limit(settings.expert_offload_limit, cache.num_layers, E,
                                  pool.allocator.mid_capacity(EXPERT), load_buffers=buffers)
    resident = elastic_start_resident(cache.num_layers, E, pool.allocator.mid_capacity(EXPERT), limit,
                                      load_buffers=buffers)
    slots = start_buffer_slots(cache.num_layers, E - resident, limit) if buffers else 0
    _check_fits("elastic", cache, pool, resident, limit, buffer_slots=slots)
    cache.make_prefix_resident(resident)
    pcie = _copy_bandwidth(store, pool.device)
    expert_bytes = 3 * cache.expert_page_bytes
    cost = slo_config(settings.slo_ttft_p99_ms, settings.slo_tpot_p99_ms, settings.offload_access,
                      pcie_bandwidth=pcie)
    adjuster, costs = build_adjuster(settings.adjuster, expert_bytes, spec.num_experts_per_tok, cost)
    online = OnlinePopularity(popularity)
    core = ElasticCore(cache.residency, adjuster, online, limit, pool.geometry.smalls_per_mid("kv", EXPERT), costs,
                       load_buffers=buffers)
    fence.watch()  # grows and the load buffers write pages that passes in flight may still read
    loader = ExpertLoader(cache, store, core.place_start(resident), fence)
    counter = RoutingCounter(spec.num_moe_layers, E, pool.device)
    if not buffers:
        provider = StaticExpertProvider(cache.expert_view, cache.tables, counter, cache.read_absent_from(store))
        return DirectElasticRuntime(core, cache, store, loader, provider, counter, pcie, settings.async_scheduling)
    tier = _host_tier(settings, store, pool.device, lambda: pcie)
    if tier is not None and tier.profile is not None and costs is not None:
        costs.use_host_tier(tier.profile, tier.costs.copy_s if tier.costs.copy_s > 0 else expert_bytes / pcie)
    provider = OffloadExpertProvider(cache, loader, _predictor(model, spec), spec.num_experts_per_tok,
                                     popularity=online.probabilities, counter=counter, host_tier=tier)
    return ElasticRuntime(core, cache, store, loader, provider, counter, pcie, settings.async_scheduling)


def _host_tier(settings: RuntimeSettings, store: HostExpertStore, device: torch.device,
               pcie_bandwidth: Callable[[], float]) -> HostExpertTier | None:
    """The host tier `--cpu-expert-compute` asks for (None: off), with this machine's costs measured now and
    logged: the host's read bandwidth and one expert's host time by tokens (host_profile.py), one expert's copy
    time at the measured PCIe bandwidth, and a layer's activation round trip."""
    if not resolve_cpu_expert_compute(settings.cpu_expert_compute, device.type, settings.offload_access):
        return None
    if settings.cpu_expert_threads is not None:
        torch.set_num_threads(settings.cpu_expert_threads)
    profile = profile_host(store.f, store.d, store.dtype)
    logger.info("cpu expert compute (%s): %s", settings.cpu_expert_compute, profile.describe())
    copy_s = store.expert_bytes / pcie_bandwidth() if device.type == "cuda" else 0.0
    fixed_s = measure_layer_fixed_s(device, store.d, store.dtype)
    if device.type == "cuda":
        logger.info("cpu expert compute: one expert's copy %.3f ms, a layer's activation round trip %.3f ms",
                    1e3 * copy_s, 1e3 * fixed_s)
    # a host where spreading a call's experts over the threads is slower than one after another computes them so
    costs = TierCosts(copy_s=copy_s, host_s=profile.expert_times, layer_fixed_s=fixed_s, spread=profile.spread.used)
    mode = "on" if settings.cpu_expert_compute == "on" else "auto"
    compute = HostExpertCompute(store, threads=profile.threads, spread=profile.spread.helps)
    return HostExpertTier(compute, costs, mode, profile)


def _predictor(model: MoECausalLM, spec: ModelSpec) -> ExpertPredictor:
    return ExpertPredictor(model.moe_routers(), spec.num_experts_per_tok)


def _copy_bandwidth(store: HostExpertStore, device: torch.device) -> float:
    """The expert copy bandwidth the elastic runtime and its adjuster reckon with: measured on a GPU; on the CPU
    (no link to measure) the H200's figure that CostAdjusterConfig names."""
    if device.type != "cuda":
        nominal = CostAdjusterConfig().pcie_bandwidth
        logger.info("expert copies: no GPU link to measure; reckoning with %.0f GB/s", nominal / 1e9)
        return nominal
    measured = measure_copy_bandwidth(store, device)
    logger.info("expert copies host -> device: %.1f GB/s (measured at start-up)", measured / 1e9)
    return measured


def _check_fits(mode: str, cache: ExpertCache, pool: PagePool, resident: int, limit: int, buffer_slots: int) -> None:
    """`resident` experts per layer and two load buffers of `buffer_slots` experts must fit the pool."""
    L, E = cache.num_layers, cache.num_experts
    need_resident, need_buffers = 3 * L * resident, load_buffer_pages(buffer_slots)
    have = pool.allocator.mid_capacity(EXPERT)
    if need_resident + need_buffers > have:
        page = cache.expert_page_bytes
        raise ValueError(
            f"offload_mode={mode!r} with resident_experts={resident} of {E} per layer and expert_offload_limit="
            f"{limit} needs {need_resident} expert pages for {L} x {resident} resident experts + {need_buffers} "
            f"for 2 load buffers of {buffer_slots} experts = {need_resident + need_buffers} pages "
            f"({format_bytes((need_resident + need_buffers) * page)}), but the page pool holds {have} "
            f"({format_bytes(have * page)}); lower resident_experts, raise expert_offload_limit or raise "
            "gpu_memory_budget")

