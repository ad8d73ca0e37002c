"""What tensor parallelism sends the other ranks is the whole pass: a follower fed only rank 0's plans reproduces it.

Under tensor parallelism rank 0 sends each pass (`PassPlan`: the batch's host arrays, expert tables, state copies,
KV moves, and the CUDA graph it replays with its arrays padded to it) and KV compaction's moves between passes
(`KVCopy`); a worker runs them (engine/tp_workers.py `follow`) over its own pool, never allocating. Here, on the CPU
and in one process, rank 0 is an engine whose workers are a link that hands every plan at once to a second engine
of the same checkpoint, as a worker would: without collectives, every pass of the follower must give the logits
rank 0 sampled from, bit for bit, eager or through the graphs' static buffers (test_hybrid_graphs' stand-ins for
captured graphs), through chunked prefill, preemptions, prefix-cache hits with state copies, evictions and grows.
What this cannot show is the collectives captured inside the graphs pairing up across GPUs; that needs two GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_hybrid_graphs import CHUNK, MODES, SEQS, _memory, replay_through_static_buffers, serve

from rimuru import LLM
from rimuru.engine.kv_cache_manager import KV
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.tp_workers import KVCopy, PassPlan, follow
from rimuru.experts.residency import EXPERT
from rimuru.memory.geometry import CONV, SSM
from rimuru.testing.pools import assert_nothing_held

pytest.importorskip("transformers")


class FollowerLink:
    """Stands in for TensorParallelWorkers: each plan rank 0 sends is run at once by `follower`, as a worker's loop
    would run it; the logits of its sampling passes are kept, in order."""

    def __init__(self, follower: LLMEngine) -> None:
        self.follower = follower
        self.logits: list[torch.Tensor] = []
        self.graph_passes = self.eager_passes = self.kv_copies = self.state_copies = 0

    def check(self) -> None:
        pass

    def send(self, plan: Any) -> None:
        if isinstance(plan, KVCopy):
            self.follower.runner.copy_kv(plan.moves)
            self.kv_copies += 1
            return
        assert isinstance(plan, PassPlan), plan
        logits = follow(self.follower, plan)
        self.state_copies += len(plan.state_copies)
        if plan.graph is not None:
            self.graph_passes += 1
        else:
            self.eager_passes += 1
        if plan.sample:
            assert logits is not None
            self.logits.append(logits.clone())

    def stop(self) -> None:
        pass


@pytest.fixture(scope="module")
def hybrid_ckpt(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint("qwen3_5_moe_text", seed=3)


def _engine(ckpt: Path, mode: str, memory: dict[str, object]) -> tuple[LLM, LLMEngine]:
    llm = LLM(str(ckpt), device="cpu", max_num_batched_tokens=CHUNK, max_num_seqs=SEQS, async_scheduling=False,
              **memory, **MODES[mode][0])
    engine = llm.engine
    cache = engine.model.state_cache
    assert cache is not None
    cache.in_place_decode = True  # the GPU's decode path (the paged kernels' torch references here)
    return llm, engine


# (mode, graphs): the modes whose graphs tensor parallelism replays (static, direct access) eager and through both
# kinds of mixed graph; copy access runs eager under tensor parallelism (cuda_graphs.why_no_graphs)
CASES = [(mode, graphs) for mode in ("static", "elastic-direct") for graphs in ("eager", "cut", "single-prefill")]
CASES.append(("fixed-copy", "eager"))


@pytest.mark.parametrize(("mode", "graphs"), CASES)
def test_a_follower_fed_only_the_plans_gives_rank_0s_logits(hybrid_ckpt: Path, mode: str, graphs: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    memory = _memory(hybrid_ckpt, mode)
    leader_llm, leader = _engine(hybrid_ckpt, mode, memory)
    follower_llm, follower = _engine(hybrid_ckpt, mode, memory)
    if graphs != "eager":  # both ranks "captured" the same ladders
        for engine in (leader, follower):
            replay_through_static_buffers(engine, single_prefill=graphs == "single-prefill")
    link = FollowerLink(follower)
    leader.workers = link  # type: ignore[assignment]  # rank 0 of two, its one worker in this process
    leader.runner.peers = leader._send_pass
    sampled: list[torch.Tensor] = []
    sampler = leader.runner.sampler

    def recording_sampler(logits: torch.Tensor, *args: Any) -> torch.Tensor:
        sampled.append(logits.clone())
        return sampler(logits, *args)

    monkeypatch.setattr(leader.runner, "sampler", recording_sampler)
    replays = {"decode": 0, "mixed": 0}  # the follower's own graph replays, by kind
    for kind in replays:
        replay = getattr(follower.runner, f"_replay_{kind}")

        def counted(*args: Any, kind: str = kind, replay: Any = replay) -> torch.Tensor:
            replays[kind] += 1
            return replay(*args)

        monkeypatch.setattr(follower.runner, f"_replay_{kind}", counted)
    used_before = {kind: follower.pool.allocator.num_used(kind) for kind in (KV, EXPERT, SSM, CONV)}

    serve(leader)

    stats = leader_llm.stats()
    if mode == "static":
        assert stats["preemptions"] > 0, stats
    elif mode == "elastic-direct":
        assert stats["expert_evictions"] > 0 and stats["expert_grows"] > 0, stats
    else:  # copies into the load buffers, and a prefix hit whose state snapshot is copied before its pass
        assert stats["expert_bytes_loaded"] > 0 and link.state_copies > 0, stats
    if graphs == "eager":
        assert link.graph_passes == 0 and link.eager_passes > 0 and replays == {"decode": 0, "mixed": 0}
    else:  # every pass replayed a graph on both ranks (the steps fit the ladders)
        assert link.eager_passes == 0 and link.graph_passes == leader.runner.graph_steps > 0
        assert replays["decode"] + replays["mixed"] == leader.runner.graph_steps  # the follower replayed each one
        assert replays["mixed"] == leader.runner.mixed_graph_steps > 0 and replays["decode"] > 0
        single = follower.runner.graphs.single_prefill_replays  # type: ignore[union-attr]
        assert (single > 0) == (graphs == "single-prefill")
        assert single == leader.runner.graphs.single_prefill_replays  # type: ignore[union-attr]
    assert len(link.logits) == len(sampled) > 0
    for i, (mine, theirs) in enumerate(zip(sampled, link.logits, strict=True)):
        assert torch.equal(mine, theirs), f"sampling pass {i}: the follower's logits differ from rank 0's"
    # the follower allocated nothing: its pages are rank 0's ids, its allocator as start-up left it
    assert {kind: follower.pool.allocator.num_used(kind) for kind in used_before} == used_before
    assert_nothing_held(leader)
    leader.workers = None
    leader_llm.shutdown()
    follower_llm.shutdown()


def test_which_tensor_parallel_engines_capture_graphs_reads_the_configured_mode() -> None:
    """Every rank profiles its workspace before the ranks agree on a mode, so under tensor parallelism the rule must
    not depend on the mode a rank picks: copy access captures no graphs unless static is set."""
    from rimuru.config import EngineConfig
    from rimuru.engine.cuda_graphs import why_no_graphs

    def why(mode: str, **kw: object) -> str | None:
        return why_no_graphs(EngineConfig(model="m", **kw), mode, in_place_decode=True)  # type: ignore[arg-type]

    for picked in ("static", "fixed", "elastic"):  # auto mode: whichever a rank's memory picked, the same answer
        assert "copy access" in (why(picked, tensor_parallel_size=2, offload_access="copy") or "")
        assert why(picked, tensor_parallel_size=2, offload_access="direct") is None
        assert why(picked, offload_access="copy") is None  # one GPU: piecewise graphs decide on the host, alone
    assert why("static", tensor_parallel_size=2, offload_access="copy", offload_mode="static") is None
    assert why("static", enforce_eager=True) == "--enforce-eager"
    assert why_no_graphs(EngineConfig(model="m"), "static", in_place_decode=False) is not None
