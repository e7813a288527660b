"""Metadata backup and restore of a volume with many extents: time, peak RSS, size.

    python -m bench.backup [--files N] [--extents-per-file K]

Prints one JSON object. The volume (SQLite, three dir: nodes) is made through the engine
API: files of K extents naming chunk rows that no node holds (the metadata is what is
measured; restore's missing-chunk report is counted, not printed). Backup and restore
each run in a subprocess of their own, so each peak RSS is that step's alone.
The issue's scale is 100,000 files x 10 extents; the default here is a tenth of it, to
run in a couple of minutes on the shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _build(vol_dir: str, nodes: list[str], files: int, per_file: int) -> None:
    from fusefs.client.volume import Volume
    from metadata.engine import ROOT_INO, Extent, NewChunk

    vol = Volume.create(vol_dir, nodes=nodes)
    size = 64 * 1024
    with vol:
        d = vol.meta.create(ROOT_INO, b"d", 0o40755, 0, 0)
        for f in range(files):
            attr = vol.meta.create(d.ino, b"f%07d" % f, 0o100644, 0, 0)
            ids = [os.urandom(16) for _ in range(per_file)]
            ext = [Extent(i * size, size, cid) for i, cid in enumerate(ids)]
            new = [NewChunk(cid, size, size) for cid in ids]
            vol.meta.commit_file(attr.ino, ext, size * per_file, new)


def _child(argv: list[str]) -> None:
    """Run one step in this process; print its seconds and peak RSS."""
    step, vol_dir, *nodes = argv
    from fusefs.client.volume import Volume
    from fusefs.maint import backup as bk

    t0 = time.perf_counter()
    out: dict = {}
    if step == "backup":
        with Volume.open(vol_dir) as vol:
            m = bk.create_backup(vol)
        out = {"size": m["size"], "extents": m["extents"], "pieces": len(m["pieces"])}
    else:
        rep = bk.restore(vol_dir, nodes)
        out = {"files": rep.files, "missing": len(rep.missing_chunks)}
    out["seconds"] = time.perf_counter() - t0
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def _run(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, "-m", "bench.backup", "--child", *args],
        capture_output=True, text=True, env=env, cwd=ROOT, check=True,
    )  # fmt: skip
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=10_000)
    ap.add_argument("--extents-per-file", type=int, default=10)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ckptfs-bench-backup-")
    try:
        nodes = [f"dir:{tmp}/nodes/n{i}" for i in range(3)]
        t0 = time.perf_counter()
        _build(f"{tmp}/vol", nodes, args.files, args.extents_per_file)
        build_s = time.perf_counter() - t0
        b = _run("backup", f"{tmp}/vol")
        r = _run("restore", f"{tmp}/restored", *nodes)
        extents = b["extents"]
        print(
            json.dumps(
                {
                    "files": args.files,
                    "extents": extents,
                    "build_s": round(build_s, 2),
                    "backup_s": round(b["seconds"], 2),
                    "restore_s": round(r["seconds"], 2),
                    "backup_peak_rss_mib": round(b["peak_rss_mib"], 1),
                    "restore_peak_rss_mib": round(r["peak_rss_mib"], 1),
                    "backup_bytes": b["size"],
                    "backup_bytes_per_extent": round(b["size"] / max(1, extents), 2),
                    "backup_pieces": b["pieces"],
                    "restored_files": r["files"],
                    "missing_chunks_reported": r["missing"],
                    "note": "chunks are rows only (no objects): the metadata is measured",
                }
            )
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
