"""Weights into a built model: safetensors checkpoints from a local directory, or dummy weights.

Non-expert tensors are copied into the model's parameters by name; a tensor named as a shard of a
`MergedLinear` (q_proj, k_proj, v_proj of `qkv_proj`; gate_proj, up_proj of `gate_up_proj`) goes to its
rows of the merged parameter. Routed experts never become
parameters: each expert's three matrices go to `expert_sink(moe_layer, expert, w1, w3, w2)`, which
the caller points at expert pages (see `write_expert_to_pages`). Two checkpoint namings of experts:

    per expert   model.layers.{i}.mlp.experts.{e}.gate_proj.weight  [f, d]   (W1)
                 model.layers.{i}.mlp.experts.{e}.up_proj.weight    [f, d]   (W3)
                 model.layers.{i}.mlp.experts.{e}.down_proj.weight  [d, f]   (W2)
                 (Mixtral: block_sparse_moe.experts.{e}.w1 / w3 / w2)
    fused        model.layers.{i}.mlp.experts.gate_up_proj  [E, 2f, d]   rows :f = W1, f: = W3
                 model.layers.{i}.mlp.experts.down_proj     [E, d, f]
                 (transformers 5 `save_pretrained(..., save_original_format=False)`)

An architecture may rename checkpoint prefixes (`checkpoint_renames`, e.g. a multimodal wrapper's
`model.language_model.`), skip the parts it does not run (`checkpoint_skipped`) and split a checkpoint tensor that
fuses several of its parameters (`split_checkpoint_tensor`, e.g. Qwen3-Next's `in_proj_qkvz`): such a tensor is read
whole, split, and each parameter takes its part (its rank's slice of it under tensor parallelism).

Tensor-parallel, a rank reads only its slice of each cut tensor (the parameter's `Shard`,
models/parallel_linear.py) and of each expert: rows [r f/N, (r+1) f/N) of W1 and W3, those columns of W2, which
the expert sink gets as [f/N, d], [f/N, d], [d, f/N].

Tensors are read one at a time (per expert for fused tensors) from memory-mapped files, so the
whole checkpoint is never resident at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from rimuru.model_spec import ModelSpec
from rimuru.models.causal_lm import CheckpointSplit, MoECausalLM
from rimuru.models.layers import MergedLinear
from rimuru.models.parallel_linear import Shard, param_shards

ExpertSink = Callable[[int, int, Tensor, Tensor, Tensor], None]

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
# Tensors some checkpoints carry that are not weights.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped tensors."""


@dataclass
class _LayerExperts:
    per_expert: dict[tuple[int, int], str] = field(default_factory=dict)  # (expert, slot 0/1/2) -> name
    fused: dict[str, str] = field(default_factory=dict)  # "gate_up_proj" / "down_proj" -> name


