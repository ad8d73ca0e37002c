"""Tiny random MoE checkpoints built with transformers' own config and model classes.

A checkpoint directory holds what a real one does: config.json, *.safetensors (experts named per
expert, or fused with `fused_experts=True`), generation_config.json and a byte-level BPE tokenizer
(trained here on a small built-in text, no download) with eos/pad tokens and a ChatML template.
Weights are redrawn with larger variance than transformers' init so that logits are spread out
(greedy decoding is not one repeated token) and routers route tokens to varied experts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

ARCHS = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
# Hybrid architectures (gated DeltaNet layers with state pages): their engine tests are their own
# (tests/test_hybrid_engine.py), so they are not in ARCHS, which the other engine tests sweep.
HYBRID_ARCHS = ("qwen3_5_moe_text", "qwen3_next")

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)  # ids 0, 1, 2
VOCAB_SIZE = 300  # tokenizer and model: 256 bytes + 3 specials + 41 merges

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a
few experts. Memory is shared between the key value cache and the expert weights, and the split
moves with the load. Hello world! How are you today? I am fine, thank you. Once upon a time there
was a small model that wanted to serve many requests at once. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42.
"""

# Shapes shared by every tiny model: GQA 4 query heads over 2 KV heads, head_dim 16 unless set.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": 2,
}

_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    # Layer 1 is dense (mlp_only_layers) so the dense-MLP path is covered too.
    "qwen2_moe": {
        "num_hidden_layers": 3, "num_experts": 8, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "intermediate_size": 96, "mlp_only_layers": [1],
        "norm_topk_prob": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # head_dim 32 != hidden / heads, tied embeddings, renormalised top-k.
    "qwen3_moe": {
        "num_hidden_layers": 2, "num_experts": 8, "moe_intermediate_size": 32, "intermediate_size": 96,
        "head_dim": 32, "norm_topk_prob": True, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "mixtral": {
        "num_hidden_layers": 2, "num_local_experts": 8, "intermediate_size": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    # clip_qkv low enough that clipping actually happens with these weights.
    "olmoe": {
        "num_hidden_layers": 2, "num_experts": 8, "intermediate_size": 32, "clip_qkv": 1.5,
        "norm_topk_prob": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    # Hybrid: gated DeltaNet layers (2 key heads, 4 value heads) and gated full attention (layer_types
    # defaults to full attention every 4th layer), partial rotary over 4 of 16 dims, shared expert.
    "qwen3_5_moe_text": {
        "num_hidden_layers": 4, "num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    },
    # Qwen3-Next: Qwen3.5's shapes, with its fused in_proj_qkvz / in_proj_ba checkpoint tensors; layer 1 is dense
    # (mlp_only_layers) and the value heads per key head (2) make the per-group layout matter.
    "qwen3_next": {
        "num_hidden_layers": 4, "num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "intermediate_size": 96, "mlp_only_layers": [1], "norm_topk_prob": True,
        "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    },
}
# Zero-centred RMSNorms (x_hat * (1 + w)) store offsets from 1: every norm of these architectures but the
# gated norm inside their linear-attention layers.
_ZERO_CENTRED_NORMS = {"qwen3_5_moe_text", "qwen3_next"}


def tiny_config(arch: str, **overrides: Any) -> Any:
    """transformers config object of the tiny `arch` model."""
    from transformers import (
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3_5MoeTextConfig,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    classes = {
        "qwen2_moe": Qwen2MoeConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "mixtral": MixtralConfig,
        "olmoe": OlmoeConfig,
        "qwen3_5_moe_text": Qwen3_5MoeTextConfig,
        "qwen3_next": Qwen3NextConfig,
    }
    if arch not in classes:
        raise ValueError(f"unknown tiny architecture {arch!r}; known: {', '.join(ARCHS + HYBRID_ARCHS)}")
    return classes[arch](**{**_COMMON, **_ARCH_CONFIG[arch], **overrides})


def _redraw_weights(model: torch.nn.Module, seed: int, zero_centred_norms: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # the same effective scale, 0.7 .. 1.3, for both norm forms
                zero_centred = zero_centred_norms and not name.endswith("linear_attn.norm.weight")
                low = 0.7 - 1.0 if zero_centred else 0.7
                p.uniform_(low, low + 0.6, generator=g)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1, generator=g)
            elif "embed_tokens" in name:
                p.normal_(0.0, 0.5, generator=g)
            else:  # Linear [out, in] or fused experts [E, out, in]: unit-scale outputs
                std = 1.0 / math.sqrt(p.shape[-1])
                if name.endswith("mlp.gate.weight"):
                    std *= 3.0  # peaked, input-dependent routing
                elif name == "lm_head.weight":
                    std *= 4.0  # spread-out logits
                p.normal_(0.0, std, generator=g)


def make_tokenizer() -> Any:
    """Byte-level BPE over a small built-in text, as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # the corpus must yield enough merges
        raise RuntimeError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_checkpoint(
    arch: str,
    out_dir: str | Path,
    *,
    fused_experts: bool = False,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random `arch` checkpoint (+ tokenizer) into `out_dir` and return its path.

    fused_experts: experts as `mlp.experts.gate_up_proj` / `down_proj` (transformers 5's internal
    form) instead of per-expert tensors. max_shard_size (e.g. "50KB"): shard with an index file.
    overrides: config fields (e.g. num_hidden_layers=3).
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    _redraw_weights(model, seed, zero_centred_norms=arch in _ZERO_CENTRED_NORMS)
    kwargs: dict[str, Any] = {"save_original_format": not fused_experts}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    make_tokenizer().save_pretrained(out)
    return out
