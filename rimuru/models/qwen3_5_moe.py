"""Qwen3.5-MoE (`qwen3_5_moe` multimodal checkpoints run as text only, and `qwen3_5_moe_text`): a hybrid.

    layer i: token mixer = GatedDeltaNet (`linear_attn`) or GatedAttention (`self_attn`), by layer_types[i]
             channel mixer = routed experts (fp32 softmax, top-k always renormalised)
                             + shared expert * sigmoid(shared_expert_gate)
    every plain RMSNorm (input, post-attention, final, q/k) is zero-centred: x_hat * (1 + w); the gated
    norm inside GatedDeltaNet is not.

Full-attention layers use the paged KV cache exactly as every other architecture does. Linear-attention
layers carry a per-request recurrent and conv state in pool pages (ssm and conv kinds), read and written
through the batch's state page ids by `LinearStateCache` (models/state_cache.py), which the engine binds with
`bind_state_cache`.

Checkpoints: a multimodal checkpoint names the text model `model.language_model.`; its vision tower
(`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are skipped: image input and speculative
decoding with the MTP layer are out of scope.
"""

from __future__ import annotations

from torch import Tensor, nn

from rimuru.model_spec import FULL_ATTENTION, ModelSpec
from rimuru.models.attention import Attention
from rimuru.models.causal_lm import DecoderLayer, MoECausalLM
from rimuru.models.forward_batch import ForwardBatch
from rimuru.models.gated_attention import GatedAttention
from rimuru.models.gated_deltanet import GatedDeltaNet
from rimuru.models.moe import SharedExpertMoE
from rimuru.models.rotary import check_rope_config
from rimuru.models.state_cache import LinearStateCache

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class LinearAttentionDecoderLayer(DecoderLayer):
    """A decoder layer whose token mixer is a gated DeltaNet reading and writing per-request state."""

    def __init__(self, linear_attn: GatedDeltaNet, linear_idx: int, mlp: nn.Module, hidden_size: int,
                 eps: float) -> None:
        super().__init__(None, mlp, hidden_size, eps, zero_centred=True)
        self.linear_attn = linear_attn
        self.linear_idx = linear_idx  # ordinal among linear-attention layers: which row of the state page ids

    def mix(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, batch: ForwardBatch,
        state_cache: LinearStateCache | None,
    ) -> Tensor:  # [T, d] -> [T, d]
        if state_cache is None:
            raise ValueError("a hybrid model needs its state pages bound (bind_state_cache) before a forward pass")
        if state_cache.splits(batch) and not state_cache.decodes_in_place(batch):
            # decode rows by the paged kernels, prefill rows by the chunk form, no host sync
            return state_cache.mixed(self.linear_attn, self.linear_idx, batch, x)
        qsl = batch.query_start_loc
        # A sequence with context before this pass continues its state; one without starts from zero
        # (a prefix-cache hit has context: its pages hold a copy of the cached state, engine/state_cache_manager.py).
        has_initial_state = batch.seq_lens.long() > (qsl[1:] - qsl[:-1]).long()  # [B]
        if state_cache.decodes_in_place(batch):  # pure decode on the GPU: the paged kernels, states in place
            return state_cache.decode(self.linear_attn, self.linear_idx, batch, x, has_initial_state)
        # the reference path (the CPU's): every sequence's states gathered, the layer, the final states scattered
        conv, recurrent = state_cache.read(self.linear_idx, batch)
        out, conv, recurrent = self.linear_attn(
            x, qsl, conv, recurrent, has_initial_state, recurrent=batch.max_query_len == 1,  # decode: per token
            max_len=batch.max_query_len,
        )
        state_cache.write(self.linear_idx, batch, conv, recurrent)
        return out


class Qwen3_5MoeForCausalLM(MoECausalLM):
    checkpoint_renames = (("model.language_model.", "model."),)
    # Multi-token prediction (MTP) and the vision tower are out of scope: their tensors are not loaded.
    checkpoint_skipped = (r"^mtp\.", r"^model\.visual\.")
    zero_centred_norms = True

    def make_layer(self, spec: ModelSpec, layer_id: int) -> DecoderLayer:
        if spec.layer_types[layer_id] == FULL_ATTENTION:
            return super().make_layer(spec, layer_id)
        linear = GatedDeltaNet(
            spec.hidden_size, spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim,
            spec.linear_value_head_dim, spec.linear_conv_kernel_dim, spec.rms_norm_eps, tp=self.tp,
        )
        return LinearAttentionDecoderLayer(linear, spec.linear_layer_ids.index(layer_id),
                                           self.make_channel_mixer(spec, layer_id), spec.hidden_size,
                                           spec.rms_norm_eps)

    def make_attention(self, spec: ModelSpec, attn_idx: int) -> Attention:
        return GatedAttention(spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
                              attn_idx, eps=spec.rms_norm_eps, bias=spec.attention_bias, tp=self.tp)

    def make_moe(self, spec: ModelSpec, moe_idx: int) -> nn.Module:
        return SharedExpertMoE(shared_intermediate_size=spec.shared_expert_intermediate_size,
                               **self.moe_kwargs(spec, moe_idx))

    @staticmethod
    def _check_supported(spec: ModelSpec) -> None:
        if spec.model_type not in MODEL_TYPES:
            raise ValueError(f"Qwen3_5MoeForCausalLM does not run model_type {spec.model_type!r}")
        text = spec.hf_config.get("text_config") or spec.hf_config  # the multimodal wrapper nests it
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"{spec.model_type}: hidden_act={act!r} is not supported (only 'silu')")
        if spec.shared_expert_intermediate_size <= 0:
            raise NotImplementedError(f"{spec.model_type}: every MoE layer has a shared expert "
                                      "(shared_expert_intermediate_size > 0)")
        # Text positions make mrope's three sections equal, so it is plain 1-D rotary over the first R dims.
        check_rope_config(text, allow_partial=True)

