"""Prompt logprobs as vLLM's `prompt_logprobs`: entry j (j >= 1) is transformers' log_softmax at position j - 1
for prompt token j, its rank and the top k; entry 0 is None. Checked with prefill cut into chunks, beside requests
that do not ask (their tokens unchanged), under async scheduling, through preemption, and against the prefix cache,
which such a request does not read. Nobody asking computes none (tests/test_cuda_graphs.py checks them from mixed
CUDA graphs' hidden states on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.engine import model_runner
from rimuru.testing.reference import random_prompts

ATOL = 1e-4  # float32 against float32
K = 3


@pytest.fixture(scope="module")
def hf(ckpt: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens]), use_cache=False).logits[0].float(), dim=-1)  # [L, V]


def check_prompt_logprobs(hf, prompt: list[int], got: list, k: int, tokenizer=None) -> None:
    ref = hf_logprobs(hf, prompt)
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        entry, row, token = got[j], ref[j - 1], prompt[j]
        assert next(iter(entry)) == token  # the prompt token first
        assert abs(entry[token].logprob - row[token].item()) < ATOL
        assert entry[token].rank == int((row >= row[token]).sum())
        top = sorted((t for t in entry if entry[t].rank <= k), key=lambda t: entry[t].rank)
        assert top == row.topk(k).indices.tolist()
        assert all(abs(entry[t].logprob - row[t].item()) < ATOL for t in top)
        assert len(entry) in (k, k + 1)
        if tokenizer is not None:
            assert all(lp.decoded_token == tokenizer.decode([t]) for t, lp in entry.items())


def params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, **kw})


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_equal_transformers_through_chunks_beside_others(ckpt: Path, hf,
                                                                          async_scheduling: bool) -> None:
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=7,
              async_scheduling=async_scheduling)
    prompts = random_prompts((19, 6, 12, 1))
    seeded = {"temperature": 0.8, "seed": 4}
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts], [params(), params(**seeded), params(), params()])
    asked = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [params(prompt_logprobs=K), params(**seeded), params(prompt_logprobs=0),
                          params(prompt_logprobs=K)])
    assert [o.outputs[0].token_ids for o in asked] == [o.outputs[0].token_ids for o in plain]
    check_prompt_logprobs(hf, prompts[0], asked[0].prompt_logprobs, K, llm.get_tokenizer())
    assert asked[1].prompt_logprobs is None and plain[0].prompt_logprobs is None
    zero = asked[2].prompt_logprobs
    check_prompt_logprobs(hf, prompts[2], zero, 0)
    assert all(len(e) == 1 for e in zero[1:])  # prompt_logprobs=0: the prompt token's own entry alone
    assert asked[3].prompt_logprobs == [None]  # one prompt token: nothing predicts it
    assert llm.stats()["kv_pages_used"] == 0


def test_a_request_asking_reads_no_cached_prefix(ckpt: Path, hf) -> None:
    llm = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu")
    prompt = random_prompts((40,), seed=3)[0]
    llm.generate({"prompt_token_ids": prompt}, params())
    again = llm.generate({"prompt_token_ids": prompt}, params())[0]
    assert again.num_cached_tokens and again.num_cached_tokens >= 32  # the cache holds the prompt's full blocks
    queries = llm.stats()["prefix_cache_queries"]
    asking = llm.generate({"prompt_token_ids": prompt}, params(prompt_logprobs=K))[0]
    assert asking.num_cached_tokens == 0
    assert llm.stats()["prefix_cache_queries"] == queries  # a lookup it skipped is not counted, as vLLM's
    check_prompt_logprobs(hf, prompt, asking.prompt_logprobs, K)
    assert asking.outputs[0].token_ids == again.outputs[0].token_ids


def test_preempted_requests_keep_their_prompt_logprobs_and_penalised_tokens(ckpt: Path, hf) -> None:
    """A pool of ~8 KV blocks for three requests of up to 4 blocks each: requests are preempted and recomputed; the
    prompt logprobs are still transformers' (each position once), and penalised and plain tokens are the roomy
    engine's."""
    roomy = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_num_batched_tokens=16)
    split, geo = roomy.engine.budget_split, roomy.engine.geometry
    per_block = roomy.engine.kv.num_layers * geo.size("kv")
    budget = (split["non_expert_weights"] + split["workspace"] + split["experts_resident"] + 8 * per_block
              + geo.huge_size)
    small = LLM(str(ckpt), gpu_memory_budget=budget, device="cpu", max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in random_prompts((21, 17, 25), seed=8)]
    ps = [params(max_tokens=30, prompt_logprobs=K), params(max_tokens=30, repetition_penalty=1.3,
                                                           frequency_penalty=0.3),
          params(max_tokens=30, presence_penalty=0.6, prompt_logprobs=1)]
    want = roomy.generate(prompts, ps)
    got = small.generate(prompts, ps)
    assert small.stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    check_prompt_logprobs(hf, prompts[0]["prompt_token_ids"], got[0].prompt_logprobs, K)
    check_prompt_logprobs(hf, prompts[2]["prompt_token_ids"], got[2].prompt_logprobs, 1)
    assert small.stats()["kv_pages_used"] == 0


def test_nobody_asking_computes_no_prompt_logprobs(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("prompt logprobs computed where nobody asked")

    monkeypatch.setattr(model_runner, "compute_prompt_logprobs", refuse)
    out = llm.generate([{"prompt_token_ids": p} for p in random_prompts((20, 5))], params())
    assert [o.prompt_logprobs for o in out] == [None, None] and len(out[0].outputs[0].token_ids) == 4


def test_limits_are_vllms(ckpt: Path, llm: LLM) -> None:
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": [5, 6]}, params(prompt_logprobs=21))
    with pytest.raises(ValueError, match="Requested prompt logprobs of 300, which is greater than max allowed: 20"):
        llm.generate({"prompt_token_ids": [5, 6]}, params(prompt_logprobs=-1))
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs must be a non-negative integer or -1"):
            params(prompt_logprobs=bad)
    wide = LLM(str(ckpt), gpu_memory_budget="64MiB", device="cpu", max_logprobs=-1)
    whole = wide.generate({"prompt_token_ids": [5, 6, 7]}, params(prompt_logprobs=-1))[0].prompt_logprobs
    assert whole[0] is None and [len(e) for e in whole[1:]] == [300, 300]
