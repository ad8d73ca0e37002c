"""Gated DeltaNet: the linear-attention layer of Qwen3.5-MoE (and Qwen3-Next), in plain torch.

Per token t and value head j (key head j // (Hv / Hk) supplies q_t, k_t):

    x_t = SiLU(causal_depthwise_conv1d(in_proj_qkv(h))_t)        conv over the last `kernel` inputs
    q_t, k_t, v_t = split(x_t);  q_t = l2norm(q_t) / sqrt(dk);  k_t = l2norm(k_t)
    beta_t = sigmoid(in_proj_b(h)_t)                            in (0, 1): how far the state moves
    g_t = -exp(A_log) * softplus(in_proj_a(h)_t + dt_bias)      <= 0: log of the state's decay
    S_t = exp(g_t) S_{t-1};  S_t += k_t (beta_t (v_t - S_t^T k_t))^T      the gated delta rule
    o_t = S_t^T q_t
    y_t = out_proj(RMSNormGated(o_t, z_t)),  z = in_proj_z(h),  RMSNormGated = w * norm(o) * silu(z)

The recurrence has two forms here, with equal results: `chunk_gated_delta_rule` (prefill; chunks of C
tokens become a few matmuls and one triangular solve, then a scan over chunks) and
`recurrent_gated_delta_rule` (decode; one state update per token). Prefill on a GPU in bf16/fp16 runs fla-core's
chunk kernel instead where it is installed (kernels/fla_gated_delta.py: packed rows, no padding, the same states in
and out); the torch chunk form stays the reference and the CPU's path.

State memory layout, per request and per linear-attention layer:

    recurrent state  [Hv, dk, dv] fp32, even in a bf16 model (the sums run long): S above, key dim first
    conv state       [conv_dim, kernel - 1] model dtype: the last kernel - 1 pre-conv inputs, oldest
                     first; conv_dim = 2 * Hk * dk + Hv * dv, channels ordered [q | k | v] as in_proj_qkv

A batch of B requests passes them as [B, Hv, dk, dv] and [B, conv_dim, kernel - 1]. The layer reads the
initial states and returns the final ones as new tensors; writing them back (e.g. into pool pages) is the
caller's. Initial-state memory of a request that starts fresh is garbage (reused pool bytes): its zero
state is SELECTED with `torch.where`, never made by multiplying with a mask (NaN * 0 is NaN).

Tokens come flattened as in ForwardBatch: sequence b owns rows query_start_loc[b] : query_start_loc[b+1].
Inside, sequences are padded to the longest one (a host int where the caller knows it, so padding reads nothing
from the device; one sequence is not padded at all); padded steps get beta = 0 and g = 0, which leave the
state unchanged, so the state after the padding is the state at the sequence's end. fla's kernel takes the rows
packed, gathered back from the padded conv output by index (`packed_index`), never by a boolean mask.

The layer's parts, each over rows of any sequences: `project` (the input projections, the decay g and beta per
row), `varlen_core` (conv and delta rule of whole sequences from their initial states), `decode_rows` (one token per
row through the paged kernels, states in their pages) and `_output` (gated norm, out_proj). `forward` is project ->
varlen_core -> _output; models/state_cache.py splits a pass between decode_rows and varlen_core.

`GatedDeltaNet.decode_paged` is the decode step (one token per sequence) with the states read from and written
to their pool pages in place by the paged kernels (kernels/causal_conv1d_update.py, kernels/gated_delta_decode.py):
no gather, no scatter, no host sync. models/state_cache.py decides which passes take it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.kernels.causal_conv1d_update import causal_conv1d_update
from rimuru.kernels.fla_gated_delta import fla_chunk_applies, fla_chunk_gated_delta_rule
from rimuru.kernels.gated_delta_decode import gated_delta_decode
from rimuru.kernels.rmsnorm import rms_norm_gated
from rimuru.models.parallel_linear import RowParallelLinear, rank_shard, section_shard, set_shard


class RMSNormGated(nn.Module):
    """w * x / rms(x), then * silu(z) in fp32: the output norm of a gated DeltaNet head (not zero-centred)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor, z: Tensor) -> Tensor:  # x, z [..., size]
        return rms_norm_gated(x, z, self.weight, self.eps)  # one Triton launch on CUDA (kernels/rmsnorm.py)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:  # [..., D]
    """x / sqrt(sum(x^2) + eps): eps inside the root, as the reference kernels do."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def varlen_index(query_start_loc: Tensor, max_len: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The padded layout of flattened rows: row index [B, L] (clamped into the batch), valid [B, L] and lens [B].

    `max_len` (the longest sequence, a host int the batch knows) sizes L without a host sync; None reads it from
    the device (one sync: the reference's way)."""
    lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [B]
    if max_len is None:
        max_len = int(lens.max()) if lens.numel() else 0
    steps = torch.arange(max_len, device=query_start_loc.device)  # [L]
    valid = steps[None, :] < lens[:, None]  # [B, L]
    rows = query_start_loc[:-1].long()[:, None] + steps[None, :]  # [B, L]
    return rows, valid, lens


