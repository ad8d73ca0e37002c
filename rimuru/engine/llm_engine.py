"""The engine: requests in, one step at a time, outputs out.

One step, the same in every offload mode (what differs lives behind the expert runtime, experts/runtime.py):

    take in requests and aborts that arrived since the last step
    runtime.begin_step()          grows whose copies have completed enter the expert tables
    scheduler.schedule()          running + waiting requests get KV pages; what is still short is the demand
    launch                        the runner queues the last step's KV moves and the forward pass; the pass
                                  fence records it
    runtime.plan(demand)          the memory plan: evictions and grows (after the launch: the host plans while
                                  the GPU runs, and the pass reads the tables as they were when it was queued)
    runtime.after_pass()          evicted experts leave the tables (after the pass); routing counts observed
    compact                       KV pages move out of mid pages the plan's grows wait for (their bytes with the
                                  next pass: engine/kv_compaction.py)
    drain                         read and process the previous pass's tokens (async) or this one's (sync)
    allocator.complete_forward()  pages the pass could still read return to the pool

With async scheduling (on by default on a GPU) step n+1 is launched before step n's tokens are read, so the host
works while the GPU runs; when the next pass would stop the host at an offloaded layer's routing read, step n is
drained first so its tokens reach clients a pass earlier. The step profiler and the step metrics watch the step
(`StepTrace`, `StepMetricsRing`); they never change it. `add_request` and `abort_request` may be called from
another thread (the server); they only queue.

With `tensor_parallel_size` N > 1 this process is rank 0 of N (engine/tp_workers.py): it starts the other ranks,
which build the same engine over their shards, and sends them every pass; only rank 0 schedules, plans and
samples. Its passes replay CUDA graphs as one GPU's do (every rank the graph rank 0 chose), except with copy
access outside static mode, where every pass runs eager (cuda_graphs.why_no_graphs); with async scheduling every
rank fills the pending rows from its copy of rank 0's sampled tokens (engine/tp_workers.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from rimuru.config import EngineConfig, format_bytes
from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.engine.cuda_graphs import capture_step_graphs, why_no_graphs
from rimuru.engine.kv_cache_manager import KV, KVCacheManager
from rimuru.engine.kv_compaction import KVMoves, compact_kv, max_pages_moved
from rimuru.engine.model_runner import GraphStep, HostBatch, ModelRunner, SampledTokens
from rimuru.engine.output_processor import OutputProcessor, final_output
from rimuru.engine.outputs import RequestOutput
from rimuru.engine.recent_tpot import RecentTpot
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.sampler import Sampler
from rimuru.engine.sampling_params import InvalidParam, SamplingParams
from rimuru.engine.scheduler import Scheduler, SchedulerOutput
from rimuru.engine.setup import (
    CPU_WORKSPACE_SCRATCH,
    MemoryPlan,
    load_popularity,
    load_tokenizer,
    load_weights,
    plan_memory,
    resolve_device,
    resolve_dtype,
    resolve_load_format,
    resolve_max_model_len,
    workspace_bytes,
)
from rimuru.engine.startup_clock import StartupClock
from rimuru.engine.state_cache_manager import StateCacheManager, StateCopy
from rimuru.engine.step_metrics import StepMetrics, StepMetricsRing
from rimuru.engine.step_profiler import NULL_TRACE, StepProfiler, StepTrace
from rimuru.engine.tp_workers import KVCopy, PassPlan, TensorParallelWorkers, WorkerFailed, pool_report, rank_device
from rimuru.engine.workspace_profile import DeviceMemoryMark, WorkspaceProfile, profile_workspace
from rimuru.experts.adjuster import AdjustPlan
from rimuru.experts.host_store import HostExpertStore
from rimuru.experts.residency import EXPERT
from rimuru.experts.runtime import StepDemand
from rimuru.experts.runtime_builders import RuntimeSettings, build_host_store, build_runtime, needs_host_store
from rimuru.kernels import kernel_builds
from rimuru.memory.geometry import PageGeometry
from rimuru.memory.pass_fence import PassFence
from rimuru.memory.pool import PagePool
from rimuru.model_spec import ModelSpec, load_model_spec
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.moe import NO_EXPERTS
from rimuru.models.registry import build_model
from rimuru.models.state_cache import LinearStateCache

logger = logging.getLogger("rimuru")

# steps that built Triton kernel variants while serving: the first this many are logged, all are counted
KERNEL_BUILDS_LOGGED = 20

InFlight = tuple[SchedulerOutput, SampledTokens]  # a launched pass whose tokens have not been read


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        """`tp`: this rank's group, for the engines of ranks > 0 (their worker processes make them); rank 0's engine
        is made without it and starts the other ranks itself when config.tensor_parallel_size > 1."""
        self.config = config
        spec = self.spec = load_model_spec(config.model)
        self.workers: TensorParallelWorkers | None = None
        if tp is None and config.tensor_parallel_size > 1:
            self.workers = TensorParallelWorkers(config)
            tp = self.workers.tp
        self.tp = tp if tp is not None else SINGLE
        try:
            self._build(config, spec)
        except BaseException as e:
            if self.workers is not None:
                if isinstance(e, RuntimeError) and not isinstance(e, WorkerFailed):  # a collective with a lost peer
                    failure = self.workers.failed(e)
                    self.workers.stop()
                    raise failure from e
                self.workers.stop()
            raise

    def _build(self, config: EngineConfig, spec: ModelSpec) -> None:
        tp = self.tp
        device = self.device = resolve_device(config.device) if tp.size == 1 else rank_device(config, tp.rank)
        if device.type == "cuda" and tp.size > 1:
            torch.cuda.set_device(device)
        start_memory = DeviceMemoryMark.now(device) if device.type == "cuda" else None
        if device.type == "cuda":  # count the Triton kernel variants start-up builds, and any a step builds later
            kernel_builds.install()
        builds_at_start = kernel_builds.count()
        clock = self._clock = StartupClock()
        dtype = resolve_dtype(config.dtype, spec, device)
        # only rank 0 reads text and writes it; another rank's start-up would spend seconds importing transformers
        tokenizer_path = config.tokenizer or (config.model if os.path.isdir(config.model) else None)
        self.tokenizer = load_tokenizer(tokenizer_path) if tp.is_driver else None
        load_format = resolve_load_format(config)
        geometry = PageGeometry.for_model(spec, dtype=dtype, block_size=config.block_size,
                                          tp_size=config.tensor_parallel_size, expert_parallel=tp.expert_parallel)
        self.geometry = geometry
        # non-expert weights first: the workspace is measured with them, before the pool exists
        model = build_model(spec, dtype, device, torch.empty(0, device=device), tp=tp)
        clock.mark("model built", "model")
        self.workspace_profile: WorkspaceProfile | None = None  # measured on a GPU
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else device.type == "cuda")
        self._host_store: HostExpertStore | None = None  # made before the pool where the mode needs one
        memory = self._agree(self._plan_memory(model, geometry, dtype, start_memory))
        clock.mark("memory plan (the workspace profile and kernel warm-up)", "memory_plan")
        self.pool = PagePool(geometry, memory.pool_bytes, device)
        num_attn = len(spec.attention_layer_ids)
        model.bind_kv_cache(self.pool.kv_view(max(1, spec.num_key_value_heads // config.tensor_parallel_size),
                                              spec.head_dim, dtype, config.block_size))
        state_cache: LinearStateCache | None = None
        if spec.is_hybrid:  # gated DeltaNet layers' per-request state: ssm and conv pages of the same pool
            state_cache = LinearStateCache(self.pool.ssm_view(), self.pool.conv_view())
            model.bind_state_cache(state_cache)
        self.fence = PassFence(device)  # pages freed while a pass may read them: memory/pass_fence.py
        self.runtime = build_runtime(self._runtime_settings(memory.mode), spec, dtype, self.pool, model,
                                     load_popularity(config, spec), self.fence, self._host_store)
        self._host_store = None  # the runtime's now
        clock.mark("pool and expert runtime", "pool")
        load_weights(model, spec, config, load_format, self.runtime, device)
        if device.type == "cuda":  # start-up transients (the copy-bandwidth probe, weight staging) go back
            torch.cuda.empty_cache()
        clock.mark("weights" + (" (random)" if load_format == "dummy" else ""), "weights")
        self.model = model
        prefix_caching = config.enable_prefix_caching
        self.kv = KVCacheManager(self.pool.allocator, num_attn, config.block_size,
                                 enable_prefix_caching=prefix_caching)
        self.state: StateCacheManager | None = None  # hybrid models: requests' ssm and conv pages
        if spec.is_hybrid:  # with prefix caching, also the state snapshots at cached prefixes' ends
            self.state = StateCacheManager(self.pool.allocator, len(spec.linear_layer_ids), geometry.size(KV),
                                           enable_prefix_caching=prefix_caching)
            if self.state.snapshots is not None:
                self.kv.spill = self.state.snapshots.drop_lru
        self._max_kv_pages = self.kv.capacity_pages() + self.runtime.evictable_kv_pages()
        # the longest context one request can hold: a hybrid model's request also holds its state pages
        one_request = self._max_kv_pages - (self.state.kv_pages if self.state is not None else 0)
        kv_tokens = max(0, one_request) // max(1, num_attn) * config.block_size
        self.max_model_len = resolve_max_model_len(config, spec, kv_tokens, self.pool.pool_bytes)
        self.budget_split = {"budget": memory.budget, "non_expert_weights": memory.non_expert_weights,
                             "workspace": memory.workspace, "pool": self.pool.pool_bytes,
                             **self.runtime.memory_split(), "kv_free": self.kv.capacity_pages() * geometry.size(KV)}
        self._log_budget(kv_tokens)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   reclaimable=self.runtime.reclaimable_kv_pages,
                                   admission_reserve=self.runtime.admission_reserve_kv_pages, state=self.state)
        self.runner = ModelRunner(model, device, num_attn, config.block_size, Sampler(device, config.seed),
                                  num_linear_layers=len(spec.linear_layer_ids),
                                  peers=self._send_pass if self.workers is not None else None)
        if tp.size > 1 and self.async_scheduling:  # every rank fills pending rows from its copy of rank 0's tokens
            self.runner.share_sampled_tokens = tp.broadcast
        self.piecewise_overhead_s: float | None = None  # measured after capture where whole graphs exist too
        if device.type == "cuda":
            no_graphs = why_no_graphs(config, self.runtime.mode, state_cache is None or state_cache.in_place_decode)
            if no_graphs is not None:
                logger.info("CUDA graphs are not captured (%s): every step runs eager", no_graphs)
            else:
                if state_cache is not None:
                    logger.info("hybrid model (%s): pure-decode steps replay CUDA graphs; steps with one prefill "
                                "sequence replay whole single-prefill graphs where every expert is resident in "
                                "pages, the others piecewise graphs cut at every gated DeltaNet layer, whose "
                                "prefill sequences run eagerly between the pieces", spec.model_type)
                self._capture_graphs()
                clock.mark("CUDA graphs", "graphs")
        if start_memory is not None:
            self._check_workspace(start_memory)
        logger.info("start-up: %s; %d Triton kernel variants built", clock.describe(),
                    kernel_builds.count() - builds_at_start)
        self._requests: dict[str, Request] = {}
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.scheduler, self._requests,
                                       self.async_scheduling)
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._next_seq_id = 0
        self._in_flight: InFlight | None = None
        self.forward_steps = 0
        self.peak_running = 0
        self.kv_pages_moved = 0  # by KV compaction (engine/kv_compaction.py)
        self._kv_moves: KVMoves | None = None  # the last compaction's, copied before the next pass (sources held)
        self._max_kv_moves = max_pages_moved(geometry, EXPERT)
        self._sent_buffer_pages: list[int] | None = None  # the load-buffer pages the workers last got
        self._passes_sent = 0  # plans sent to the workers (a step that raises after sending one leaves them mid-pass)
        self.kernel_variants_built = 0  # Triton kernel variants steps built (kernels/kernel_builds.py)
        self.start_time = time.monotonic()
        self.step_metrics = StepMetricsRing()
        self.recent_tpot = RecentTpot()  # what finished requests saw: the SLO mode corrects its step model with it
        self.profiler: StepProfiler | None = None  # enable_step_profiler()
        self.trace: StepTrace = NULL_TRACE  # what watches each step: the profiler once enabled
        self._expert_page_bytes = geometry.size(EXPERT)
        self._kv_page_bytes = geometry.size(KV)

    # ---- start-up ------------------------------------------------------------------------------------
    def _runtime_settings(self, mode: str) -> RuntimeSettings:
        config = self.config
        return RuntimeSettings(mode=mode, resident_experts=config.resident_experts,
                               expert_offload_limit=config.expert_offload_limit, adjuster=config.adjuster,
                               slo_ttft_p99_ms=config.slo_ttft_p99_ms, slo_tpot_p99_ms=config.slo_tpot_p99_ms,
                               async_scheduling=self.async_scheduling, offload_access=config.offload_access,
                               cpu_expert_compute=config.cpu_expert_compute,
                               cpu_expert_threads=config.cpu_expert_threads)

    def _make_host_store(self, mode: str, dtype: torch.dtype) -> None:
        """Pins the host expert store of an offloading mode before the graph profile: its device-side mappings
        (hundreds of MB for a 58 GB store) are memory outside torch the workspace must hold."""
        if needs_host_store(self._runtime_settings(mode), self.spec, self.tp):
            t0 = time.monotonic()
            self._host_store = build_host_store(self.spec, dtype, self.device, self.tp)
            self._clock.add("the host store", time.monotonic() - t0)

    def _agree(self, memory: MemoryPlan) -> MemoryPlan:
        """Tensor parallelism: rank 0's mode and split, with the smallest pool of any rank, so that every rank's
        pool has the same pages."""
        if self.tp.size == 1:
            return memory
        plan: MemoryPlan = self.tp.broadcast_object(memory)
        return replace(plan, pool_bytes=self.tp.min_int(memory.pool_bytes))

    def _send_pass(self, h: HostBatch, sample: bool, state_copies: list[StateCopy], kv_moves: KVMoves | None,
                   graph: GraphStep | None) -> None:
        """Rank 0: the pass about to run, to every other rank (with the expert tables where they move, the state
        copies and KV moves queued before it, and the graph it replays)."""
        assert self.workers is not None
        elastic = self.runtime.mode == "elastic"
        tables = self.runtime.cache.host_tables.numpy().copy() if elastic else None
        buffers = None  # elastic mode with copies: its load buffers' pages, when they moved
        if elastic and self.config.offload_access == "copy":
            pages = self.runtime.loader.buffer_pages
            if pages != self._sent_buffer_pages:
                buffers = self._sent_buffer_pages = pages
        pending = (h.pending_rows, h.pending_src) if h.pending_rows is not None and h.pending_src is not None else None
        self._passes_sent += 1
        self.workers.send(PassPlan(h.fields(), h.max_query_len, sample, tables, list(state_copies), h.prompt_rows,
                                   buffer_pages=buffers, kv_moves=kv_moves, graph=graph, pending=pending))

    def _plan_memory(self, model: MoECausalLM, geometry: PageGeometry, dtype: torch.dtype,
                     start_memory: DeviceMemoryMark | None) -> MemoryPlan:
        """The budget split: on a GPU around the workspace measured for the offload mode's graphs (the mode when
        none was given is chosen from the eager workspace), on the CPU around workspace_bytes' bound."""
        spec, config, device = self.spec, self.config, self.device
        if start_memory is None:
            logger.info("on the CPU the workspace is bounded from the batch limits, not measured")
            # the non-expert tensors this rank holds (its shards under tensor parallelism), byte for byte
            held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
            return plan_memory(spec, config, geometry, dtype, device,
                               workspace_bytes(spec, config, dtype, CPU_WORKSPACE_SCRATCH), non_expert_weights=held)
        # the non-expert weights as allocated (the allocator rounds every tensor up), not as counted
        weights = torch.cuda.memory_reserved(device) - start_memory.reserved
        max_model_len = config.max_model_len or spec.max_position_embeddings  # the longest the graphs can be sized for
        self.workspace_profile = profile_workspace(
            model, spec, config, geometry, dtype, device, max_model_len,
            mode_for=lambda eager: plan_memory(spec, config, geometry, dtype, device, eager,
                                               non_expert_weights=weights).mode,
            engine_start=start_memory, before_graphs=lambda mode: self._make_host_store(mode, dtype))
        return plan_memory(spec, config, geometry, dtype, device, self.workspace_profile.workspace,
                           mode=self.workspace_profile.mode, non_expert_weights=weights)

    def _capture_graphs(self) -> None:
        cfg = self.config
        graphs = capture_step_graphs(self.model, self.runtime.graph_plan(), self.device, self.runner.num_layers,
                                     cfg.max_num_seqs, self.max_model_len, cfg.block_size, cfg.max_num_batched_tokens,
                                     cfg.max_cudagraph_capture_size, num_linear_layers=self.runner.num_linear_layers)
        if self.tp.size > 1 and self.tp.min_int(int(bool(graphs.single_prefill_graphs))) == 0:
            graphs.single_prefill_graphs.clear()  # a capture that failed on any rank: every rank serves without them
        self.runner.use_cuda_graphs(graphs)
        overhead = graphs.measure_piecewise_overhead()
        if overhead is not None:  # step times are measured without it; the cost adjuster charges it to offloading
            self.piecewise_overhead_s = overhead
            self.runtime.set_piecewise_overhead(overhead)

    def _log_budget(self, kv_tokens: int) -> None:
        s = self.budget_split
        logger.info("budget %s = non-expert weights %s + workspace %s + pool %s (experts %s, load buffers %s, "
                    "KV %s = %d tokens); %s mode, %d of %d experts resident, host copies %s",
                    format_bytes(s["budget"]), format_bytes(s["non_expert_weights"]), format_bytes(s["workspace"]),
                    format_bytes(s["pool"]), format_bytes(s["experts_resident"]), format_bytes(s["load_buffers"]),
                    format_bytes(s["kv_free"]), kv_tokens, self.runtime.mode, self._resident_experts(),
                    self.runtime.cache.total_experts, format_bytes(s["host_experts"]))

    def _resident_experts(self) -> int:
        """Routed experts resident on the device, all layers: under expert parallelism the group's (static mode: every
        rank holds its E/N of each layer, as this one does), so a model served whole reads all of them resident."""
        per_rank = self.runtime.cache.num_resident
        return per_rank * self.tp.size if self.tp.expert_parallel else per_rank

    def _check_workspace(self, start_memory: DeviceMemoryMark) -> None:
        """The budget reserved the measured `workspace` for everything beyond weights and pool; say when the start
        took more (graph pools, the host store's mappings, kernels loaded after the profile), since then the engine
        holds more than its budget."""
        split = self.budget_split
        later = DeviceMemoryMark.now(self.device)
        reserved = later.reserved - start_memory.reserved - split["non_expert_weights"] - split["pool"]
        outside = start_memory.outside_torch_since(self.device)
        used = reserved + outside
        log = logger.warning if used > split["workspace"] else logger.info
        log("after start the engine holds %s beyond weights and pool (torch %s, outside torch %s); the workspace "
            "measured before the pool is %s", format_bytes(used), format_bytes(reserved), format_bytes(outside),
            format_bytes(split["workspace"]))

    # ---- requests ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: [0, vocab_size)."""
        return self.spec.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        return self.spec.eos_token_id[0] if self.spec.eos_token_id else None

    def max_kv_pages(self) -> int:
        """KV pages the pool could ever give requests (every allowed expert evicted)."""
        return self._max_kv_pages

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send prompt token ids instead of text")
        # split_special_tokens: "<|im_end|>" typed by a user stays text, never a control token
        return self.tokenizer.encode(prompt, add_special_tokens=False, split_special_tokens=True)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queues a request; raises ValueError (nothing queued) when it is malformed or can never run."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenize(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        past = [t for t in (params.logit_bias or {}) if t >= vocab]
        if past:
            raise ValueError(f"logit_bias names token {past[0]}, outside this model's vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context (max_model_len) is "
                             f"{self.max_model_len}, which leaves no room for output")
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens={params.max_tokens} is too large: the prompt has {len(ids)} tokens "
                             f"and max_model_len is {self.max_model_len}, so at most {room} can be generated")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        self._check_logprobs(params)
        need = self.kv.blocks_for(len(ids) + max_tokens) * self.kv.num_layers
        state = self.state.kv_pages if self.state is not None else 0  # a hybrid model's state, in KV pages
        most = self.max_kv_pages()
        if need + state > most:
            what = f" and its state {state}" if state else ""
            raise ValueError(f"this request needs {need} KV pages ({len(ids)} prompt + {max_tokens} output tokens)"
                             f"{what} but the pool can never hold more than {most}; lower max_tokens or the prompt")
        with self._lock:
            if request_id in self._requests or any(r.request_id == request_id for r in self._inbox):
                raise ValueError(f"request id {request_id!r} is already in use")
            req = Request(
                request_id=request_id, seq_id=self._next_seq_id, prompt=text, prompt_token_ids=ids,
                params=params, max_tokens=max_tokens, eos_token_id=self.eos_token_id,
                arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            )
            self._next_seq_id += 1
            if params.seed is not None:
                req.generator = torch.Generator(device=self.device)
                req.generator.manual_seed(params.seed)
            self._inbox.append(req)

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's limits and messages: -1 asks for the whole vocabulary; max_logprobs -1 allows it."""
        vocab = self.vocab_size
        limit = vocab if self.config.max_logprobs == -1 else self.config.max_logprobs
        for what, param, n in (("sample", "logprobs", params.logprobs),
                               ("prompt", "prompt_logprobs", params.prompt_logprobs)):
            asked = vocab if n == -1 else n
            if asked is not None and asked > limit:
                raise InvalidParam(param, f"Requested {what} logprobs of {asked}, which is greater than max allowed: "
                                          f"{limit}")

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        # KV moves not yet copied: one more step queues them (the cached blocks they renamed are read later)
        return (pending or self.scheduler.has_unfinished() or self._in_flight is not None
                or self._kv_moves is not None)

    # ---- the step ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        trace = self.trace
        trace.begin(t0)
        loaded0, graph_steps0 = self.runtime.bytes_loaded, self.runner.graph_steps
        builds0 = kernel_builds.count()
        if self.workers is not None:
            self.workers.check()
        outputs = self._take_inbox()
        self.runtime.begin_step()
        sched = self.scheduler.schedule()
        num_tokens = sched.num_tokens  # as scheduled (the early drain below may drop finished requests)
        self.peak_running = max(self.peak_running, len(self.scheduler.running))
        trace.scheduled(sched)
        demand = self._demand(sched)
        previous, self._in_flight = self._in_flight, None
        if previous is not None and sched.scheduled and self.runtime.pass_reads_routing(sched.num_tokens):
            # This launch would stop at an offloaded layer's routing read, long after pass n is done: drain pass n
            # first. Requests that finish now leave the batch (their pages are already freed).
            outputs += self._drain(previous)
            previous = None
            sched.scheduled = [s for s in sched.scheduled if not s.request.status.finished]
        sched.kv_moves = self._kv_moves  # the last step's compaction (kept for the next step if the launch fails)
        sent = self._passes_sent
        try:
            launched = self._launch(sched)
            if sched.kv_moves is not None:
                if launched is None:  # no pass to carry the copies: queued alone
                    self._copy_kv(sched.kv_moves)
                self.pool.allocator.release_held()  # the copies are queued: the sources go at this step's end
                self._kv_moves = None
        except WorkerFailed:
            raise
        except BaseException as e:
            if self.workers is None or not (isinstance(e, RuntimeError) or self._passes_sent != sent):
                raise
            # a collective with a lost peer, or rank 0 raised after it sent the pass: the other ranks wait in the
            # pass's collectives, where the next plan would meet the wrong one
            failure = self.workers.failed(e)
            if not isinstance(e, Exception):  # an interrupt stays one (the workers are gone all the same)
                raise
            raise failure from e
        # The memory plan for the steps after this one, while the GPU runs: the pass just launched reads the tables
        # as they are (evictions leave them after it, grows enter once their copies are done)
        plan = self.runtime.plan(demand)
        self.runtime.after_pass()
        trace.mark("adjust")
        if launched is not None and sched.kv_moves is None and (awaited := self.runtime.mid_pages_awaited()) > 0:
            # the plan's grows wait for whole mid pages: move the few live KV pages out of the emptiest (renamed now,
            # read under their new names from the next pass on, which the copies precede). Not in a step that
            # carried the last compaction's copies: the mid pages they empty merge only at its end, and the plan
            # still counts them as awaited
            self._kv_moves = compact_kv(self.kv, self.scheduler.running, EXPERT, awaited, self._max_kv_moves,
                                        hold=True, grids=self.runner)
            self.kv_pages_moved += len(self._kv_moves) if self._kv_moves is not None else 0
        trace.mark("compact")
        if self.async_scheduling:  # pass n+1 is queued behind pass n on the device: read pass n meanwhile
            self._in_flight = launched
        else:
            previous = launched
        if previous is not None:
            outputs += self._drain(previous)
        self.pool.allocator.complete_forward()  # pages the finished pass may have read are free now
        t_end = self._record(t0, num_tokens, self.runner.graph_steps > graph_steps0, plan, loaded0)
        trace.end(t_end)
        if (built := kernel_builds.count() - builds0) > 0:
            self._note_kernel_builds(built, sched.num_tokens, len(sched.scheduled))
        for out in outputs:
            self.recent_tpot.observe(out)
        return outputs

    def _note_kernel_builds(self, built: int, num_tokens: int, num_seqs: int) -> None:
        """A step built Triton kernel variants the start-up warm-up did not (engine/kernel_warmup.py): it waited for
        them. Counted in stats; the first few are logged with the step's shape."""
        self.kernel_variants_built += built
        if self.kernel_variants_built <= KERNEL_BUILDS_LOGGED:
            logger.info("a step of %d tokens over %d sequences built %d Triton kernel variant(s) the warm-up did not "
                        "(%d while serving so far; per kernel since the process began: %s)", num_tokens, num_seqs,
                        built, self.kernel_variants_built, kernel_builds.by_kernel())

    def _demand(self, sched: SchedulerOutput) -> StepDemand:
        return StepDemand(shortfall_kv_pages=sched.shortfall_pages, num_batched_tokens=sched.num_tokens,
                          num_scheduled=len(sched.scheduled), num_running=len(self.scheduler.running),
                          num_waiting=len(self.scheduler.waiting),
                          num_stalled=len(sched.stalled), max_num_seqs=self.scheduler.max_num_seqs,
                          oldest_wait_s=self.scheduler.oldest_wait_s(time.monotonic()),
                          tpot_p99_s=self.recent_tpot.p99_s(), tpot_observed=self.recent_tpot.count)

    def _launch(self, sched: SchedulerOutput) -> InFlight | None:
        self.runtime.before_pass(sched.num_tokens)
        if not sched.scheduled:
            return None
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            req.num_computed_tokens = s.start + s.num_new_tokens
        tokens = self.runner.launch(sched, self.trace)
        self.fence.pass_launched()
        self.forward_steps += 1
        if self.async_scheduling:
            for s in sched.scheduled:
                if s.samples:
                    s.request.num_pending_tokens += 1  # read by the drain of the next step
        return sched, tokens

    def _copy_kv(self, moves: KVMoves) -> None:
        """KV moves in a step without a pass: queued on the compute stream on every rank; the fence records them as
        it records a pass (a grow into the mid pages they empty must wait for them)."""
        if self.workers is not None:
            self.workers.send(KVCopy(moves))
        self.runner.copy_kv(moves)
        self.fence.pass_launched()

    def _drain(self, launched: InFlight) -> list[RequestOutput]:
        sched, tokens = launched
        outputs = self.outputs.process(sched, tokens.tolist(), tokens.logprobs(), tokens.prompt_logprobs())
        self.trace.mark("process")
        return outputs

    def _take_inbox(self) -> list[RequestOutput]:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in new:
            self._requests[req.request_id] = req
            self.scheduler.add(req)
        outputs = []
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None:
                self.outputs.finish(req, RequestStatus.FINISHED_ABORTED, time.monotonic())
                outputs.append(final_output(req))
        return outputs

    def _record(self, t0: float, num_tokens: int, graph: bool, plan: AdjustPlan, loaded0: int) -> float:
        expert_bytes = self.pool.allocator.num_used(EXPERT) * self._expert_page_bytes
        kv_pages = self.kv.pages_in_use
        kv_bytes = kv_pages * self._kv_page_bytes
        state_bytes = self.state.bytes_in_use if self.state is not None else 0
        now = time.monotonic()
        self.step_metrics.append(StepMetrics(
            t=now - self.start_time, step_time_s=now - t0, num_tokens=num_tokens, cuda_graph=graph,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_pages_used=kv_pages, resident_experts=self.runtime.cache.num_resident,
            evictions=len(plan.evict), grows=len(plan.grow), bytes_loaded=self.runtime.bytes_loaded - loaded0,
            expert_bytes=expert_bytes, kv_bytes=kv_bytes, state_bytes=state_bytes,
            free_bytes=self.pool.pool_bytes - expert_bytes - kv_bytes - state_bytes))
        return now

    # ---- observing -----------------------------------------------------------------------------------
    def enable_step_profiler(self, num_steps: int, trace_steps: int = 1) -> StepProfiler:
        """Profiles the next `num_steps` steps (engine/step_profiler.py); `trace_steps` steps of each kind also
        get their kernels counted (CUDA only). Read `step_profile_report()` afterwards."""
        self.profiler = StepProfiler(num_steps, self.device, self.runner.step_kind, trace_steps=trace_steps,
                                     expert_wait_s=lambda: self.runtime.expert_wait_s,
                                     offloaded=lambda: self.runtime.cache.num_offloaded,
                                     host_reads=lambda: self.runtime.host_reads)
        self.trace = self.profiler
        return self.profiler

    def observed_routing(self) -> np.ndarray | None:
        """[L_moe, E] the (token, expert) assignments this engine's passes routed so far (elastic mode counts
        them); None where none are counted. `ExpertPopularity.from_counts` makes a ranking file of them."""
        return self.runtime.observed_routing()

    def disable_step_profiler(self) -> None:
        """Steps are no longer watched; the last report is gone."""
        self.profiler = None
        self.trace = NULL_TRACE

    def shutdown(self) -> None:
        """Cuts the reference cycles among the engine's parts, so that dropping the engine frees its memory at once
        instead of at the garbage collector's next full pass (until then a GPU's memory stays taken); the engine
        serves nothing after:

            MoE block -> its expert provider -> the expert predictor -> the MoE blocks   (fixed and elastic modes;
                                                      the provider holds the pool's expert view and the host store)
            page allocator -> its reclaimer, the prefix cache -> the allocator
            engine -> its step profiler -> the expert-wait callback -> the engine
        """
        self.disable_step_profiler()
        if self.workers is not None:  # the other ranks exit, and this process leaves the group
            workers, self.workers = self.workers, None
            if self._in_flight is not None and workers.failure is None:  # its collectives end before the group does
                self._in_flight = None
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            workers.stop()
        self.model.attach_experts(NO_EXPERTS)
        self.pool.allocator.reclaimer = None

    def pool_reports(self) -> list[dict[str, Any]]:
        """Every rank's pool (engine/tp_workers.py `pool_report`: pages in use by kind, expert tables), rank 0's
        first; the ranks check their allocators' invariants. Between steps only: the other ranks answer it in
        place of a pass."""
        own = pool_report(self)
        return [own] if self.workers is None else self.workers.pool_reports(own)

    def step_profile_report(self) -> dict[str, Any] | None:
        """The step profiler's report (engine/step_profiler.py), None when it was never enabled."""
        return self.profiler.report() if self.profiler is not None else None

    def reset_prefix_cache(self) -> int:
        """Frees every prefix-cache page no request holds (vLLM's reset_prefix_cache), a hybrid model's state
        snapshots included; returns how many."""
        state = self.state.reset_prefix_cache() if self.state is not None else 0
        return self.kv.reset_prefix_cache() + state

    def stats(self) -> dict[str, Any]:
        st = self.pool.allocator.stats()
        with self._lock:
            queued = len(self._inbox)
        cache = self.runtime.cache
        warmup = self.workspace_profile.warmup if self.workspace_profile is not None else None
        return {
            "offload_mode": self.runtime.mode,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + queued,
            "kv_pages_used": self.kv.pages_in_use,  # held by requests
            "kv_pages_free": self.kv.capacity_pages(),  # free or cached for no request (reclaimable)
            "kv_pages_cached": self.kv.num_cached_pages,  # the prefix cache's pages no request holds
            # vLLM's counters, in tokens: prompt tokens looked up at admission, and those found in the cache
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "pool_bytes": st.pool_bytes,
            "free_bytes": st.total_free_bytes,
            # the pool's split: pool_bytes == kv_bytes_used + expert_bytes_used + state_bytes_used + free_bytes
            "kv_bytes_used": st.used_bytes.get(KV, 0),  # cached pages included
            "expert_bytes_used": st.used_bytes.get(EXPERT, 0),  # resident experts and the load buffers
            # hybrid models: requests' ssm + conv pages (0 for the others); in pool_bytes' split beside kv and experts
            "state_pages_used": self.state.pages_in_use if self.state is not None else 0,
            "state_bytes_used": self.state.bytes_in_use if self.state is not None else 0,  # snapshots included
            # hybrid models with prefix caching: ssm + conv pages of the state snapshots (held by requests or not)
            "state_pages_cached": self.state.num_cached_pages if self.state is not None else 0,
            "trapped_bytes": st.trapped_bytes,
            "resident_experts": self._resident_experts(),
            "total_experts": cache.total_experts,
            "forward_steps": self.forward_steps,
            "peak_running": self.peak_running,
            "preemptions": self.scheduler.num_preemptions,
            "kv_pages_moved": self.kv_pages_moved,  # by KV compaction, for experts coming home
            "kernel_variants_built": self.kernel_variants_built,  # by steps: each one waited for a compile
            # start-up's kernel warm-up (a GPU's; None on the CPU): what a cold Triton cache adds to a start
            "kernel_warmup_s": warmup.seconds if warmup is not None else None,
            "kernel_warmup_variants": warmup.variants_built if warmup is not None else None,
            "piecewise_overhead_ms": None if self.piecewise_overhead_s is None else 1e3 * self.piecewise_overhead_s,
            # KV tokens the pool could ever give requests (every allowed expert evicted) and the workspace the
            # budget reserved: levels fixed at start, what a serving sweep records beside its latencies
            "kv_tokens_max": self._max_kv_pages // max(1, self.kv.num_layers) * self.config.block_size,
            "workspace_bytes": self.budget_split["workspace"],
            # its parts as measured on a GPU (engine/workspace_profile.py; None on the CPU, where it is a bound)
            **{f"workspace_{part}_bytes": getattr(self.workspace_profile, part, None)
               for part in ("forward", "graphs", "sampling", "outside")},
            # where the start-up went (engine/startup_clock.py): seconds per phase, levels fixed at start
            **{f"startup_{key}_s": seconds for key, seconds in self._clock.seconds.items()},
            "startup_total_s": self._clock.total_s,
            **self.runtime.stats(),  # expert_bytes_loaded, prefetch hits/misses, evictions, grows, adjuster view
        }

