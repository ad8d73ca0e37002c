"""vLLM's server flags: --chat-template, --enable-log-requests, --trust-remote-code, and rimuru.__version__."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import rimuru
from rimuru.server.background import BackgroundServer
from rimuru.server.cli import read_chat_template
from rimuru.server.config import ServerConfig
from tests.test_server_fake_engine import MODEL, FakeEngine, FakeTokenizer


def test_chat_template_is_read_from_a_file_or_taken_inline(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    assert read_chat_template(str(path)) == path.read_text(encoding="utf-8")
    inline = "{{ messages[0]['content'] }}"
    assert read_chat_template(inline) == inline
    with pytest.raises(SystemExit, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_serve_help_lists_the_vllm_flags() -> None:
    out = subprocess.run([sys.executable, "-m", "rimuru.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for flag in ("--chat-template", "--enable-log-requests", "--trust-remote-code", "--served-model-name",
                 "--gpu-memory-utilization", "--max-logprobs", "--enable-prefix-caching", "--generation-config",
                 "--enable-prompt-tokens-details"):
        assert flag in out, flag


def test_enable_log_requests_logs_each_request(caplog: pytest.LogCaptureFixture) -> None:
    config = ServerConfig(served_model_name=MODEL, enable_log_requests=True)
    with caplog.at_level(logging.INFO, logger="rimuru"), BackgroundServer(FakeEngine(FakeTokenizer()), config) as srv:
        resp = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [[10, 20, 30]],
                                                              "max_tokens": 2})
        assert resp.status_code == 200, resp.text
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request cmpl-")]
    assert len(lines) == 1 and "[3] tokens" in lines[0] and "max_tokens=2" in lines[0], lines
    quiet = ServerConfig(served_model_name=MODEL)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rimuru"), BackgroundServer(FakeEngine(FakeTokenizer()), quiet) as srv:
        httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": [[10]], "max_tokens": 1})
    assert not [r for r in caplog.records if r.getMessage().startswith("request cmpl-")]


def test_version_is_the_package_version() -> None:
    from importlib.metadata import version

    assert rimuru.__version__ == version("rimuru")
