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
