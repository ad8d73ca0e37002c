"""How a rank's weights are cut from the full ones, and the row-parallel projection that sums the ranks' parts.

Tensor parallelism over N ranks (vLLM's layout): a column-parallel projection keeps 1/N of its output rows, its
output stays split (heads, MLP columns); the row-parallel projection after it keeps the matching 1/N of its input
columns, and the sum of the ranks' partial outputs (one all-reduce) is the full output:

    x [T, d] --W_col[rank] [n/N, d]--> y_rank [T, n/N] --W_row[rank] [d, n/N]--> partial [T, d] --all_reduce--> out

A module names the Shard of each parameter it cuts in `module.tp_shards` (a module attribute: parameters are
remade when the model leaves the meta device); `param_shards(model)` collects them by parameter name. The loader
reads only that slice of the checkpoint tensor, and dummy weights draw the full tensor and keep the slice, so
every rank's replicated weights are the same numbers. A MergedLinear names one Shard per checkpoint shard
(models/layers.py).

The embedding and the LM head are cut by vocabulary rows (`VocabParallelEmbedding`, a `PaddedShard` when N does not
divide V): each rank looks up the tokens whose rows it holds, zeros for the rest, and the all-reduce of the ranks'
lookups is the full embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rimuru.distributed.parallel_state import SINGLE, TensorParallel


@dataclass(frozen=True)
class Shard:
    """Chunk `index` of `chunks` equal chunks of a tensor along `dim`."""

    dim: int
    chunks: int
    index: int

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] *= self.chunks
        return tuple(shape)

    def _bounds(self, full: int) -> slice:
        n = full // self.chunks
        return slice(self.index * n, (self.index + 1) * n)

    def take(self, full: Tensor) -> Tensor:
        """This shard of a full tensor (a view)."""
        b = self._bounds(full.shape[self.dim])
        return full.narrow(self.dim, b.start, b.stop - b.start)

    def read(self, tensor_slice: Any, full_shape: tuple[int, ...]) -> Tensor:
        """This shard read from a safetensors slice, without reading the rest."""
        index: list[slice] = [slice(None)] * len(full_shape)
        index[self.dim] = self._bounds(full_shape[self.dim])
        return tensor_slice[tuple(index)]


@dataclass(frozen=True)
class PaddedShard(Shard):
    """Chunk `index` of a tensor whose `size` entries along `dim` are padded with zeros to `chunks` chunks of
    ceil(size / chunks): the vocabulary rows of an embedding or LM head whose V the ranks do not divide. The last
    rank's chunk (or last ranks') ends in zero rows past `size`."""

    size: int = 0

    @property
    def per_rank(self) -> int:
        return -(-self.size // self.chunks)

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = self.size
        return tuple(shape)

    def _bounds(self, full: int) -> slice:
        n = self.per_rank
        return slice(min(self.index * n, full), min((self.index + 1) * n, full))

    def _pad(self, part: Tensor) -> Tensor:
        missing = self.per_rank - part.shape[self.dim]
        if missing == 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)

    def take(self, full: Tensor) -> Tensor:
        """This chunk of a full tensor, zero rows past `size` (a view where there are none)."""
        return self._pad(super().take(full))

    def read(self, tensor_slice: Any, full_shape: tuple[int, ...]) -> Tensor:
        return self._pad(super().read(tensor_slice, full_shape))


@dataclass(frozen=True)
class SectionShard(Shard):
    """Chunk `index` of `chunks` of every one of the consecutive `sections` (their full sizes) of a tensor along
    `dim`, the chunks concatenated in section order: a fused projection whose output is several head groups, as
    gated DeltaNet's in_proj_qkv [q | k | v] and its conv channels, each cut by heads."""

    sections: tuple[int, ...] = ()

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local)
        shape[self.dim] = sum(self.sections)
        return tuple(shape)

    def _section_bounds(self) -> list[slice]:
        out, start = [], 0
        for size in self.sections:
            n = size // self.chunks
            out.append(slice(start + self.index * n, start + (self.index + 1) * n))
            start += size
        return out

    def take(self, full: Tensor) -> Tensor:
        """This rank's chunk of each section, concatenated (a new tensor)."""
        return torch.cat([full.narrow(self.dim, b.start, b.stop - b.start) for b in self._section_bounds()],
                         dim=self.dim)

    def read(self, tensor_slice: Any, full_shape: tuple[int, ...]) -> Tensor:
        parts = []
        for b in self._section_bounds():
            index: list[slice] = [slice(None)] * len(full_shape)
            index[self.dim] = b
            parts.append(tensor_slice[tuple(index)])
        return torch.cat(parts, dim=self.dim)


