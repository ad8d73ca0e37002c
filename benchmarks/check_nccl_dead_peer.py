"""Whether a tensor-parallel rank blocked in an NCCL collective on a dead peer gets out, on the GPUs of one host: the
check of the engine's peer watch (rimuru/distributed/peer_watcher.py).

    python benchmarks/check_nccl_dead_peer.py --output-json $OUT/nccl-dead-peer.json

Two ranks join as the engine's do (`init_tensor_parallel`: NCCL for the device, gloo for control; rank 0 starts
rank 1 as a spawned child). After one all-reduce both agree on, one rank dies (SIGKILL, as the OOM killer would)
while the other is in a second all-reduce and waits for it on the GPU:

    worker_dies   rank 1 dies; rank 0 watches its sentinel and aborts the process groups (`abort_device_groups`):
                  its collective must raise within seconds, and the check records whether CUDA still works after
    rank0_dies    rank 0 dies; rank 1 watches its parent and ends itself: it must be gone within seconds

Each runs with the watch and without it (the control: there the blocked rank should still be waiting at the
deadline, which is what the watch exists for). A supervisor process runs every case under `--deadline-s` and kills
what is left. The result: per case, how the blocked rank ended and after how many seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import metadata, print_header, write_json  # noqa: E402
from benchmarks.sweep_processes import process_ended  # noqa: E402
from rimuru.distributed.parallel_state import free_port, init_tensor_parallel  # noqa: E402
from rimuru.distributed.peer_watcher import PeerWatcher, abort_device_groups  # noqa: E402

CASES = ("worker_dies", "rank0_dies")
GROUP_TIMEOUT_S = 300.0  # longer than any deadline here: a rank that gets out did not time out


def _all_reduce(device: torch.device) -> None:
    x = torch.ones(1 << 20, device=device)
    torch.distributed.all_reduce(x)
    torch.cuda.synchronize(device)


def _rank1(case: str, watch: bool, port: int, results) -> None:
    parent = mp.parent_process()
    if watch and case == "rank0_dies" and parent is not None:  # as the engine's workers watch rank 0
        PeerWatcher([parent.sentinel], lambda: os._exit(1))
    device = torch.device("cuda", 1)
    torch.cuda.set_device(device)
    init_tensor_parallel(1, 2, port, device, timeout_s=GROUP_TIMEOUT_S)
    _all_reduce(device)
    results.put(("rank1_pid", os.getpid()))
    if case == "worker_dies":
        time.sleep(1.0)  # rank 0 is in its second all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    _all_reduce(device)  # rank 0 dies meanwhile: blocks unless the watch ends this process
    results.put(("rank1_returned", None))


def _rank0(case: str, watch: bool, port: int, results) -> None:
    report: dict[str, object] = {}
    try:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        peer = mp.get_context("spawn").Process(target=_rank1, args=(case, watch, port, results), daemon=True)
        peer.start()
        init_tensor_parallel(0, 2, port, device, timeout_s=GROUP_TIMEOUT_S)
        if watch and case == "worker_dies":
            PeerWatcher([peer.sentinel], abort_device_groups)
        _all_reduce(device)
        if case == "rank0_dies":
            time.sleep(1.0)  # rank 1 is in its second all-reduce by now
            results.put(("rank0_killing_itself", time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            _all_reduce(device)
            report["blocked_rank"] = "returned without error"
        except Exception as e:  # noqa: BLE001 - the error the abort gives is what is checked
            report["blocked_rank"] = f"raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        report["seconds_in_collective"] = time.monotonic() - t0
        try:
            y = torch.arange(4, device=device).sum()
            report["cuda_after"] = f"ok ({int(y)})"
        except Exception as e:  # noqa: BLE001
            report["cuda_after"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    except Exception:  # noqa: BLE001
        report["error"] = traceback.format_exc(limit=5)
    results.put(("rank0_report", report))
    os._exit(0)  # no teardown of an aborted group


def run_case(case: str, watch: bool, deadline_s: float) -> dict[str, object]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_rank0, args=(case, watch, free_port(), results))
    proc.start()
    out: dict[str, object] = {"case": case, "watch": watch}
    deadline = time.monotonic() + deadline_s
    rank1_pid, killed_at = None, None
    while time.monotonic() < deadline:
        try:
            kind, value = results.get(timeout=0.2)
        except queue.Empty:
            kind, value = None, None
        if kind == "rank1_pid":
            rank1_pid = value
        elif kind == "rank0_killing_itself":
            killed_at = value
        elif kind == "rank0_report":
            out.update(value)
            break
        elif kind == "rank1_returned":
            out["blocked_rank"] = "rank 1's collective returned"
            break
        if case == "rank0_dies" and killed_at is not None and rank1_pid is not None and process_ended(rank1_pid):
            out["blocked_rank"] = "rank 1 ended"
            out["seconds_to_end"] = time.time() - killed_at
            break
    else:
        out["blocked_rank"] = f"still blocked at the {deadline_s:.0f} s deadline"
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=10)
    if rank1_pid is not None and not process_ended(rank1_pid):
        os.kill(rank1_pid, signal.SIGKILL)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deadline-s", type=float, default=45.0, help="per case, NCCL's start included")
    p.add_argument("--output-json", type=Path)
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}")
    meta = metadata("check_nccl_dead_peer", nccl=".".join(map(str, torch.cuda.nccl.version())),
                    nccl_p2p_disable=os.environ.get("NCCL_P2P_DISABLE"),
                    torch_nccl_async_error_handling=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"))
    print_header(meta)
    cases = []
    for case in CASES:
        for watch in (True, False):
            r = run_case(case, watch, args.deadline_s)
            print(json.dumps(r))
            cases.append(r)
    watched = [c for c in cases if c["watch"]]
    passed = all(c.get("blocked_rank") in ("rank 1 ended",) or str(c.get("blocked_rank", "")).startswith("raised")
                 for c in watched)
    print("dead peer under NCCL:", "the watched ranks got out" if passed else "FAILED (see the cases above)")
    write_json(args.output_json, {**meta, "passed": passed}, cases)  # one row a case


if __name__ == "__main__":
    main()
