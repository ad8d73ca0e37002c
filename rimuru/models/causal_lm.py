"""The decoder every supported MoE architecture shares, and the hooks an architecture overrides.

    input_ids [T] -> embed -> L x DecoderLayer -> final norm -> hidden [T, d]
    DecoderLayer: h += attn(norm(h));  h += mlp(norm(h))   (mlp = SparseMoE or a dense GatedMLP)
    compute_logits(hidden[logits_indices]) -> [B', V] fp32

Each residual add is fused into the norm that follows it (vLLM's layout): a layer takes and returns a
pair (x, residual) whose sum is the residual stream, and its first norm does the add:

    layer(x, residual):  h = x + residual;  a = norm(h)         input_layernorm.add_norm (layer 0: h = x)
                         h = attn(a) + h;   m = norm(h)         post_attention_layernorm.add_norm
                         return mlp(m), h                        the add is left to the next norm
    after the last:      norm(x + residual)                      model.norm.add_norm

Every add rounds to the model dtype exactly where `h = h + f(norm(h))` did, so the result is the same.

Parameter names follow the Hugging Face checkpoints (`model.layers.{i}.self_attn.q_proj.weight`, ...),
so the loader maps checkpoint tensors to parameters by name. An architecture file subclasses
`MoECausalLM` and overrides `make_attention` / `make_moe` (or `make_layer`, for a layer whose token mixer
is not attention) and the checkpoint-name hooks only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from rimuru.distributed.parallel_state import SINGLE, TensorParallel
from rimuru.model_spec import FULL_ATTENTION, ModelSpec
from rimuru.models.attention import Attention
from rimuru.models.expert_provider import ExpertProvider
from rimuru.models.forward_batch import ForwardBatch
from rimuru.models.layers import GatedMLP, RMSNorm
from rimuru.models.moe import SparseMoE
from rimuru.models.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from rimuru.models.rotary import RotaryEmbedding, check_rope_config
from rimuru.models.state_cache import LinearStateCache

# A fused checkpoint tensor's parameters: their names, and the whole tensor -> each one's whole tensor, in that order.
CheckpointSplit = tuple[tuple[str, ...], Callable[[Tensor], tuple[Tensor, ...]]]


class DecoderLayer(nn.Module):
    def __init__(
        self, self_attn: nn.Module | None, mlp: nn.Module, hidden_size: int, eps: float, zero_centred: bool = False
    ) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps, zero_centred=zero_centred)
        if self_attn is not None:  # None: a subclass holds another token mixer under its checkpoint name
            self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, zero_centred=zero_centred)
        self.mlp = mlp

    def mix(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, batch: ForwardBatch,
        state_cache: LinearStateCache | None,
    ) -> Tensor:  # [T, d] -> [T, d]: the token mixer; hybrid layers override it
        return self.self_attn(x, cos, sin, kv_cache, batch)

    def forward(
        self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: Tensor, batch: ForwardBatch,
        state_cache: LinearStateCache | None = None,
    ) -> tuple[Tensor, Tensor]:  # x, residual [T, d]: the residual stream is x + residual (x alone if None)
        if residual is None:
            h, x = x, self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_norm(x, residual)  # h: this layer's input hidden states
        if isinstance(self.mlp, SparseMoE):
            # Earliest point this layer's routing could be predicted: let the provider prefetch.
            self.mlp.provider.before_layer(self.mlp.moe_idx, h)
        x = self.mix(x, cos, sin, kv_cache, batch, state_cache)  # [T, d]
        x, h = self.post_attention_layernorm.add_norm(x, h)  # h += attn output
        return self.mlp(x), h  # [T, d] each; the next norm adds them


class DecoderStack(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(
        self, vocab_size: int, hidden_size: int, layers: list[DecoderLayer], eps: float, zero_centred: bool = False,
        tp: TensorParallel = SINGLE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size, tp=tp)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps, zero_centred=zero_centred)


class MoECausalLM(nn.Module):
    # Checkpoint naming hooks, used by rimuru.models.loader.
    # (old, new) substring renames from checkpoint names to this model's names.
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # Per-expert checkpoint names of W1 (gate), W3 (up), W2 (down): `...mlp.experts.{e}.{name}.weight`.
    expert_weight_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Regexes of checkpoint names the loader skips: tensors of parts of the checkpoint this model does not run.
    checkpoint_skipped: tuple[str, ...] = ()
    # The x_hat * (1 + w) form of every plain RMSNorm (input, post-attention, final) instead of x_hat * w.
    zero_centred_norms: bool = False

    def split_checkpoint_tensor(self, name: str) -> CheckpointSplit | None:
        """A checkpoint tensor (its name after `checkpoint_renames`) that holds several of this model's parameters:
        the parameters' names and a function from the whole tensor to each parameter's whole tensor (before any
        tensor-parallel cut), in that order. None: the tensor is not such a fused one."""
        return None

    def __init__(self, spec: ModelSpec, kv_cache: Tensor, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self._check_supported(spec)
        self.spec = spec
        # this rank's group: attention by heads, MLPs by columns/rows, experts by f, the embedding and the LM head
        # by vocabulary rows; the norms are replicated
        self.tp = tp
        self.kv_cache = kv_cache  # [n_pages, 2, block, Hkv, D]; a view of the pool, not model state
        # hybrid models: the pool's ssm and conv views (bind_state_cache); None for the others
        self.state_cache: LinearStateCache | None = None
        layers = [self.make_layer(spec, i) for i in range(spec.num_hidden_layers)]
        self.model = DecoderStack(spec.vocab_size, spec.hidden_size, layers, spec.rms_norm_eps,
                                  zero_centred=self.zero_centred_norms, tp=tp)
        self.rotary = RotaryEmbedding.from_factor(spec.head_dim, spec.rope_theta, spec.partial_rotary_factor)
        self.lm_head: ParallelLMHead | None = None  # None: tied, the embedding's weight is the head's
        if not spec.tie_word_embeddings:
            self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, tp=tp)

    # ------------------------------------------------------------------ architecture hooks

    def make_layer(self, spec: ModelSpec, layer_id: int) -> DecoderLayer:
        attn = self.make_attention(spec, spec.attention_layer_ids.index(layer_id))
        return DecoderLayer(attn, self.make_channel_mixer(spec, layer_id), spec.hidden_size, spec.rms_norm_eps,
                            zero_centred=self.zero_centred_norms)

    def make_channel_mixer(self, spec: ModelSpec, layer_id: int) -> nn.Module:
        """The layer's MoE block, or its dense MLP where the layer is not MoE."""
        if spec.moe_layers[layer_id]:
            return self.make_moe(spec, spec.moe_layer_ids.index(layer_id))
        return self.make_mlp(spec)

    def make_attention(self, spec: ModelSpec, attn_idx: int) -> Attention:
        bias = spec.attention_bias
        return Attention(
            spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, attn_idx,
            qkv_bias=bias, o_bias=bias, tp=self.tp,
        )

    def moe_kwargs(self, spec: ModelSpec, moe_idx: int) -> dict:
        """The routed-expert arguments every MoE block takes (SparseMoE and its subclasses)."""
        return dict(hidden_size=spec.hidden_size, num_experts=spec.num_experts, top_k=spec.num_experts_per_tok,
                    intermediate_size=spec.moe_intermediate_size, renormalize=spec.norm_topk_prob,
                    moe_idx=moe_idx, tp=self.tp)

    def make_moe(self, spec: ModelSpec, moe_idx: int) -> nn.Module:
        return SparseMoE(**self.moe_kwargs(spec, moe_idx))

    def make_mlp(self, spec: ModelSpec) -> nn.Module:
        if spec.intermediate_size <= 0:
            raise ValueError(f"{spec.model_type}: a dense layer needs intermediate_size > 0")
        return GatedMLP(spec.hidden_size, spec.intermediate_size, tp=self.tp)

    # ------------------------------------------------------------------ routed experts

    def moe_blocks(self) -> list[SparseMoE]:
        """Every MoE block, in MoE-layer order."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoE)]

    def moe_routers(self) -> list[tuple[nn.Module, SparseMoE]]:
        """(the norm before it, the MoE block) of every MoE layer, in MoE-layer order: what the expert predictor
        applies one layer early."""
        return [(layer.post_attention_layernorm, layer.mlp) for layer in self.model.layers
                if isinstance(layer.mlp, SparseMoE)]

    def bind_kv_cache(self, kv_cache: Tensor) -> None:
        """Every attention layer reads and writes `kv_cache` [n_pages, 2, block, Hkv, D] from now on (the start-up
        memory profile runs over a one-page scratch pool before the real pool exists)."""
        self.kv_cache = kv_cache

    def bind_state_cache(self, state_cache: LinearStateCache) -> None:
        """Every linear-attention layer (hybrid models) reads and writes its per-request state in `state_cache`'s
        pages from now on."""
        self.state_cache = state_cache

    def attach_experts(self, provider: ExpertProvider) -> None:
        """Every MoE block reads its routed experts through `provider` from now on (the expert runtime's provider,
        or a stand-in while CUDA graphs are captured)."""
        for block in self.moe_blocks():
            block.provider = provider

    # ------------------------------------------------------------------ forward

    def forward(self, batch: ForwardBatch) -> Tensor:
        """Hidden states [T, d] after the final norm."""
        if self.state_cache is not None:  # hybrid models: which rows the linear-attention layers decode in place
            self.state_cache.begin_pass(batch)
        h = self.model.embed_tokens(batch.input_ids)  # [T, d]; tensor-parallel, the ranks' lookups all-reduced
        cos, sin = self.rotary.cos_sin(batch.positions, h.dtype)  # [T, D/2] each, shared by all layers
        residual: Tensor | None = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, cos, sin, self.kv_cache, batch, self.state_cache)
        if residual is None:
            return self.model.norm(h)
        return self.model.norm.add_norm(h, residual)[0]  # [T, d]

    def compute_logits(self, hidden: Tensor) -> Tensor:  # [B', d]
        """[B', V] fp32 logits; tensor-parallel, each rank computes its Vp/N vocabulary rows (V padded to a multiple
        of N) and every rank gets all of them (an all-gather), the padding rows' logits dropped."""
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens  # tied: the embedding's rows
        logits = F.linear(hidden, head.weight).float()  # [B', Vp/N]: this rank's vocabulary rows
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.spec.vocab_size]  # [B', V]: the padding rows dropped

    # ------------------------------------------------------------------ checks

    @staticmethod
    def _check_supported(spec: ModelSpec) -> None:
        cfg = spec.hf_config
        if spec.is_hybrid or any(t != FULL_ATTENTION for t in spec.layer_types):
            raise NotImplementedError(f"{spec.model_type}: only full-attention layers are supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"{spec.model_type}: hidden_act={act!r} is not supported (only 'silu')")
        # Qwen configs keep a sliding_window value even when use_sliding_window is false.
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if window:
            raise NotImplementedError(f"{spec.model_type}: sliding-window attention (sliding_window={window})"
                                      " is not supported")
        check_rope_config(cfg)
