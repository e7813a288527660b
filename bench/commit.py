"""Synchronized checkpoint commit from N ranks against a real `ckptfs meta serve`.

N simulated ranks are spread over worker processes, each process with its
own connection pipelining its ranks' requests. At one barrier every rank
sends commit_rank (4 files x 16 extents, every extent a new chunk); then
every rank fetches its manifest at once. Requests are encoded before the
barrier, as each rank of a real job encodes its own on its own host. Prints
one JSON object per engine:

  publish_ms          first commit sent -> step visible (wait_published)
  p50_ms/p99_ms/max_ms per-rank commit latency (send -> answer)
  manifest_fanout_ms  N ranks ask for the manifest at once -> all answered
  baseline_rpc_ms     N pipelined no-op RPCs (`ping`, answered on the service's
                      reader) from the same workers: the protocol floor the
                      ratios are taken against
  latest_rpc_ms       N pipelined `latest` RPCs of one job, as at a restart:
                      answered in batches by the service's read thread

With --ranks-per-host K (K > 1) the ranks are grouped K per simulated host, as a
host's agent groups them (issue 42): each host sends ONE commit_ranks for its K
ranks and ONE manifest(job, step, ranks=[...]) (and, with --leases, one
missing_chunks for all their chunks); a rank's commit latency is its host's
request's. The pings and `latest`s stay one per rank. `hosts` and `ranks_per_host`
say how the ranks were grouped.

With --jobs J (J > 1) or --meta-replicas R (R > 1) it measures instead whether
independent jobs commit side by side: J jobs of N ranks each (one load-generator
process per job, its connection on replica j mod R of R services sharing one
PostgreSQL database) commit one job after another, then all at once, in the
same run (after a warm-up step all at once; --rounds rounds, alternating which
of the two comes first; the round with the median ratio is reported):

  serial_ms             sum over jobs of (first commit sent -> step published)
  concurrent_ms         all jobs sent at one barrier -> the last step published
  concurrent_vs_serial  concurrent_ms / serial_ms (target <= 0.75: writers of
                        different checkpoints do not queue behind one lock)
  serial_publish_ms, concurrent_publish_ms  each job's own publish time
  rounds_concurrent_vs_serial  every round's ratio
  failovers             client failovers counted (0 unless a replica died)

Usage: python -m bench.commit --ranks 4096 [--engine sqlite|postgres|both] [--tls]
       python -m bench.commit --engine postgres --jobs 4 --meta-replicas 2 --ranks 1024
(--tls: the service speaks TLS, with a self-signed certificate made for the run;
SQLite volumes run one service, so --meta-replicas > 1 skips them)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from metadata.sql.checkpoints import CHK, EXT  # noqa: E402

FILES, EXTENTS, EXT_LEN = 4, 16, 1 << 20


def rank_files(rank: int) -> list[dict]:
    files = []
    for f in range(FILES):
        ids = [os.urandom(16) for _ in range(EXTENTS)]
        ext = b"".join(EXT.pack(i * EXT_LEN, EXT_LEN, 0, cid) for i, cid in enumerate(ids))
        chk = b"".join(CHK.pack(cid, EXT_LEN, EXT_LEN // 2, 0) for cid in ids)
        files.append(
            {"path": f"rank-{rank:05d}/shard-{f}.distcp", "size": EXTENTS * EXT_LEN,
             "extents": ext, "new_chunks": chk}
        )  # fmt: skip
    return files


def _pipelined(client, calls: list[tuple]) -> tuple[float, float, list[float]]:
    """Send every call at once; (first send, last answer, per-call latency).

    The requests were encoded before the barrier (`encode_many`): on a real job
    each rank encodes its own request on its own host, while here 4 processes
    speak for all ranks on the service's 2 cores. Encoding 16384 commits inside
    the window cost over 1 s of those cores' time."""
    lat = [0.0] * len(calls)
    done = threading.Semaphore(0)
    t0 = time.time()

    def finish(i: int, sent: float):
        def cb(_f) -> None:
            lat[i] = time.time() - sent
            done.release()

        return cb

    sent = time.time()
    futs = client.submit_encoded(calls)  # every simulated rank's request at the same moment
    for i, fut in enumerate(futs):
        fut.add_done_callback(finish(i, sent))
    for _ in calls:
        done.acquire()
    t1 = time.time()
    for f in futs:
        f.result()  # surface errors
    return t0, t1, lat


