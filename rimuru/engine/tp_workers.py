"""The ranks of a tensor-parallel engine: rank 0 is the engine's own process, ranks 1..N-1 are worker processes.

Every rank builds the same engine from the same config (engine/llm_engine.py) with its own shard of the weights, its
own pool of the same page count and its own slice of the host expert store, so that page ids mean the same bytes
of every rank's slice. One decision, applied everywhere: only rank 0 schedules, adjusts and samples; per forward
pass it sends a `PassPlan` and every rank runs the same pass, meeting in the collectives of the sharded layers:

    rank 0                                              rank r > 0 (`_worker_main`)
    schedule, plan (evictions, grows: its allocator)
    PassPlan(batch arrays, expert tables, graph) --broadcast-->  receive; new table rows: copy this rank's slice
                                                          of the expert from its host store into the named pages
    forward + LM head  <------- all-reduce / all-gather ------->  forward + LM head (sampled rows, then any
    (eager, or the graph      inside the pass or the graph     prompt-logprob rows in rank 0's chunks; logits
     of the step's size)                                        dropped): the same graph where rank 0 replays one
    sample; with async scheduling
    broadcast the sampled  --------- device broadcast -------->  keep them for the next pass's pending rows
    tokens, stream outputs
    ...
    shutdown: None --broadcast-->                         exit

Workers never allocate: their allocators stay as start-up left them, the ids all come from rank 0. The batch arrays
hold the input tokens, but for async scheduling's pending rows (the previous pass's sampled tokens, which rank 0 had
not read when it sent the plan): every rank fills those on its device from its copy of that pass's tokens, which
rank 0 broadcasts on the device group as the last collective of each sampling pass. CUDA graphs: every rank captures
the same ladders in the same order at start (the same config and code), so the collectives captured in them pair up;
a pass rank 0 replays from a graph carries its choice (`GraphStep`) and arrays padded to its size, and every rank
replays the same graph. Where passes decide per expert-table cut inside the graph (copy access), the ranks run eager
(`cuda_graphs.why_no_graphs`). Between passes rank 0 may send a `KVCopy` (KV compaction's moves in a step without a
pass) or a `PoolProbe`: every rank answers the probe with its `pool_report` (the tests' check that no rank holds a
page after a run and that every rank's expert tables are rank 0's).

Failure: a worker that raises reports its traceback on a queue and exits; one that dies closes its sockets. Either
way the collective rank 0 is in fails within about a second (gloo), and the engine raises one `WorkerFailed`
naming the rank and its error; every later step raises it again; `stop` ends the workers that are left. Rank 0
raising in a step after it sent the pass's plan (before the pass's collectives) fails the same way: the workers
wait in that pass, where no later plan can meet them, so they are killed and the engine raises `WorkerFailed`
naming rank 0's error. The server marks its engine dead on a `WorkerFailed` (/health answers 503). Under NCCL a
collective blocked on a dead peer does not fail by itself: rank 0 watches its workers' process sentinels and aborts
the process groups on a death, and every worker watches rank 0 and ends itself if it dies
(distributed/peer_watcher.py).
"""

from __future__ import annotations

import logging
import os
import queue
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.multiprocessing as mp

from rimuru.config import EngineConfig
from rimuru.distributed.parallel_state import TensorParallel, destroy_tensor_parallel, free_port, init_tensor_parallel
from rimuru.distributed.peer_watcher import PeerWatcher, abort_device_groups, device_groups_need_abort
from rimuru.engine.kv_cache_manager import KV
from rimuru.engine.kv_compaction import KVMoves
from rimuru.engine.model_runner import GraphStep
from rimuru.engine.state_cache_manager import StateCopy
from rimuru.experts.offload_runtime import OffloadRuntime
from rimuru.experts.residency import EXPERT
from rimuru.memory.geometry import CONV, SSM

if TYPE_CHECKING:
    from rimuru.engine.llm_engine import LLMEngine

logger = logging.getLogger("rimuru")

# How long rank 0 waits, after a collective failed, for the failed worker's report to arrive.
REPORT_WAIT_S = 3.0


class WorkerFailed(RuntimeError):
    """A tensor-parallel rank died or raised (a worker, or rank 0 mid-pass): the engine cannot run another pass."""


@dataclass
class PassPlan:
    """One forward pass, as rank 0 sends it to every rank."""

    arrays: list[np.ndarray]  # HostBatch.fields(), in order
    max_query_len: int
    sample: bool  # the pass computes logits (every rank joins the LM head's all-gather)
    expert_tables: np.ndarray | None = None  # [L_moe, E, 3] int32: the tables the pass reads (elastic mode)
    # hybrid models' prefix caching: whole states copied page to page before the pass (engine/state_cache_manager.py)
    state_copies: list[StateCopy] = field(default_factory=list)
    # prompt logprobs: the hidden rows the LM head runs over after the sampled rows (engine/prompt_logprobs.py)
    prompt_rows: np.ndarray | None = None
    # elastic mode with copies: rank 0's load-buffer pages (buffer 0's slots, then buffer 1's), when they changed
    # since the last plan ([] once detached); which expert a slot holds stays each rank's own
    buffer_pages: list[int] | None = None
    kv_moves: KVMoves | None = None  # KV compaction's page moves, copied before the pass (engine/kv_compaction.py)
    graph: GraphStep | None = None  # the captured graph rank 0 replays (its arrays padded to it); None: eager
    # async scheduling: the input rows whose tokens the previous pass sampled, and their rows among those tokens
    pending: tuple[list[int], list[int]] | None = None