def section_shard(tp: TensorParallel, dim: int, sections: tuple[int, ...], what: str) -> SectionShard | None:
    """This rank's 1/N of every section (None without tensor parallelism); each section must divide evenly."""
    if tp.size == 1:
        return None
    for size in sections:
        tp.part(size, what)
    return SectionShard(dim, tp.size, tp.rank, sections=sections)


def vocab_shard(tp: TensorParallel, vocab_size: int) -> PaddedShard | None:
    """This rank's vocabulary rows [r Vp/N, (r+1) Vp/N), Vp = V rounded up to a multiple of N (None without
    tensor parallelism)."""
    return None if tp.size == 1 else PaddedShard(0, tp.size, tp.rank, size=vocab_size)


def rank_shard(tp: TensorParallel, dim: int) -> Shard | None:
    """This rank's 1/N along `dim` (None without tensor parallelism)."""
    return None if tp.size == 1 else Shard(dim, tp.size, tp.rank)


def kv_head_shard(tp: TensorParallel, num_kv_heads: int) -> tuple[int, Shard | None]:
    """(KV heads this rank holds, which of them): 1/N of them, or, with fewer KV heads than ranks, one head
    replicated on N / Hkv consecutive ranks (rank r holds head r * Hkv / N)."""
    if tp.size == 1:
        return num_kv_heads, None
    if num_kv_heads >= tp.size:
        return tp.part(num_kv_heads, "num_key_value_heads"), Shard(0, tp.size, tp.rank)
    if tp.size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp.size} must be a multiple of num_key_value_heads={num_kv_heads} "
                         "when it exceeds them (each KV head is replicated on the same number of ranks)")
    return 1, Shard(0, num_kv_heads, tp.rank * num_kv_heads // tp.size)


def set_shard(module: nn.Module, name: str, shard: Shard | None) -> None:
    """Parameter `name` of `module` holds `shard` of the checkpoint's tensor (None: the whole tensor)."""
    if shard is not None and getattr(module, name, None) is not None:
        shards = module.__dict__.setdefault("tp_shards", {})
        shards[name] = shard


def param_shards(model: nn.Module) -> dict[str, Shard]:
    """Every cut parameter of `model` by its full name."""
    out: dict[str, Shard] = {}
    for mname, module in model.named_modules():
        for pname, shard in module.__dict__.get("tp_shards", {}).items():
            out[f"{mname}.{pname}" if mname else pname] = shard
    return out


class ColumnParallelLinear(nn.Linear):
    """nn.Linear holding this rank's 1/N of the output rows (and bias); its output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE,
                 what: str = "out_features") -> None:
        super().__init__(in_features, tp.part(out_features, what), bias=bias)
        set_shard(self, "weight", rank_shard(tp, 0))
        set_shard(self, "bias", rank_shard(tp, 0))


class RowParallelLinear(nn.Linear):
    """nn.Linear over this rank's 1/N of the input columns; with `reduce` the ranks' partial outputs are summed
    (the bias, replicated, is added once after the sum). Without it the caller reduces, once for several partial
    sums (a MoE block adds its shared expert's part to the routed experts' before one all-reduce)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE,
                 reduce: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.reduce = reduce
        set_shard(self, "weight", rank_shard(tp, 1))
        if tp.size > 1 and bias and not reduce:
            raise ValueError("a row-parallel projection with a bias must reduce its output (the bias is added once)")

    def forward(self, x: Tensor) -> Tensor:  # [T, in/N] -> [T, out]
        if self.tp.size == 1:
            return super().forward(x)
        y = F.linear(x, self.weight)
        if self.reduce:
            self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding holding this rank's vocabulary rows (`vocab_shard`): a token looks up its row on the rank that
    holds it and zeros on the others, and the all-reduce of the ranks' lookups is the full embedding (a sum of one
    row and zeros, so the same bits as one rank's lookup)."""

    def __init__(self, vocab_size: int, embedding_dim: int, tp: TensorParallel = SINGLE) -> None:
        shard = vocab_shard(tp, vocab_size)
        super().__init__(vocab_size if shard is None else shard.per_rank, embedding_dim)
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start = 0 if shard is None else tp.rank * shard.per_rank  # this rank's first row's token id
        set_shard(self, "weight", shard)

    def local_lookup(self, ids: Tensor) -> Tensor:  # [T] -> [T, d]: this rank's rows, zeros for the others' ids
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return out.masked_fill_(~mine.unsqueeze(-1), 0)

    def forward(self, ids: Tensor) -> Tensor:  # [T] -> [T, d]
        return self.tp.all_reduce(self.local_lookup(ids))


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head's weight [Vp/N, d]: the same vocabulary rows as the embedding (`compute_logits` applies
    it; its logits are all-gathered and the padding rows dropped)."""

    def forward(self, ids: Tensor) -> Tensor:
        raise RuntimeError("an LM head is applied by compute_logits, not looked up")