def checkpoint_files(checkpoint_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else every *.safetensors."""
    root = Path(checkpoint_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {root}")
    return files


def load_checkpoint(
    model: MoECausalLM, spec: ModelSpec, checkpoint_dir: str | Path, expert_sink: ExpertSink
) -> None:
    """Fill every non-expert parameter of `model` and hand every routed expert to `expert_sink`.

    Raises CheckpointError naming the tensor when one is missing, unexpected or mis-shaped; all
    names and shapes are checked before any data is read.
    """
    params = dict(model.named_parameters())
    cut_of = param_shards(model)  # parameter -> the slice of the checkpoint tensor it holds (tensor parallelism)
    shard_of = _merged_shards(model)  # checkpoint-style name -> (merged parameter, row offset, rows, cut)
    moe_ordinal = {layer: i for i, layer in enumerate(spec.moe_layer_ids)}
    slot_of = {name: slot for slot, name in enumerate(model.expert_weight_names)}
    with ExitStack() as stack:
        handles: dict[str, Any] = {}  # checkpoint name -> open safe_open handle
        for path in checkpoint_files(checkpoint_dir):
            handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            for name in handle.keys():
                if name in handles:
                    raise CheckpointError(f"tensor {name} appears in more than one file of {checkpoint_dir}")
                handles[name] = handle

        targets: dict[str, str] = {}  # parameter name -> checkpoint name
        shard_targets: dict[str, str] = {}  # shard name (checkpoint style) -> checkpoint name
        split_targets: dict[str, CheckpointSplit] = {}  # checkpoint name -> (parameter names, splitter)
        experts: dict[int, _LayerExperts] = {}
        unexpected: list[str] = []
        skipped = [re.compile(p) for p in model.checkpoint_skipped]
        for name in handles:
            if any(p.search(name) for p in skipped):
                continue
            canon = name
            for old, new in model.checkpoint_renames:
                canon = canon.replace(old, new)
            if _IGNORED.search(canon) or (canon == "lm_head.weight" and model.lm_head is None):
                continue
            if canon in params:
                targets[canon] = name
            elif canon in shard_of:
                shard_targets[canon] = name
            elif (split := model.split_checkpoint_tensor(canon)) is not None and all(p in params for p in split[0]):
                split_targets[name] = split
            elif (m := _PER_EXPERT.match(canon)) and m.group(3) in slot_of and int(m.group(1)) in moe_ordinal:
                layer = experts.setdefault(moe_ordinal[int(m.group(1))], _LayerExperts())
                layer.per_expert[(int(m.group(2)), slot_of[m.group(3)])] = name
            elif (m := _FUSED.match(canon)) and int(m.group(1)) in moe_ordinal:
                experts.setdefault(moe_ordinal[int(m.group(1))], _LayerExperts()).fused[m.group(2)] = name
            else:
                unexpected.append(name)
        if unexpected:
            raise CheckpointError(
                f"unexpected tensors in checkpoint (not in the {spec.model_type} model): {unexpected[:8]}"
            )
        covered = {shard_of[s][0] for s in shard_targets}
        covered |= {p for pnames, _ in split_targets.values() for p in pnames}
        missing = [s for s in shard_of if s not in shard_targets]
        missing += [p for p in params if p not in targets and p not in covered]
        if missing:
            raise CheckpointError(f"checkpoint {checkpoint_dir} lacks tensors: {missing[:8]}")
        full_shapes: dict[str, tuple[int, ...]] = {}  # checkpoint name -> its shape as the model expects it
        for pname, cname in targets.items():
            local = tuple(params[pname].shape)
            full_shapes[cname] = cut_of[pname].full_shape(local) if pname in cut_of else local
        for sname, cname in shard_targets.items():
            pname, _, rows, cut = shard_of[sname]
            full_shapes[cname] = (rows * (cut.chunks if cut else 1), *params[pname].shape[1:])
        for cname, (pnames, _) in split_targets.items():  # the parts stacked by rows, in some order
            parts = [cut_of[p].full_shape(tuple(params[p].shape)) if p in cut_of else tuple(params[p].shape)
                     for p in pnames]
            full_shapes[cname] = (sum(shape[0] for shape in parts), *parts[0][1:])
        for cname, want in full_shapes.items():
            _check_shape(cname, handles[cname].get_slice(cname).get_shape(), want)
        plans = [
            _expert_plan(model, spec, moe_idx, experts.get(moe_idx, _LayerExperts()), handles)
            for moe_idx in range(spec.num_moe_layers)
        ]

        def read(cname: str, cut: Shard | None) -> Tensor:
            if cut is None:
                return handles[cname].get_tensor(cname)
            return cut.read(handles[cname].get_slice(cname), full_shapes[cname])

        with torch.no_grad():
            for pname, cname in targets.items():
                params[pname].copy_(read(cname, cut_of.get(pname)))
            for sname, cname in shard_targets.items():
                pname, offset, rows, cut = shard_of[sname]
                params[pname][offset : offset + rows].copy_(read(cname, cut))
            for cname, (pnames, split_fn) in split_targets.items():
                for pname, whole in zip(pnames, split_fn(handles[cname].get_tensor(cname)), strict=True):
                    params[pname].copy_(cut_of[pname].take(whole) if pname in cut_of else whole)
            for moe_idx, read_expert in enumerate(plans):
                for e in model.tp.local_experts(spec.num_experts):  # a rank reads only the experts it holds
                    expert_sink(moe_idx, e, *read_expert(e))


def _merged_shards(model: MoECausalLM) -> dict[str, tuple[str, int, int, Shard | None]]:
    """For every MergedLinear: `<parent>.<shard>.weight|bias` -> (`<module>.weight|bias`, row offset, rows, the
    rows of the checkpoint's tensor this rank holds)."""
    out: dict[str, tuple[str, int, int, Shard | None]] = {}
    for mname, module in model.named_modules():
        if not isinstance(module, MergedLinear):
            continue
        parent = mname.rsplit(".", 1)[0] if "." in mname else ""
        for shard, (offset, rows) in module.shards.items():
            for suffix in ("weight", "bias") if module.bias is not None else ("weight",):
                key = f"{parent}.{shard}.{suffix}" if parent else f"{shard}.{suffix}"
                out[key] = (f"{mname}.{suffix}", offset, rows, module.cuts[shard])
    return out


def _check_shape(name: str, got: Sequence[int], want: tuple[int, ...]) -> None:
    if tuple(got) != want:
        raise CheckpointError(f"tensor {name} has shape {tuple(got)}, expected {want}")


def _expert_plan(
    model: MoECausalLM, spec: ModelSpec, moe_idx: int, layer: _LayerExperts, handles: dict[str, Any]
) -> Callable[[int], tuple[Tensor, Tensor, Tensor]]:
    """Validate one MoE layer's expert tensors; return a reader of (w1, w3, w2) by expert id: this rank's slice
    along f under tensor parallelism, the whole expert under expert parallelism (or on one rank)."""
    E, f, d = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    tp = model.tp
    sliced = tp.size > 1 and not tp.expert_parallel
    fl = tp.expert_part(f)
    lo, hi = (tp.rank * fl, (tp.rank + 1) * fl) if sliced else (0, f)  # this rank's rows of W1 / W3, columns of W2
    layer_id = spec.moe_layer_ids[moe_idx]
    if layer.per_expert and layer.fused:
        raise CheckpointError(
            f"layer {layer_id} has experts both per expert and fused: {sorted(layer.fused.values())}"
        )
    if layer.fused:
        for kind, shape in (("gate_up_proj", (E, 2 * f, d)), ("down_proj", (E, d, f))):
            name = layer.fused.get(kind) or f"model.layers.{layer_id}.mlp.experts.{kind}"
            if kind not in layer.fused:
                raise CheckpointError(f"checkpoint lacks tensor {name}")
            _check_shape(name, handles[name].get_slice(name).get_shape(), shape)
        gate_up, down = layer.fused["gate_up_proj"], layer.fused["down_proj"]

        def read_fused(e: int) -> tuple[Tensor, Tensor, Tensor]:
            if sliced:
                w13, w2 = handles[gate_up].get_slice(gate_up), handles[down].get_slice(down)
                return w13[e, lo:hi], w13[e, f + lo : f + hi], w2[e, :, lo:hi]  # [f/N, d], [f/N, d], [d, f/N]
            w13 = handles[gate_up].get_slice(gate_up)[e]  # [2f, d]
            return w13[:f], w13[f:], handles[down].get_slice(down)[e]  # [f, d], [f, d], [d, f]

        return read_fused

    prefix = next(iter(layer.per_expert.values()), f"model.layers.{layer_id}.mlp.experts.0.x.weight")
    prefix = prefix[: prefix.index(".experts.")]
    shapes = ((f, d), (f, d), (d, f))
    for e in range(E):
        for slot, wname in enumerate(model.expert_weight_names):
            name = layer.per_expert.get((e, slot))
            if name is None:
                raise CheckpointError(f"checkpoint lacks tensor {prefix}.experts.{e}.{wname}.weight")
            _check_shape(name, handles[name].get_slice(name).get_shape(), shapes[slot])
    stray = sorted(name for (e, _), name in layer.per_expert.items() if e >= E)
    if stray:
        raise CheckpointError(f"unexpected tensors for experts beyond num_experts={E}: {stray[:8]}")

    def read_per_expert(e: int) -> tuple[Tensor, Tensor, Tensor]:
        w1, w3, w2 = (layer.per_expert[(e, slot)] for slot in range(3))
        if sliced:
            return (handles[w1].get_slice(w1)[lo:hi], handles[w3].get_slice(w3)[lo:hi],
                    handles[w2].get_slice(w2)[:, lo:hi])
        return handles[w1].get_tensor(w1), handles[w3].get_tensor(w3), handles[w2].get_tensor(w2)

    return read_per_expert


def write_expert_to_pages(
    expert_view: Tensor, table_row: Tensor | Sequence[int], w1: Tensor, w3: Tensor, w2: Tensor
) -> None:
    """Copy one expert's W1 [f, d], W3 [f, d], W2 [d, f] into its pages (p1, p3, p2) of
    `expert_view` [n_mid, f*d], converting to the view's dtype and device."""
    pages = [int(p) for p in (table_row.tolist() if isinstance(table_row, Tensor) else table_row)]
    if len(pages) != 3 or min(pages) < 0 or max(pages) >= expert_view.shape[0]:
        raise ValueError(f"expert pages {pages} must be 3 ids in [0, {expert_view.shape[0]})")
    f, d = w1.shape
    for name, w, shape in (("w1", w1, (f, d)), ("w3", w3, (f, d)), ("w2", w2, (d, f))):
        if tuple(w.shape) != shape or f * d != expert_view.shape[1]:
            raise ValueError(
                f"expert matrix {name} has shape {tuple(w.shape)}, expected {shape} "
                f"with f*d = {expert_view.shape[1]}"
            )
    with torch.no_grad():
        for page, w in zip(pages, (w1, w3, w2), strict=True):
            expert_view[page].copy_(w.reshape(-1))


def init_dummy_weights(model: MoECausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random non-expert weights of the real shapes on the model's device (vLLM's
    `--load-format dummy`): N(0, std) everywhere, norm weights 1 (0 for zero-centred norms: also scale 1)."""
    generators: dict[torch.device, torch.Generator] = {}
    zero_centred = {f"{n}.weight" for n, m in model.named_modules() if getattr(m, "zero_centred", False)}
    cuts = param_shards(model)
    merged = {f"{n}.{s}": m for n, m in model.named_modules() if isinstance(m, MergedLinear)
              for s in ("weight", "bias") if any(c is not None for c in m.cuts.values())}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(0.0 if name in zero_centred else 1.0)
                continue
            if p.device not in generators:
                generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            g = generators[p.device]
            if name in cuts:  # a rank's slice: draw what the whole tensor would be, keep the slice
                full = p.new_empty(cuts[name].full_shape(tuple(p.shape))).normal_(0.0, std, generator=g)
                p.copy_(cuts[name].take(full))
            elif name in merged:
                m = merged[name]
                rows = sum(m.full_rows(s) for s in m.shards)
                p.copy_(m.local_of_full(p.new_empty(rows, *p.shape[1:]).normal_(0.0, std, generator=g)))
            else:
                p.normal_(0.0, std, generator=g)


def init_dummy_expert_pages(
    expert_view: Tensor, pages: Tensor, seed: int = 0, std: float = 0.02, chunk: int = 256
) -> None:
    """Random N(0, std) expert matrices in the given pages of `expert_view` [n_mid, f*d], generated
    on the view's device `chunk` pages at a time (no full-size temporary)."""
    flat = pages.reshape(-1).to(device=expert_view.device, dtype=torch.long)
    g = torch.Generator(device=expert_view.device).manual_seed(seed)
    with torch.no_grad():
        for start in range(0, flat.numel(), chunk):
            ids = flat[start : start + chunk]
            rows = expert_view.new_empty(ids.numel(), expert_view.shape[1])  # [chunk, f*d]
            expert_view[ids] = rows.normal_(0.0, std, generator=g)
