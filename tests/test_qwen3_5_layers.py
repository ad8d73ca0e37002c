"""Partial rotary and the zero-centred RMSNorm against transformers' Qwen3.5-MoE modules (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from rimuru.models.layers import RMSNorm
from rimuru.models.rotary import RotaryEmbedding, check_rope_config, partial_rotary_factor, rotate_qk

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf  # noqa: E402


def tiny_config(head_dim: int = 32, factor: float = 0.25, theta: float = 1e7) -> Qwen3_5MoeTextConfig:
    return Qwen3_5MoeTextConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
        vocab_size=64, layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )  # fmt: skip


@torch.no_grad()
@pytest.mark.parametrize(("head_dim", "factor"), [(32, 0.25), (16, 0.5), (16, 1.0)])
def test_partial_rotary_matches_reference(head_dim: int, factor: float) -> None:
    torch.manual_seed(0)
    cfg = tiny_config(head_dim, factor)
    T = 23
    positions = torch.arange(T) * 37  # large positions: the low frequencies matter
    q, k = torch.randn(T, 4, head_dim), torch.randn(T, 2, head_dim)
    ref_rope = hf.Qwen3_5MoeTextRotaryEmbedding(cfg)
    cos_r, sin_r = ref_rope(q, positions[None, None].expand(3, 1, T))  # text: all three mrope rows equal
    q_r, k_r = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_r, sin_r)
    ours = RotaryEmbedding.from_factor(head_dim, cfg.rope_parameters["rope_theta"], factor)
    cos, sin = ours.cos_sin(positions, torch.float32)
    q_o, k_o = rotate_qk(q, k, cos, sin)
    torch.testing.assert_close(q_o, q_r[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(k_o, k_r[0].transpose(0, 1), atol=1e-5, rtol=0)
    if factor < 1.0:  # the unrotated tail passes through bit for bit
        R = ours.rotary_dim
        assert torch.equal(q_o[..., R:], q[..., R:]) and torch.equal(k_o[..., R:], k[..., R:])


def test_rope_config_refuses_partial_unless_allowed() -> None:
    cfg = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    assert partial_rotary_factor(cfg) == 0.25
    with pytest.raises(NotImplementedError):
        check_rope_config(cfg)  # architectures that rotate the full head keep refusing
    check_rope_config(cfg, allow_partial=True)
    check_rope_config({"rope_parameters": {"rope_type": "default"}})


@torch.no_grad()
def test_zero_centred_rms_norm_matches_reference() -> None:
    torch.manual_seed(0)
    ref = hf.Qwen3_5MoeRMSNorm(24, eps=1e-6)
    ref.weight.copy_(torch.randn(24) * 0.2)
    ours = RMSNorm(24, 1e-6, zero_centred=True)
    assert torch.equal(ours.weight, torch.zeros(24))  # checkpoints store offsets from 1
    ours.load_state_dict(ref.state_dict())
    x, r = torch.randn(7, 24), torch.randn(7, 24)
    torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=0)
    normed, summed = ours.add_norm(x, r)
    torch.testing.assert_close(normed, ref(x + r), atol=1e-6, rtol=0)
    torch.testing.assert_close(summed, x + r)


@torch.no_grad()
def test_default_rms_norm_unchanged() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(24, 1e-6)
    norm.weight.copy_(torch.randn(24))
    x = torch.randn(5, 24)
    expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=0)
