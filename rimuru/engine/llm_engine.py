"""The engine: requests in, one step at a time, outputs out.

One step (docs/architecture.md, "Request lifecycle"):
  1. take in requests and aborts that arrived since the last step;
  2. the scheduler picks running + waiting requests and gives them KV pages;
  3. the runner builds the batch, runs the model, samples;
  4. new tokens are appended, detokenised and checked against stop conditions; finished requests
     free their pages; pages released after the forward pass (evicted experts) return to the pool.
`add_request` and `abort_request` may be called from another thread (the server); they only queue.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from rimuru.config import EngineConfig, format_bytes
from rimuru.engine.cuda_graphs import PIECEWISE_OVERHEAD_PER_LAYER_S
from rimuru.engine.detokenizer import detokenize_incrementally
from rimuru.engine.model_runner import ModelRunner, SampledTokens
from rimuru.engine.outputs import CompletionOutput, RequestOutput
from rimuru.engine.piecewise_graphs import ExpertTableBoundaries
from rimuru.engine.request import Request, RequestStatus
from rimuru.engine.sampler import Sampler
from rimuru.engine.sampling_params import SamplingParams
from rimuru.engine.scheduler import Scheduler, SchedulerOutput
from rimuru.engine.setup import build_engine_parts
from rimuru.engine.step_metrics import StepMetrics, StepMetricsRing
from rimuru.engine.step_profiler import StepProfiler
from rimuru.experts.adjuster import AdjustPlan
from rimuru.experts.cache import EXPERT
from rimuru.experts.offload_provider import OffloadExpertProvider
from rimuru.models.expert_provider import StaticExpertProvider

logger = logging.getLogger("rimuru")


def _moe_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "provider")]


def _graph_capturable(model: torch.nn.Module) -> bool:
    """Graphs need expert tables that never require a host decision mid-forward (static experts)."""
    return all(isinstance(m.provider, StaticExpertProvider) for m in _moe_modules(model))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine_parts(config)
        self.parts = parts
        self.spec = parts.spec
        self.tokenizer = parts.tokenizer
        self.device = parts.device
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.experts = parts.experts
        self.kv = parts.kv
        self.elastic = parts.elastic
        self.scheduler = Scheduler(parts.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   reclaimable=self.elastic.reclaimable_kv_pages if self.elastic else None,
                                   admission_reserve=self.elastic.admission_reserve_kv_pages if self.elastic else None)
        self.runner = ModelRunner(parts.model, parts.device, parts.num_attention_layers, config.block_size,
                                  Sampler(parts.device, config.seed))
        # Async scheduling: step n+1 is launched before step n's tokens are read. A page freed meanwhile may still
        # be read by the pass in flight: KV allocations reuse it on the same stream (ordered after that pass), and
        # elastic grows copy into pages only after the last launched pass (ExpertLoader.last_pass_done).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        if self.elastic is not None:
            self.elastic.async_steps = self.async_scheduling
        self._in_flight: tuple[SchedulerOutput, SampledTokens] | None = None
        if isinstance(parts.provider, OffloadExpertProvider):
            self.runner.expert_provider = parts.provider
        self.piecewise_overhead_s: float | None = None  # elastic with graphs: measured at start-up
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs()
        if self.device.type == "cuda":
            self._check_workspace()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._requests: dict[str, Request] = {}
        self._next_seq_id = 0
        self.forward_steps = 0
        self.start_time = time.monotonic()
        self.step_metrics = StepMetricsRing()
        self.peak_running = 0
        self.step_profiler: StepProfiler | None = None  # enable_step_profiler()
        self._expert_page_bytes = parts.geometry.size(EXPERT)
        self._kv_page_bytes = parts.geometry.size("kv")

    def _capture_graphs(self) -> None:
        """CUDA graphs (engine/cuda_graphs.py). Static experts: whole-forward graphs. Offloading providers
        (fixed, elastic): piecewise graphs cut at every MoE layer's expert-table decision, which is replayed
        on the host between the pieces (engine/piecewise_graphs.py); elastic also whole graphs over the
        resident tables, replayed while every expert is resident. Expert tables and page tables change in
        place, so evictions, grows and loads never invalidate a graph."""
        cfg, model = self.config, self.parts.model
        args = (cfg.max_num_seqs, self.max_model_len, cfg.max_num_batched_tokens)
        provider = self.parts.provider
        cap = cfg.max_cudagraph_capture_size
        if _graph_capturable(model):
            self.runner.enable_cuda_graphs(*args, counter=getattr(provider, "counter", None), max_capture_size=cap)
        elif isinstance(provider, OffloadExpertProvider):
            boundaries = ExpertTableBoundaries(provider, _moe_modules(model))
            resident = None
            # elastic passes are often fully resident: whole graphs for those, unless every expert can never be
            # resident at once (the free pool at start, before any KV, cannot take the offloaded ones back)
            offloaded = self.experts.total_experts - self.experts.num_resident
            can_all_fit = offloaded * 3 <= self.pool.allocator.mid_capacity(EXPERT)
            if self.elastic is not None and can_all_fit:
                resident = StaticExpertProvider(provider.expert_view, provider.cache.tables)
                resident.counter = provider.counter
            self.runner.enable_cuda_graphs(*args, counter=provider.counter, boundaries=boundaries,
                                           resident_provider=resident, max_capture_size=cap)
            if resident is not None:
                overhead = self.runner.graphs.measure_piecewise_overhead()
                if overhead is None:  # experts offloaded at start: the H200's figure per MoE layer
                    overhead = PIECEWISE_OVERHEAD_PER_LAYER_S * provider.cache.num_layers
                    logger.info("piecewise graphs: not measurable at start (experts offloaded); assuming %.2f ms",
                                1e3 * overhead)
                self.piecewise_overhead_s = overhead
                # step times are measured without it; the cost adjuster charges it to offloading
                self.elastic.piecewise_overhead_s = overhead
                if hasattr(self.elastic.adjuster, "piecewise_overhead_s"):
                    self.elastic.adjuster.piecewise_overhead_s = overhead

    def _check_workspace(self) -> None:
        """The budget reserved `workspace` for everything beyond weights and pool; say when the start alone
        (graph pools, warm-up) took more, since then the engine holds more than gpu_memory_budget."""
        split = self.parts.budget_split
        used = torch.cuda.memory_reserved(self.device) - split["non_expert_weights"] - split["pool"]
        log = logger.warning if used > split["workspace"] else logger.info
        log("after start, torch holds %s beyond weights and pool; the workspace bound is %s",
            format_bytes(used), format_bytes(split["workspace"]))

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
        vocab = self.spec.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's context (max_model_len) is "
                             f"{self.max_model_len}, which leaves no room for output")
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens={params.max_tokens} is too large: the prompt has {len(ids)} tokens "
                             f"and max_model_len is {self.max_model_len}, so at most {room} can be generated")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        need = self.kv.blocks_for(len(ids) + max_tokens) * self.kv.num_layers
        most = self.max_kv_pages()
        if need > most:
            raise ValueError(f"this request needs {need} KV pages ({len(ids)} prompt + {max_tokens} output tokens)"
                             f" but the pool can never hold more than {most}; lower max_tokens or the prompt")
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

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)

    @property
    def eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return int(self.tokenizer.eos_token_id)
        return self.spec.eos_token_id[0] if self.spec.eos_token_id else None

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: [0, vocab_size)."""
        return self.spec.vocab_size

    def step_profile_report(self) -> dict[str, Any] | None:
        """The step profiler's report (engine/step_profiler.py), None when it was never enabled."""
        return self.step_profiler.report() if self.step_profiler is not None else None

    def max_kv_pages(self) -> int:
        """KV pages the pool could ever give requests (every allowed expert evicted)."""
        return self.parts.max_kv_pages

    # ---- the step ----------------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        with self._lock:
            pending = bool(self._inbox or self._aborts)
        return pending or self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        prof = self.step_profiler if self.step_profiler is not None and self.step_profiler.active else None
        if prof is not None:
            prof.begin(t0)
        loaded0 = self._bytes_loaded()
        graph_steps0 = self.runner.graph_steps
        outputs = self._take_inbox()
        if self.elastic is not None:
            self.elastic.commit_grows()
        sched = self.scheduler.schedule()
        num_tokens = sched.num_tokens
        running = len(self.scheduler.running)
        if running > self.peak_running:
            self.peak_running = running
        if prof is not None:
            prof.mark("schedule")
            prof.set_kind(self.runner.step_kind(sched), num_tokens, len(sched.scheduled))
        plan = None
        if self.elastic is not None:
            plan = self.elastic.adjust(sched.shortfall_pages, num_tokens, running, len(self.scheduler.waiting),
                                       num_stalled=len(sched.stalled), max_num_seqs=self.scheduler.max_num_seqs)
        if prof is not None:
            prof.mark("adjust")
        previous: tuple[SchedulerOutput, SampledTokens] | None = None
        if self.async_scheduling:
            previous, self._in_flight = self._in_flight, None
            if previous is not None and sched.scheduled and self.runner.pass_reads_routing(sched.num_tokens):
                # This launch would stop at an offloaded layer's routing read, long after step n is done: read
                # and process step n first, so its tokens reach clients a pass earlier. Requests that finish
                # now leave the batch (their pages are already freed).
                outputs += self._process(previous[0], previous[1].tolist())
                previous = None
                sched.scheduled = [s for s in sched.scheduled if not s.request.status.finished]
        if self.elastic is not None:
            self.elastic.launching(sched.num_tokens)  # what runs now (finished requests may have left the batch)
        launched: tuple[SchedulerOutput, SampledTokens] | None = None
        if sched.scheduled:
            now = time.monotonic()
            for s in sched.scheduled:
                req = s.request
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
                req.num_computed_tokens = s.start + s.num_new_tokens
            launched = (sched, self.runner.launch(sched))
            self.forward_steps += 1
            if self.async_scheduling:
                for s in sched.scheduled:
                    if s.samples:
                        s.request.num_pending_tokens += 1  # read by _process when the next step() has launched
        # Async: step n+1 is queued behind step n on the device; read and process step n meanwhile.
        # Sync: read and process the step just launched (the read waits for it).
        if self.async_scheduling:
            self._in_flight = launched
        else:
            previous = launched
        if previous is not None:
            outputs += self._process(previous[0], previous[1].tolist())
            if prof is not None:
                prof.mark("process")
        if self.elastic is not None:
            self.elastic.after_forward()
        self.pool.allocator.complete_forward()  # pages the finished forward pass may have read are free now
        t_end = self._record(t0, num_tokens, self.runner.graph_steps > graph_steps0, plan, loaded0)
        if prof is not None:
            prof.end(t_end)
            if not prof.active:
                self.runner.profiler = None
        return outputs

    # ---- step profiler -----------------------------------------------------------------------------
    def enable_step_profiler(self, num_steps: int, trace_steps: int = 1) -> StepProfiler:
        """Profiles the next `num_steps` steps (engine/step_profiler.py); `trace_steps` steps of each kind
        also get their kernels counted (CUDA only). Read `engine.step_profiler.report()` afterwards."""
        if self.step_profiler is not None:  # a profiler still running gives its providers back first
            self.step_profiler.close()
        providers = [m.provider for m in self.parts.model.modules()
                     if hasattr(m, "provider") and not isinstance(m.provider, StaticExpertProvider)]
        unique = list({id(p): p for p in providers}.values())
        self.step_profiler = StepProfiler(num_steps, self.device, trace_steps=trace_steps, providers=unique)
        self.runner.profiler = self.step_profiler
        return self.step_profiler

    def _bytes_loaded(self) -> int:
        loader = self.parts.loader
        return loader.counters.bytes_loaded if loader is not None else 0

    def _record(self, t0: float, num_tokens: int, graph: bool, plan: AdjustPlan | None, loaded0: int) -> float:
        expert_bytes = self.pool.allocator.num_used(EXPERT) * self._expert_page_bytes
        kv_pages = self.kv.pages_in_use
        kv_bytes = kv_pages * self._kv_page_bytes
        now = time.monotonic()
        self.step_metrics.append(StepMetrics(
            t=now - self.start_time, step_time_s=now - t0, num_tokens=num_tokens, cuda_graph=graph,
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            kv_pages_used=kv_pages, resident_experts=self.experts.num_resident,
            evictions=len(plan.evict) if plan else 0, grows=len(plan.grow) if plan else 0,
            bytes_loaded=self._bytes_loaded() - loaded0,
            expert_bytes=expert_bytes, kv_bytes=kv_bytes,
            free_bytes=self.pool.pool_bytes - expert_bytes - kv_bytes))
        return now

    def _take_inbox(self) -> list[RequestOutput]:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in new:
            self._requests[req.request_id] = req
            self.scheduler.add(req)
        outputs = []
        for rid in aborts:
            req = self._requests.pop(rid, None)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                req.metrics.finished_time = time.monotonic()
                outputs.append(self._output(req))
        return outputs

    def _process(self, sched: SchedulerOutput, tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        it = iter(tokens)
        now = time.monotonic()
        for s in sched.scheduled:
            req = s.request
            if not s.samples:
                continue
            token = next(it)
            if self.async_scheduling:
                req.num_pending_tokens -= 1
            if req.status.finished:  # async: finished or aborted while this step was in flight; a wasted row
                continue
            req.output_token_ids.append(token)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            status = self._check_stop(req, token)
            if status is not None:
                self.scheduler.finish(req, status)
                req.metrics.finished_time = now
                self._requests.pop(req.request_id, None)
                outputs.append(self._output(req))
            else:
                outputs.append(self._running_output(req))
        return outputs

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if self.tokenizer is not None:
            new_text = detokenize_incrementally(self.tokenizer, req, p.skip_special_tokens)
            if p.stop_strings and new_text:
                # a stop string may straddle the old and new text: search the tail that could contain it
                start = max(0, len(req.output_text) - max(len(s) for s in p.stop_strings) + 1)
                req.output_text += new_text
                for stop in p.stop_strings:
                    at = req.output_text.find(stop, start)
                    if at != -1:
                        end = at + len(stop) if p.include_stop_str_in_output else at
                        req.output_text = req.output_text[:end]
                        req.stop_reason = stop
                        return RequestStatus.FINISHED_STOPPED
            else:
                req.output_text += new_text
        if token == req.eos_token_id and not p.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, req: Request) -> RequestOutput:
        comp = CompletionOutput(index=0, text=req.output_text, token_ids=list(req.output_token_ids),
                                finish_reason=req.finish_reason, stop_reason=req.stop_reason)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=[comp], finished=req.status.finished, metrics=req.metrics)

    @staticmethod
    def _running_output(req: Request) -> RequestOutput:
        """`_output` of a request that is still running (no finish reason), without the status lookups.

        With stop strings cut from the output, the last `longest stop - 1` characters are held back (vLLM's
        stop buffer): they may be the start of a stop string that the next token completes, and the final
        text then drops them, so a streamed text that had sent them could not be taken back."""
        text = req.output_text
        p = req.params
        if p.stop_strings and not p.include_stop_str_in_output:
            hold = max(len(s) for s in p.stop_strings) - 1
            if hold:
                text = text[:-hold]
        comp = CompletionOutput(0, text, req.output_token_ids.copy(), None, req.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], False, req.metrics)

    # ---- numbers -----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        st = self.pool.allocator.stats()
        with self._lock:
            queued = len(self._inbox)
        return {
            "offload_mode": self.parts.mode,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + queued,
            "kv_pages_used": self.kv.pages_in_use,
            "kv_pages_free": self.kv.capacity_pages(),
            "pool_bytes": st.pool_bytes,
            "free_bytes": st.total_free_bytes,
            # the pool's split: pool_bytes == kv_bytes_used + expert_bytes_used + free_bytes
            "kv_bytes_used": st.used_bytes.get("kv", 0),
            "expert_bytes_used": st.used_bytes.get(EXPERT, 0),  # resident experts and the load buffers
            "trapped_bytes": st.trapped_bytes,
            "resident_experts": self.experts.num_resident,
            "total_experts": self.experts.total_experts,
            "forward_steps": self.forward_steps,
            "peak_running": self.peak_running,
            "preemptions": self.scheduler.num_preemptions,
            "piecewise_overhead_ms": None if self.piecewise_overhead_s is None else 1e3 * self.piecewise_overhead_s,
            **self.parts.offload_stats(),  # expert_bytes_loaded, prefetch_hits, prefetch_misses
        }
