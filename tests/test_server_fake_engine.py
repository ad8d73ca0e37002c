"""The server's response shapes and routes over a fake engine that implements `EngineLike`: no model, so each
test states exactly which tokens the engine produced and which bytes the client must see."""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from rimuru.engine.outputs import CompletionOutput, RequestOutput
from rimuru.engine.sampling_params import SamplingParams
from rimuru.server.async_engine import EngineLike
from rimuru.server.background import BackgroundServer
from rimuru.server.config import ServerConfig
from rimuru.server.responses import (
    ChoiceDelta,
    ResponseHead,
    chat_completion_chunk,
    chat_completion_response,
    completion_chunk,
    completion_response,
    usage_info,
)

MODEL = "fake"
VOCAB = 100


@dataclass
class _Encoding:
    input_ids: list[int]


class FakeTokenizer:
    """One token per character; the chat template tags each message with its role."""

    chat_template = "role-tags"

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> _Encoding:
        return _Encoding([ord(c) % VOCAB for c in text])

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def apply_chat_template(self, conversation: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in conversation) + "<assistant>"


@dataclass
class _Running:
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)


class FakeEngine:
    """Each step gives every running request one more token (its prompt's last id + 1, + 2, ...), whose
    text is the id and a space; a request ends with "length" at its max_tokens."""

    def __init__(self, tokenizer: FakeTokenizer | None = None, max_model_len: int = 64) -> None:
        self.tokenizer: Any = tokenizer
        self.max_model_len = max_model_len
        self.running: dict[str, _Running] = {}
        self.profile: dict[str, Any] | None = None
        self.step_metrics = None  # no per-step ring: no tokens-per-step histogram

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        assert isinstance(prompt, list)  # the server always sends token ids
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt)
        self.running[request_id] = _Running(prompt, max_tokens)

    def abort_request(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, req in list(self.running.items()):
            req.tokens.append(req.prompt[-1] + len(req.tokens) + 1)
            done = len(req.tokens) == req.max_tokens
            text = "".join(f"{t} " for t in req.tokens)
            comp = CompletionOutput(0, text, list(req.tokens), "length" if done else None, None)
            outputs.append(RequestOutput(rid, None, req.prompt, [comp], done))
            if done:
                del self.running[rid]
        if self.profile is not None:
            self.profile["steps_profiled"] += 1
            self.profile["steps"].append({"kind": "decode-eager"})
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": 0}

    def enable_step_profiler(self, num_steps: int, trace_steps: int = 1) -> None:
        self.profile = {"steps_profiled": 0, "steps": [], "kinds": {}, "num_steps": num_steps}

    def step_profile_report(self) -> dict[str, Any] | None:
        return None if self.profile is None else dict(self.profile)

    def observed_routing(self) -> None:
        return None  # counts no routing, as static mode


@pytest.fixture
def url() -> Iterator[str]:
    with BackgroundServer(FakeEngine(FakeTokenizer()), ServerConfig(served_model_name=MODEL)) as srv:
        yield srv.url


def _events(resp: httpx.Response) -> list[Any]:
    messages = [m.strip().removeprefix("data: ") for m in resp.text.split("\n\n") if m.strip()]
    assert messages[-1] == "[DONE]"
    return [json.loads(m) for m in messages[:-1]]


@pytest.mark.parametrize("engine_name", ["LLMEngine", "FakeEngine"])
def test_engines_have_every_method_of_engine_like(engine_name: str) -> None:
    """The engine is rewritten apart from the server: this catches a renamed or re-signed method at once.
    LLMEngine is imported here, not at the top, so the fake-engine tests run whatever state the engine is in."""
    if engine_name == "LLMEngine":
        from rimuru.engine.llm_engine import LLMEngine

        engine: type = LLMEngine
    else:
        engine = FakeEngine
    methods = {name: member for name, member in vars(EngineLike).items()
               if not name.startswith("_") and (callable(member) or isinstance(member, property))}
    assert set(methods) >= {"vocab_size", "add_request", "step", "enable_step_profiler", "step_profile_report"}
    for name, member in methods.items():
        implemented = inspect.getattr_static(engine, name)
        assert isinstance(implemented, property) == isinstance(member, property), name
        if callable(member):
            wanted = list(inspect.signature(member).parameters)
            assert list(inspect.signature(implemented).parameters)[: len(wanted)] == wanted, name


# ---- builders -----------------------------------------------------------------------------------------
HEAD = ResponseHead("cmpl-1", 7, MODEL)


def test_builders_give_the_openai_shapes() -> None:
    done = CompletionOutput(0, "hi", [4, 5], "stop", "!")
    out = RequestOutput("r", None, [1, 2, 3], [done], True)
    usage = usage_info([[1, 2, 3], [4]], [out, out])
    assert usage == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert completion_response(HEAD, [(0, out)], usage) == {
        "id": "cmpl-1", "object": "text_completion", "created": 7, "model": MODEL, "usage": usage,
        "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop", "stop_reason": "!",
                     "prompt_logprobs": None}],
    }
    chat = chat_completion_response(HEAD, [(1, out)], usage)
    assert chat["choices"] == [
        {"index": 1, "message": {"role": "assistant", "content": "hi"}, "logprobs": None, "finish_reason": "stop",
         "stop_reason": "!"}
    ]
    assert chat["prompt_logprobs"] is None
    delta = ChoiceDelta(2, "lo", None, None, first=True)
    assert completion_chunk(HEAD, delta) == {
        "id": "cmpl-1", "object": "text_completion", "created": 7, "model": MODEL, "usage": None,
        "choices": [{"index": 2, "text": "lo", "logprobs": None, "finish_reason": None, "stop_reason": None}],
    }
    first = chat_completion_chunk(HEAD, delta)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"] == [{"index": 2, "delta": {"role": "assistant", "content": "lo"}, "logprobs": None,
                                 "finish_reason": None, "stop_reason": None}]
    later = chat_completion_chunk(HEAD, ChoiceDelta(2, "!", "stop", "!", first=False))
    assert later["choices"][0]["delta"] == {"content": "!"} and later["choices"][0]["finish_reason"] == "stop"
    assert later["choices"][0]["stop_reason"] == "!"
    for chunk in (completion_chunk, chat_completion_chunk):
        assert chunk(HEAD, None, usage)["choices"] == [] and chunk(HEAD, None, usage)["usage"] == usage


