import math

import pytest
import torch

from rimuru.memory.geometry import PageGeometry
from rimuru.model_spec import load_model_spec


def geo(name: str, **kw) -> PageGeometry:
    return PageGeometry.for_model(load_model_spec(name), **kw)


def test_qwen15_moe():
    g = geo("qwen1.5-moe-a2.7b")
    assert g.size("expert") == 1408 * 2048 * 2 == 5_767_168
    assert g.huge_size == 5_767_168
    assert g.size("kv") == 16 * 2 * 16 * 128 * 2 == 131_072
    assert g.smalls_per_mid("kv", "expert") == 44 and g.padding("kv") == 0
    assert g.mid_kinds == ("expert",) and g.small_kinds == ("kv",)


def test_qwen3_30b():
    g = geo("qwen3-30b-a3b")
    assert g.size("expert") == 768 * 2048 * 2 == 3_145_728
    assert g.size("kv") == 16 * 2 * 4 * 128 * 2 == 32_768
    assert g.smalls_per_mid("kv", "expert") == 96


def test_mixtral():
    g = geo("mixtral-8x7b")
    assert g.size("expert") == 14336 * 4096 * 2 == 117_440_512
    assert g.size("kv") == 16 * 2 * 8 * 128 * 2 == 65_536
    assert g.smalls_per_mid("kv", "expert") == 1792


def test_olmoe():
    g = geo("olmoe-1b-7b")
    assert g.size("expert") == 1024 * 2048 * 2 == 4_194_304
    assert g.size("kv") == 16 * 2 * 16 * 128 * 2 == 131_072


def test_qwen35_35b_matches_design_doc():
    g = geo("qwen3.5-35b-a3b")
    assert g.size("expert") == 512 * 2048 * 2 == 2_097_152
    assert g.size("ssm") == 32 * 128 * 128 * 4 == 2_097_152
    assert g.huge_size == 2_097_152
    assert g.size("kv") == 16 * 2 * 2 * 256 * 2 == 32_768
    assert g.unpadded_size("conv") == (2 * 16 * 128 + 32 * 128) * 3 * 2 == 49_152
    assert g.size("conv") == 65_536 and g.padding("conv") == 65_536 - 49_152
    assert g.mid_kinds == ("expert", "ssm") and g.small_kinds == ("kv", "conv")
    assert g.ssm_shape == (32, 128, 128) and g.conv_shape == (8192, 3)


def test_qwen35_122b():
    g = geo("qwen3.5-122b-a10b")
    assert g.size("expert") == 1024 * 3072 * 2 == 6_291_456  # 3 * 2**21
    assert g.size("ssm") == 64 * 128 * 128 * 4 == 4_194_304  # 2**22
    assert g.huge_size == 3 * 2**22 == 12_582_912
    assert g.mids_per_huge("expert") == 2 and g.mids_per_huge("ssm") == 3
    assert g.size("kv") == 16 * 2 * 2 * 256 * 2
    # conv 73,728 B; the sizes dividing gcd(2**21 * 3, 2**22) = 2**21 are powers of two -> 131,072
    assert g.unpadded_size("conv") == (2 * 16 * 128 + 64 * 128) * 3 * 2 == 73_728
    assert g.size("conv") == 131_072


