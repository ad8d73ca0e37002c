"""benchmarks/engine_thread_profile.py: py-spy's raw stacks of the engine thread, attributed to the step's callees."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from engine_thread_profile import category, parse, summary  # noqa: E402

STEP = ["Thread.run (threading.py:982)", "AsyncEngine._run (rimuru/server/async_engine.py:250)",
        "LLMEngine.step (rimuru/engine/llm_engine.py:430)"]
PLAN = "ElasticRuntime.plan (rimuru/experts/elastic_runtime.py:95)"


def _line(thread: str, frames: list[str], count: int) -> str:
    return f"thread (11): {';'.join([thread, *frames])} {count}"


RAW = "\n".join([
    _line("rimuru-engine", [*STEP, PLAN, "CostAdjuster.plan (rimuru/experts/cost_adjuster.py:400)"], 30),
    _line("rimuru-engine", [*STEP, PLAN, "copy_to_pages (rimuru/experts/loader.py:100)",
                            "PyEval_RestoreThread (libpython3.12.so)", "take_gil (libpython3.12.so)"], 10),
    _line("rimuru-engine", [*STEP, "LLMEngine._drain (rimuru/engine/llm_engine.py:505)",
                            "cudaStreamSynchronize (libcudart.so)"], 50),
    _line("rimuru-engine", STEP, 10),
    _line("rimuru-engine", ["Thread.run (threading.py:982)", "Queue.get (queue.py:171)"], 7),
    _line("MainThread", ["Server.serve (uvicorn/server.py:60)"], 99),
    "not a stack line",
])


def test_samples_are_attributed_to_the_step_callee_and_classified() -> None:
    prof = parse(RAW.splitlines())
    assert prof.samples == 107 and prof.in_step == 100  # the main thread and the bad line are left out
    plan = prof.by_callee["ElasticRuntime.plan"]
    assert plan["host"] == 30 and plan["gil"] == 10
    assert prof.by_callee["LLMEngine._drain"]["device"] == 50
    assert prof.by_callee["LLMEngine.step (itself)"]["host"] == 10
    assert prof.by_callee["outside step"]["host"] == 7
    assert prof.inclusive["CostAdjuster.plan"] == 30 and prof.inclusive["ElasticRuntime.plan"] == 40
    s = summary(prof, top=3)
    first = s["callees"][0]
    assert first["callee"] == "LLMEngine._drain" and first["share_of_step"] == 0.5 and first["device_share"] == 1.0
    assert [t["function"] for t in s["top_functions"]][:2] == ["LLMEngine._drain", "ElasticRuntime.plan"]


def test_the_innermost_wait_decides_the_category() -> None:
    assert category(["f (a.py:1)", "take_gil (libpython3.12.so)"]) == "gil"
    # a statically linked interpreter: the GIL's wait shows as a libc condition wait after a C call that released it
    assert category(["f (a.py:1)", "pybind11::gil_scoped_release::~gil_scoped_release (libtorch_python.so)",
                     "pthread_cond_timedwait (libc.so.6)", "0x7f00 (libc.so.6)"]) == "gil"
    assert category(["Queue.get (queue.py:171)", "PyThread_acquire_lock_timed (python3.12)",
                     "pthread_cond_timedwait (libc.so.6)"]) == "lock"
    assert category(["Event.synchronize (torch/cuda/streams.py:3)"]) == "device"
    assert category(["f (a.py:1)", "g (b.py:2)"]) == "host"
