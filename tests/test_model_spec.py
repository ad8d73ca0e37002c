import json

import pytest

from rimuru.model_spec import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    ModelSpec,
    ModelSpecError,
    load_model_spec,
    preset_names,
)

PRESETS = ["mixtral-8x7b", "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "qwen3-next-80b-a3b",
           "qwen3.5-122b-a10b", "qwen3.5-35b-a3b"]


def test_all_presets_ship():
    assert preset_names() == PRESETS


def test_qwen15_moe():
    s = load_model_spec("qwen1.5-moe-a2.7b")
    assert (s.model_type, s.hidden_size, s.num_hidden_layers, s.head_dim) == ("qwen2_moe", 2048, 24, 128)
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (60, 4, 1408)
    assert s.shared_expert_intermediate_size == 5632
    assert s.moe_layer_ids == tuple(range(24)) and s.attention_layer_ids == tuple(range(24))
    assert s.linear_layer_ids == () and not s.is_hybrid
    assert s.attention_bias is True and s.norm_topk_prob is False
    assert s.expert_matrix_numel == 1408 * 2048
    assert s.num_routed_experts_total == 24 * 60
    assert s.routed_expert_bytes("bfloat16") == 24 * 60 * 3 * 1408 * 2048 * 2
    assert s.eos_token_id == (151643,)


def test_qwen3_30b():
    s = load_model_spec("qwen3-30b-a3b")
    assert (s.num_key_value_heads, s.head_dim, s.num_experts, s.moe_intermediate_size) == (4, 128, 128, 768)
    assert s.norm_topk_prob is True and s.rope_theta == 1_000_000.0
    # Published total: 30,532,122,624 parameters.
    assert s.routed_expert_params() + s.non_expert_params() == 30_532_122_624


def test_mixtral_uses_intermediate_size_and_local_experts():
    s = load_model_spec("mixtral-8x7b")
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (8, 2, 14336)
    assert s.shared_expert_intermediate_size == 0 and s.head_dim == 4096 // 32
    routed = 32 * 8 * 3 * 14336 * 4096
    assert s.routed_expert_params() == routed
    # embed + lm_head + final norm + per layer (q,k,v,o + 2 norms + router)
    dense = 2 * 32000 * 4096 + 4096 + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096 + 4096 * 8)
    assert s.non_expert_params() == dense
    assert routed + dense == 46_702_792_704  # the published count
    assert s.non_expert_bytes("bfloat16") == dense * 2


def test_olmoe_total_params():
    s = load_model_spec("olmoe-1b-7b")
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size) == (64, 8, 1024)
    assert s.routed_expert_params() + s.non_expert_params() == 6_919_161_856


def test_qwen35_text_config_is_unwrapped():
    s = load_model_spec("qwen3.5-35b-a3b")
    assert s.model_type == "qwen3_5_moe"
    assert (s.hidden_size, s.num_hidden_layers, s.num_key_value_heads, s.head_dim) == (2048, 40, 2, 256)
    assert (s.num_experts, s.moe_intermediate_size, s.shared_expert_intermediate_size) == (256, 512, 512)
    assert s.attention_layer_ids == (3, 7, 11, 15, 19, 23, 27, 31, 35, 39)
    assert len(s.linear_layer_ids) == 30 and s.layer_types[0] == LINEAR_ATTENTION
    assert (s.linear_num_key_heads, s.linear_num_value_heads) == (16, 32)
    assert s.linear_conv_dim == 2 * 16 * 128 + 32 * 128
    assert s.rope_theta == 10_000_000.0 and s.eos_token_id == (248044,)
    assert s.num_moe_layers == 40
    # Qwen3.5 always renormalises its top-k (the config has no norm_topk_prob) and rotates 64 of 256 dims
    assert s.norm_topk_prob is True and s.attn_output_gate is True and s.partial_rotary_factor == 0.25


def test_qwen3_next_80b():
    s = load_model_spec("qwen3-next-80b-a3b")
    assert s.model_type == "qwen3_next" and s.num_hidden_layers == 48 and s.num_moe_layers == 48
    assert (s.num_experts, s.num_experts_per_tok, s.moe_intermediate_size, s.shared_expert_intermediate_size) == (
        512, 10, 512, 512)
    assert (s.linear_num_key_heads, s.linear_num_value_heads, s.linear_key_head_dim) == (16, 32, 128)
    assert s.attention_layer_ids == tuple(range(3, 48, 4)) and (s.num_attention_heads, s.head_dim) == (16, 256)
    assert s.norm_topk_prob and s.attn_output_gate and s.partial_rotary_factor == 0.25
    assert s.routed_expert_params() + s.non_expert_params() == 79_674_391_296


def test_qwen35_122b():
    s = load_model_spec("qwen3.5-122b-a10b")
    assert (s.hidden_size, s.num_hidden_layers, s.moe_intermediate_size, s.linear_num_value_heads) == (
        3072, 48, 1024, 64)
    assert len(s.attention_layer_ids) == 12


def test_mlp_only_layers_and_sparse_step():
    cfg = json.loads(json.dumps(load_model_spec("qwen3-30b-a3b").hf_config))
    cfg.update(num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2)
    s = ModelSpec.from_hf_config(cfg)
    assert s.moe_layers == (False, True, False, True, False, True)
    assert s.moe_layer_ids == (1, 3, 5) and s.num_moe_layers == 3


def test_layer_types_from_interval_when_absent():
    cfg = dict(load_model_spec("qwen3.5-35b-a3b").hf_config["text_config"])
    del cfg["layer_types"]
    cfg["num_hidden_layers"] = 8
    s = ModelSpec.from_hf_config(cfg)
    assert s.layer_types == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,) + (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)


def test_qwen35_layer_types_default_without_interval():
    cfg = dict(load_model_spec("qwen3.5-122b-a10b").hf_config["text_config"])
    del cfg["layer_types"], cfg["full_attention_interval"]
    s = ModelSpec.from_hf_config({**cfg, "num_hidden_layers": 8})
    assert s.attention_layer_ids == (3, 7) and s.norm_topk_prob is True


def test_hf_config_not_in_equality():
    a = load_model_spec("olmoe-1b-7b")
    b = ModelSpec.from_hf_config({**a.hf_config, "unrelated_field": 1})
    assert a == b and hash(a) == hash(b)


def test_from_pretrained_and_load_by_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_model_spec("mixtral-8x7b").hf_config))
    assert load_model_spec(tmp_path) == ModelSpec.from_pretrained(tmp_path) == load_model_spec("mixtral-8x7b")


def test_errors():
    with pytest.raises(ModelSpecError, match="neither a directory"):
        load_model_spec("no-such-model")
    with pytest.raises(ModelSpecError, match="unknown preset"):
        ModelSpec.from_preset("no-such-model")
    with pytest.raises(ModelSpecError, match="no routed experts"):
        ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
                                  "num_attention_heads": 1, "vocab_size": 8})
    cfg = dict(load_model_spec("qwen3-30b-a3b").hf_config)
    del cfg["moe_intermediate_size"]
    with pytest.raises(ModelSpecError, match="moe_intermediate_size"):
        ModelSpec.from_hf_config(cfg)
    with pytest.raises(FileNotFoundError):
        ModelSpec.from_pretrained("/nonexistent")