def pad_rows(x: Tensor, rows: Tensor, valid: Tensor) -> Tensor:
    """x [T, ...] gathered into the padded layout of `varlen_index`: [B, L, ...], zeros past each end."""
    padded = x[rows.clamp(max=max(x.shape[0] - 1, 0))]  # [B, L, ...]
    mask = valid.view(*valid.shape, *([1] * (x.dim() - 1)))
    return torch.where(mask, padded, 0)  # a scalar: no zero tensor to make


def pad_varlen(x: Tensor, query_start_loc: Tensor, max_len: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Flattened rows [T, ...] -> padded [B, L, ...] (zeros past each end), plus valid [B, L] and lens [B]."""
    rows, valid, lens = varlen_index(query_start_loc, max_len)
    return pad_rows(x, rows, valid), valid, lens


def packed_index(query_start_loc: Tensor, max_len: int, num_rows: int) -> Tensor:
    """[T] int64: each flattened row's place b * L + t in the padded [B * L] layout (the inverse of the padding).
    T and L are host ints: no host sync (repeat_interleave is told its output size)."""
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens,
                                  output_size=num_rows)  # [T]
    return seq * max_len + torch.arange(num_rows, device=lens.device) - starts[seq]


def causal_conv1d(
    x: Tensor, conv_state: Tensor, weight: Tensor, lens: Tensor | int
) -> tuple[Tensor, Tensor]:  # x [B, C, L], conv_state [B, C, K-1], weight [C, K], lens [B] (or one host int)
    """Depthwise causal conv + SiLU over each sequence, continuing from conv_state; returns (y, final state).

    Output t of sequence b sees inputs t-K+1 .. t, where negative times come from its conv state. The
    final state is the last K-1 inputs before each sequence's end, which for a sequence shorter than K-1
    still includes part of the initial state. `lens` as a host int (every sequence that long): the final states
    are a slice, not a gather.
    """
    B, C, L = x.shape
    K = weight.shape[1]
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1)  # [B, C, K-1+L]: state columns are times -K+1..-1
    y = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=C)  # [B, C, L], no padding: all causal
    y = F.silu(y).to(x.dtype)
    # Sequence b ends at column (K-1) + lens[b] of `full`; its last K-1 inputs are the columns just before.
    if isinstance(lens, int):
        return y, full[:, :, lens : lens + K - 1]
    cols = lens[:, None] + torch.arange(K - 1, device=x.device)[None, :]  # [B, K-1]
    final = full.gather(2, cols[:, None, :].expand(B, C, K - 1))  # [B, C, K-1]
    return y, final


def chunk_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk_size: int = 64
) -> tuple[Tensor, Tensor]:
    """The gated delta rule in chunks. q, k [B, H, L, dk] (normalised, scaled), v [B, H, L, dv],
    g, beta [B, H, L], state [B, H, dk, dv]; all fp32. Returns o [B, H, L, dv] and the final state.

    Inside a chunk with cumulative log decay c_t = g_1 + ... + g_t and entry state S_0, the updates
    u_t = beta_t (v_t - S_{t-1}'^T k_t) (S' = decayed state) satisfy a unit lower-triangular system

        u_t + sum_{s<t} beta_t e^{c_t - c_s} (k_t . k_s) u_s = beta_t v_t - beta_t e^{c_t} S_0^T k_t

    and then  o_t = e^{c_t} S_0^T q_t + sum_{s<=t} e^{c_t - c_s} (q_t . k_s) u_s,
              S_C = e^{c_C} S_0 + sum_s e^{c_C - c_s} k_s u_s^T.
    """
    B, H, L, dk = k.shape
    dv = v.shape[-1]
    pad = (-L) % chunk_size
    if pad:  # padded steps: beta = 0, g = 0 leave the state alone and their outputs are dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (L + pad) // chunk_size
    C = chunk_size
    q, k, v = (t.reshape(B, H, n, C, t.shape[-1]) for t in (q, k, v))  # [B, H, n, C, d]
    g, beta = (t.reshape(B, H, n, C) for t in (g, beta))  # [B, H, n, C]

    c = g.cumsum(-1)  # [B, H, n, C] cumulative log decay inside each chunk
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [C, C] s <= t
    # e^{c_t - c_s} for s <= t; the masked entries would be e^{positive}: mask before exp, not after
    decay_ts = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, n, C, C]

    kk = k @ k.transpose(-1, -2)  # [B, H, n, C, C]
    system = beta[..., :, None] * kk * decay_ts  # strictly-lower part is A; the diagonal is replaced by 1
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    system = system.masked_fill(~causal, 0.0).tril(-1) + eye  # [B, H, n, C, C] unit lower triangular
    rhs_v = beta[..., None] * v  # [B, H, n, C, dv]
    rhs_k = (beta * c.exp())[..., None] * k  # [B, H, n, C, dk]: multiplies S_0 on the right-hand side
    solved = torch.linalg.solve_triangular(system, torch.cat([rhs_v, rhs_k], dim=-1), upper=False,
                                           unitriangular=True)  # [B, H, n, C, dv + dk]
    u_v, u_k = solved.split([dv, dk], dim=-1)  # u = u_v - u_k @ S_0

    qk = (q @ k.transpose(-1, -2)) * decay_ts  # [B, H, n, C, C], zero above the diagonal
    q_decayed = q * c.exp()[..., None]  # [B, H, n, C, dk]: reads S_0 through e^{c_t}
    k_to_end = k * (c[..., -1:] - c).exp()[..., None]  # [B, H, n, C, dk]: e^{c_C - c_s} k_s
    chunk_decay = c[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]

    out = torch.empty(B, H, n, C, dv, dtype=q.dtype, device=q.device)
    for i in range(n):  # the only sequential part: one step per chunk
        u = u_v[:, :, i] - u_k[:, :, i] @ state  # [B, H, C, dv]
        out[:, :, i] = q_decayed[:, :, i] @ state + qk[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u  # [B, H, dk, dv]
    return out.reshape(B, H, n * C, dv)[:, :, :L], state


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The gated delta rule one token at a time (decode). Same arguments and results as the chunk form."""
    L = q.shape[2]
    outs = []
    for t in range(L):
        state = state * g[:, :, t].exp()[..., None, None]  # [B, H, dk, dv] decayed
        k_t = k[:, :, t]  # [B, H, dk]
        predicted = (k_t[..., None] * state).sum(-2)  # [B, H, dv] = S^T k
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)  # [B, H, dv]
        state = state + k_t[..., None] * delta[..., None, :]  # rank-1 update k delta^T
        outs.append((q[:, :, t, :, None] * state).sum(-2))  # [B, H, dv] = S^T q
    return torch.stack(outs, dim=2), state  # [B, H, L, dv], [B, H, dk, dv]


