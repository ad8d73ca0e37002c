"""logit_bias as vLLM's and OpenAI's: added to a row's raw logits before temperature, top-k and top-p; the logprobs
stay the raw model's. Checked against transformers' logits of the same tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rimuru import LLM, SamplingParams

PROMPT = [5, 17, 33, 9, 41]


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> tuple[LLM, torch.Tensor]:
    """The engine over a tiny qwen2_moe and transformers' float32 logits at the prompt's last position."""
    from transformers import AutoModelForCausalLM

    path: Path = tiny_checkpoint("qwen2_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT]), use_cache=False).logits[0, -1].float()
    llm = LLM(str(path), gpu_memory_budget="64MiB", device="cpu")
    yield llm, ref
    llm.shutdown()


def first_token(llm: LLM, **params: object) -> tuple[int, dict]:
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, ignore_eos=True, **params))
    choice = out[0].outputs[0]
    return choice.token_ids[0], (choice.logprobs[0] if choice.logprobs else {})


def test_greedy_takes_the_argmax_of_the_biased_logits(model) -> None:
    llm, ref = model
    top2 = ref.topk(2)
    best, second = int(top2.indices[0]), int(top2.indices[1])
    gap = float(top2.values[0] - top2.values[1])
    assert first_token(llm, temperature=0.0)[0] == best
    # a bias just past the gap moves the argmax to the second token; one just short of it does not
    assert first_token(llm, temperature=0.0, logit_bias={second: gap + 0.05})[0] == second
    assert first_token(llm, temperature=0.0, logit_bias={second: max(0.0, gap - 0.05)})[0] == best
    assert first_token(llm, temperature=0.0, logit_bias={best: -100.0})[0] == second


def test_sampled_rows_draw_from_the_biased_distribution_and_logprobs_stay_raw(model) -> None:
    llm, ref = model
    target = int(ref.argmin())  # the least likely token: only the bias can make it drawn
    for seed in range(5):
        tok, lps = first_token(llm, temperature=1.0, top_k=5, seed=seed, logit_bias={target: 100.0}, logprobs=1)
        assert tok == target  # +100 before top-k puts it in the top 5 and all but certain
        raw = torch.log_softmax(ref, dim=-1)
        assert abs(lps[target].logprob - float(raw[target])) < 1e-4  # the raw model's logprob, not the biased one
    # without the bias the draws never reach it
    assert all(first_token(llm, temperature=1.0, top_k=5, seed=s)[0] != target for s in range(5))


def test_bad_logit_bias_is_refused_with_its_reason(model) -> None:
    llm, _ = model
    for bias, reason in (({-1: 1.0}, "token ids"), ({3: 100.5}, r"\[-100, 100\]"), ({"3": 1.0}, "token ids")):
        with pytest.raises(ValueError, match=reason):
            SamplingParams(logit_bias=bias)
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, logit_bias={10**6: 1.0}))
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0