@dataclass
class KVCopy:
    """Not a pass: KV compaction's moves, queued alone because rank 0's step had no pass to carry them."""

    moves: KVMoves


@dataclass
class PoolProbe:
    """Not a pass: every rank answers with its `pool_report`, gathered on rank 0."""


def pool_report(engine: LLMEngine) -> dict[str, Any]:
    """This rank's pool after its allocator's invariants are checked: pages in use by kind, pages requests hold,
    state holders, the expert tables the passes read and the expert bytes it copied host -> device."""
    alloc = engine.pool.allocator
    alloc.check_invariants()
    kinds = (KV, EXPERT, SSM, CONV) if engine.state is not None else (KV, EXPERT)  # state kinds: hybrid models'
    return {"rank": engine.tp.rank, "used": {kind: alloc.num_used(kind) for kind in kinds},
            "kv_pages_in_use": engine.kv.pages_in_use,
            "state_holders": engine.state.num_holders if engine.state is not None else 0,
            "expert_tables": engine.runtime.cache.host_tables.numpy().copy(),
            "expert_bytes_loaded": engine.runtime.bytes_loaded}


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r's device: the r-th visible GPU (CUDA_VISIBLE_DEVICES decides which they are), or the CPU."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is available")
    if torch.cuda.device_count() < config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs as many GPUs; "
                         f"{torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", rank)