class GatedDeltaNet(nn.Module):
    """One gated DeltaNet layer over a varlen batch; parameter names follow the HF checkpoints."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        chunk_size: int = 64,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        # Tensor-parallel, rank r holds key heads [r Hk/N, (r+1) Hk/N) and the value heads that read them,
        # [r Hv/N, (r+1) Hv/N): every size below is this rank's, the state pages hold its heads only
        # (PageGeometry.ssm_shape, conv_shape), and out_proj sums the ranks' parts.
        sections = (num_k_heads * head_k_dim, num_k_heads * head_k_dim, num_v_heads * head_v_dim)  # q, k, v
        qkv_cut = section_shard(tp, 0, sections, "linear attention q/k/v heads")
        num_k_heads = tp.part(num_k_heads, "linear_num_key_heads")
        num_v_heads = tp.part(num_v_heads, "linear_num_value_heads")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.chunk_size = chunk_size
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        # nn.Conv1d only to hold `conv1d.weight` [conv_dim, 1, K] under the checkpoint's name
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = RMSNormGated(head_v_dim, eps)  # per head, over dv: replicated, no reduce
        self.out_proj = RowParallelLinear(self.value_dim, hidden_size, bias=False, tp=tp)
        set_shard(self.in_proj_qkv, "weight", qkv_cut)
        set_shard(self.conv1d, "weight", qkv_cut)  # the conv's channels are in_proj_qkv's outputs
        heads = rank_shard(tp, 0)
        for module, name in ((self.in_proj_z, "weight"), (self.in_proj_b, "weight"), (self.in_proj_a, "weight"),
                             (self, "dt_bias"), (self, "A_log")):
            set_shard(module, name, heads)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """Per-request (conv state [conv_dim, K-1] in the model dtype, recurrent state [Hv, dk, dv] fp32)."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def forward(
        self,
        x: Tensor,  # [T, hidden]
        query_start_loc: Tensor,  # [B+1] int
        conv_state: Tensor,  # [B, conv_dim, K-1] model dtype, garbage where has_initial_state is False
        recurrent_state: Tensor,  # [B, Hv, dk, dv] fp32, likewise
        has_initial_state: Tensor,  # [B] bool: False = the sequence starts fresh (zero states)
        recurrent: bool = False,  # True: the per-token form (decode); False: the chunk form (prefill)
        max_len: int | None = None,  # the longest sequence (host int): no host sync; None reads it on the device
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns (output [T, hidden], final conv state [B, conv_dim, K-1], final recurrent state [B, Hv, dk, dv])."""
        keep = has_initial_state.bool()
        conv0 = torch.where(keep[:, None, None], conv_state, 0)  # selected: the garbage is never multiplied
        state0 = torch.where(keep[:, None, None, None], recurrent_state.float(), 0)
        mixed, g, beta = self.project(x)
        o, conv_final, state = self.varlen_core(mixed, g, beta, conv0, state0, query_start_loc, max_len, recurrent)
        return self._output(x, o), conv_final.to(conv_state.dtype), state  # [T, hidden]

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, hidden] -> the pre-conv inputs [T, conv_dim], log decay g [T, Hv] fp32 and beta [T, Hv] (x's dtype,
        rounded there as HF does): per row, whatever sequence the row belongs to."""
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # [T, Hv]
        return self.in_proj_qkv(x), g, self.in_proj_b(x).sigmoid()

    def varlen_core(
        self,
        mixed: Tensor,  # [T, conv_dim] pre-conv inputs of B sequences (project), flattened
        g: Tensor,  # [T, Hv] fp32
        beta: Tensor,  # [T, Hv]
        conv0: Tensor,  # [B, conv_dim, K-1]: initial conv states, zero for fresh sequences (selected by the caller)
        state0: Tensor,  # [B, Hv, dk, dv] fp32: initial recurrent states, likewise
        query_start_loc: Tensor,  # [B+1] int, query_start_loc[0] == 0, query_start_loc[B] == T
        max_len: int | None,  # the longest of the B sequences (host int), None: read on the device (a sync)
        recurrent: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The conv and the delta rule of each sequence from its initial states: (o [T, Hv, dv] in mixed's dtype,
        final conv states [B, conv_dim, K-1], final recurrent states [B, Hv, dk, dv] fp32). With max_len given no
        step reads the device from the host. One sequence (B == 1) needs no padding gather at all."""
        T = mixed.shape[0]
        B = query_start_loc.shape[0] - 1
        lens: Tensor | int
        if B == 1:  # the rows are the sequence: [1, T, ...] views, nothing padded
            L, valid, lens = T, None, T
            padded = mixed[None]
        else:
            rows, valid, lens = varlen_index(query_start_loc, max_len)
            L = rows.shape[1]
            padded = pad_rows(mixed, rows, valid)  # [B, L, conv_dim]

        def pad(t: Tensor) -> Tensor:  # [T, ...] -> [B, L, ...]
            return t[None] if valid is None else pad_rows(t, rows, valid)

        def unpad(t: Tensor) -> Tensor:  # [B, L, ...] -> [T, ...]: padded steps dropped, back to row order
            if valid is None:
                return t[0]
            return t.reshape(B * L, *t.shape[2:]).index_select(0, packed_index(query_start_loc, L, T))

        conv_out, conv_final = causal_conv1d(padded.transpose(1, 2), conv0, self.conv1d.weight.squeeze(1), lens)
        q, k, v = conv_out.transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        if not recurrent and fla_chunk_applies(mixed):  # prefill on a GPU in bf16/fp16: fla's kernel, packed rows
            o, state = self._fla_rule(unpad(q), unpad(k), unpad(v), g, beta, state0, query_start_loc)
            return o.to(mixed.dtype), conv_final, state
        beta_p, g_p = pad(beta).float(), pad(g)  # [B, L, Hv]; beta rounded to the model dtype first, as HF
        if valid is not None:  # padded steps must not touch the state: select beta = 0 and g = 0 there
            beta_p = torch.where(valid[..., None], beta_p, 0.0)
            g_p = torch.where(valid[..., None], g_p, 0.0)
        o, state = self._torch_rule(q, k, v, g_p, beta_p, state0, recurrent)
        return unpad(o).to(mixed.dtype), conv_final, state  # [T, Hv, dv]

    def _fla_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state0: Tensor,
                  cu_seqlens: Tensor | None) -> tuple[Tensor, Tensor]:
        """fla's chunk form over packed rows: q, k [T, key_dim] raw (normalised in the kernel), v [T, value_dim],
        g, beta [T, Hv]; cu_seqlens None for one sequence of all T rows. (o [T, Hv, dv], final states fp32)."""
        T = q.shape[0]
        Hk, Hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        group = Hv // Hk  # value head j reads key head j // group
        return fla_chunk_gated_delta_rule(q.reshape(T, Hk, dk).repeat_interleave(group, dim=1),
                                          k.reshape(T, Hk, dk).repeat_interleave(group, dim=1),
                                          v.reshape(T, Hv, dv), g, beta, state0, cu_seqlens, scale=dk**-0.5)

    def _torch_rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state0: Tensor,
                    recurrent: bool = False) -> tuple[Tensor, Tensor]:
        """The torch form over B padded sequences: q, k [B, L, key_dim] raw, v [B, L, value_dim], g, beta [B, L, Hv]
        fp32 (0 on padded steps). (o [B, L, Hv, dv] fp32, final states [B, Hv, dk, dv] fp32)."""
        B, L = q.shape[:2]
        Hk, Hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        group = Hv // Hk
        q = l2_normalize(q.reshape(B, L, Hk, dk).float()) * dk**-0.5  # [B, L, Hk, dk]
        k = l2_normalize(k.reshape(B, L, Hk, dk).float())
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)  # [B, L, Hv, dk]
        v = v.reshape(B, L, Hv, dv).float()  # [B, L, Hv, dv]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, Hv, L, d]
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, Hv, L]
        if recurrent:
            o, state = recurrent_gated_delta_rule(q, k, v, g, beta, state0)
        else:
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, state0, self.chunk_size)
        return o.transpose(1, 2), state

    def window_core(
        self,
        mixed: Tensor,  # [W, conv_dim] one sequence's pre-conv inputs in its first rows, zeros after
        g: Tensor,  # [W, Hv] fp32, 0 past the sequence (no decay)
        beta: Tensor,  # [W, Hv], 0 past the sequence (no update)
        conv0: Tensor,  # [1, conv_dim, K-1] initial conv state (zero for a fresh sequence, selected by the caller)
        state0: Tensor,  # [1, Hv, dk, dv] fp32 initial recurrent state, likewise
        length: Tensor,  # [1] int64 on the device: the sequence's rows
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The conv and the delta rule of ONE sequence in a fixed window of W rows, its length known on the device
        only (a CUDA graph's static shapes): (o [W, Hv, dv] in mixed's dtype, rows past the sequence garbage; final
        conv state [1, conv_dim, K-1], the K-1 inputs before row `length`; final recurrent state [1, Hv, dk, dv]
        fp32). The rows past the sequence pass the recurrent state on unchanged: beta = 0 writes nothing, g = 0
        decays nothing. The chunks start at row 0, as varlen_core's do, so the sequence's sums are the same."""
        conv_out, conv_final = causal_conv1d(mixed[None].transpose(1, 2), conv0, self.conv1d.weight.squeeze(1),
                                             length)
        q, k, v = conv_out[0].transpose(0, 1).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        if fla_chunk_applies(mixed):  # fla's fixed-length path: no chunk indices built on the host
            o, state = self._fla_rule(q, k, v, g, beta, state0, None)
            return o.to(mixed.dtype), conv_final, state
        o, state = self._torch_rule(q[None], k[None], v[None], g[None], beta[None].float(), state0)
        return o[0].to(mixed.dtype), conv_final, state  # [W, Hv, dv]

    def _output(self, x: Tensor, o: Tensor) -> Tensor:  # x [T, hidden], o [T, Hv, dv] in x's dtype
        """The gated norm with z = in_proj_z(x), then out_proj: [T, hidden]."""
        T = x.shape[0]
        z = self.in_proj_z(x).view(T, self.num_v_heads, self.head_v_dim)  # [T, Hv, dv]
        y = self.norm(o, z).reshape(T, self.value_dim)  # [T, Hv*dv]
        return self.out_proj(y)

    def decode_paged(
        self,
        x: Tensor,  # [B, hidden]: one token per sequence
        conv: Tensor,  # [n_conv_pages, conv_dim, K-1] model dtype: the pool's conv view, updated in place
        conv_pages: Tensor,  # [B] int: page of each sequence's conv state; < 0 = padding row (writes nothing)
        ssm: Tensor,  # [n_ssm_pages, Hv, dk, dv] fp32: the pool's ssm view, updated in place
        ssm_pages: Tensor,  # [B] int: page of each sequence's recurrent state; < 0 = padding row
        has_initial_state: Tensor,  # [B] bool: False = fresh (zero states selected, the pages' bytes unread)
    ) -> Tensor:
        """One decode step of B sequences: `forward(..., recurrent=True)` for one token each plus the write of both
        final states into their pages, by the paged kernels. Returns [B, hidden] (padding rows: unspecified)."""
        mixed, g, beta = self.project(x)
        o = self.decode_rows(mixed, g, beta, conv, conv_pages, ssm, ssm_pages, has_initial_state)
        return self._output(x, o.to(x.dtype))  # [B, hidden]

    def decode_rows(self, mixed: Tensor, g: Tensor, beta: Tensor, conv: Tensor, conv_pages: Tensor, ssm: Tensor,
                    ssm_pages: Tensor, has_initial_state: Tensor) -> Tensor:
        """The paged decode of `decode_paged` from the projections (project) of B rows, one token each: row b's states
        in pages conv_pages[b] and ssm_pages[b] (< 0: nothing read or written, o 0). Returns o [B, Hv, dv] fp32."""
        B = mixed.shape[0]
        Hk, Hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        conv_out = causal_conv1d_update(mixed, conv, self.conv1d.weight.squeeze(1), conv_pages,
                                        has_initial_state)  # [B, conv_dim] mixed's dtype, SiLU applied
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        # [B, Hk, dk] key heads, views of conv_out: grouped, l2-normalised and q scaled in the kernel, read as fp32
        q, k, v = q.reshape(B, Hk, dk), k.reshape(B, Hk, dk), v.reshape(B, Hv, dv)
        return gated_delta_decode(q, k, v, g, beta, ssm, ssm_pages, has_initial_state, qk_scale=dk**-0.5)