def test_tensor_parallel():
    g = geo("qwen3-30b-a3b", tp_size=2)
    assert g.size("expert") == 768 // 2 * 2048 * 2
    assert g.size("kv") == 16 * 2 * (4 // 2) * 128 * 2
    g8 = geo("qwen3-30b-a3b", tp_size=8)
    assert g8.kv_heads_per_rank == 1  # 4 KV heads replicated over 8 ranks
    h = geo("qwen3.5-35b-a3b", tp_size=2)
    assert h.size("ssm") == 16 * 128 * 128 * 4 and h.unpadded_size("conv") == 8192 // 2 * 3 * 2
    with pytest.raises(ValueError, match="not divisible by tp_size=3"):
        geo("qwen3-30b-a3b", tp_size=3)


def test_dtype_and_block_size():
    g = geo("qwen1.5-moe-a2.7b", dtype=torch.float32, block_size=32)
    assert g.size("expert") == 1408 * 2048 * 4 and g.size("kv") == 32 * 2 * 16 * 128 * 4


def test_custom_pads_small_to_a_divisor_of_every_mid():
    g = PageGeometry.custom(mid_sizes={"expert": 96, "ssm": 64}, small_sizes={"kv": 16, "conv": 20})
    assert g.huge_size == 192
    assert g.size("conv") == 32 and g.padding("conv") == 12  # divisors of gcd 32: ..16, 32
    assert g.level("huge") == "huge" and g.level("ssm") == "mid" and g.level("conv") == "small"
    with pytest.raises(ValueError, match="larger than the gcd"):
        PageGeometry.custom(mid_sizes={"expert": 96, "ssm": 64}, small_sizes={"kv": 33})


def test_id_arithmetic():
    g = PageGeometry.custom(mid_sizes={"expert": 96, "ssm": 64}, small_sizes={"kv": 16})
    assert g.offset("kv", 7) == 112 and g.page_id("kv", 112) == 7
    assert g.offset("ssm", 5) == 320 and g.huge_of_mid("ssm", 5) == 1
    assert g.mids_of_huge("expert", 1) == range(2, 4) and g.mids_of_huge("ssm", 1) == range(3, 6)
    assert g.smalls_of_mid("kv", "expert", 2) == range(12, 18)
    assert g.huge_of_small("kv", 12) == 1
    with pytest.raises(ValueError, match="not on a 'kv' page boundary"):
        g.page_id("kv", 8)
    with pytest.raises(KeyError, match="unknown page kind 'nope'"):
        g.size("nope")


def test_non_hybrid_has_no_ssm_or_conv():
    g = geo("mixtral-8x7b")
    with pytest.raises(KeyError):
        g.size("ssm")
    with pytest.raises(KeyError):
        g.size("conv")


def test_every_hybrid_preset_nests_and_reports_its_padding():
    from rimuru.model_spec import preset_names

    hybrids = [n for n in preset_names() if load_model_spec(n).is_hybrid]
    assert {"qwen3.5-35b-a3b", "qwen3.5-122b-a10b"} <= set(hybrids)
    for name in hybrids:
        g = geo(name)
        assert g.huge_size % g.size("ssm") == 0 and g.huge_size % g.size("expert") == 0
        for small in ("kv", "conv"):
            assert all(ms % g.size(small) == 0 for _, ms in g.mid), (name, small)
        assert g.padding("ssm") == 0 and g.padding("conv") > 0  # both presets: only the conv state is padded
        assert f"conv {g.size('conv'):,} B (pad {g.padding('conv'):,})" in g.describe()


def test_an_ssm_page_that_would_blow_up_the_huge_page_is_padded():
    from rimuru.memory.geometry import MAX_HUGE_FACTOR, padded_ssm_size
    from rimuru.model_spec import ModelSpec

    # expert 40 x 96 x 4 = 15,360 B; state 4 x 16 x 20 x 4 = 5,120 B: lcm 15,360 = the expert page, no padding
    base = {"model_type": "qwen3_5_moe_text", "hidden_size": 96, "num_hidden_layers": 4, "vocab_size": 64,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 40, "shared_expert_intermediate_size": 8,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 20, "linear_conv_kernel_dim": 4}
    g = PageGeometry.for_model(ModelSpec.from_hf_config(base), dtype=torch.float32)
    assert g.size("ssm") == 5120 and g.padding("ssm") == 0 and g.huge_size == 15360
    # dv 21: 5,376 B, lcm(15,360, 5,376) = 107,520 = 7 x 15,360 <= 8 x; its gcd 768 cannot hold the conv state
    # (2 x 32 + 84) x 3 x 4 = 1,776 B, so the ssm page is padded up: to 7,680 (a divisor of the expert page)
    odd = PageGeometry.for_model(ModelSpec.from_hf_config({**base, "linear_value_head_dim": 21}), dtype=torch.float32)
    assert odd.unpadded_size("ssm") == 5376 and odd.size("ssm") == 7680 and odd.padding("ssm") == 7680 - 5376
    assert odd.huge_size == 15360 and "ssm 7,680 B (pad 2,304)" in odd.describe()
    assert odd.ssm_shape == (4, 16, 21)
    # far apart: a huge page beyond MAX_HUGE_FACTOR x the larger mid is padded to a multiple of the expert page
    assert padded_ssm_size(3 * 1024, 8 * 1024 + 4, ()) == 9 * 1024
    assert math.lcm(3 * 1024, 8 * 1024 + 4) > MAX_HUGE_FACTOR * (8 * 1024 + 4)
