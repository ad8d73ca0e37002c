"""Pool checks of the engine tests: budgets tight enough that experts, KV and state pages compete, and the check that
a run left no page in use (hybrid models: KV, ssm and conv pages; experts and load buffers stay)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rimuru.experts.residency import EXPERT
from rimuru.memory.geometry import CONV, SSM

if TYPE_CHECKING:
    from rimuru.engine.llm_engine import LLMEngine

CHUNK = 16  # the hybrid engine tests' max_num_batched_tokens: prompts longer than this are prefilled in chunks


def assert_nothing_held(engine: LLMEngine) -> None:
    """No request holds a page: KV, ssm and conv pages are the prefix cache's alone (its cached KV blocks and state
    snapshots), and after a reset all back; only experts (and load buffers) remain."""
    alloc = engine.pool.allocator
    alloc.check_invariants()
    assert alloc.pending_deferred == 0
    assert engine.state is not None and engine.state.num_holders == 0
    engine.kv.check()
    engine.state.check()
    assert engine.kv.pages_in_use == 0
    assert alloc.num_used("kv") == engine.kv.num_cached_pages
    assert alloc.num_used(SSM) + alloc.num_used(CONV) == engine.state.num_cached_pages
    snaps = engine.state.snapshots
    assert snaps is None or snaps.num_unreferenced == snaps.num_snapshots  # no request holds one
    engine.reset_prefix_cache()
    alloc.check_invariants()
    assert alloc.num_used("kv") == 0 and engine.kv.pages_in_use == 0
    assert alloc.num_used(SSM) == 0 and alloc.num_used(CONV) == 0
    assert engine.state is not None and engine.state.num_holders == 0
    engine.state.check()
    st = engine.stats()
    assert st["state_bytes_used"] == 0 and st["kv_bytes_used"] == 0 and st["running"] == st["waiting"] == 0
    assert st["expert_bytes_used"] + st["free_bytes"] == st["pool_bytes"]


def tight_budget(ckpt: Path, requests: int, load_buffer_experts: int = 0, chunk: int = CHUNK,
                 **args: object) -> int:
    """A budget (bytes, CPU) holding every expert, `load_buffer_experts` load-buffer slots, and the state plus the
    first `chunk`-token KV of about `requests` requests of a hybrid model (sizes from a probe engine with the same
    batch limits and `args`)."""
    from rimuru import LLM

    probe = LLM(str(ckpt), gpu_memory_budget="1GiB", device="cpu", max_num_batched_tokens=chunk, **args)
    e = probe.engine
    split, geo = e.budget_split, e.geometry
    experts = 3 * e.runtime.cache.total_experts * geo.size(EXPERT)
    buffers = 2 * 3 * load_buffer_experts * geo.size(EXPERT)
    assert e.state is not None
    per_request = e.state.request_bytes + e.kv.blocks_for(chunk) * e.kv.num_layers * geo.size("kv")
    budget = split["non_expert_weights"] + split["workspace"] + experts + buffers + requests * per_request
    probe.shutdown()
    return budget + geo.huge_size
