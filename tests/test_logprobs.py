"""Logprobs as vLLM computes them: log_softmax of the raw logits (before temperature, top-k, top-p) in float32,
the sampled token's own and the top k per generated token, read with the step's tokens.

Checked against transformers' logits of the same context, in a batch with requests that did not ask (whose tokens
must not change), with async scheduling and chunked prefill, and through the packing on random logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine import model_runner
from rimuru.engine.logprobs import compute_logprobs, logprob_rows, unpack_logprobs
from rimuru.engine.sampler import SAMPLE_ROWS_PER_CHUNK
from rimuru.testing.reference import random_prompts

STEPS = 10
K = 5
ATOL = 1e-4  # float32 against float32: the model parity tests' tolerance on the logits




def hf_logprobs(ckpt: Path, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits [L, V] at every position of one sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def params(logprobs: int | None = None, **kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": STEPS, "temperature": 0.0, "ignore_eos": True, "logprobs": logprobs,
                             **kw})


def test_greedy_logprobs_equal_log_softmax_of_transformers_logits(ckpt: Path, llm: LLM) -> None:
    prompts = random_prompts((5, 19))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(K))
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == STEPS
        # causal: position len(prompt) - 1 + i of the whole sequence predicts generated token i
        ref = hf_logprobs(ckpt, prompt + comp.token_ids)[len(prompt) - 1 : -1]  # [STEPS, V]
        top_lp, top_ids = ref.topk(K, dim=-1)  # [STEPS, K]
        for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            assert list(entry)[:K] == top_ids[i].tolist()  # greedy: the sampled token is the top one, listed once
            assert len(entry) == K
            assert entry[token].rank == 1
            got = torch.tensor([entry[t].logprob for t in top_ids[i].tolist()])
            assert (got - top_lp[i]).abs().max().item() < ATOL
            assert [entry[t].rank for t in top_ids[i].tolist()] == list(range(1, K + 1))
            assert all(lp.decoded_token == tok.decode([t]) for t, lp in entry.items())


def test_sampled_token_keeps_its_raw_logprob_and_rank_under_temperature(ckpt: Path, llm: LLM) -> None:
    """Sampling at temperature 1.5 with top-k 40: the logprobs are still of the raw distribution, the sampled token
    first (wherever it ranks), then the k most likely."""
    prompt = random_prompts((7,))[0]
    comp = llm.generate({"prompt_token_ids": prompt}, params(2, temperature=1.5, top_k=40, seed=3))[0].outputs[0]
    ref = hf_logprobs(ckpt, prompt + comp.token_ids)[len(prompt) - 1 : -1]  # [STEPS, V]
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs or [], strict=True)):
        assert next(iter(entry)) == token
        assert abs(entry[token].logprob - ref[i, token].item()) < ATOL
        assert entry[token].rank == int((ref[i] >= ref[i, token]).sum())
        assert sorted((t for t in entry if entry[t].rank <= 2), key=lambda t: entry[t].rank) == \
            ref[i].topk(2).indices.tolist()
    assert any(entry[t].rank > 1 for t, entry in zip(comp.token_ids, comp.logprobs or [], strict=True))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_batch_mixing_logprobs_and_none_keeps_every_token(ckpt: Path, async_scheduling: bool) -> None:
    """Asking for logprobs changes no token: neither the asking request's nor its neighbours' (greedy and seeded
    sampling), with prefill cut into chunks so that steps mix prefill chunks and decodes."""
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", async_scheduling=async_scheduling,
              max_num_batched_tokens=9)
    prompts = [{"prompt_token_ids": p} for p in random_prompts((5, 17, 12, 3))]
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    plain = [params(), params(**sampled), params(**sampled), params()]
    mixed = [params(3), params(**sampled), params(0, **sampled), params()]
    want = [o.outputs[0] for o in llm.generate(prompts, plain)]
    got = [o.outputs[0] for o in llm.generate(prompts, mixed)]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.logprobs is None for c in got] == [False, True, False, True]
    assert all(len(c.logprobs or []) == STEPS for c in (got[0], got[2]))
    assert [len(e) for e in got[2].logprobs or []] == [1] * STEPS  # logprobs=0: the sampled token's alone
    assert llm.stats()["kv_pages_used"] == 0


def test_nobody_asking_computes_no_logprobs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("logprobs computed for a batch where nobody asked")

    monkeypatch.setattr(model_runner, "compute_logprobs", refuse)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params())[0].outputs[0]
    assert out.logprobs is None and len(out.token_ids) == STEPS


def test_packing_matches_log_softmax_on_chunks_and_row_subsets() -> None:
    """More rows than one sampler chunk, some asking for different numbers (one for the whole vocabulary)."""
    g = torch.Generator().manual_seed(0)
    B, V = SAMPLE_ROWS_PER_CHUNK + 9, 50
    logits = torch.randn(B, V, generator=g) * 3  # [B, V]
    tokens = torch.randint(0, V, (B,), generator=g)  # [B]
    asked: list[int | None] = [None if i % 3 == 0 else i % 7 for i in range(B)]
    asked[1] = -1
    sel = logprob_rows(asked, V)
    assert sel is not None and sel.width == V
    rows = unpack_logprobs(compute_logprobs(logits, tokens, sel), sel)
    ref = torch.log_softmax(logits, dim=-1)
    for i, (n, row) in enumerate(zip(asked, rows, strict=True)):
        if n is None:
            assert row is None
            continue
        n = V if n == -1 else n
        assert row is not None and len(row.top_ids) == n
        assert row.token_logprob == ref[i, tokens[i]].item()
        assert row.rank == int((ref[i] >= ref[i, tokens[i]]).sum())
        assert row.top_ids == ref[i].topk(n).indices.tolist()
        assert row.top_logprobs == ref[i].topk(n).values.tolist()
    assert logprob_rows([None, None], V) is None


def test_limits_are_vllms(ckpt: Path, llm: LLM) -> None:
    with pytest.raises(ValueError, match="greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": [5, 6]}, params(21))
    with pytest.raises(ValueError, match="Requested sample logprobs of 300, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": [5, 6]}, params(-1))
    with pytest.raises(ValueError, match="logprobs must be"):
        params(-2)
    wide = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_logprobs=-1)
    comp = wide.generate({"prompt_token_ids": [5, 6]}, params(-1, max_tokens=2))[0].outputs[0]
    assert [len(e) for e in comp.logprobs or []] == [300, 300]
    assert llm.stats()["kv_pages_used"] == 0


def test_max_logprobs_is_a_flag() -> None:
    from rimuru.cli import build_parser
    from rimuru.config import EngineConfig

    args = build_parser().parse_args(["serve", "path/to/model", "--max-logprobs", "5"])
    assert EngineConfig.from_cli_args(args).max_logprobs == 5
    assert EngineConfig.from_cli_args(build_parser().parse_args(["serve", "m"])).max_logprobs == 20
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig(model="m", max_logprobs=-2)
