"""Weight loading: both expert namings, sharded checkpoints, and errors that name the tensor."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.model_spec import ModelSpec
from rimuru.models import (
    build_model,
    init_dummy_expert_pages,
    init_dummy_weights,
    load_checkpoint,
    write_expert_to_pages,
)
from rimuru.models.loader import CheckpointError, checkpoint_files

Experts = dict[tuple[int, int], tuple[Tensor, Tensor, Tensor]]


def load(ckpt: Path) -> tuple[torch.nn.Module, Experts]:
    spec = ModelSpec.from_pretrained(ckpt)
    provider = StaticExpertProvider(torch.empty(0, 1), torch.zeros(spec.num_moe_layers, spec.num_experts, 3))
    kv = torch.empty(1, 2, 16, spec.num_key_value_heads, spec.head_dim)
    model = build_model(spec, torch.float32, "cpu", kv, provider)
    experts: Experts = {}

    def sink(layer: int, e: int, w1: Tensor, w3: Tensor, w2: Tensor) -> None:
        assert (layer, e) not in experts, f"expert {(layer, e)} delivered twice"
        experts[layer, e] = (w1.clone(), w3.clone(), w2.clone())

    load_checkpoint(model, spec, ckpt, sink)
    return model, experts


def rewrite(src: Path, dst: Path, edit: Callable[[dict[str, Tensor]], None]) -> Path:
    """A copy of single-file checkpoint `src` with its tensors edited."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_both_namings_and_sharding_load_the_same_weights(
    tiny_checkpoint: Callable[..., Path], arch: str
) -> None:
    per_expert = tiny_checkpoint(arch)
    sharded = tiny_checkpoint(arch, max_shard_size="40KB")
    assert len(checkpoint_files(sharded)) > 1 and (sharded / "model.safetensors.index.json").is_file()
    model_a, experts_a = load(per_expert)
    model_b, experts_b = load(tiny_checkpoint(arch, fused_experts=True))
    model_c, experts_c = load(sharded)
    spec = ModelSpec.from_pretrained(per_expert)
    assert sorted(experts_a) == [(m, e) for m in range(spec.num_moe_layers) for e in range(spec.num_experts)]
    for other, other_experts in ((model_b, experts_b), (model_c, experts_c)):
        for (name, p), q in zip(model_a.state_dict().items(), other.state_dict().values(), strict=True):
            assert torch.equal(p, q), name
        for key, mats in experts_a.items():
            assert all(torch.equal(x, y) for x, y in zip(mats, other_experts[key], strict=True)), key

    # Against the checkpoint itself: W1 = gate/w1, W3 = up/w3, W2 = down/w2 of the right layer.
    raw = load_file(per_expert / "model.safetensors")
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if arch == "mixtral" else "mlp"
    layer = spec.moe_layer_ids[-1]
    for slot, wname in enumerate(names):
        want = raw[f"model.layers.{layer}.{block}.experts.5.{wname}.weight"]
        assert torch.equal(experts_a[spec.num_moe_layers - 1, 5][slot], want)


def test_missing_non_expert_tensor_is_named(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    ckpt = rewrite(tiny_checkpoint("qwen3_moe"), tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(ckpt)


def test_missing_expert_tensor_is_named(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    name = "model.layers.1.block_sparse_moe.experts.6.w3.weight"
    ckpt = rewrite(tiny_checkpoint("mixtral"), tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(ckpt)


def test_missing_fused_tensor_is_named(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.down_proj"
    ckpt = rewrite(tiny_checkpoint("olmoe", fused_experts=True), tmp_path / "c", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(ckpt)


@pytest.mark.parametrize(
    ("arch", "fused", "name"),
    [
        ("qwen2_moe", False, "model.layers.0.mlp.shared_expert_gate.weight"),
        ("qwen2_moe", False, "model.layers.2.mlp.experts.3.down_proj.weight"),
        ("olmoe", True, "model.layers.1.mlp.experts.gate_up_proj"),
    ],
)
def test_misshaped_tensor_is_named(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, arch: str, fused: bool, name: str
) -> None:
    def shorten(t: dict[str, Tensor]) -> None:
        t[name] = t[name][..., :-1].contiguous()

    ckpt = rewrite(tiny_checkpoint(arch, fused_experts=fused), tmp_path / "c", shorten)
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ".*shape"):
        load(ckpt)


def test_unexpected_tensor_is_named(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.extra_proj.weight"
    ckpt = rewrite(tiny_checkpoint("qwen2_moe"), tmp_path / "c", lambda t: t.update({name: torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load(ckpt)


def test_write_expert_to_pages_places_and_checks() -> None:
    f, d = 3, 4
    view = torch.zeros(5, f * d)
    w1, w3, w2 = torch.randn(f, d), torch.randn(f, d), torch.randn(d, f)
    write_expert_to_pages(view, torch.tensor([4, 0, 2], dtype=torch.int32), w1, w3, w2)
    assert torch.equal(view[4].view(f, d), w1) and torch.equal(view[0].view(f, d), w3)
    assert torch.equal(view[2].view(d, f), w2) and not view[[1, 3]].any()
    with pytest.raises(ValueError, match="w2"):
        write_expert_to_pages(view, [1, 3, 2], w1, w3, w2.T)
    with pytest.raises(ValueError, match="pages"):
        write_expert_to_pages(view, [1, -1, 2], w1, w3, w2)


def test_init_dummy_weights(tiny_checkpoint: Callable[..., Path]) -> None:
    spec = ModelSpec.from_pretrained(tiny_checkpoint("qwen3_moe"))
    provider = StaticExpertProvider(torch.empty(0, 1), torch.zeros(spec.num_moe_layers, spec.num_experts, 3))
    kv = torch.empty(1, 2, 16, spec.num_key_value_heads, spec.head_dim)
    a = build_model(spec, torch.bfloat16, "cpu", kv, provider)
    b = build_model(spec, torch.bfloat16, "cpu", kv, provider)
    init_dummy_weights(a, seed=7)
    init_dummy_weights(b, seed=7)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
        if name.endswith("norm.weight"):
            assert torch.all(p == 1), name
    emb = a.model.embed_tokens.weight.float()
    assert 0.015 < emb.std().item() < 0.025


def test_init_dummy_expert_pages_fills_only_the_given_pages() -> None:
    view = torch.zeros(10, 12)
    init_dummy_expert_pages(view, torch.tensor([[7, 2, 5]]), seed=1, chunk=2)
    assert view[[2, 5, 7]].abs().min() > 0 and not view[[0, 1, 3, 4, 6, 8, 9]].any()


def test_unsupported_model_type() -> None:
    from rimuru.models import model_class

    with pytest.raises(ValueError, match="deepseek_v3.*supported"):
        model_class("deepseek_v3")
