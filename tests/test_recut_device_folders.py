"""scripts/recut_device_folders.py: the re-cut folders, copied into one place, reassemble byte for byte with the
loop gpu-install.sh runs (`cat NAME.part* > NAME` per NAME.part00), and no folder exceeds the limit."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "recut_device_folders", Path(__file__).resolve().parent.parent / "scripts" / "recut_device_folders.py")
recut_mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = recut_mod  # its dataclass looks its module up there
spec.loader.exec_module(recut_mod)

# gpu-install.sh's reassembly line, as it runs on the device
JOIN = 'for p in *.part00; do [ -e "$p" ] || continue; b=${p%.part00}; cat "$b".part* > "$b"; rm "$b".part*; done'


def copy_and_join(folders: list[Path], w: Path) -> Path:
    """What the device does: every folder's files copied into one place, then gpu-install.sh's join."""
    w.mkdir()
    for d in folders:
        for f in d.iterdir():
            shutil.copy(f, w / f.name)
    subprocess.run(["bash", "-c", JOIN], cwd=w, check=True, env={**os.environ, "LC_ALL": "C"})
    return w


def _split(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


def test_recut_reassembles_and_fits(tmp_path: Path) -> None:
    big = os.urandom(2500)  # a wheel prepare.sh cut into parts of 1,000 bytes: part00..part02
    other = os.urandom(1700)  # a second one: part00, part01
    folders = {".vc01": {"a.whl.part00": _split(big, 1000)[0], "small.whl": b"s" * 300},
               ".vc02": {"a.whl.part01": _split(big, 1000)[1], "b.whl.part00": _split(other, 1000)[0]},
               ".vc03": {"a.whl.part02": _split(big, 1000)[2], "b.whl.part01": _split(other, 1000)[1],
                         "gpu-install.sh": b"#!/bin/sh\n"}}
    for d, files in folders.items():
        (tmp_path / d).mkdir()
        for name, data in files.items():
            (tmp_path / d / name).write_bytes(data)
    out = recut_mod.recut(tmp_path, limit=400)
    assert all(sum(f.stat().st_size for f in d.iterdir() if f.name != "gpu-install.sh") <= 400 for d in out)
    assert (out[-1] / "gpu-install.sh").exists() and not any((d / "gpu-install.sh").exists() for d in out[:-1])
    w = copy_and_join(out, tmp_path / "w")
    assert (w / "a.whl").read_bytes() == big
    assert (w / "b.whl").read_bytes() == other
    assert (w / "small.whl").read_bytes() == b"s" * 300
    assert not list(w.glob("*.part*"))


def test_a_part_cut_into_more_than_ten_pieces_joins_in_order(tmp_path: Path) -> None:
    data = os.urandom(2300)  # one part cut into 12 pieces of 200: _10 and _11 must not sort before _02
    (tmp_path / ".vc01").mkdir()
    (tmp_path / ".vc01" / "c.whl.part00").write_bytes(data)
    (tmp_path / ".vc01" / "gpu-install.sh").write_bytes(b"")
    out = recut_mod.recut(tmp_path, limit=200)
    w = copy_and_join(out, tmp_path / "w")
    assert (w / "c.whl").read_bytes() == data


def test_recut_refuses_a_large_file_that_is_no_part(tmp_path: Path) -> None:
    (tmp_path / ".vc01").mkdir()
    (tmp_path / ".vc01" / "huge.whl").write_bytes(b"x" * 500)
    (tmp_path / ".vc01" / "gpu-install.sh").write_bytes(b"")
    with pytest.raises(SystemExit, match="not a .whl.part piece"):
        recut_mod.recut(tmp_path, limit=400)
