"""--generation-config: the model's generation_config.json fills the sampling parameters a request leaves out."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rimuru.server.generation_config import SamplingDefaults, load_sampling_defaults
from rimuru.server.protocol import ChatCompletionRequest, CompletionRequest
from rimuru.server.sampling import to_sampling_params


def _folder(tmp_path: Path, **fields: object) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(fields), encoding="utf-8")
    return tmp_path


def test_auto_reads_the_model_folder_and_vllm_reads_nothing(tmp_path: Path) -> None:
    model = _folder(tmp_path / "m", temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=128, do_sample=True)
    assert load_sampling_defaults("auto", str(model)) == SamplingDefaults(0.7, 0.8, 20, 128)
    assert load_sampling_defaults("vllm", str(model)) == SamplingDefaults()
    other = _folder(tmp_path / "other", temperature=0.3)
    assert load_sampling_defaults(str(other), str(model)) == SamplingDefaults(temperature=0.3)
    assert load_sampling_defaults("auto", "qwen3-30b-a3b") == SamplingDefaults()  # a preset: no folder


def test_bad_choices_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="not 'auto', 'vllm' or a directory"):
        load_sampling_defaults(str(tmp_path / "missing"), str(tmp_path))
    with pytest.raises(ValueError, match="has no generation_config.json"):
        load_sampling_defaults(str(tmp_path), str(tmp_path))
    with pytest.raises(ValueError, match="temperature must be a number"):
        load_sampling_defaults("auto", str(_folder(tmp_path / "bad", temperature="hot")))
    with caplog.at_level(logging.WARNING, logger="rimuru"):
        defaults = load_sampling_defaults("auto", str(_folder(tmp_path / "pen", repetition_penalty=1.05,
                                                              presence_penalty=0.5)))
    # vLLM's reading: repetition_penalty is a default, presence_penalty is not read from a generation config
    assert defaults.repetition_penalty == 1.05
    warned = [r.getMessage() for r in caplog.records]
    assert any("presence_penalty" in m for m in warned) and not any("repetition_penalty" in m for m in warned)
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number greater than zero"):
        load_sampling_defaults("auto", str(_folder(tmp_path / "zero", repetition_penalty=0)))


def test_defaults_fill_only_what_the_request_leaves_out() -> None:
    defaults = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, max_tokens=5)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    p = to_sampling_params(chat, prompt_len=4, max_model_len=64, choice=0, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.7, 0.8, 20, 5)
    own = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0.0, top_k=3,
                                max_tokens=9)
    p = to_sampling_params(own, prompt_len=4, max_model_len=64, choice=0, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 0.8, 3, 9)
    # completions default max_tokens to 16 as OpenAI does: that is the request's own value
    p = to_sampling_params(CompletionRequest(model="m", prompt="x"), 1, 64, 0, defaults)
    assert p.max_tokens == 16 and p.temperature == 0.7
    plain = to_sampling_params(chat, prompt_len=4, max_model_len=64, choice=0)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.max_tokens) == (1.0, 1.0, -1, None)
    assert (plain.repetition_penalty, plain.presence_penalty, plain.frequency_penalty) == (1.0, 0.0, 0.0)


def test_a_repetition_penalty_default_fills_only_what_the_request_leaves_out() -> None:
    defaults = SamplingDefaults(repetition_penalty=1.1)
    req = CompletionRequest(model="m", prompt="x", frequency_penalty=0.5)
    p = to_sampling_params(req, 1, 64, 0, defaults)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.1, 0.5, 0.0)
    own = CompletionRequest(model="m", prompt="x", repetition_penalty=1.0)
    assert to_sampling_params(own, 1, 64, 0, defaults).repetition_penalty == 1.0
