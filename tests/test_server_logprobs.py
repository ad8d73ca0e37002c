"""Logprobs through the server, read by the official `openai` client: completions' legacy form and chat's
content form, whole and streamed, hold the engine's own numbers; a request over --max-logprobs is a 400 naming
the limit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from rimuru import LLM, SamplingParams
from rimuru.config import EngineConfig
from rimuru.engine.llm_engine import LLMEngine
from rimuru.engine.outputs import CompletionOutput, Logprob
from rimuru.server.app import ServerConfig
from rimuru.server.background import BackgroundServer
from rimuru.server.prompts import chat_prompt
from rimuru.server.protocol import ChatMessage
from rimuru.server.responses import ChoiceDelta, ResponseHead, chat_completion_chunk, completion_chunk

MODEL = "tiny-moe"
TOKENS = 8
ATOL = 1e-4  # the same model on both sides, batched or cached differently: float32 sums round differently
PROMPT = [5, 17, 80, 120, 33]
MESSAGES = [{"role": "user", "content": "Hello there"}]



@pytest.fixture(scope="module")
def client(ckpt: Path) -> Iterator[openai.OpenAI]:
    engine = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", gpu_memory_budget="64MiB"))
    with BackgroundServer(engine, ServerConfig(served_model_name=MODEL)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def engine_outputs(ckpt: Path) -> dict[str, CompletionOutput]:
    """What the engine itself returns for the test's two prompts (greedy, 3 top logprobs)."""
    llm = LLM(str(ckpt), device="cpu", gpu_memory_budget="64MiB")
    chat_ids = chat_prompt(llm.get_tokenizer(), [ChatMessage(**m) for m in MESSAGES])
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": chat_ids}], params)
    return {"completion": outs[0].outputs[0], "chat": outs[1].outputs[0]}


def _greedy(**kw: object) -> dict:
    return {"model": MODEL, "temperature": 0.0, "max_tokens": TOKENS, "extra_body": {"ignore_eos": True}, **kw}


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < ATOL for x, y in zip(a, b, strict=True))


def _top(entry: dict, n: int) -> list[tuple[str, float]]:
    best = sorted(entry.values(), key=lambda lp: lp.rank)[:n]
    return [(lp.decoded_token, lp.logprob) for lp in best]


def test_completion_logprobs_whole_and_streamed(client: openai.OpenAI, engine_outputs: dict) -> None:
    want = engine_outputs["completion"]
    choice = client.completions.create(prompt=PROMPT, logprobs=3, **_greedy()).choices[0]
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == TOKENS
    texts = [want.logprobs[i][t].decoded_token for i, t in enumerate(want.token_ids)]
    assert lp.tokens == texts
    for got, token, entry in zip(lp.token_logprobs, want.token_ids, want.logprobs, strict=True):
        assert abs(got - entry[token].logprob) < ATOL
    for top, entry in zip(lp.top_logprobs, want.logprobs, strict=True):
        # the sampled token and the 3 most likely, keyed by text as OpenAI's legacy form is (tokens that decode
        # alike, such as lone bytes of one character, share a key)
        expect = {e.decoded_token: e.logprob for e in entry.values()}
        assert 1 <= len(top) <= 4 and top.keys() == expect.keys()
        assert all(abs(top[text] - value) < ATOL for text, value in expect.items())
    assert lp.text_offset == [sum(len(t) for t in texts[:i]) for i in range(TOKENS)]

    chunks = list(client.completions.create(prompt=PROMPT, logprobs=3, stream=True, **_greedy()))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    # the chunks put together are the whole body (to float32 rounding: a repeated prompt may come from the
    # prefix cache, which sums the same numbers in another order)
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert _close([v for s in streamed for v in s.token_logprobs], lp.token_logprobs)
    streamed_top = [d for s in streamed for d in s.top_logprobs]
    assert [d.keys() for d in streamed_top] == [d.keys() for d in lp.top_logprobs]
    assert all(_close(list(a.values()), list(b.values())) for a, b in zip(streamed_top, lp.top_logprobs, strict=True))
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset

    plain = client.completions.create(prompt=PROMPT, **_greedy()).choices[0]
    assert plain.logprobs is None and plain.text == choice.text


