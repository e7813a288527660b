"""What a harness run produced: per-step numbers, the verdict, the table, JSON and plots.

The verdict is a pure function of the step records (`judge`), so tests can check it on
real runs whose data or ranks were broken on purpose.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict

from fusefs.cli.units import format_size


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def breakdown(hosts: list[dict], t0: float, measured: float | None, tail: str = "") -> dict | None:
    """Where the step's time went, on its critical path: the host that finished last, from
    the step's start (`t0`) through its phases to `measured` seconds after t0.

    The host's phases are timed one by one (each its own clock reading, in the worker), the
    start delay is when its task began, `tail` (publish) is what the measured time has after
    the host's last answer; so the parts add up to the measured time only if nothing else
    took time in between (a thread hand-off, the loop busy elsewhere, a slow scheduler):
    `gap` is that rest, `error` its share. Thread-seconds (the verify time summed over the
    pool's workers) and work that ran beside the phases on the clock ("beside", a resume's
    volume opening and resolving) are shown aside, not added."""
    if not hosts or not measured:
        return None
    h = max(hosts, key=lambda x: x["last"])
    parts = {"start": h["began"] - t0}
    aside = {}
    for k, v in h["phases"].items():
        (aside if "thread-s" in k or "beside" in k else parts)[k] = v
    if tail:
        parts[tail] = max(0.0, t0 + measured - h["last"])
    total = sum(parts.values())
    return {
        "host": h["host"],
        "phases_s": {k: round(v, 4) for k, v in parts.items()},
        "aside": {k: round(v, 4) for k, v in aside.items()},
        "waves": h.get("waves"),
        "sum_s": round(total, 4),
        "measured_s": round(measured, 4),
        "gap_s": round(measured - total, 4),
        "error": round(abs(measured - total) / measured, 4),
    }


def per_rank_ms(client: float, service: float, ranks: int, what: str = "") -> dict:
    """CPU milliseconds per rank, client + service and each: `cpu_ms_per_rank{_what}`..."""
    key = f"cpu_ms_per_rank{'_' + what if what else ''}"
    return {
        key: round((client + service) / ranks * 1e3, 3),
        f"{key}_client": round(client / ranks * 1e3, 3),
        f"{key}_service": round(service / ranks * 1e3, 3),
    }


def _per_rank_ms(cpu: dict, what: str, ranks: int) -> dict:
    client, service = cpu.get(f"{what}_client_s"), cpu.get(f"{what}_service_s")
    if client is None or service is None or not ranks:
        return {}
    return per_rank_ms(client, service, ranks, what)


def step_summary(rec, cfg) -> dict:
    """Numbers of one step from its raw rank records."""
    saved = [r for r in rec.save if "done" in r]
    save_lat = [r["done"] - rec.start for r in saved]
    last_sent = max((r["sent"] for r in saved), default=None)
    if rec.published:
        save_s = rec.published - rec.start
    else:
        save_s = max(save_lat) if save_lat else None
    logical = sum(r["logical"] for r in saved)
    stored = sum(r["stored"] for r in saved)
    loaded = [r for r in rec.load if "done" in r]
    load_lat = [r["done"] - rec.load_start for r in loaded]
    load_s = max(load_lat) if load_lat else None
    load_bytes = sum(r["bytes"] for r in rec.load)
    bad_loads = [r for r in rec.load if not r.get("ok")]
    info = rec.info or {}
    hosts = {r["rank"]: r.get("host", "") for r in info.get("ranks", [])}
    return {
        "step": rec.step,
        "state": rec.state,
        "reason": rec.reason,
        "faults": rec.faults,
        "save_s": _r(save_s),
        "save_gbps": _r(logical / 1e9 / save_s, 3) if save_s and rec.published else None,
        "publish_ms": _r((rec.published - last_sent) * 1e3, 1)
        if rec.published and last_sent
        else None,
        "save_p50_s": _r(_pct(save_lat, 0.5)),
        "save_p99_s": _r(_pct(save_lat, 0.99)),
        "save_max_s": _r(max(save_lat) if save_lat else None),
        "ranks_committed": len(saved),
        "rank_errors": [f"{r['rank']}: {r['error']}" for r in rec.save if r.get("error")][:10],
        "killed_ranks": [r["rank"] for r in rec.save if r.get("killed")],
        "logical_bytes": logical,
        "stored_bytes": stored,
        "stored_ratio": _r(stored / logical, 4) if logical else None,
        "stragglers": [f"{s}@{hosts.get(s) or '?'}" for s in info.get("stragglers", [])],
        "loaded_step": rec.loaded_step,
        "latest_after": rec.latest_after,
        "load_s": _r(load_s),
        "load_gbps": _r(load_bytes / 1e9 / load_s, 3) if load_s else None,
        "load_p50_s": _r(_pct(load_lat, 0.5)),
        "load_p99_s": _r(_pct(load_lat, 0.99)),
        "load_max_s": _r(max(load_lat) if load_lat else None),
        "verified": sum(1 for r in rec.load if r.get("ok")),
        "verify_failures": [f"{r['rank']}: {r['error']}" for r in bad_loads][:10],
        "save_latency_s": [_r(x, 4) for x in save_lat],
        "save_done_at": [_r(r["done"] - rec.start, 4) for r in saved],
        "load_done_at": [_r(r["done"] - rec.load_start, 4) for r in loaded],
        "t_save": rec.start,
        "t_load": rec.load_start,
        "may_abort": rec.may_abort,
        "commit_latency_s": [_r(r["done"] - r["sent"], 4) for r in saved if "sent" in r],
        "save_breakdown": breakdown(
            rec.save_hosts, rec.start, save_s, "publish" if rec.published else ""
        ),
        "load_breakdown": breakdown(rec.load_hosts, rec.load_start, load_s),
        **_per_rank_ms(rec.cpu, "save", len(saved)),
        **_per_rank_ms(rec.cpu, "load", len(loaded)),
        # of the client's: the hosts' agents (with --no-agent, 0)
        "cpu_ms_per_rank_save_agents": _r(
            rec.cpu.get("save_agents_s", 0) / max(1, len(saved)) * 1e3, 3
        ),
        "cpu_ms_per_rank_load_agents": _r(
            rec.cpu.get("load_agents_s", 0) / max(1, len(loaded)) * 1e3, 3
        ),
        # the tiers' background uploads that ran inside the phase (sharing its CPU and disk)
        "uploaded_mib_during_save": _r(rec.uploaded.get("save", 0) / 2**20, 1),
        "uploaded_mib_during_load": _r(rec.uploaded.get("load", 0) / 2**20, 1),
    }


ABORTING_FAULTS = ("kill-rank", "kill-node")  # may abort a step whatever its deadline
# --hang-meta: the step a replica hung in must publish within this many seconds of the steps
# without faults (their median): the clients leave a silent replica in ~4 s (1 s of silence,
# a 3 s ping), the database ends its idle transaction in 5 s, and a fleet that waited for
# the resume instead (HANG_S, 10 s) would miss it by seconds
HANG_BUDGET_S = 5.0


def hang_check(steps: list[dict], fault: dict) -> dict:
    """The hung step's publish time (step start -> published) against the median of the
    published steps with no fault noted (a step that started while the replica was still
    stopped has one) that came before it, the fleet as it was before anything was done to
    it (only when there is none, those after it: a run's later steps can be slowed by other
    things, such as write-behind tiers backing up, which would hide the hang's cost), and
    whether it is within HANG_BUDGET_S of it."""
    free = [s for s in steps if s["state"] == "published" and not s["faults"] and s.get("save_s")]
    free = [s for s in free if s["step"] < fault["step"]] or free
    hit = next((s for s in steps if s["step"] == fault["step"]), None)
    pub = hit.get("save_s") if hit is not None and hit["state"] == "published" else None
    base = statistics.median(s["save_s"] for s in free) if free else None
    over = pub - base if pub is not None and base is not None else None
    return {
        "publish_s": _r(pub, 3),
        "state": hit["state"] if hit is not None else None,
        "baseline_publish_s": _r(base, 3),
        "baseline_steps": [s["step"] for s in free],
        "over_baseline_s": _r(over, 3),
        "budget_s": HANG_BUDGET_S,
        "within_budget": over is not None and over <= HANG_BUDGET_S,
    }


def _hang_line(f: dict, c: dict) -> str:
    head = f"hang-meta {f['target']} (step {f['step']}, stopped {f['down_s'] or 0:.1f}s)"
    if c["publish_s"] is None:
        return f"{head}: FAIL the step did not publish ({c['state']})"
    if c["baseline_publish_s"] is None:
        return f"{head}: FAIL no step without faults published to compare it with"
    steps = ",".join(str(n) for n in c["baseline_steps"])
    text = (
        f"step {f['step']} published in {c['publish_s']:.2f}s, steps without faults "
        f"{c['baseline_publish_s']:.2f}s (median of {steps}): {c['over_baseline_s']:+.2f}s"
    )
    answered = f.get("answered_s")
    if answered is not None and f.get("probe_on") == f["target"]:
        text += f"; a client on the stopped replica answered by another in {answered:.1f}s"
    elif answered is not None:
        text += f"; (the probe client was on {f.get('probe_on')}, not the stopped replica)"
    if c["within_budget"]:
        return f"{head}: {text} (budget +{HANG_BUDGET_S:g}s)"
    return f"{head}: FAIL {text}, over the budget of +{HANG_BUDGET_S:g}s"


def judge(
    steps: list[dict],
    ranks: int,
    flush: dict | None,
    latest,
    durable,
    final: dict | None = None,
    faults: list[dict] | None = None,
    errors: list[str] | None = None,
    resume: dict | None = None,
) -> dict:
    """Pass only if every step published with every byte verified, or was aborted where an
    injected fault made publishing impossible (a killed rank or node, or an outage longer
    than the step's deadline) with the previous published step still latest and verified;
    every staged chunk drained; no acknowledged write lost (the final check); every
    injected fault undone; the step a replica hung in (--hang-meta) published within
    HANG_BUDGET_S of the steps without faults; no metadata call of the run failed."""
    lines, ok = [], True
    last_published = None
    for s in steps:
        n = s["step"]
        injected = s.get("may_abort")
        if injected is None:
            injected = any(f.startswith(ABORTING_FAULTS) for f in s["faults"])
        if s["state"] == "published":
            if any(f.startswith("kill-rank") for f in s["faults"]):
                ok = False
                lines.append(f"step {n}: FAIL published although a rank was killed")
            elif s["verified"] == ranks and not s["verify_failures"]:
                lines.append(f"step {n}: published, {ranks}/{ranks} ranks verified")
            else:
                ok = False
                why = "; ".join(s["verify_failures"][:3]) or "missing load results"
                lines.append(
                    f"step {n}: FAIL published but {s['verified']}/{ranks} verified ({why})"
                )
            last_published = n
        elif s["state"] == "aborted":
            prev_ok = (
                s["loaded_step"] == last_published
                and s["latest_after"] == last_published
                and (last_published is None or s["verified"] == ranks)
            )
            if not injected:
                ok = False
                lines.append(f"step {n}: FAIL aborted without an injected fault ({s['reason']})")
            elif not prev_ok:
                ok = False
                lines.append(
                    f"step {n}: FAIL aborted, but the previous step is not intact "
                    f"(latest {s['latest_after']}, {s['verified']}/{ranks} verified)"
                )
            else:
                lines.append(
                    f"step {n}: aborted ({s['reason']}); previous step {last_published} "
                    f"intact, {s['verified']}/{ranks} ranks verified"
                )
        else:
            ok = False
            why = f" ({s['reason']})" if s.get("reason") else ""
            lines.append(f"step {n}: FAIL left {s['state']}{why}")
    if flush is not None:
        if flush["ok"] and durable == latest:
            lines.append(
                f"drain: every staged chunk durable in {flush['s']:.1f}s "
                f"(latest_durable = latest = {latest})"
            )
        else:
            ok = False
            lines.append(
                f"drain: FAIL latest {latest}, latest_durable {durable}, errors {flush['errors']}"
            )
    if final is not None:
        checked = ", ".join(f"step {c['step']} {c['verified']}/{ranks}" for c in final["steps"])
        if final["ok"]:
            if final["steps"]:
                lines.append(f"no acknowledged write lost: read back at the end: {checked}")
        elif final.get("error"):
            ok = False
            lines.append(f"FAIL acknowledged writes could not be checked: {final['error']}")
        else:
            ok = False
            gone = final.get("not_published_any_more") or []
            why = f"steps {gone} no longer published; " if gone else ""
            lines.append(f"FAIL acknowledged writes lost: {why}read back at the end: {checked}")
    if resume is not None:
        if resume.get("verified") == ranks and resume.get("step") == durable:
            lines.append(
                f"resume: fresh connections read latest_durable = {durable}, "
                f"{ranks}/{ranks} ranks verified in {resume['s']:.2f}s"
            )
        else:
            ok = False
            why = "; ".join(resume.get("failures", [])[:3]) or resume.get("error", "")
            lines.append(
                f"resume: FAIL step {resume.get('step')} (latest_durable {durable}), "
                f"{resume.get('verified', 0)}/{ranks} verified ({why})"
            )
    for f in faults or []:
        if not f["recovered"]:
            ok = False
            lines.append(
                f"FAIL fault {f['what']} {f['target']} (step {f['step']}) did not recover: "
                f"{f['error'] or 'no recovery seen'}"
            )
    for f in faults or []:
        if f["what"] == "hang-meta":
            c = hang_check(steps, f)
            ok = ok and c["within_budget"]
            lines.append(_hang_line(f, c))
    if faults and all(f["recovered"] for f in faults):
        worst = max(f["recovered_s"] or 0 for f in faults)
        lines.append(f"faults: {len(faults)} injected, all undone; slowest recovery {worst:.1f}s")
    for e in (errors or [])[:5]:
        ok = False
        lines.append(f"FAIL {e}")
    return {"ok": ok, "verdict": "PASS" if ok else "FAIL", "lines": lines}


def latency_split(summaries: list[dict]) -> dict:
    """Publish latency (step start -> visible) and per-rank commit latency (sent ->
    acknowledged), p50/p99, for steps with injected faults and for steps without."""
    out = {}
    for name, want in (("without_faults", False), ("with_faults", True)):
        group = [s for s in summaries if bool(s["faults"]) == want]
        pub = [s["save_s"] for s in group if s["state"] == "published" and s["save_s"]]
        com = [x for s in group for x in s.get("commit_latency_s", []) if x is not None]
        out[name] = {
            "steps": [s["step"] for s in group],
            "publish_p50_s": _r(_pct(pub, 0.5)),
            "publish_p99_s": _r(_pct(pub, 0.99)),
            "commit_p50_s": _r(_pct(com, 0.5)),
            "commit_p99_s": _r(_pct(com, 0.99)),
        }
    return out


def build_report(
    cfg,
    job,
    chunk,
    steps,
    baseline,
    flush,
    latest,
    durable,
    stats,
    killed,
    t_run,
    *,
    topology: dict | None = None,
    faults: list[dict] | None = None,
    counters: dict | None = None,
    final: dict | None = None,
    errors: list[str] | None = None,
    worker_logs: dict | None = None,
    resume: dict | None = None,
    process_exits: list[dict] | None = None,
    agents: dict | None = None,
):
    summaries = [step_summary(r, cfg) for r in steps]
    for f in faults or []:
        if f["what"] == "hang-meta":
            f["publish"] = hang_check(summaries, f)
    verdict = judge(
        summaries, cfg.ranks, flush, latest, durable, final, faults, errors, resume=resume
    )
    conf = asdict(cfg)
    conf["chunk_size"] = chunk
    published = [s for s in summaries if s["state"] == "published" and s["save_gbps"]]
    best = max((s["save_gbps"] for s in published), default=None)
    best_load = max((s["load_gbps"] for s in summaries if s["load_gbps"]), default=None)
    by_step = {s["step"]: s for s in published}
    s1, s2 = by_step.get(1), by_step.get(2)
    read_gbps = baseline.get("read_gbps")
    cpu = {
        k: _r(_pct([s[k] for s in summaries if s.get(k) is not None], 0.5), 3)
        for k in (
            "cpu_ms_per_rank_save",
            "cpu_ms_per_rank_load",
            "cpu_ms_per_rank_save_service",
            "cpu_ms_per_rank_load_service",
        )
    }
    return {
        "bench": "harness",
        "config": conf,
        "job": job,
        "cpus": os.cpu_count(),
        "elapsed_s": round(time.time() - t_run, 2),
        "baseline_disk": baseline,
        "save_vs_disk": round(best / baseline["gbps"], 3)
        if best and baseline.get("gbps")
        else None,
        "step2_vs_step1": round(s1["save_s"] / s2["save_s"], 3) if s1 and s2 else None,
        "load_vs_disk": round(best_load / read_gbps, 3) if best_load and read_gbps else None,
        "resume_vs_disk": round(resume["gbps"] / read_gbps, 3)
        if resume and resume.get("gbps") and read_gbps
        else None,
        **cpu,
        "resume": resume,
        "agents": agents,  # None: --no-agent; else what the agents counted
        "steps": summaries,
        "flush": flush,
        "latest": latest,
        "latest_durable": durable,
        "killed_node": killed,
        "volume_stats": stats,
        "topology": topology or {"kind": cfg.topology},
        "faults": faults or [],
        "failovers": (counters or {}).get("failovers", 0),
        "reconnects": (counters or {}).get("reconnects", 0),
        "hangs": (counters or {}).get("hangs", 0),
        "publish_latency": latency_split(summaries),
        "final_check": final,
        "errors": errors or [],
        "worker_logs": worker_logs or {},
        "process_exits": process_exits or [],  # servers that exited when no fault asked
        "verdict": verdict,
    }


def format_table(rep: dict) -> str:
    """The final table: one line per step, then stragglers, faults and the verdict."""
    head = (
        f"{'STEP':>4} {'STATE':9} {'SAVE_S':>7} {'GB/S':>6} {'PUB_MS':>7} "
        f"{'P50_S':>6} {'P99_S':>6} {'MAX_S':>6} {'LOAD_S':>7} {'GB/S':>6} "
        f"{'L_P99':>6} {'LOGICAL':>10} {'STORED':>10} {'RATIO':>6}  STRAGGLERS"
    )

    def f(x, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    out = [head]
    for s in rep["steps"]:
        strag = ", ".join(s["stragglers"][:6]) or "-"
        if len(s["stragglers"]) > 6:
            strag += f" (+{len(s['stragglers']) - 6})"
        out.append(
            f"{s['step']:>4} {s['state']:9} {f(s['save_s'], '.2f'):>7} "
            f"{f(s['save_gbps'], '.3f'):>6} {f(s['publish_ms'], '.1f'):>7} "
            f"{f(s['save_p50_s'], '.2f'):>6} {f(s['save_p99_s'], '.2f'):>6} "
            f"{f(s['save_max_s'], '.2f'):>6} {f(s['load_s'], '.2f'):>7} "
            f"{f(s['load_gbps'], '.3f'):>6} {f(s['load_p99_s'], '.2f'):>6} "
            f"{format_size(s['logical_bytes']):>10} {format_size(s['stored_bytes']):>10} "
            f"{f(s['stored_ratio'], '.3f'):>6}  {strag}"
        )
    for s in rep["steps"]:
        if s["faults"]:
            out.append(f"step {s['step']} faults: {'; '.join(s['faults'])}")
        if s["rank_errors"] and not s["killed_ranks"]:
            out.append(f"step {s['step']} rank errors: {'; '.join(s['rank_errors'][:3])}")
    for f in rep.get("faults", []):
        rec = "-" if f["recovered_s"] is None else f"{f['recovered_s']:.1f}s"
        down = "-" if f["down_s"] is None else f"{f['down_s']:.1f}s"
        what = "stopped" if f["what"] == "hang-meta" else "down"
        extra = ""
        if f.get("answered_s") is not None:
            extra = f", a client on it answered by another replica in {f['answered_s']:.1f}s"
        pub = f.get("publish") or {}
        if pub.get("publish_s") is not None and pub.get("baseline_publish_s") is not None:
            extra += (
                f", step published in {pub['publish_s']:.2f}s vs {pub['baseline_publish_s']:.2f}s"
                " without faults"
            )
        out.append(
            f"fault {f['what']} {f['target']} step {f['step']} at {f['at_s']:.1f}s: "
            f"{what} {down}, recovered in {rec}{extra}"
            f"{'  ' + f['error'] if f['error'] else ''}"
        )
    topo = rep.get("topology") or {}
    if topo:
        lat = rep.get("publish_latency", {})
        parts = []
        for k in ("without_faults", "with_faults"):
            g = lat.get(k) or {}
            if g.get("publish_p50_s") is not None:
                parts.append(
                    f"{k.replace('_', ' ')}: p50 {g['publish_p50_s']:.2f}s p99 "
                    f"{g['publish_p99_s']:.2f}s"
                )
        out.append(
            f"topology {topo.get('kind')}, {len(topo.get('meta_replicas', []))} service "
            f"replicas, failovers {rep.get('failovers', 0)}, reconnects "
            f"{rep.get('reconnects', 0)}, hangs {rep.get('hangs', 0)}; "
            f"publish latency {'; '.join(parts) or '-'}"
        )
    b = rep["baseline_disk"]
    out.append(
        f"baseline: plain write+fsync of {format_size(b['bytes'])} at {b['gbps']:.3f} GB/s; "
        f"best save / baseline = {rep['save_vs_disk']}"
    )
    if b.get("read_gbps"):
        out.append(
            f"baseline: plain cold read at {b['read_gbps']:.3f} GB/s; best load / baseline = "
            f"{rep.get('load_vs_disk')}; resume / baseline = {rep.get('resume_vs_disk')}"
        )
    cpu = [
        f"{k.replace('cpu_ms_per_rank_', '')} {rep[k]:.3f}"
        for k in ("cpu_ms_per_rank_save", "cpu_ms_per_rank_load")
        if rep.get(k) is not None
    ]
    if cpu:
        out.append(f"CPU per rank (client + service), ms: {', '.join(cpu)}")
    out.append(f"verdict: {rep['verdict']['verdict']}")
    out.extend(f"  {line}" for line in rep["verdict"]["lines"])
    return "\n".join(out)


def write_json(rep: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(rep, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def plot(rep: dict, out_dir: str) -> list[str]:
    """PNGs: save-latency CDF per step, throughput over time, stored bytes per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    c = rep["config"]
    title = f"{c['ranks']} ranks, {c['hosts']} hosts, {format_size(c['shard_size'])} shards"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in rep["steps"]:
        lat = sorted(x for x in s["save_latency_s"] if x is not None)
        if lat:
            ys = [(i + 1) / len(lat) for i in range(len(lat))]
            ax.plot(lat, ys, label=f"step {s['step']} ({s['state']})")
    ax.set_xlabel("per-rank save latency (s): start -> commit acknowledged")
    ax.set_ylabel("fraction of ranks")
    ax.set_title(f"Save latency CDF: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir, "save_latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    t0 = min((s["t_save"] for s in rep["steps"]), default=0)
    shard = c["shard_size"]
    for kind, key, base in (("save", "save_done_at", "t_save"), ("load", "load_done_at", "t_load")):
        times = sorted(
            s[base] - t0 + x for s in rep["steps"] for x in s[key] if x is not None and s[base]
        )
        if not times:
            continue
        width = max(0.05, (times[-1] - times[0]) / 80 if len(times) > 1 else 0.1)
        buckets: dict[int, int] = {}
        for t in times:
            buckets[int(t / width)] = buckets.get(int(t / width), 0) + shard
        xs = sorted(buckets)
        ax.bar(
            [x * width for x in xs],
            [buckets[x] / 1e9 / width for x in xs],
            width=width,
            alpha=0.6,
            label=kind,
            align="edge",
        )
    ax.set_xlabel("time since the first save started (s)")
    ax.set_ylabel("GB/s (ranks completing x shard size)")
    ax.set_title(f"Throughput over time: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out_dir, "throughput.png"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps = [s["step"] for s in rep["steps"]]
    ax.bar(
        [x - 0.2 for x in steps],
        [s["logical_bytes"] / 2**20 for s in rep["steps"]],
        0.4,
        label="logical",
    )
    ax.bar(
        [x + 0.2 for x in steps],
        [s["stored_bytes"] / 2**20 for s in rep["steps"]],
        0.4,
        label="stored (new, encoded)",
    )
    ax.set_xticks(steps)
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_title(f"Stored vs logical bytes per step (change rate {c['change_rate']})")
    ax.legend()
    paths.append(_save(fig, out_dir, "stored_bytes.png"))
    return paths


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
