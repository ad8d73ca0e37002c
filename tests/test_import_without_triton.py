"""The API and every kernels/ module import, and the kernels' dispatchers run, where Triton is not installed
(the CPU build of torch comes without it). Triton is blocked in a fresh process: `sys.modules["triton"] = None`
makes every `import triton...` raise ImportError, as on such an install."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    sys.modules["triton"] = None

    from rimuru import LLM  # noqa: F401  (imports the engine, the models and the kernels they use)
    import rimuru.kernels
    for info in pkgutil.iter_modules(rimuru.kernels.__path__):
        importlib.import_module(f"rimuru.kernels.{info.name}")

    import torch
    from rimuru.kernels.activation import silu_and_mul
    from rimuru.kernels.rmsnorm import rms_norm
    from rimuru.kernels.rotary import apply_rotary_qk, cos_sin
    from rimuru.kernels.router import route_topk

    x = torch.randn(3, 8)
    rms_norm(x, torch.ones(8), 1e-6)
    silu_and_mul(x, x)
    route_topk(x, torch.zeros(8), 2, True)
    cos, sin = cos_sin(torch.arange(3), torch.ones(4), torch.float32)
    apply_rotary_qk(x.view(3, 1, 8), x.view(3, 1, 8), cos, sin)
    assert "triton" not in {m.split(".")[0] for m, mod in sys.modules.items() if mod is not None}
    print("ok")
    """
)


def test_api_and_kernels_import_without_triton() -> None:
    res = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr
