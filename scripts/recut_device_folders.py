"""Re-cut the vLLM wheel folders (.vc01 ... .vcNN, made by ../shared/tools/vllm-anchor/prepare.sh) into smaller
folders (.vd01 ... .vdMM) so that each fits one device call beside the working tree.

Why: the device tool refuses a call whose tracked tree plus carried paths exceed 64 MiB. prepare.sh cuts folders of
58 MB; with the committed results the tree grew to ~17 MiB (2026-11-30), so a 58 MB folder no longer fits.

Layout kept for gpu-install.sh, which, in /tmp/w, joins every `NAME.part00` family with `cat NAME.part* > NAME`:
a piece larger than --max-mib is cut again into `NAME.partKK`, `NAME.partKK_01`, `NAME.partKK_02`, ... (two
digits, so `_10` cannot sort before `_02`). Those names sort right after `NAME.partKK` and before `NAME.partKK+1`
(in the C locale `0-9` < `_`; a locale that ignores `_` compares `partKK01` with `partKK+1`, the same order), so
`cat NAME.part*` still joins the bytes in order. Whole files are
packed first-fit by decreasing size; gpu-install.sh goes into the last folder, which must be copied last.

    python3 scripts/recut_device_folders.py [--max-mib 40]
    # then, per folder k = 01 ... MM, one call each, back to back:
    #   carry [".vdKK"]:  mkdir -p /tmp/w && cp .vdKK/* /tmp/w/
    # and with the last one also: bash .vdMM/gpu-install.sh
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path

INSTALL_SCRIPT = "gpu-install.sh"


@dataclass(frozen=True)
class Piece:
    name: str  # file name in the new folder
    source: Path
    offset: int
    length: int


def cut(files: list[Path], limit: int) -> list[Piece]:
    """Every file as pieces of at most `limit` bytes; a file that needs several must be a `.part` already."""
    pieces = []
    for f in files:
        size = f.stat().st_size
        if size <= limit:
            pieces.append(Piece(f.name, f, 0, size))
            continue
        if ".whl.part" not in f.name:
            raise SystemExit(f"{f} is larger than {limit} bytes and is not a .whl.part piece that gpu-install.sh joins")
        offsets = range(0, size, limit)
        if len(offsets) > 100:
            raise SystemExit(f"{f} would need {len(offsets)} pieces of {limit} bytes; at most 100 keep their order")
        for k, off in enumerate(offsets):
            pieces.append(Piece(f.name + (f"_{k:02d}" if k else ""), f, off, min(limit, size - off)))
    return pieces


def pack(pieces: list[Piece], limit: int) -> list[list[Piece]]:
    """First-fit decreasing: folders of at most `limit` bytes."""
    folders: list[list[Piece]] = []
    for p in sorted(pieces, key=lambda p: -p.length):
        for folder in folders:
            if sum(q.length for q in folder) + p.length <= limit:
                folder.append(p)
                break
        else:
            folders.append([p])
    return folders


def recut(root: Path, limit: int, src_glob: str = ".vc[0-9][0-9]", dst_prefix: str = ".vd") -> list[Path]:
    sources = sorted(root.glob(src_glob))
    install = [d / INSTALL_SCRIPT for d in sources if (d / INSTALL_SCRIPT).exists()]
    if not sources or not install:
        raise SystemExit(f"no {src_glob} folders with {INSTALL_SCRIPT} under {root} (run prepare.sh and copy it first)")
    files = [f for d in sources for f in sorted(d.iterdir()) if f.name != INSTALL_SCRIPT]
    for old in root.glob(f"{dst_prefix}[0-9][0-9]"):
        shutil.rmtree(old)
    out = []
    for i, folder in enumerate(pack(cut(files, limit), limit), 1):
        d = root / f"{dst_prefix}{i:02d}"
        d.mkdir()
        for p in folder:
            with open(p.source, "rb") as r, open(d / p.name, "wb") as w:
                r.seek(p.offset)
                w.write(r.read(p.length))
        out.append(d)
    shutil.copy(install[-1], out[-1] / INSTALL_SCRIPT)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("."), help="the repository root holding .vc01 ...")
    ap.add_argument("--max-mib", type=float, default=40.0, help="largest folder, MiB (tree + folder <= 64 MiB)")
    args = ap.parse_args()
    folders = recut(args.root, int(args.max_mib * 2**20))
    sizes = [sum(f.stat().st_size for f in d.iterdir()) / 2**20 for d in folders]
    print(f"{len(folders)} folders {folders[0].name} ... {folders[-1].name}, largest {max(sizes):.1f} MiB; "
          f"copy {folders[-1].name} last (it holds {INSTALL_SCRIPT})")


if __name__ == "__main__":
    main()
