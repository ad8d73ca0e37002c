import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rimuru.memory import PageGeometry, PagePool
from rimuru.model_spec import load_model_spec

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def test_pool_is_whole_huge_pages():
    g = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16})
    p = PagePool(g, 64 * 3 + 63, "cpu")
    assert p.num_huge_pages == 3 and p.pool_bytes == 192 and p.buffer.numel() == 192
    assert p.buffer.dtype == torch.uint8 and p.buffer.is_contiguous()
    assert p.allocator.num_huge_pages == 3
    with pytest.raises(ValueError, match="smaller than one huge page"):
        PagePool(g, 63, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_qwen15_views_share_bytes(device):
    g = PageGeometry.for_model(load_model_spec("qwen1.5-moe-a2.7b"))
    p = PagePool(g, 2 * 5_767_168, device)
    kv = p.kv_view()
    ex = p.expert_view()
    assert kv.shape == (2 * 44, 2, 16, 16, 128) and kv.dtype == torch.bfloat16
    assert ex.shape == (2, 1408 * 2048)
    assert kv.data_ptr() == ex.data_ptr() == p.buffer.data_ptr()  # no copies
    # kv page 45 = bytes 45 * 131072 .. 46 * 131072 = the second KV block inside expert page 1.
    kv[45].fill_(3.0)
    elems = 131_072 // 2
    row = ex[1].cpu()
    assert (row[elems : 2 * elems] == 3.0).all()
    assert (row[:elems] == 0).all() and (row[2 * elems :] == 0).all()
    assert p.buffer.count_nonzero().item() == 131_072  # bf16 3.0 = 0x4040: both bytes of every element set


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_views_and_padding(device):
    g = PageGeometry.for_model(load_model_spec("qwen3.5-35b-a3b"))
    p = PagePool(g, 2 * 2_097_152, device)
    ssm, conv, kv = p.ssm_view(), p.conv_view(), p.kv_view()
    assert ssm.shape == (2, 32, 128, 128) and ssm.dtype == torch.float32
    assert conv.shape == (2 * 32, 8192, 3) and conv.dtype == torch.bfloat16
    assert kv.shape == (2 * 64, 2, 16, 2, 256)
    assert conv.stride() == (65_536 // 2, 3, 1)  # rows step over the padding
    conv[33].fill_(1.0)  # bytes 33 * 65536 .. + 49152, inside ssm page 1 (ssm 1 starts at 2 MiB = conv 32)
    flat = ssm[1].reshape(-1).view(torch.uint8).cpu()
    start = 65_536
    assert flat[start : start + 49_152].count_nonzero().item() == 49_152  # bf16 1.0 = 0x3F80: no zero byte
    assert flat[start + 49_152 : start + 65_536].count_nonzero().item() == 0  # padding untouched
    # The same bytes through the KV view: conv 33 = kv 66 (all of it) + the first half of kv 67.
    assert (kv[66] == 1.0).all()
    assert (kv[67].reshape(-1)[: 16_384 // 2] == 1.0).all() and (kv[67].reshape(-1)[16_384 // 2 :] == 0).all()


def test_allocator_ids_index_views():
    g = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16})
    p = PagePool(g, 128, "cpu")
    a = p.allocator
    e = a.allocate_mid("expert", 1)
    ks = a.allocate_small("kv", 4, owner="r")
    assert e == [0] and ks == [4, 5, 6, 7]
    kv = p.view("kv", torch.int32, (4,))
    ex = p.view("expert", torch.int32, (16,))
    for i in ks:
        kv[i] = torch.arange(4, dtype=torch.int32) + 10 * i
    assert ex[1].tolist() == [40, 41, 42, 43, 50, 51, 52, 53, 60, 61, 62, 63, 70, 71, 72, 73]
    assert ex[0].count_nonzero().item() == 0


def test_view_errors():
    g = PageGeometry.custom(mid_sizes={"expert": 64}, small_sizes={"kv": 16})
    p = PagePool(g, 64, "cpu")
    with pytest.raises(ValueError, match="needs 32 B, a kv page has 16 B"):
        p.view("kv", torch.float32, (8,))
    with pytest.raises(ValueError, match="no KV shape"):
        p.kv_view()
    with pytest.raises(KeyError, match="unknown page kind"):
        p.view("ssm", torch.float32, (1,))


VIEW_GEOMETRIES = [
    PageGeometry.custom(mid_sizes={"expert": 96, "ssm": 64}, small_sizes={"kv": 16, "conv": 20}),
    PageGeometry.custom(mid_sizes={"expert": 48}, small_sizes={"kv": 16, "conv": 8}),
]


@settings(max_examples=60, deadline=None)
@given(geo=st.sampled_from(VIEW_GEOMETRIES), data=st.data())
def test_write_through_one_kind_read_through_another(geo: PageGeometry, data: st.DataObject):
    p = PagePool(geo, 2 * geo.huge_size, "cpu")
    kinds = [*geo.mid_kinds, *geo.small_kinds]
    src = data.draw(st.sampled_from(kinds))
    page = data.draw(st.integers(0, geo.num_pages(src, p.pool_bytes) - 1))
    n = geo.size(src) // 4
    pattern = torch.arange(1, n + 1, dtype=torch.int32) * 7
    p.view(src, torch.int32, (n,))[page] = pattern
    start = geo.offset(src, page)
    expected = pattern.view(torch.uint8)  # the bytes at [start, start + size(src))
    for dst in kinds:
        size = geo.size(dst)
        view = p.view(dst, torch.uint8, (size,))
        for q in range(start // size, (start + geo.size(src) - 1) // size + 1):
            lo, hi = max(start, geo.offset(dst, q)), min(start + geo.size(src), geo.offset(dst, q) + size)
            got = view[q][lo - geo.offset(dst, q) : hi - geo.offset(dst, q)]
            assert torch.equal(got, expected[lo - start : hi - start])
    assert p.buffer.count_nonzero().item() == expected.count_nonzero().item()
