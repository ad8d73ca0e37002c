"""User mistakes the server answers with one clear 400 naming the field, and vLLM's `stop_reason` on chat choices."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from rimuru.engine.sampling_params import SamplingParams
from rimuru.server.background import BackgroundServer
from rimuru.server.config import ServerConfig
from rimuru.server.protocol import CompletionRequest
from rimuru.server.sampling import to_sampling_params
from tests.test_server_fake_engine import MODEL, FakeEngine, FakeTokenizer


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with BackgroundServer(FakeEngine(FakeTokenizer()), ServerConfig(served_model_name=MODEL)) as srv:
        yield srv.url


def test_a_negative_token_id_names_what_a_prompt_may_be(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[-1, 5], max_tokens=2)
    body = exc.value.body
    assert isinstance(body, dict) and body["param"] == "prompt"
    assert "token ids (integers >= 0)" in body["message"] and "valid string" not in body["message"]


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_a_seed_beyond_64_bits_is_refused_by_name(url: str, seed: int) -> None:
    resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5], "seed": seed})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "seed", resp.text
    with pytest.raises(ValueError, match="64 bits"):
        SamplingParams(seed=2**64)


def test_seeded_choices_stay_within_64_bits() -> None:
    req = CompletionRequest(model=MODEL, prompt=[5], seed=2**63 - 1, n=2)
    seeds = [to_sampling_params(req, 1, 64, i).seed for i in range(2)]
    assert seeds == [2**63 - 1, -(2**63)]  # distinct, and a generator takes both


def test_chat_choices_carry_stop_reason(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    raw = out.choices[0].model_dump()
    assert "stop_reason" in raw and raw["stop_reason"] is None and out.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, stream=True))
    assert all("stop_reason" in c.choices[0].model_dump() for c in chunks if c.choices)


def test_min_tokens_reaches_the_engine_and_a_negative_one_is_refused(url: str) -> None:
    req = CompletionRequest(model=MODEL, prompt=[5], min_tokens=3)
    assert to_sampling_params(req, 1, 64, 0).min_tokens == 3
    resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [5], "min_tokens": -1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "min_tokens", resp.text
