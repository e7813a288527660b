"""Metadata backup and restore of a volume with many extents: time, peak RSS, size.

    python -m bench.backup [--files N] [--extents-per-file K]

Prints one JSON object. The volume (SQLite, three dir: nodes) is made through the engine
API: files of K extents naming chunk rows that no node holds (the metadata is what is
measured; restore's missing-chunk report is counted, not printed). Backup and restore
each run in a subprocess of their own, so each peak RSS is that step's alone.

`commit_during_backup_vs_alone`: a real `ckptfs meta serve` on the built volume; one
client pipelines a 1024-rank commit (bench/commit.py's rank_files: 4 files x 16 new
extents per rank) and waits for the step's publish, alone, then with `ckptfs meta backup
VOL` running in a subprocess (the commit is sent once the backup has opened its snapshot
connection; the backup's own manifest times its dump, from which the overlap is checked).
Alone and during alternate for --rounds rounds (which goes first alternating, after a
warm-up step); the median round's ratio is reported, every round beside it.
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


def _snapshot_open(pid: int, db: str) -> bool:
    """Whether process `pid` holds two descriptors on `db`: the engine's connection and
    the snapshot's (metadata/engines/sqlite.py `_snapshot_open`)."""
    n = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                n += os.readlink(f"/proc/{pid}/fd/{fd}") == db
            except OSError:
                pass
    except OSError:
        return False
    return n >= 2


def _commit_vs_backup(vol_dir: str, ranks: int, rounds: int) -> dict:
    """A `ranks`-rank commit's publish time alone and while `ckptfs meta backup` runs."""
    from bench.commit import EXTENTS, FILES, _pipelined, rank_files
    from bench.servers import child_env
    from bench.servers.metaserve import MetaServer
    from metadata.client import connect

    job = "bench-backup"
    steps = list(range(1 + 2 * rounds))  # step 0: the warm-up
    db = os.path.realpath(os.path.join(vol_dir, "meta.db"))
    server = MetaServer(vol_dir)
    per_round: list[dict] = []
    try:
        client = connect(server.url)
        for step in steps:
            client.begin(job, step, ranks, deadline_s=3600)
        host = f"bench-{os.getpid()}"

        def commit(step: int) -> tuple[float, float, str]:
            calls = [("commit_rank", (job, step, r, rank_files(r)), {"host": host})
                     for r in range(ranks)]  # fmt: skip
            enc = client.encode_many(calls)  # before the window, as in bench/commit.py
            t0, _, _ = _pipelined(client, enc)
            state = client.wait_published(job, step, 600)["state"]
            return t0, time.time(), state

        def during(step: int) -> dict:
            calls = [("commit_rank", (job, step, r, rank_files(r)), {"host": host})
                     for r in range(ranks)]  # fmt: skip
            enc = client.encode_many(calls)
            cmd = [sys.executable, "-m", "fusefs.cli", "meta", "backup", vol_dir,
                   "--keep", "1", "--json"]  # fmt: skip
            b0 = time.time()
            p = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
            while not _snapshot_open(p.pid, db) and p.poll() is None:
                time.sleep(0.002)
            began = time.time()
            running = p.poll() is None
            t0, _, _ = _pipelined(client, enc)
            state = client.wait_published(job, step, 600)["state"]
            t1 = time.time()
            out, err = p.communicate(timeout=3600)
            b1 = time.time()
            if p.returncode != 0:
                raise RuntimeError(f"meta backup failed: {err.strip()}")
            m = json.loads(out)
            dump_end = m["created"]
            dump_start = dump_end - m["seconds"]
            return {
                "publish_ms": round((t1 - t0) * 1e3, 1),
                "state": state,
                "backup_s": round(b1 - b0, 2),
                "backup_dump_s": m["seconds"],
                "backup_running_at_commit": running,
                "commit_sent_after_backup_start_s": round(t0 - b0, 2),
                "backup_dump_covers_commit": dump_start <= t0 and dump_end >= t1,
                "overlap_ms": round(max(0.0, min(t1, dump_end) - max(t0, dump_start)) * 1e3, 1),
                "snapshot_seen_s": round(began - b0, 2),
            }

        commit(0)  # warm-up: the service's plans and caches, the connection
        for k in range(rounds):
            alone_step, during_step = 1 + 2 * k, 2 + 2 * k
            res: dict = {}
            order = ["alone", "during"] if k % 2 == 0 else ["during", "alone"]
            for how in order:
                if how == "alone":
                    t0, t1, state = commit(alone_step)
                    res["alone"] = {"publish_ms": round((t1 - t0) * 1e3, 1), "state": state}
                else:
                    res["during"] = during(during_step)
            a, d = res["alone"]["publish_ms"], res["during"]["publish_ms"]
            per_round.append(
                {"first": order[0], "alone_publish_ms": a, "during_publish_ms": d,
                 "ratio": round(d / a, 3), "alone_state": res["alone"]["state"],
                 **{k2: v for k2, v in res["during"].items() if k2 != "publish_ms"}}
            )  # fmt: skip
        client.close()
    finally:
        server.stop()
    median = sorted(per_round, key=lambda r: r["ratio"])[rounds // 2]
    return {
        "commit_during_backup_vs_alone": median["ratio"],
        "commit_ranks": ranks,
        "commit_extents": ranks * FILES * EXTENTS,
        "commit_alone_publish_ms": median["alone_publish_ms"],
        "commit_during_backup_publish_ms": median["during_publish_ms"],
        "commit_rounds": per_round,
        "target_commit_during_backup_vs_alone": 2.0,
    }


def _child(argv: list[str]) -> None:
    """Run one step in this process; print its seconds and peak RSS."""
    step, vol_dir, *nodes = argv  # restore: NEWVOL KEYFILE NODE...
    from fusefs.client.volume import Volume
    from fusefs.maint import backup as bk

    t0 = time.perf_counter()
    out: dict = {}
    if step == "backup":
        with Volume.open(vol_dir) as vol:
            m = bk.create_backup(vol)
        out = {"size": m["size"], "extents": m["extents"], "pieces": len(m["pieces"])}
    else:
        key_file, *nodes = nodes
        rep = bk.restore(vol_dir, nodes, key=bk.read_key(key_file))  # verified, as an operator's
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
    ap.add_argument("--ranks", type=int, default=1024, help="ranks of the concurrent commit")
    ap.add_argument("--rounds", type=int, default=3, help="alone/during-backup commit rounds")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ckptfs-bench-backup-")
    try:
        nodes = [f"dir:{tmp}/nodes/n{i}" for i in range(3)]
        t0 = time.perf_counter()
        _build(f"{tmp}/vol", nodes, args.files, args.extents_per_file)
        build_s = time.perf_counter() - t0
        b = _run("backup", f"{tmp}/vol")
        shutil.copy(f"{tmp}/vol/backup.key", f"{tmp}/backup.key")  # the off-host copy
        r = _run("restore", f"{tmp}/restored", f"{tmp}/backup.key", *nodes)
        c = _commit_vs_backup(f"{tmp}/vol", args.ranks, args.rounds)
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
                    "target_peak_rss_mib": 512,
                    **c,
                }
            )
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
