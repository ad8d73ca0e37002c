"""Completions' echo and vLLM's prompt_logprobs through the server, read by the official `openai` client: the
prompt's text comes before the completion, its tokens' logprobs (transformers' log_softmax, the first null) before
the generated ones, whole and streamed; max_tokens=0 with echo returns the prompt alone; prompt_logprobs ride on
each completions choice and once on a chat body, as vLLM's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from rimuru import LLM, SamplingParams
from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.server.app import ServerConfig
from rimuru.server.background import BackgroundServer
from rimuru.server.prompts import chat_prompt
from rimuru.server.protocol import ChatMessage

MODEL = "tiny-moe"
TOKENS = 5
ATOL = 1e-4
PROMPT = [5, 17, 80, 120, 33, 41]
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(ckpt: Path) -> Iterator[openai.OpenAI]:
    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", gpu_memory_budget="64MiB"))
    with BackgroundServer(engine, ServerConfig(served_model_name=MODEL)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf_logprobs(ckpt: Path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    def logprobs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([tokens]), use_cache=False).logits[0].float(), dim=-1)

    return logprobs


def _greedy(**kw: object) -> dict:
    return {"model": MODEL, "temperature": 0.0, "max_tokens": TOKENS, "extra_body": {"ignore_eos": True}, **kw}


def test_echo_with_logprobs_puts_the_prompt_first_whole_and_streamed(client: openai.OpenAI, llm: LLM,
                                                                     hf_logprobs) -> None:
    tok = llm.get_tokenizer()
    want = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                                     ignore_eos=True, logprobs=2))[0].outputs[0]
    choice = client.completions.create(prompt=PROMPT, echo=True, logprobs=2, **_greedy()).choices[0]
    assert choice.text == tok.decode(PROMPT) + want.text
    lp = choice.logprobs
    P = len(PROMPT)
    assert lp.tokens == [tok.decode([t]) for t in PROMPT + want.token_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    ref = hf_logprobs(PROMPT)
    for j in range(1, P):
        assert abs(lp.token_logprobs[j] - ref[j - 1, PROMPT[j]].item()) < ATOL
        top = ref[j - 1].topk(2)
        assert set(lp.top_logprobs[j]) >= {tok.decode([t]) for t in top.indices.tolist()}
    for got, token, entry in zip(lp.token_logprobs[P:], want.token_ids, want.logprobs or [], strict=True):
        assert abs(got - entry[token].logprob) < ATOL
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(P + TOKENS)]
    # as vLLM: echo computes the prompt logprobs, and the choice carries them too
    assert choice.prompt_logprobs[0] is None and len(choice.prompt_logprobs) == P

    chunks = list(client.completions.create(prompt=PROMPT, echo=True, logprobs=2, stream=True, **_greedy()))
    parts = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in parts) == choice.text and parts[0].text.startswith(tok.decode(PROMPT))
    streamed = [p.logprobs for p in parts if p.logprobs is not None]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    values = [v for s in streamed for v in s.token_logprobs]
    assert values[0] is None and all(abs(a - b) < ATOL for a, b in zip(values[1:], lp.token_logprobs[1:], strict=True))


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client: openai.OpenAI, llm: LLM, hf_logprobs) -> None:
    tok = llm.get_tokenizer()
    out = client.completions.create(prompt=PROMPT, echo=True, logprobs=1, **_greedy(max_tokens=0))
    choice = out.choices[0]
    assert choice.text == tok.decode(PROMPT)
    assert choice.logprobs.tokens == [tok.decode([t]) for t in PROMPT]
    ref = hf_logprobs(PROMPT)
    assert [round(v, 4) if v is not None else None for v in choice.logprobs.token_logprobs] == \
        [None] + [round(ref[j - 1, PROMPT[j]].item(), 4) for j in range(1, len(PROMPT))]
    text = client.completions.create(prompt="Hello there", echo=True, **_greedy(max_tokens=0)).choices[0].text
    assert text == "Hello there"  # a text prompt echoes as sent
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=PROMPT, **_greedy(max_tokens=0))
    assert err.value.body["param"] == "max_tokens"


def test_prompt_logprobs_ride_on_completions_choices_and_chat_bodies(client: openai.OpenAI, llm: LLM,
                                                                     hf_logprobs) -> None:
    tok = llm.get_tokenizer()
    choices = client.completions.create(prompt=PROMPT, n=2, **_greedy(extra_body={"prompt_logprobs": 3})).choices
    ref = hf_logprobs(PROMPT)
    for choice in choices:
        plp = choice.prompt_logprobs
        assert len(plp) == len(PROMPT) and plp[0] is None
        for j in range(1, len(PROMPT)):
            entry = {int(t): v for t, v in plp[j].items()}
            token = PROMPT[j]
            assert abs(entry[token]["logprob"] - ref[j - 1, token].item()) < ATOL
            assert entry[token]["rank"] == int((ref[j - 1] >= ref[j - 1, token]).sum())
            assert entry[token]["decoded_token"] == tok.decode([token])
            best = sorted((t for t in entry if entry[t]["rank"] <= 3), key=lambda t: entry[t]["rank"])
            assert best == ref[j - 1].topk(3).indices.tolist()
        assert choice.logprobs is None  # prompt_logprobs alone asks for no sampled logprobs
    assert client.completions.create(prompt=PROMPT, **_greedy()).choices[0].prompt_logprobs is None

    chat_ids = chat_prompt(tok, [ChatMessage(**m) for m in MESSAGES])
    chat = client.chat.completions.create(messages=MESSAGES, **_greedy(extra_body={"prompt_logprobs": 1}))
    plp = chat.prompt_logprobs
    ref = hf_logprobs(chat_ids)
    assert len(plp) == len(chat_ids) and plp[0] is None
    assert all(abs(plp[j][str(chat_ids[j])]["logprob"] - ref[j - 1, chat_ids[j]].item()) < ATOL
               for j in range(1, len(chat_ids)))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=PROMPT, **_greedy(extra_body={"prompt_logprobs": -2}))
    assert err.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError, match="Requested prompt logprobs of 21, which is greater than max "
                                                     "allowed: 20") as err:
        client.completions.create(prompt=PROMPT, **_greedy(extra_body={"prompt_logprobs": 21}))
    assert err.value.body["param"] == "prompt_logprobs"
    with pytest.raises(openai.BadRequestError, match="not available when `stream=True`"):
        client.chat.completions.create(messages=MESSAGES, stream=True, **_greedy(extra_body={"prompt_logprobs": 2}))