def _requests(job: str, step: int, hosts: list[list[int]], files: dict) -> tuple[list, list]:
    """(commits, manifest requests): one each per rank when every host has one rank
    (commit_rank with this process as its host, as before --ranks-per-host), else one
    each per host (commit_ranks, manifest of the host's ranks)."""
    if all(len(h) == 1 for h in hosts):
        host = f"bench-{os.getpid()}"
        return (
            [("commit_rank", (job, step, h[0], files[h[0]]), {"host": host}) for h in hosts],
            [("manifest", (job, step), {"rank": h[0]}) for h in hosts],
        )
    return (
        [("commit_ranks", (job, step, [[r, files[r], f"host-{h[0]}"] for r in h]), {})
         for h in hosts],
        [("manifest", (job, step), {"ranks": h}) for h in hosts],
    )  # fmt: skip


def worker(
    url: str,
    job: str,
    step: int,
    hosts: list[list[int]],
    barrier,
    out,
    leases: bool,
    token: str | None,
) -> None:
    from metadata.client import connect

    client = connect(url, token=token)  # None: the volume's admin token (CKPTFS_TOKEN_FILE)
    ranks = [r for h in hosts for r in h]
    files = {r: rank_files(r) for r in ranks}
    commit_calls, manifest_calls = _requests(job, step, hosts, files)
    pings = client.encode_many([("ping", (), {}) for _ in ranks])
    latests = client.encode_many([("latest", (job,), {}) for _ in ranks])
    asks = client.encode_many(
        [("missing_chunks", ([c[0] for r in h for f in files[r]
                              for c in CHK.iter_unpack(f["new_chunks"])],), {}) for h in hosts]
    ) if leases else []  # fmt: skip
    commits = client.encode_many(commit_calls)
    manifests = client.encode_many(manifest_calls)
    barrier.wait()
    base = _pipelined(client, pings)
    barrier.wait()
    latest = _pipelined(client, latests)
    barrier.wait()
    # --leases: each rank asks "which of my chunks exist?" first, as a real writer does
    # before storing them; the answer leases every one (metadata/sql/leases.py)
    lease = _pipelined(client, asks) if leases else (0.0, 0.0, [])
    barrier.wait()
    t0, t1, lat = _pipelined(client, commits)
    commit = (t0, t1, [x for h, x in zip(hosts, lat, strict=True) for _ in h])  # per rank
    barrier.wait()
    man = _pipelined(client, manifests)
    client.close()
    out.put({"base": base[:2], "latest": latest[:2], "lease": lease[:2], "commit": commit,
             "manifest": man[:2]})  # fmt: skip


def job_worker(url: str, job: str, steps: list[int], ranks: int, cmds, barrier, out) -> None:
    """One job's ranks, pipelined on one connection. Every step's commits are encoded
    first; then, per command ("alone" or "together", step), the step's commits are sent
    at once (together: after the barrier every job waits at) and the time from the first
    send to the step's publish is reported."""
    from metadata.client import connect

    client = connect(url)
    host = f"bench-{os.getpid()}"
    encoded = {
        step: client.encode_many(
            [("commit_rank", (job, step, r, rank_files(r)), {"host": host}) for r in range(ranks)]
        )
        for step in steps
    }
    out.put(("ready", job))
    while True:
        cmd = cmds.get()
        if cmd is None:
            break
        how, step = cmd
        if how == "together":
            barrier.wait()
        t0, _, _ = _pipelined(client, encoded.pop(step))
        state = client.wait_published(job, step, 600)["state"]
        out.put(("done", job, step, t0, time.time(), state, client.failovers))
    client.close()