class TensorParallelWorkers:
    """Rank 0's handle on ranks 1..N-1: starts them, sends them each pass, notices when one is gone."""

    def __init__(self, config: EngineConfig) -> None:
        size = config.tensor_parallel_size
        self.device = rank_device(config, 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        port = free_port()
        ctx = mp.get_context("spawn")
        self._errors: Any = ctx.Queue()
        self.failure: WorkerFailed | None = None
        self.watcher: PeerWatcher | None = None
        self.procs = [ctx.Process(target=_worker_main, args=(rank, config, port, self._errors), daemon=True,
                                  name=f"rimuru-tp-rank{rank}") for rank in range(1, size)]
        for p in self.procs:
            p.start()
        try:
            self.tp = init_tensor_parallel(0, size, port, self.device,
                                           expert_parallel=config.enable_expert_parallel)
        except BaseException:
            self.kill()
            raise
        # NCCL: a collective blocked on a dead worker returns only when the communicators are aborted
        self.watcher = PeerWatcher([p.sentinel for p in self.procs], abort_device_groups,
                                   name="rimuru-tp-worker-watcher") if device_groups_need_abort() else None
        logger.info("tensor parallelism: %d ranks (%s), workers %s", size, self.device.type,
                    ", ".join(str(p.pid) for p in self.procs))

    def send(self, plan: PassPlan | KVCopy | PoolProbe | None) -> None:
        self.check()
        self.tp.broadcast_object(plan)

    def pool_reports(self, own: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `pool_report`, rank 0's (`own`) first."""
        self.send(PoolProbe())
        try:
            reports = self.tp.gather_object(own)
        except RuntimeError as e:  # a worker whose pool failed its checks raised and left
            raise self.failed(e) from e
        assert reports is not None
        return reports

    def check(self) -> None:
        """Raises the failure already seen, or that of a worker found dead now."""
        if self.failure is None and any(p.exitcode is not None for p in self.procs):
            self.failure = self._failure(None)
        if self.failure is not None:
            raise self.failure

    def failed(self, error: BaseException) -> WorkerFailed:
        """The one error the engine raises for `error`, raised by a collective or a send of rank 0."""
        if self.failure is None:
            self.failure = self._failure(error)
        return self.failure

    def _failure(self, error: BaseException | None) -> WorkerFailed:
        reports: list[tuple[int, str]] = []
        try:
            reports.append(self._errors.get(timeout=REPORT_WAIT_S))
            while True:
                reports.append(self._errors.get_nowait())
        except queue.Empty:
            pass
        for p in self.procs:
            p.join(timeout=0.5)
        dead = [f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
                for r, p in enumerate(self.procs, start=1) if p.exitcode is not None]
        lines = [f"rank {r} raised:\n{tb.rstrip()}" for r, tb in reports] + dead
        if not lines:  # a collective timed out, or rank 0 itself raised after it sent the pass
            lines = [f"rank 0 raised with every worker alive: {type(error).__name__}: {error}"]
        self._stop_watching()  # the workers killed now end on purpose
        self.kill()
        return WorkerFailed("a tensor-parallel rank failed; the engine cannot run another pass:\n"
                            + "\n".join(lines))

    def stop(self) -> None:
        """Tells the workers to exit and waits for them; kills those that do not."""
        self._stop_watching()
        if self.failure is None and all(p.exitcode is None for p in self.procs):
            try:
                self.tp.broadcast_object(None)
            except RuntimeError:
                pass
        for p in self.procs:
            p.join(timeout=10)
        self.kill()
        destroy_tensor_parallel(self.tp)

    def _stop_watching(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()

    def kill(self) -> None:
        for p in self.procs:
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)


def follow(engine: LLMEngine, plan: PassPlan) -> torch.Tensor | None:
    """Runs rank 0's pass on this rank: its expert tables first, then the forward pass and the LM head (eager, or
    the graph rank 0 replays). Fixed mode with copies decides its loads inside the pass, from the routing, which is
    the same on every rank: each rank's provider copies its own slice of the experts it routes into its own load
    buffers (the pass hooks around it as on rank 0). Returns this rank's copy of the pass's logits."""
    if plan.expert_tables is not None:
        apply_expert_tables(engine, plan.expert_tables)
    if plan.buffer_pages is not None:
        apply_buffer_pages(engine, plan.buffer_pages)
    # the copy path's pass hook (its streaming plan, its buffers' claims); the rest of the runtimes' pass hooks is
    # rank 0's bookkeeping (the adjusters' observations), which the workers do not keep
    if engine.config.offload_access == "copy" and engine.runtime.mode != "static":
        OffloadRuntime.before_pass(engine.runtime, len(plan.arrays[0]))  # the input ids: no padding rows eagerly
    return engine.runner.follow(plan.arrays, plan.max_query_len, plan.sample, plan.state_copies, plan.prompt_rows,
                                plan.kv_moves, plan.graph, plan.pending)


def apply_buffer_pages(engine: LLMEngine, pages: list[int]) -> None:
    """Rank 0's load-buffer pages become this rank's: the same page ids (rank 0's allocator gave them), emptied
    and refilled by this rank's own loads. Applied before the pass that first reads them, and a detach before the
    first pass after rank 0's (which frees the pages only after its last pass that read them)."""
    loader = engine.runtime.loader
    if loader.buffer_pages == pages:
        return
    if loader.buffer_pages:
        loader.detach()
    if pages:
        loader.add_slots(pages)


def apply_expert_tables(engine: LLMEngine, tables: np.ndarray) -> None:
    """Rank 0's expert tables become this rank's: an expert that entered pages (a grow) gets its slice copied from
    this rank's host store into them first. Pages a row names stop being read only when rank 0's tables stop naming
    them, so this rank's copy lands before any pass reads it and after the last pass that read the pages before."""
    cache = engine.runtime.cache
    new = torch.from_numpy(tables)
    changed = ((new != cache.host_tables).any(-1) & (new[..., 0] >= 0)).nonzero().tolist()
    store = getattr(engine.runtime, "store", None)
    for layer, expert in changed:
        if store is None:
            raise RuntimeError(f"rank 0 moved expert {expert} of MoE layer {layer} but this rank keeps no host store")
        src = store.expert(layer, expert)  # [3, f/N * d]
        for j, page in enumerate(new[layer, expert].tolist()):
            cache.expert_view[page].copy_(src[j])
    cache.host_tables.copy_(new)
    cache.tables_changed()
    cache.tables.copy_(new.to(cache.tables.device))


def _worker_main(rank: int, config: EngineConfig, port: int, errors: Any) -> None:
    """A worker's life: join the group, build this rank's engine, follow rank 0's passes until told to stop."""
    from rimuru.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)  # tiny per-rank work on shared cores; a GPU rank does its work on the device
    tp: TensorParallel | None = None
    try:
        parent = mp.parent_process()
        if parent is not None:  # rank 0 gone: end this rank, wherever it waits (the rendezvous, an NCCL collective)
            PeerWatcher([parent.sentinel], lambda: os._exit(1), name="rimuru-tp-rank0-watcher")
        device = rank_device(config, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = init_tensor_parallel(rank, config.tensor_parallel_size, port, device,
                                  expert_parallel=config.enable_expert_parallel)
        engine = LLMEngine(config, tp=tp)
        while True:
            plan = tp.broadcast_object()
            if plan is None:
                break
            if isinstance(plan, PoolProbe):
                tp.gather_object(pool_report(engine))
                continue
            if isinstance(plan, KVCopy):
                engine.runner.copy_kv(plan.moves)
                continue
            follow(engine, plan)
    except BaseException:  # noqa: BLE001 - every failure goes to rank 0, then the process ends
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        os._exit(1)
    engine.shutdown()
    if tp is not None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)  # no collective of the last pass still queued on the device
        destroy_tensor_parallel(tp)
    # no interpreter teardown: the communication library's threads would be torn down under it (and say so on stderr)
    os._exit(0)
