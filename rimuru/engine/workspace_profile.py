"""The start-up memory profile: what one step holds beyond the weights and the pool, measured before the pool exists.

The budget is non-expert weights + workspace + pool, and the pool takes whatever is left, so the workspace has to be
known before the pool is allocated (profile, then allocate, as vLLM does). The model's non-expert weights are on
the GPU by then; its routed experts and KV cache live in the pool, which does not exist yet. The profile runs the
model over a one-huge-page scratch pool instead: every expert table entry points at expert page 0 and every block
table at KV page 0, so the kernels read and write real pages of the real shapes while the shapes of every
activation are those of the engine's worst step.

    scratch pool (one huge page)   | expert 0 | expert 1 | ... | kv 0 kv 1 ... |
    every (layer, expert)  ------> expert page 0 (W1, W3, W2 alike)
    every (sequence, block) -----> KV page 0

What is measured (device memory seen by torch's allocator and by the driver, `torch.cuda.mem_get_info`):

    forward   the eager pass of max_num_batched_tokens tokens over min(max_num_seqs, T) prompts, with every
              sequence's last row sampled (temperature, top-k and top-p: the sampler's largest working set), and
              the default stream's cuBLAS workspace its matmuls make
    outside   memory the passes made outside torch's allocator (cuBLAS handles, loaded kernel images)
    graphs    a throwaway capture of the same CUDA graphs the engine captures (whole, piecewise, or both; a hybrid
              model's mixed ladder cut at its gated DeltaNet layers, with the static rows those cuts share), over
              the scratch pool: the graphs' memory pool (with the cuBLAS workspace their matmuls made inside it) and
              the graph objects; then given back
    sampling  what runs eagerly beside the graphs' pool: S rows of logits sampled, and one chunk of prompt logprobs
              (the LM head over SAMPLE_ROWS_PER_CHUNK hidden rows, with the default stream's cuBLAS workspace that
              its matmul makes, unless `forward` is counted beside the graphs and holds it already)

torch keeps a cuBLAS workspace per stream for the life of the process (32 MiB on Hopper, `release_cublas_workspaces`
in engine/cuda_graphs.py): the profile gives every one back before each measurement and at its end, so each term
counts the workspace its own passes make, and the engine makes each again where it first needs it.

The presence, frequency and repetition penalties hold nothing between steps: a chunk's counts are built inside the
sampler chunk's working set that `sampling` (and `forward`) measure (engine/penalties.py), so they add no term.

Device memory is read with `torch.cuda.mem_get_info`, which sees the whole GPU: like vLLM's profile, this one assumes
no other process allocates on the GPU while the engine starts (another process's memory would be charged to the
workspace; the GPU tests that start engines run one at a time for this reason).

The workspace is `forward + outside` when every step runs eagerly; with CUDA graphs it is `graphs + sampling +
outside`, plus the eager `forward` when steps above --max-cudagraph-capture-size run eagerly beside the graphs (a
hybrid model's mixed steps always run part of the pass eagerly beside them: its prefill sequences' chunk form
between the pieces). The capture's graphs read state page ids of -1 (their static buffers as captured), so the
paged decode kernels touch no state page. On the
CPU nothing is measured (host memory; see setup.workspace_bytes for the bound used there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rimuru.config import EngineConfig, format_bytes
from rimuru.engine.cuda_graphs import StepGraphs, release_cublas_workspaces, why_no_graphs
from rimuru.engine.kernel_warmup import WarmupReport, warm_up_kernels
from rimuru.engine.kv_cache_manager import KV
from rimuru.engine.piecewise_graphs import ExpertTableBoundaries
from rimuru.engine.prompt_logprobs import PromptLogprobRows, compute_prompt_logprobs
from rimuru.engine.sampler import SAMPLE_ROWS_PER_CHUNK, Sampler
from rimuru.engine.sampling_params import SamplingParams
from rimuru.experts.expert_tiers import resolve_cpu_expert_compute
from rimuru.experts.residency import EXPERT
from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.memory.geometry import PageGeometry
from rimuru.memory.pool import PagePool
from rimuru.model_spec import ModelSpec
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.forward_batch import ForwardBatch, StepLayout
from rimuru.models.loader import init_dummy_weights
from rimuru.models.moe import NO_EXPERTS
from rimuru.models.state_cache import LinearStateCache, no_state_cache

logger = logging.getLogger("rimuru")

# the sampling parameters of the profile: every cut on, so the sampler's working copies are all made
_PROFILE_SAMPLING = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)


@dataclass(frozen=True)
class WorkspaceProfile:
    mode: str  # the offload mode whose graphs were captured
    forward: int  # eager pass of the largest step plus its sampling, beyond what was held before
    outside: int  # device memory outside torch's allocator the passes made (cuBLAS workspaces, kernel images)
    graphs: int  # CUDA graphs' pool and graph objects (0: eager)
    sampling: int  # S rows sampled eagerly (beside the graphs)
    eager_steps_beside_graphs: bool  # steps above the capture cap run eagerly while the graphs hold their pool
    warmup: WarmupReport | None = None  # the kernel warm-up's passes, time and Triton builds (engine/kernel_warmup.py)

    @property
    def workspace(self) -> int:
        if self.graphs == 0:
            return self.forward + self.outside
        return self.graphs + self.sampling + self.outside + (self.forward if self.eager_steps_beside_graphs else 0)

    def describe(self) -> str:
        parts = [f"forward {format_bytes(self.forward)}", f"outside torch {format_bytes(self.outside)}"]
        if self.graphs:
            parts += [f"CUDA graphs {format_bytes(self.graphs)}", f"sampling {format_bytes(self.sampling)}"]
        return ", ".join(parts)


@dataclass(frozen=True)
class DeviceMemoryMark:
    """Device memory in use (driver's view) and reserved by torch's allocator at one moment."""

    used: int
    reserved: int

    @classmethod
    def now(cls, device: torch.device) -> DeviceMemoryMark:
        return cls(used=_device_used(device), reserved=torch.cuda.memory_reserved(device))

    def outside_torch_since(self, device: torch.device) -> int:
        """Device memory made since this mark outside torch's allocator (kernel images, library handles)."""
        later = DeviceMemoryMark.now(device)
        return max(0, (later.used - self.used) - (later.reserved - self.reserved))


def _device_used(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class _ScratchPool:
    """One huge page of the real geometry: expert and KV views whose page 0 every table entry points at."""

    def __init__(self, spec: ModelSpec, geometry: PageGeometry, dtype: torch.dtype, device: torch.device,
                 num_kv_heads: int, block_size: int) -> None:
        if geometry.num_pages(EXPERT, geometry.huge_size) < 1 or geometry.num_pages(KV, geometry.huge_size) < 1:
            raise ValueError("a huge page holds no expert page or no KV page: the geometry cannot be profiled")
        self.pool = PagePool(geometry, geometry.huge_size, device)
        self.kv_view = self.pool.kv_view(num_kv_heads, spec.head_dim, dtype, block_size)
        tables = torch.zeros(spec.num_moe_layers, spec.num_experts, 3, dtype=torch.int32, device=device)
        self.provider = StaticExpertProvider(self.pool.expert_view(dtype), tables)
        # hybrid models: every sequence's state on ssm and conv page 0 of the same bytes
        self.state = LinearStateCache(self.pool.ssm_view(), self.pool.conv_view(dtype)) if spec.is_hybrid else None


def _largest_step(num_layers: int, tokens: int, seqs: int, block_size: int, vocab_size: int,
                  device: torch.device, num_linear_layers: int = 0) -> ForwardBatch:
    """`tokens` prompt tokens split over `seqs` fresh prompts (see `_prompt_step`)."""
    lens = [tokens // seqs + (1 if i < tokens % seqs else 0) for i in range(seqs)]
    return _prompt_step(lens, num_layers, block_size, vocab_size, device, num_linear_layers)


def _prompt_step(lens: list[int], num_layers: int, block_size: int, vocab_size: int, device: torch.device,
                 num_linear_layers: int = 0) -> ForwardBatch:
    """Fresh prompts of `lens` tokens, every block on KV page 0 (a hybrid model's states on state page 0), each
    prompt's last row sampled."""
    seqs, tokens = len(lens), sum(lens)
    state_pages = (torch.zeros(num_linear_layers, seqs, dtype=torch.int64, device=device) if num_linear_layers
                   else None)
    starts = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])
    max_len = max(lens)
    blocks = -(-max_len // block_size)
    slots = (positions % block_size).to(torch.int64)  # page 0, the token's offset in its block
    return ForwardBatch(
        input_ids=torch.randint(0, vocab_size, (tokens,), device=device), positions=positions.to(device),
        query_start_loc=starts.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros(num_layers, seqs, blocks, dtype=torch.int32, device=device),
        slot_mapping=slots.to(device).expand(num_layers, tokens).contiguous(),
        logits_indices=(starts[1:] - 1).to(torch.int64).to(device), max_query_len=max_len, max_seq_len=max_len,
        ssm_pages=state_pages, conv_pages=state_pages,
        layout=StepLayout.of(lens) if num_linear_layers else None)  # the serving passes' split (state_cache.py)


def _run_prompts(model: MoECausalLM, spec: ModelSpec, lens: list[int], block_size: int,
                 device: torch.device) -> torch.Tensor:
    """One pass over fresh prompts of `lens` tokens in the scratch pool (`_prompt_step`): the sampled rows' logits."""
    step = _prompt_step(lens, len(spec.attention_layer_ids), block_size, spec.vocab_size, device,
                        len(spec.linear_layer_ids))
    return model.compute_logits(model(step)[step.logits_indices])


def _sample(logits: torch.Tensor, sampler: Sampler) -> None:
    rows = logits.shape[0]  # logits [rows, V] fp32
    sampler(logits, [_PROFILE_SAMPLING] * rows, [None] * rows)


@torch.inference_mode()
def profile_workspace(model: MoECausalLM, spec: ModelSpec, config: EngineConfig, geometry: PageGeometry,
                      dtype: torch.dtype, device: torch.device, max_model_len: int,
                      mode_for: Callable[[int], str], engine_start: DeviceMemoryMark,
                      before_graphs: Callable[[str], None] = lambda mode: None) -> WorkspaceProfile:
    """Measures the workspace of `model` (non-expert weights on `device`, no experts or KV cache bound yet) at the
    batch limits of `config`, with graphs sized for `max_model_len`, for the CUDA graphs of the offload mode
    `mode_for(eager workspace)` names; leaves the model unbound again. Memory outside torch's allocator is counted
    from `engine_start` (what building the model loaded counts too). The non-expert weights are random here
    (the checkpoint is read after the pool exists, and overwrites them)."""
    init_dummy_weights(model, seed=config.seed)  # uninitialised memory could hold NaNs; shapes are what count
    T, S = config.max_num_batched_tokens, config.max_num_seqs
    num_attn = len(spec.attention_layer_ids)
    kv_heads = max(1, spec.num_key_value_heads // config.tensor_parallel_size)
    release_cublas_workspaces(device)  # the forward pass makes the default stream's workspace: it counts
    torch.cuda.empty_cache()
    scratch = _ScratchPool(spec, geometry, dtype, device, kv_heads, config.block_size)
    held = torch.cuda.memory_reserved(device)  # the scratch pool is not workspace
    model.bind_kv_cache(scratch.kv_view)
    model.attach_experts(scratch.provider)
    if scratch.state is not None:
        model.bind_state_cache(scratch.state)
    sampler = Sampler(device, config.seed)
    torch.cuda.reset_peak_memory_stats(device)
    batch = _largest_step(num_attn, T, min(S, T), config.block_size, spec.vocab_size, device,
                          len(spec.linear_layer_ids))
    hidden = model(batch)  # [T, d]
    logits = model.compute_logits(hidden[batch.logits_indices])  # [rows, V] fp32
    del hidden
    _sample(logits, sampler)
    del logits, batch
    forward = torch.cuda.max_memory_reserved(device) - held
    mode = mode_for(forward + engine_start.outside_torch_since(device))
    with torch.inference_mode(False):  # what the hook makes (the host store) outlives the profile: normal tensors
        before_graphs(mode)
    # the kernel variants serving will launch, in the mode's variant, built now; their images count in `outside`
    model.attach_experts(_engine_provider(scratch, mode, config))
    warmup = warm_up_kernels(lambda lens: _run_prompts(model, spec, lens, config.block_size, device), S, T,
                             spec.num_experts, spec.num_experts_per_tok)
    model.attach_experts(scratch.provider)
    torch.cuda.empty_cache()
    outside = engine_start.outside_torch_since(device)
    graphs = sampling = 0
    eager_beside = False
    # the engine's choice (why_no_graphs): the graphs it will capture in this mode are measured
    in_place = scratch.state is None or scratch.state.in_place_decode
    if why_no_graphs(config, mode, in_place) is None:
        release_cublas_workspaces(device)  # the capture counts the workspace it makes in the graphs' pool
        torch.cuda.empty_cache()
        before = _device_used(device)
        step_graphs = _capture_like_the_engine(model, scratch, mode, device, num_attn, len(spec.linear_layer_ids),
                                               config, max_model_len)
        graphs = _device_used(device) - before
        # eager passes beside the graphs' pool: steps above the largest graph, and a hybrid's eager stretches
        # between the pieces of its mixed graphs (its prefill sequences' chunk form, bounded by the eager pass)
        eager_beside = not step_graphs.token_sizes or step_graphs.token_sizes[-1] < T or bool(spec.is_hybrid)
        sampling = _eager_beside_graphs(model, spec, config, sampler, device, counts_cublas=not eager_beside)
        del step_graphs
    model.bind_kv_cache(torch.empty(0, device=device))
    model.attach_experts(NO_EXPERTS)  # nothing of the scratch pool stays reachable
    if scratch.state is not None:
        model.bind_state_cache(no_state_cache(device, dtype))
    del scratch
    release_cublas_workspaces(device)  # made again by the engine's first pass that needs one, as measured
    torch.cuda.empty_cache()
    profile = WorkspaceProfile(mode=mode, forward=forward, outside=outside, graphs=graphs, sampling=sampling,
                               eager_steps_beside_graphs=eager_beside, warmup=warmup)
    logger.info("workspace measured before the pool: %s (%s)", format_bytes(profile.workspace), profile.describe())
    return profile


def _eager_beside_graphs(model: MoECausalLM, spec: ModelSpec, config: EngineConfig, sampler: Sampler,
                         device: torch.device, counts_cublas: bool) -> int:
    """What the engine runs eagerly beside the graphs' pool in a step that replays a graph: the sampler over S rows
    of the graphs' logits buffer (counted with the graphs), and the prompt logprobs' LM head over one chunk of
    hidden rows with its packing (engine/prompt_logprobs.py), whose matmul makes the default stream's cuBLAS
    workspace. That workspace stays once made: counted here unless the eager forward pass, counted beside the graphs
    too, already holds it (`counts_cublas` False)."""
    S, V, K = config.max_num_seqs, spec.vocab_size, config.max_logprobs
    rows = min(SAMPLE_ROWS_PER_CHUNK, config.max_num_batched_tokens)
    width = V if K == -1 else min(K, V)
    # the LM head's input: final hidden states in the model dtype (the embedding's; some layers keep fp32 parameters)
    hidden = torch.zeros(rows, spec.hidden_size, dtype=model.model.embed_tokens.weight.dtype, device=device)
    prompt = PromptLogprobRows(hidden_rows=np.arange(rows, dtype=np.int64), targets=np.zeros(rows, dtype=np.int64),
                               nums=[width] * rows, spans=[])
    torch.cuda.empty_cache()
    start = torch.cuda.memory_reserved(device)
    compute_prompt_logprobs(model.compute_logits, hidden, prompt)  # makes the default stream's workspace
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    cublas = torch.cuda.memory_reserved(device) - start  # what stays: the workspace
    logits = torch.zeros(S, V, dtype=torch.float32, device=device)
    torch.cuda.reset_peak_memory_stats(device)
    start = torch.cuda.memory_reserved(device)
    compute_prompt_logprobs(model.compute_logits, hidden, prompt)
    _sample(logits, sampler)
    transient = torch.cuda.max_memory_reserved(device) - start
    return transient + (cublas if counts_cublas else 0)


def _capture_like_the_engine(model: MoECausalLM, scratch: _ScratchPool, mode: str, device: torch.device,
                             num_attn: int, num_linear: int, config: EngineConfig, max_model_len: int) -> StepGraphs:
    """The graph ladders the engine will capture in `mode` (static, and fixed or elastic with direct access: whole
    graphs; fixed with copies: piecewise; elastic with copies: piecewise and whole), over the scratch pool; a hybrid
    model's (`num_linear` linear-attention layers) mixed graphs cut at its gated DeltaNet layers, over its scratch
    state cache."""
    provider = _engine_provider(scratch, mode, config)
    boundaries = None
    copies = mode != "static" and config.offload_access == "copy"
    if copies:  # with the engine's host joins where its provider has a host tier
        host_joins = resolve_cpu_expert_compute(config.cpu_expert_compute, device.type, config.offload_access)
        boundaries = ExpertTableBoundaries(None, model, provider.expert_view, provider.tables, host_joins=host_joins)
    model.attach_experts(provider)
    graphs = StepGraphs(model, device, num_attn, config.max_num_seqs, max_model_len, config.block_size,
                        config.max_num_batched_tokens, boundaries=boundaries,
                        resident_provider=provider if copies and mode == "elastic" else None,
                        max_capture_size=config.max_cudagraph_capture_size, num_linear_layers=num_linear)
    graphs.capture()
    return graphs


def _engine_provider(scratch: _ScratchPool, mode: str, config: EngineConfig) -> StaticExpertProvider:
    """The scratch pool's experts in the MoE kernel variant the engine's mode launches: fixed and elastic modes with
    direct access read host rows (here the scratch pages stand for them: no host memory is read); static mode and
    copy access read pages only."""
    provider = scratch.provider
    if mode == "static" or config.offload_access == "copy":
        return provider
    return StaticExpertProvider(provider.expert_view, provider.tables,
                                host_rows=[provider.expert_view] * provider.tables.shape[0])
