"""The processes a serving sweep (serve_sweep.py) starts: servers and clients in their own process groups, killed
if the sweep dies; servers detached into their own session for a later sweep to adopt (`--detach` / `--attach`,
for a server whose start and point outlast one device call); ports and /health on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class SweepError(RuntimeError):
    """A configuration or point that cannot run; recorded as an error row."""


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL if the sweep dies, so no server outlives a killed sweep."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_process(cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path = REPO) -> subprocess.Popen:
    """A child in its own process group (same session), output to log_path, killed if we die."""
    log = open(log_path, "wb")  # noqa: SIM115 - closed by stop_process
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, process_group=0,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    except BaseException:
        log.close()
        raise
    proc._sweep_log = log  # type: ignore[attr-defined]
    return proc


def process_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields from the state on (index 0: state, 19: start time in clock ticks since boot),
    or None when no such process exists. Raises OSError where there is no /proc (not Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if not Path("/proc/self/stat").exists():
            raise
        return None
    return text[text.rindex(")") + 2:].split()


def process_ended(pid: int) -> bool:
    """Gone, or a zombie nobody has reaped yet (an orphan's new parent may never reap it): the process ended."""
    fields = process_stat(pid)
    return fields is None or fields[0] == "Z"


def process_start_ticks(pid: int) -> int | None:
    """When the process started (ticks since boot): with the pid, it names one process, never a later one
    that got the same pid. None where it cannot be read."""
    try:
        fields = process_stat(pid)
    except OSError:
        return None
    return int(fields[19]) if fields else None


class DetachedServer:
    """A server started by an earlier sweep with `--detach` (its own session, so it outlived that sweep's
    device call), adopted by `--attach`. Quacks like the Popen that stop_process, wait_healthy and
    run_client use: poll / wait / returncode / pid (the pid is its process group's id, from setsid).
    It has exited when it is gone, a zombie, or its pid now names another process (start time differs)."""

    def __init__(self, pid: int, start_ticks: int | None) -> None:
        self.pid = pid
        self.start_ticks = start_ticks
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        child = _STARTED.get(self.pid)
        if child is not None:  # started by this process (the tests' case): its Popen has reaped it or will
            self.returncode = child.poll()
            return self.returncode
        try:
            fields = process_stat(self.pid)
        except OSError:  # no /proc: only whether the pid exists
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -1
            return self.returncode
        if fields is None or fields[0] == "Z" or (self.start_ticks is not None and int(fields[19]) != self.start_ticks):
            self.returncode = -1  # not our child: its exit code is not ours to read
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.2)
        return self.returncode  # type: ignore[return-value]


# The Popen of every server this process detached, kept so that its exit code stays readable: a Popen that is
# collected reaps a child that already exited (Popen.__del__ polls it), and the code would be lost.
_STARTED: dict[int, subprocess.Popen] = {}


def start_detached(cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path = REPO) -> int:
    """A server in a new session that outlives this process (no death signal); returns its pid."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)
    _STARTED[proc.pid] = proc
    return proc.pid


def stop_process(proc: subprocess.Popen | DetachedServer | None, grace_s: float = 20.0) -> None:
    """SIGTERM to the whole process group (vLLM's engine core too), SIGKILL after grace_s."""
    if proc is None:
        return
    try:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of the group, even when the leader exited
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    finally:
        log = getattr(proc, "_sweep_log", None)
        if log is not None:
            log.close()


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def port_is_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (SO_REUSEADDR: closed connections in TIME_WAIT do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_healthy(base_url: str) -> bool:
    """GET /health answers 200."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:  # noqa: S310 - 127.0.0.1 only
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_healthy(base_url: str, proc: subprocess.Popen | DetachedServer, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SweepError(f"server exited with code {proc.returncode} before /health answered")
        if is_healthy(base_url):
            return
        time.sleep(0.5)
    raise SweepError(f"/health did not answer 200 within {timeout_s:.0f} s")