def run_jobs(
    engine: str, n: int, jobs: int, replicas: int, tmp: str, tls: bool = False, rounds: int = 5
) -> dict:
    """`jobs` jobs of `n` ranks, one after another, then all at once (module docstring):
    a warm-up step all at once, then `rounds` rounds of both, alternating which comes
    first; the median round's ratio is reported, every round's beside it."""
    from bench.servers.metaserve import MetaServer, self_signed
    from bench.servers.postgres import PgCluster, pg_available
    from fusefs.client.volume import Volume
    from metadata.client import connect

    head = {"engine": engine, "tls": tls, "ranks": n, "jobs": jobs, "meta_replicas": replicas}
    if engine == "sqlite" and replicas > 1:
        return {**head, "skipped": "a SQLite volume runs one service (use --engine postgres)"}
    cluster = None
    db = None
    if engine == "postgres":
        reason = pg_available()
        if reason:
            return {**head, "skipped": reason}
        cluster = PgCluster(fsync=True)
        db = cluster.create_db()
    vol_dir = os.path.join(tmp, f"vol-{engine}")
    Volume.create(vol_dir, nodes=2, db=db).close()
    cert = self_signed(tmp) if tls else None
    servers: list = []
    ps: list = []
    names = [f"job{j}" for j in range(jobs)]
    steps = list(range(1 + 2 * rounds))  # step 0: the warm-up
    times: dict[tuple[str, int], tuple[float, float, str]] = {}
    failovers = dict.fromkeys(names, 0)
    try:
        servers = [MetaServer(vol_dir, db=db, tls=cert) for _ in range(replicas)]
        main = connect(servers[0].url)
        for job in names:
            for step in steps:
                main.begin(job, step, n, deadline_s=3600)
        main.close()
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(jobs)
        out = ctx.Queue()
        cmds = [ctx.Queue() for _ in names]
        ps = [
            ctx.Process(target=job_worker, args=(servers[j % replicas].url, job, steps, n,
                                                 cmds[j], barrier, out))
            for j, job in enumerate(names)
        ]  # fmt: skip
        for p in ps:
            p.start()
        for _ in ps:
            assert out.get(timeout=600)[0] == "ready"

        def phase(how: str, step: int) -> None:
            for j in range(jobs) if how == "together" else []:
                cmds[j].put((how, step))
            for j in range(jobs):
                if how == "alone":  # the next job starts when this one published
                    cmds[j].put((how, step))
                msg = out.get(timeout=600)
                _, job, st, t0, t1, state, fo = msg
                times[(job, st)] = (t0, t1, state)
                failovers[job] = fo

        phase("together", 0)  # warm-up: plans, caches and connections of every replica
        for k in range(rounds):
            alone, together = 1 + 2 * k, 2 + 2 * k
            order = [("alone", alone), ("together", together)]
            for how, step in order if k % 2 == 0 else order[::-1]:
                phase(how, step)
        for q in cmds:
            q.put(None)
        for p in ps:
            p.join(timeout=60)
    finally:
        for p in ps:
            if p.is_alive():
                p.kill()
        for s in servers:
            s.stop()
        if cluster:
            cluster.stop()
    per_round = []
    for k in range(rounds):
        alone = [times[(job, 1 + 2 * k)] for job in names]
        together = [times[(job, 2 + 2 * k)] for job in names]
        serial_ms = sum(t1 - t0 for t0, t1, _ in alone) * 1e3
        conc_ms = (max(t[1] for t in together) - min(t[0] for t in together)) * 1e3
        per_round.append(
            {
                "serial_ms": round(serial_ms, 1),
                "concurrent_ms": round(conc_ms, 1),
                "concurrent_vs_serial": round(conc_ms / serial_ms, 3),
                "serial_publish_ms": [round((t1 - t0) * 1e3, 1) for t0, t1, _ in alone],
                "concurrent_publish_ms": [round((t1 - t0) * 1e3, 1) for t0, t1, _ in together],
            }
        )
    median = sorted(per_round, key=lambda r: r["concurrent_vs_serial"])[rounds // 2]
    return {
        **head,
        "rounds": rounds,
        "states": sorted({st for _, _, st in times.values()}),
        **median,
        "rounds_concurrent_vs_serial": [r["concurrent_vs_serial"] for r in per_round],
        "failovers": sum(failovers.values()),
        "extents": jobs * n * FILES * EXTENTS,
    }


def scoped_vs_admin(
    engine: str, n: int, procs: int, tmp: str, tls: bool, leases: bool, rounds: int, per_host: int
) -> dict:
    """`rounds` publishes with writer tokens and as many with the admin token, alternating
    which goes first; the scoped credential's checks (server/access.py) cost what this
    ratio shows (target <= 1.10)."""
    runs: dict[str, list[dict]] = {"admin": [], "scoped": []}
    for r in range(rounds):
        for kind in ("admin", "scoped") if r % 2 == 0 else ("scoped", "admin"):
            scoped = kind == "scoped"
            runs[kind].append(run(engine, n, procs, tmp, tls, leases, scoped, per_host))
    med = {k: statistics.median(x["publish_ms"] for x in v) for k, v in runs.items()}
    return {
        "engine": engine,
        "ranks": n,
        "rounds": rounds,
        "admin_publish_ms": [x["publish_ms"] for x in runs["admin"]],
        "scoped_publish_ms": [x["publish_ms"] for x in runs["scoped"]],
        "scoped_vs_admin": round(med["scoped"] / med["admin"], 3),
        "target_scoped_vs_admin": 1.10,
        "states": sorted({x["state"] for v in runs.values() for x in v}),
    }


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def run(
    engine: str,
    n: int,
    procs: int,
    tmp: str,
    tls: bool = False,
    leases: bool = False,
    scoped: bool = False,
    per_host: int = 1,
) -> dict:
    """One publish of n ranks; `scoped`: the ranks hold a writer token of the job's scope
    (metadata/server/access.py checks each request), else the volume's admin token;
    `per_host`: ranks per simulated host, each host's sent as one request (docstring)."""
    from bench.servers.metaserve import MetaServer, self_signed
    from bench.servers.postgres import PgCluster, pg_available
    from fusefs.client.volume import Volume
    from metadata.client import connect

    cluster = None
    db = None
    if engine == "postgres":
        reason = pg_available()
        if reason:
            return {"engine": engine, "skipped": reason}
        cluster = PgCluster(fsync=True)
        db = cluster.create_db()
    vol_dir = os.path.join(tmp, f"vol-{engine}")
    shutil.rmtree(vol_dir, ignore_errors=True)
    shutil.rmtree(vol_dir + ".nodes", ignore_errors=True)
    vol = Volume.create(vol_dir, nodes=2, db=db)
    token = vol.meta.create_token("bench-ranks", "writer", ["bench"]) if scoped else None
    vol.close()
    server = MetaServer(vol_dir, db=db, tls=self_signed(tmp) if tls else None)
    hosts = [list(range(h, min(n, h + per_host))) for h in range(0, n, per_host)]
    procs = min(procs, len(hosts))
    try:
        job, step = "bench", 1
        main = connect(server.url)
        main.begin(job, step, n, deadline_s=600)
        ctx = mp.get_context("spawn")
        barrier = ctx.Barrier(procs + 1)
        out = ctx.Queue()
        ps = [
            ctx.Process(target=worker, args=(server.url, job, step, hosts[i::procs],
                                              barrier, out, leases, token))
            for i in range(procs)
        ]  # fmt: skip
        for p in ps:
            p.start()
        barrier.wait()  # payloads built
        barrier.wait()  # ping baseline done
        barrier.wait()  # latest baseline done
        barrier.wait()  # leases taken (with --leases)
        published_at = [0.0]

        def waiter() -> None:
            main.wait_published(job, step, 600)
            published_at[0] = time.time()

        w = threading.Thread(target=waiter)
        w.start()
        barrier.wait()  # commits go
        w.join()
        res = [out.get(timeout=600) for _ in ps]
        for p in ps:
            p.join(timeout=60)
        info = main.step_state(job, step)
        main.close()
    finally:
        server.stop()
        if cluster:
            cluster.stop()
    lat = [x for r in res for x in r["commit"][2]]
    first = min(r["commit"][0] for r in res)
    base_ms = (max(r["base"][1] for r in res) - min(r["base"][0] for r in res)) * 1e3
    latest_ms = (max(r["latest"][1] for r in res) - min(r["latest"][0] for r in res)) * 1e3
    man_ms = (max(r["manifest"][1] for r in res) - min(r["manifest"][0] for r in res)) * 1e3
    lease_ms = (max(r["lease"][1] for r in res) - min(r["lease"][0] for r in res)) * 1e3
    publish_ms = (published_at[0] - first) * 1e3
    return {
        "engine": engine,
        "tls": tls,
        "ranks": n,
        "procs": procs,
        "hosts": len(hosts),
        "ranks_per_host": per_host,
        "state": info["state"],
        "publish_ms": round(publish_ms, 1),
        "p50_ms": round(_pct(lat, 0.5) * 1e3, 1),
        "p99_ms": round(_pct(lat, 0.99) * 1e3, 1),
        "max_ms": round(max(lat) * 1e3, 1),
        "manifest_fanout_ms": round(man_ms, 1),
        "baseline_rpc_ms": round(base_ms, 1),
        "latest_rpc_ms": round(latest_ms, 1),
        "leases": leases,
        "scoped": scoped,
        "lease_rpc_ms": round(lease_ms, 1) if leases else None,
        "publish_vs_baseline": round(publish_ms / base_ms, 2) if base_ms else None,
        "manifest_vs_baseline": round(man_ms / base_ms, 2) if base_ms else None,
        "extents": n * FILES * EXTENTS,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--procs", type=int, default=4, help="worker processes (connections)")
    ap.add_argument("--engine", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--tls", action="store_true", help="the service speaks TLS")
    ap.add_argument("--jobs", type=int, default=1, help="jobs of --ranks ranks each")
    ap.add_argument("--meta-replicas", type=int, default=1, help="services on one database")
    ap.add_argument("--rounds", type=int, default=5, help="with --jobs: serial/concurrent rounds")
    ap.add_argument(
        "--leases", action="store_true",
        help="ranks ask which of their chunks exist first (leasing them), as real writers do",
    )  # fmt: skip
    ap.add_argument(
        "--scoped", action="store_true",
        help="--rounds publishes with a writer token of the job and as many with the admin "
        "token, alternating: sqlite.scoped_vs_admin (median over median publish_ms)",
    )  # fmt: skip
    ap.add_argument(
        "--ranks-per-host", type=int, default=1,
        help="ranks per simulated host, each host's commits sent as one commit_ranks",
    )  # fmt: skip
    args = ap.parse_args(argv)
    k = args.ranks_per_host
    if min(args.ranks, args.jobs, args.meta_replicas, args.procs, args.rounds, k) < 1:
        ap.error(
            "--ranks, --jobs, --meta-replicas, --procs, --rounds and --ranks-per-host must be "
            "at least 1"
        )
    engines = ["sqlite", "postgres"] if args.engine == "both" else [args.engine]
    multi = args.jobs > 1 or args.meta_replicas > 1
    if multi and k > 1:
        ap.error("--ranks-per-host applies to one job on one service (not --jobs, --meta-replicas)")
    tmp = tempfile.mkdtemp(prefix="ckptfs-bench-commit-")
    try:
        procs = min(args.procs, args.ranks)
        results = {
            e: run_jobs(e, args.ranks, args.jobs, args.meta_replicas, tmp, args.tls, args.rounds)
            if multi
            else scoped_vs_admin(e, args.ranks, procs, tmp, args.tls, args.leases, args.rounds, k)
            if args.scoped
            else run(e, args.ranks, procs, tmp, args.tls, args.leases, per_host=k)
            for e in engines
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # (publish_ms, manifest_fanout_ms) on this 2-core machine, and publish over one round
    # trip of N pipelined pings: the figure that does not depend on the machine's speed
    targets = {4096: (300, 500), 16384: (1000, None), 65536: (2000, None)}.get(args.ranks)
    doc = {"bench": "commit", "ranks": args.ranks, "targets_ms": targets}
    if args.ranks == 4096:
        doc["target_publish_vs_baseline"] = 10.0
    if multi:
        doc["target_concurrent_vs_serial"] = 0.75
    print(json.dumps({**doc, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