# ---- routes over the fake engine ----------------------------------------------------------------------
def test_completion_body_and_stream(url: str) -> None:
    body = {"model": MODEL, "prompt": [[10, 20], [30]], "n": 2, "max_tokens": 3}
    resp = httpx.post(url + "/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["id"].startswith("cmpl-") and data["object"] == "text_completion" and data["model"] == MODEL
    # choice index = prompt x n + choice
    assert [(c["index"], c["text"], c["finish_reason"]) for c in data["choices"]] == [
        (0, "21 22 23 ", "length"), (1, "21 22 23 ", "length"), (2, "31 32 33 ", "length"), (3, "31 32 33 ", "length")
    ]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}

    stream = httpx.post(url + "/v1/completions", json={**body, "n": 1, "prompt": [10], "stream": True,
                                                       "stream_options": {"include_usage": True}})
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = _events(stream)
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("cmpl-")
    assert "".join(c["text"] for e in events for c in e["choices"]) == "11 12 13 "
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


def test_echo_puts_the_prompt_first_and_max_tokens_0_returns_it_alone(url: str) -> None:
    """Text prompts echo as sent, token-id prompts decoded; each choice once, whole or streamed (its first chunk)."""
    body = {"model": MODEL, "prompt": [[10, 20], [30]], "n": 2, "max_tokens": 2, "echo": True}
    data = httpx.post(url + "/v1/completions", json=body).json()
    assert [c["text"] for c in data["choices"]] == ["<10><20>21 22 "] * 2 + ["<30>31 32 "] * 2
    assert httpx.post(url + "/v1/completions", json={**body, "prompt": "ab"}).json()["choices"][0]["text"] == \
        "ab" + "".join(f"{ord('b') % VOCAB + i} " for i in (1, 2))
    alone = httpx.post(url + "/v1/completions", json={**body, "max_tokens": 0}).json()
    assert [c["text"] for c in alone["choices"]] == ["<10><20>"] * 2 + ["<30>"] * 2
    # as vLLM: the engine generated one token per choice, which the text leaves out and the usage counts
    assert all(c["finish_reason"] == "length" for c in alone["choices"])
    assert alone["usage"]["completion_tokens"] == 4
    events = _events(httpx.post(url + "/v1/completions", json={**body, "n": 1, "prompt": [10], "stream": True}))
    texts = [c["text"] for e in events for c in e["choices"]]
    assert texts[0].startswith("<10>") and "".join(texts) == "<10>11 12 "
    events = _events(httpx.post(url + "/v1/completions", json={**body, "n": 1, "prompt": [10], "stream": True,
                                                              "max_tokens": 0}))
    assert "".join(c["text"] for e in events for c in e["choices"]) == "<10>"
    plain = httpx.post(url + "/v1/completions", json={**body, "echo": False, "max_tokens": 0})
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "max_tokens"
    assert "0 only with echo" in plain.json()["error"]["message"]
    streamed = httpx.post(url + "/v1/completions", json={**body, "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    assert "not available when `stream=True`" in streamed.json()["error"]["message"]


def test_chat_body_and_stream(url: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ab"}], "max_completion_tokens": 2}
    data = httpx.post(url + "/v1/chat/completions", json=body).json()
    prompt_len = len("<user>ab<assistant>")
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert data["choices"][0]["message"]["role"] == "assistant"
    assert data["usage"]["prompt_tokens"] == prompt_len and data["usage"]["completion_tokens"] == 2

    events = _events(httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}))
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
    assert "".join(d["content"] for d in deltas) == data["choices"][0]["message"]["content"]
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_unsupported_fields_and_errors_are_counted(url: str) -> None:
    resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1], "suffix": "x"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "suffix"
    resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [VOCAB]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_token_id"
    # valid JSON, no Unicode text: a lone surrogate is the client's mistake, named, in a prompt or a message
    raw = json.dumps({"model": MODEL, "prompt": "a\ud800b"})  # escaped as \ud800: valid JSON
    resp = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_text"
    assert "surrogate" in resp.json()["error"]["message"] and resp.json()["error"]["param"] == "prompt"
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]})
    resp = httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    assert f'rimuru:http_errors_total{{model_name="{MODEL}",status="400"}} 4.0' in httpx.get(url + "/metrics").text


