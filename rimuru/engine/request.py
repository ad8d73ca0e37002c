"""The state of one request (one sequence) as it moves through the engine.

Lifecycle: WAITING -> RUNNING -> FINISHED_* ; a preempted request goes back to WAITING with its KV
pages (and a hybrid model's state pages) freed and `num_computed_tokens = 0` (recompute), keeping the tokens it
already produced (with prefix caching its full blocks stay cached, so it recomputes only what was reclaimed
meanwhile).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rimuru.engine.outputs import PromptLogprobs, RequestMetrics, SampleLogprobs
from rimuru.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    seq_id: int  # small integer, unique while alive: the allocator's page owner
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what the context leaves
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # KV cache filled (or being filled by a launched step) for all_token_ids[:num_computed_tokens]
    num_computed_tokens: int = 0
    # async scheduling: tokens sampled by launched steps but not read yet (0-2); they follow output_token_ids
    num_pending_tokens: int = 0
    # kv_pages[i][l] = page id (kind "kv") of block i in attention layer l
    kv_pages: list[list[int]] = field(default_factory=list)
    # hybrid models (engine/state_cache_manager.py): per linear-attention layer l, the page id of its recurrent
    # state (kind "ssm") and of its conv state (kind "conv"); empty while the request holds none
    ssm_pages: list[int] = field(default_factory=list)
    conv_pages: list[int] = field(default_factory=list)
    # with prefix caching: the state snapshots the request holds (the one it took, the one it started from)
    state_snapshots: list[Any] = field(default_factory=list)
    # hybrid prefix caching: where the request's cached KV chain ended at admission with no snapshot there (a
    # block boundary of its prompt; 0: none): its prefill snapshots that boundary too (state_cache_manager.py)
    kv_chain_boundary: int = 0
    # prefix caching (engine/kv_cache_manager.py): the names of the full blocks of all_token_ids hashed so far, and
    # how many leading blocks of kv_pages were offered to the cache (each is then the cached block or a private copy)
    block_hashes: list[bytes] = field(default_factory=list)
    num_offered_blocks: int = 0
    # prompt tokens found in the prefix cache at admission (vLLM's RequestOutput.num_cached_tokens); None before
    num_cached_tokens: int | None = None
    output_text: str = ""
    # one entry per output token when params.logprobs is set (engine/output_processor.py), else None
    logprobs: SampleLogprobs | None = field(init=False, default=None)
    # params.prompt_logprobs set: the entries of the prompt positions computed so far ([None] for the first), else
    # None; never changed once whole (the outputs share it)
    prompt_logprobs: PromptLogprobs | None = field(init=False, default=None)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request sampling stream when a seed is given
    metrics: RequestMetrics = field(init=False)
    # incremental detokenisation state (see detokenizer.py)
    prefix_offset: int = 0
    read_offset: int = 0
    # tokenizers.decoders.DecodeStream of a fast tokenizer (engine/detokenizer.py); False: it failed, window path
    decode_stream: Any = None

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """num_tokens plus the pending token: what the scheduler plans with."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.kv_pages)

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
