"""Running Triton kernels on the CPU: Triton's interpreter, in a fresh process.

Triton reads TRITON_INTERPRET when it is imported, so a test that wants the interpreter runs its checks
in a subprocess with the variable set. The script prints "ok" when every check passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_under_interpreter(script: str, timeout: float = 300) -> None:
    """Runs `script` (Python source) under TRITON_INTERPRET=1; raises AssertionError with its output unless it
    exits 0 and prints "ok"."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
