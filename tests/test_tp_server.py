"""A tensor-parallel server as a process: `rimuru serve --tensor-parallel-size 2` on the CPU (gloo), stopped the
way a container stop stops it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.sweep_processes import process_ended, wait_healthy
from rimuru.distributed.parallel_state import free_port


def _children(pid: int) -> set[int]:
    """The processes `pid` started (Linux: /proc/<pid>/task/*/children)."""
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(c) for c in (task / "children").read_text().split()}
    return out


@pytest.mark.slow
def test_sigterm_stops_a_tensor_parallel_server_and_its_workers(parity_checkpoints: dict[str, Path]) -> None:
    """`rimuru serve --tensor-parallel-size 2` and SIGTERM (what a container stop sends): the server shuts down
    within seconds, its engine's workers stop before it exits, and nothing prints a traceback."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    model = str(parity_checkpoints["qwen2_moe"])
    cmd = [sys.executable, "-m", "rimuru.cli", "serve", model, "--device", "cpu", "--gpu-memory-budget", "64MiB",
           "--tensor-parallel-size", "2", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_healthy(base, server, 120, Path("/dev/null"))  # the server writes to the pipe, read below
        resp = httpx.post(base + "/v1/completions", timeout=30, json={"model": model, "prompt": [1, 2, 3],
                                                                      "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        workers = _children(server.pid)
        assert workers, "no worker process"
        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        output = server.communicate(timeout=30)[0]
        assert time.monotonic() - t0 < 20
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode in (0, -signal.SIGTERM), output  # uvicorn ends with the signal's status
    assert "Application shutdown complete" in output, output
    assert "Traceback" not in output, output
    # the engine was shut down before the process ended: otherwise its workers' queue is left to the resource
    # tracker, which says so ("leaked semaphore objects")
    assert "leaked" not in output, output
    deadline = time.monotonic() + 10  # a worker told to stop may still be unwinding when the server exits
    while (alive := [pid for pid in workers if not process_ended(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"workers {alive} outlived the server\n{output}"
