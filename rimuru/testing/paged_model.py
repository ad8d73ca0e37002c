"""A model over hand-built paged batches, for tests against transformers: the page bookkeeping an engine would do.

Experts sit at shuffled pages of a NaN-filled expert view, every attention layer's KV at shuffled pages of a
NaN-filled KV cache and, for hybrid models, every linear-attention layer's state at shuffled pages of NaN-filled
ssm and conv views, so a wrong page id, an unwritten slot or a fresh state read instead of selected as zero shows
up as NaN or a mismatch.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from rimuru.experts.static_provider import StaticExpertProvider
from rimuru.model_spec import ModelSpec
from rimuru.models.causal_lm import MoECausalLM
from rimuru.models.forward_batch import ForwardBatch, StepLayout
from rimuru.models.loader import load_checkpoint, write_expert_to_pages
from rimuru.models.registry import build_model, build_model_of_class
from rimuru.models.state_cache import LinearStateCache

BLOCK = 16


class PagedModel:
    """A Rimuru model (of `model_cls`, else the registry's class for the checkpoint) and its pages."""

    def __init__(self, ckpt: Path, seed: int = 0, num_kv_pages: int = 64, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", model_cls: type[MoECausalLM] | None = None, num_state_pages: int = 24) -> None:
        g = torch.Generator().manual_seed(seed)
        spec = ModelSpec.from_pretrained(ckpt)
        L, E = spec.num_moe_layers, spec.num_experts
        n_mid = 3 * L * E + 7  # spare pages stay NaN
        self.device = device
        self.generator = g
        tables = torch.randperm(n_mid, generator=g)[: 3 * L * E].view(L, E, 3).int()  # [L_moe, E, 3]
        self.tables = tables.to(device)
        expert_numel = spec.moe_intermediate_size * spec.hidden_size
        self.expert_view = torch.full((n_mid, expert_numel), float("nan"), dtype=dtype, device=device)
        kv_shape = (num_kv_pages, 2, BLOCK, spec.num_key_value_heads, spec.head_dim)
        self.kv_cache = torch.full(kv_shape, float("nan"), dtype=dtype, device=device)
        provider = StaticExpertProvider(self.expert_view, self.tables)
        if model_cls is None:
            self.model = build_model(spec, dtype, device, self.kv_cache, provider)
        else:
            self.model = build_model_of_class(model_cls, spec, dtype, device, self.kv_cache, provider)
        self.loaded: set[tuple[int, int]] = set()
        load_checkpoint(self.model, spec, ckpt, self._sink)
        self.spec = spec
        self.free_pages = torch.randperm(num_kv_pages, generator=g).tolist()
        self.pages: dict[int, list[list[int]]] = {}  # seq -> per attention layer, its page ids
        self.lens: dict[int, int] = {}
        # hybrid models: seq -> per linear-attention layer, its (ssm page, conv page)
        self.state_pages: dict[int, list[tuple[int, int]]] = {}
        if spec.is_hybrid:
            rec = (spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim)
            conv = (spec.linear_conv_dim, spec.linear_conv_kernel_dim - 1)
            nan = float("nan")
            self.model.bind_state_cache(LinearStateCache(
                torch.full((num_state_pages, *rec), nan, dtype=torch.float32, device=device),
                torch.full((num_state_pages, *conv), nan, dtype=dtype, device=device)))
            self.free_ssm = torch.randperm(num_state_pages, generator=g).tolist()
            self.free_conv = torch.randperm(num_state_pages, generator=g).tolist()

    def _sink(self, moe_layer: int, expert: int, w1: Tensor, w3: Tensor, w2: Tensor) -> None:
        self.loaded.add((moe_layer, expert))
        write_expert_to_pages(self.expert_view, self.tables[moe_layer, expert], w1, w3, w2)

    def batch(self, chunks: list[tuple[int, list[int]]]) -> ForwardBatch:
        """The batch of one forward pass over (seq id, new tokens) pairs, every new token's logits sampled; the
        sequences' pages grow to hold them."""
        n_attn = len(self.spec.attention_layer_ids)
        ids, positions, qsl, seq_lens, slots = [], [], [0], [], [[] for _ in range(n_attn)]
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            pages = self.pages.setdefault(seq, [[] for _ in range(n_attn)])
            for layer_pages in pages:
                while len(layer_pages) * BLOCK < end:
                    layer_pages.append(self.free_pages.pop())
            for a in range(n_attn):
                slots[a] += [pages[a][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            ids += tokens
            positions += range(start, end)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(end)
            self.lens[seq] = end
        max_blocks = max(len(self.pages[seq][0]) for seq, _ in chunks)
        tables = torch.zeros(n_attn, len(chunks), max_blocks, dtype=torch.int32)
        for b, (seq, _) in enumerate(chunks):
            for a in range(n_attn):
                tables[a, b, : len(self.pages[seq][a])] = torch.tensor(self.pages[seq][a])
        T, dev = len(ids), self.device
        ssm_pages = conv_pages = None
        if self.spec.is_hybrid:
            n_lin = len(self.spec.linear_layer_ids)
            for seq, _ in chunks:
                if seq not in self.state_pages:
                    self.state_pages[seq] = [(self.free_ssm.pop(), self.free_conv.pop()) for _ in range(n_lin)]
            state = torch.tensor([self.state_pages[seq] for seq, _ in chunks], dtype=torch.int64)  # [B, L_lin, 2]
            ssm_pages, conv_pages = state[..., 0].T.contiguous().to(dev), state[..., 1].T.contiguous().to(dev)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.arange(T, dtype=torch.int64, device=dev),
            max_query_len=max(len(t) for _, t in chunks),
            max_seq_len=max(seq_lens),
            ssm_pages=ssm_pages,
            conv_pages=conv_pages,
            layout=StepLayout.of([len(t) for _, t in chunks]) if self.spec.is_hybrid else None,
        )

    def step(self, chunks: list[tuple[int, list[int]]]) -> list[Tensor]:
        """One forward pass over (seq id, new tokens) pairs; the logits of every new token per seq."""
        batch = self.batch(chunks)
        with torch.inference_mode():
            hidden = self.model(batch)  # [T, d]
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [T, V]
        return list(logits.cpu().split([len(t) for _, t in chunks]))


def greedy_decode_together(model: PagedModel, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all sequences decoding together: one prefill pass, then `steps` passes of one
    token each (sequence i is seq id i)."""
    outs = model.step(list(enumerate(prompts)))
    tokens: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = [int(out[-1].argmax()) for out in outs]
        for s, t in enumerate(nxt):
            tokens[s].append(t)
        outs = model.step([(s, [t]) for s, t in enumerate(nxt)])
    return tokens


def random_prompts(seed: int, vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Token ids in [3, vocab) (clear of the tiny tokenizers' special ids), one prompt per length."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_close(got: Tensor, want: Tensor, what: str, atol: float) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    diff = (got - want).abs().max().item()
    assert diff < atol, f"{what}: max abs diff {diff:.3g} >= {atol}"