def test_step_profile_reads_the_engines_report(url: str) -> None:
    assert httpx.get(url + "/debug/step_profile").status_code == 404  # nothing profiled yet
    assert httpx.post(url + "/debug/step_profile?steps=3").json() == {"profiling_steps": 3}
    httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 2})
    report = httpx.get(url + "/debug/step_profile").json()
    assert report == {"steps_profiled": 2, "kinds": {}, "num_steps": 3}  # the per-step rows are left out


def test_fields_this_server_cannot_honour_are_refused_not_dropped(url: str) -> None:
    """tools, tool_choice and response_format change what a client gets back: set to anything but their neutral
    value they are a 400 naming the field; at it, the request is served. top_logprobs without logprobs is vLLM's
    400 naming it; a logit_bias key that is no token id is a 400 naming logit_bias (logit_bias itself is served)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "ab"}], "max_completion_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for name, value in (("response_format", {"type": "json_object"}), ("tools", [tool]),
                        ("tool_choice", "required")):
        resp = httpx.post(url + "/v1/chat/completions", json={**chat, name: value})
        assert resp.status_code == 400, name
        assert resp.json()["error"]["param"] == name and resp.json()["error"]["code"] == "unsupported"
    resp = httpx.post(url + "/v1/chat/completions", json={**chat, "top_logprobs": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs"
    assert "`logprobs` must be set to true" in resp.json()["error"]["message"]
    for bias in ({"x": 1.0}, {"1": 101.0}):
        resp = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1], "logit_bias": bias})
        assert resp.status_code == 400, bias
        assert resp.json()["error"]["param"] == "logit_bias" or "logit_bias" in resp.json()["error"]["message"]
    neutral = {"logit_bias": {}, "response_format": {"type": "text"}, "tools": [], "tool_choice": "auto",
               "top_logprobs": 0}
    assert httpx.post(url + "/v1/chat/completions", json={**chat, **neutral}).status_code == 200


def test_several_served_model_names_as_vllm_takes_them() -> None:
    """`--served-model-name A B`: clients may send either name, responses and the first model card carry A,
    /v1/models lists both, any other name is a 404 that names them."""
    from rimuru.cli import build_parser

    args = build_parser().parse_args(["serve", "path/to/model", "--served-model-name", MODEL, "alias"])
    config = ServerConfig.from_cli_args(args.served_model_name, args.model, args.api_key, args.max_body_bytes)
    assert (config.served_model_name, config.served_model_names, config.model_path) == (
        MODEL, (MODEL, "alias"), "path/to/model")
    default = build_parser().parse_args(["serve", "path/to/model"])
    assert ServerConfig.from_cli_args(default.served_model_name, "path/to/model", None, 1).served_model_names == (
        "path/to/model",)
    with BackgroundServer(FakeEngine(FakeTokenizer()), config) as srv:
        data = httpx.post(srv.url + "/v1/completions", json={"model": "alias", "prompt": [1], "max_tokens": 2}).json()
        assert data["model"] == MODEL and data["choices"][0]["text"]
        assert [c["id"] for c in httpx.get(srv.url + "/v1/models").json()["data"]] == [MODEL, "alias"]
        resp = httpx.post(srv.url + "/v1/completions", json={"model": "other", "prompt": [1]})
        assert resp.status_code == 404 and "'alias'" in resp.json()["error"]["message"]


class LostRanksEngine(FakeEngine):
    """A tensor-parallel engine whose workers are gone: every step raises the engine's `WorkerFailed`."""

    def step(self) -> list[RequestOutput]:
        from rimuru.engine.tp_workers import WorkerFailed

        raise WorkerFailed("a tensor-parallel rank failed; the engine cannot run another pass:\nrank 1 exited")


def test_lost_ranks_fail_the_request_and_mark_the_engine_dead() -> None:
    """A step that raises `WorkerFailed` fails its requests with the error, and the server says it cannot serve
    any more (/health 503, later requests 503 engine_dead) rather than taking requests no step can run."""
    with BackgroundServer(LostRanksEngine(FakeTokenizer()), ServerConfig(served_model_name=MODEL)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 2})
        assert resp.status_code >= 500 and "rank 1 exited" in resp.json()["error"]["message"]
        assert httpx.get(srv.url + "/health").status_code == 503
        later = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 2})
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_dead"