def test_chat_logprobs_whole_and_streamed(client: openai.OpenAI, engine_outputs: dict) -> None:
    want = engine_outputs["chat"]
    out = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, **_greedy())
    content = out.choices[0].logprobs.content
    assert len(content) == TOKENS == out.usage.completion_tokens
    for item, token, entry in zip(content, want.token_ids, want.logprobs, strict=True):
        assert item.token == entry[token].decoded_token
        assert item.bytes == list(item.token.encode("utf-8", "replace"))
        assert abs(item.logprob - entry[token].logprob) < ATOL
        assert len(item.top_logprobs) == 2
        for top, (text, value) in zip(item.top_logprobs, _top(entry, 2), strict=True):
            assert top.token == text and abs(top.logprob - value) < ATOL
            assert top.bytes == list(text.encode("utf-8", "replace"))
        assert item.top_logprobs[0].token == item.token  # greedy: the sampled token is the most likely

    chunks = list(client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=2, stream=True,
                                                 **_greedy()))
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs for i in c.choices[0].logprobs.content]
    assert len(streamed) == len(content)
    for a, b in zip(streamed, content, strict=True):
        assert (a.token, a.bytes) == (b.token, b.bytes)
        assert [(t.token, t.bytes) for t in a.top_logprobs] == [(t.token, t.bytes) for t in b.top_logprobs]
        assert _close([a.logprob, *(t.logprob for t in a.top_logprobs)],
                      [b.logprob, *(t.logprob for t in b.top_logprobs)])

    alone = client.chat.completions.create(messages=MESSAGES, logprobs=True, **_greedy()).choices[0]
    assert [i.top_logprobs for i in alone.logprobs.content] == [[]] * TOKENS  # the sampled tokens' only
    assert client.chat.completions.create(messages=MESSAGES, **_greedy()).choices[0].logprobs is None


def test_more_logprobs_than_max_logprobs_is_a_400_naming_it(client: openai.OpenAI) -> None:
    """And the other logprobs refusals: top_logprobs without logprobs, a negative number."""
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20") as err:
        client.completions.create(prompt=PROMPT, logprobs=21, **_greedy())
    assert err.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="greater than max allowed: 20"):
        client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=21, **_greedy())
    with pytest.raises(openai.BadRequestError, match="`logprobs` must be set to true") as err:
        client.chat.completions.create(messages=MESSAGES, top_logprobs=2, **_greedy())
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(prompt=PROMPT, logprobs=-2, **_greedy())
    assert err.value.body["param"] == "logprobs"


def test_response_builders_name_tokens_floor_minus_inf_and_keep_chat_top_to_the_most_likely() -> None:
    """A sampled token outside the top k leads completions' dict but stays out of chat's top list; an engine without
    a tokenizer names tokens `token_id:N`; -inf becomes OpenAI's -9999.0."""
    entry = {7: Logprob(float("-inf"), 40, None), 3: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, "é")}
    head = ResponseHead("id", 0, MODEL, num_logprobs=2)
    delta = ChoiceDelta(0, "x", None, None, first=False, token_ids=[7], logprobs=[entry], text_offset=4)
    legacy = completion_chunk(head, delta)["choices"][0]["logprobs"]
    assert legacy == {"tokens": ["token_id:7"], "token_logprobs": [-9999.0],
                      "top_logprobs": [{"token_id:7": -9999.0, "a": -0.5, "é": -1.5}], "text_offset": [4]}
    chat = chat_completion_chunk(head, delta)["choices"][0]["logprobs"]["content"][0]
    assert chat["token"] == "token_id:7" and chat["logprob"] == -9999.0
    assert chat["top_logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                    {"token": "é", "logprob": -1.5, "bytes": [195, 169]}]
    assert completion_chunk(ResponseHead("id", 0, MODEL), delta)["choices"][0]["logprobs"] is None
