"""The summary of a ``scripts/gpu-check.sh`` profile, and the README of a results folder.

    python -m bench.gpu_summary STAGE --profile NAME [--dry-run]   (gpu-check.sh runs this)
    python -m bench.gpu_summary --readme bench/results/<gpu>-<date>  (after copying both profiles in)

STAGE is the folder a profile filled: ``steps.tsv`` (step, status, rc, seconds, cap, command),
``env.json``, each step's ``<step>.json`` and, for the pytest steps, ``<step>.xml`` (JUnit). The
first form writes ``summary-<profile>.json`` and ``summary-<profile>.txt`` there, (re)writes
``README.md`` from every ``summary-*.json`` in the folder, and prints the folder's name,
``<gpu>-<date>``. The second only rewrites the README, so that the two profiles' folders of one
machine, copied into one, get one README.

The summary names every step the profile planned, with its status (``ok``, ``failed``,
``timeout``, ``skipped-budget``, ``planned`` in a dry run, ...), and every mode of
``bench.colocate`` as ``colocate/<mode>``. The README puts each figure beside its goal and its
baseline measured in the same run; nothing in it is typed by hand.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import sys
import time
import xml.etree.ElementTree as ET

PYTEST_STEPS = ("pytest-gpu", "mps", "nccl-park", "ray-gpu")
OK_STATUSES = ("ok", "planned", "unpacked", "not-asked", "not-carried")


def load(stage: str, name: str):
    try:
        with open(os.path.join(stage, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def junit(stage: str, name: str) -> dict | None:
    try:
        root = ET.parse(os.path.join(stage, name)).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    total["failed_tests"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
                             if c.find("failure") is not None or c.find("error") is not None]
    return total


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}×"


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f} ms"


# A figure: (what, value, goal, baseline in the same run, met: True / False / None = not judged)


def colocate_figures(r: dict) -> list[tuple]:
    out = []
    default = r.get("default_mode", "corun")
    modes = r.get("modes", {})
    ok = {m: e for m, e in modes.items() if e.get("status") == "ok"}
    judged = r.get("backend") == "cuda"
    for name, spec in r.get("loads", {}).items():
        alone = ok.get("alone", {}).get("loads", {}).get(name)
        prio = ok.get("mps-priority", {}).get("loads", {}).get(name)
        base = (f"alone p99 {_ms(alone and alone['p99_ms'])}"
                + (f"; mps-priority {_x(prio['p99_over_alone'])} · {_pct(prio['kept'])}" if prio else ""))
        title = f"{name} ({spec.get('model')} b{spec.get('batch')}, {spec.get('rate_per_s') or 0:.1f} req/s)"
        for mode, entry in ok.items():
            if mode == "alone":
                continue
            e = entry["loads"][name]
            value = (f"p99 {_ms(e['p99_ms'])} = {_x(e['p99_over_alone'])} alone, kept {_pct(e['kept'])}, "
                     f"dropped {e['dropped']}, queued at end {e['queued_at_end']} of {e['offered']}")
            goal, met = "-", None
            if mode == default:
                lost = e["dropped"] > 0
                if prio:
                    goal = "p99 ≤ mps-priority's, kept ≥ its − 2 points, none dropped"
                    met = (not lost and e["p99_ms"] <= prio["p99_ms"] and e["kept"] is not None
                           and prio["kept"] is not None and e["kept"] >= prio["kept"] - 0.02)
                if name == "heavy":
                    goal += "; ≤ 1.20× alone with ≥ 64% kept (beyond: 1.10×, 70%)"
                    met = bool(met is not False and not lost and e["p99_over_alone"] is not None
                               and e["p99_over_alone"] <= 1.20 and (e["kept"] or 0) >= 0.64)
                if not judged:
                    goal, met = "not judged on cpu", None
            out.append((f"{title}: {mode}", value, goal, base, met))
    for mode, e in modes.items():
        if e.get("status") != "ok":
            out.append((f"colocate {mode}", e.get("status"), "runs", "-", False if e.get("status") == "failed"
                        else None))
    return out


def llm_wake_figures(r: dict) -> list[tuple]:
    judged = r.get("backend") == "cuda"
    gib = (r.get("weight_bytes") or 0) / 2**30
    mps = r.get("mps")
    return [
        ("first token after a wake", f"{_ms(r.get('wake_ttft_ms'))} ({r.get('speedup')}× faster)",
         "≥ 20× faster than a cold start", f"cold start {_ms(r.get('cold_ttft_ms'))}; warm {_ms(r.get('warm_ttft_ms'))}",
         (r.get("speedup") or 0) >= 20 if judged else None),
        ("the wake", f"{_ms(r.get('wake_ms'))} for {gib:.2f} GiB of weights + KV "
         f"{(r.get('kv_cache_bytes') or 0) / 2**30:.2f} GiB", "< 100 ms for 1 GiB",
         f"park {_ms(r.get('park_ms'))}", (r.get("wake_ms") or 1e9) < 100 and gib >= 0.95 if judged else None),
        ("outputs identical, addresses kept", f"{r.get('outputs_identical')}, {r.get('addresses_kept')}",
         "both true", "the generation before the first sleep",
         bool(r.get("outputs_identical") and r.get("addresses_kept"))),
        ("MPS as asked", f"--mps {r.get('mps_asked')}: " + ("; ".join(mps["problems"]) or "as asked"
                                                           if mps else "no evidence (cpu)"),
         "the server ran under MPS exactly when asked", "-", (not mps["problems"]) if mps else None),
    ]


def mps_fault_figures(r: dict) -> list[tuple]:
    if r.get("skipped"):
        return [("MPS fault isolation", f"not run: {r['skipped']}", "runs", "-", False)]
    fault, kill = r.get("fault", {}), r.get("kill", {})
    return [
        ("fault → a new service's first good request", _ms(fault.get("fault_to_next_good_ms")),
         "measured; the healthy service told by the daemon (E_DEVICE)",
         f"its requests before: p50 {_ms(fault.get('service_p50_ms_before'))}",
         fault.get("fault_to_next_good_ms") is not None and bool(fault.get("service_first_error_from_daemon"))),
        ("what the healthy service was told", str(fault.get("service_error"))[:160], "the daemon's notice", "-",
         bool(fault.get("service_first_error_from_daemon"))),
        ("a client SIGKILLed mid-kernel beside the service",
         f"service error {kill.get('service_error')}; p99 {_ms(kill.get('service_p99_ms_before'))} → "
         f"{_ms(kill.get('service_p99_ms_after'))}", "the service keeps serving",
         f"p99 before {_ms(kill.get('service_p99_ms_before'))}",
         kill.get("service_error") is None and (kill.get("service_requests_after") or 0) > 0),
        ("MPS evidence (servers, clients, priorities, limits)", f"verified {r.get('mps_verified')}",
         "every process under MPS as set", "-", r.get("mps_verified")),
    ]


def park_figures(r: dict) -> list[tuple]:
    out = []
    for size, s in r.get("sizes", {}).items():
        k = s.get("keep_addresses") or {}
        if "skipped" in k or not k:
            out.append((f"{size} MiB park keeping addresses", f"not here: {k.get('skipped')}", "runs", "-", False))
            continue
        judged = k.get("park_of_memcpy") is not None
        out.append((f"{size} MiB park / unpark keeping addresses",
                    f"{k['suspend_gb_per_s']} / {k['resume_gb_per_s']} GB/s = {_pct(k.get('park_of_memcpy'))} / "
                    f"{_pct(k.get('unpark_of_memcpy'))} of a pinned cudaMemcpy; addresses kept {k['addresses_kept']}",
                    "≥ 90% of the memcpy each way, addresses kept",
                    f"pinned cudaMemcpy {_ms(k.get('memcpy_d2h_ms'))} d2h, {_ms(k.get('memcpy_h2d_ms'))} h2d",
                    (k["park_of_memcpy"] >= 0.9 and k["unpark_of_memcpy"] >= 0.9 and k["addresses_kept"])
                    if judged else None))
    return out


def other_figures(name: str, r: dict) -> list[tuple]:
    if name == "suspend":
        return [(f"{k} MiB suspend vs restart", f"{v['speedup']}× (verified {v['verified']})",
                 f"≥ {r.get('goal_speedup', 100)}×", "a restart of the same state, same run",
                 v["speedup"] >= r.get("goal_speedup", 100)) for k, v in r.get("sizes", {}).items()]
    if name == "reclaim":
        return [("reclaim, cooperative / enforced", f"{_ms(r.get('reclaim_cooperative_ms'))} / "
                 f"{_ms(r.get('reclaim_enforced_ms'))}", f"enforced within its deadline ({r.get('deadline_ms')} ms)",
                 f"park {_ms(r.get('park_ms'))}", None)]
    if name == "switch":
        return [(f"switch {model}", f"ready {_ms(m.get('ready_ms'))}, pipelined {_ms(m.get('pipelined_ms'))}",
                 "-", f"pinned+sync {_ms(m.get('pinned_sync_ms'))}; cold {_ms(m.get('cold_ms'))}", None)
                for model, m in r.get("models", {}).items()]
    return []


def figures(name: str, r: dict | None, j: dict | None) -> list[tuple]:
    if name in PYTEST_STEPS:
        out = [] if not j else [
            (f"pytest ({name})", f"{j['passed']} passed, {j['failures'] + j['errors']} failed, {j['skipped']} "
             f"skipped" + (f": {', '.join(j['failed_tests'][:5])}" if j["failed_tests"] else ""),
             "all pass", "-", j["failures"] + j["errors"] == 0 and j["passed"] > 0)]
        if name == "mps" and r:  # tests/daemon/test_mps.py's 30/70 split, written beside the JUnit report
            out.append(("MPS 70% / 30% SM shares: throughput ratio", f"{r['throughput_ratio']:.2f}",
                        f"near the ideal {r['expected_ratio']:.2f}", "the same work at each share, same run", None))
        return out
    if not r:
        return []
    if name == "colocate":
        return colocate_figures(r)
    if name.startswith("llm-wake"):
        return llm_wake_figures(r)
    if name == "mps-fault":
        return mps_fault_figures(r)
    if name == "park-keep-addresses":
        return park_figures(r)
    return other_figures(name, r)


def last_words(stage: str, step: str) -> str:
    """Where a step failed: the last line of its log."""
    try:
        with open(os.path.join(stage, f"{step}.log"), errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def tag_of(env: dict) -> tuple[str | None, str]:
    torch_env = env.get("torch") if isinstance(env.get("torch"), dict) else {}
    gpu = torch_env.get("device") if torch_env.get("available") else None
    slug = re.sub(r"[^a-z0-9]+", "-", (gpu or "nogpu").lower()).strip("-")
    return gpu, f"{re.sub(r'^nvidia-', '', slug)}-{time.strftime('%Y-%m-%d', time.gmtime())}"


def summarize(stage: str, profile: str, dry: bool) -> dict:
    env = load(stage, "env.json") or {}
    gpu, tag = tag_of(env)
    with open(os.path.join(stage, "steps.tsv")) as f:
        steps = list(csv.DictReader(f, delimiter="\t"))
    rows, results, pytest_counts, figs = [], {}, {}, {}
    for s in steps:
        name = s["step"]
        r, j = load(stage, "mps_30_70.json" if name == "mps" else f"{name}.json"), junit(stage, f"{name}.xml")
        try:
            found = figures(name, r, j)
        except (KeyError, TypeError, ValueError) as exc:  # a result without the keys expected
            found = [(name, f"(unreadable result: {type(exc).__name__}: {exc})", "-", "-", False)]
        if r is not None:
            results[name] = r
        if j is not None:
            pytest_counts[name] = j
        figs[name] = [dict(zip(("what", "value", "goal", "baseline", "met"), f)) for f in found]
        text = "; ".join(f"{f[0]}: {f[1]}" for f in found)
        if s["status"] in ("failed", "timeout"):
            text = f"{text}; {last_words(stage, name)}" if text else last_words(stage, name)
        rows.append({"step": name, "status": s["status"], "rc": s["rc"], "seconds": int(s["seconds"] or 0),
                     "cap_s": int(s.get("cap") or 0), "result": text, "command": s["command"]})
        if name == "colocate" and r:  # every mode, by name
            for mode, e in r.get("modes", {}).items():
                rows.append({"step": f"colocate/{mode}", "status": e.get("status"), "rc": "-",
                             "seconds": int(e.get("seconds") or 0), "cap_s": 0,
                             "result": e.get("error") or e.get("reason") or e.get("setup") or "", "command": ""})
    summary = {"tag": tag, "profile": profile, "dry_run": dry, "device": gpu, "tree": env.get("tree"),
               "environment": env, "steps": rows, "figures": figs, "results": results, "pytest": pytest_counts,
               "ok": all(r["status"] in OK_STATUSES for r in rows)}
    return summary


def table(summary: dict) -> str:
    lines = [f"gpu-check {summary['tag']} profile {summary['profile']}"
             + (" (dry run: nothing ran on a GPU)" if summary["dry_run"] else ""),
             f"{'step':<26} {'status':<14} {'secs':>5} {'cap':>5}  result"]
    lines += [f"{r['step']:<26} {r['status'] or '-':<14} {r['seconds']:>5} {r['cap_s'] or '-':>5}  {r['result'][:300]}"
              for r in summary["steps"]]
    return "\n".join(lines) + "\n"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def readme(folder: str) -> str:
    """README.md of a results folder, from every summary-*.json in it."""
    summaries = []
    for path in sorted(glob.glob(os.path.join(folder, "summary-*.json"))):
        try:
            with open(path) as f:
                summaries.append(json.load(f))
        except (OSError, ValueError):
            continue
    order = {"colocate": 0, "rest": 1}
    summaries.sort(key=lambda s: order.get(s.get("profile"), 9))
    first = summaries[0] if summaries else {}
    env = first.get("environment") or {}
    nvml = env.get("nvml") if isinstance(env.get("nvml"), dict) else {}
    torch_env = env.get("torch") if isinstance(env.get("torch"), dict) else {}
    out = [f"# {first.get('device') or 'no GPU'}: scripts/gpu-check.sh", "",
           "Generated by `python -m bench.gpu_summary --readme` from the `summary-*.json` beside it; "
           "every baseline was measured in the same device call as its figure.", "",
           f"Driver {nvml.get('driver', '?')}, torch {torch_env.get('version', '?')} (CUDA {torch_env.get('cuda', '?')}), "
           f"Python {env.get('python', '?')}.", ""]
    for s in summaries:
        out += [f"## Profile `{s['profile']}` ({s['tag']}, tree {s.get('tree') or 'unknown'})"
                + (" - dry run, nothing measured" if s.get("dry_run") else ""), "",
                "| figure | value | goal | in-run baseline | met |", "| --- | --- | --- | --- | --- |"]
        for step, found in s.get("figures", {}).items():
            for f in found:
                met = {True: "yes", False: "**no**", None: "-"}[f["met"]]
                out.append(f"| {_cell(f['what'])} | {_cell(f['value'])} | {_cell(f['goal'])} | "
                           f"{_cell(f['baseline'])} | {met} |")
        out += ["", "| step | status | seconds | cap s |", "| --- | --- | --- | --- |"]
        out += [f"| {r['step']} | {r['status']} | {r['seconds']} | {r['cap_s'] or '-'} |" for r in s["steps"]]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_summary", description=__doc__.split("\n\n")[0],
                                 allow_abbrev=False)
    ap.add_argument("stage", nargs="?", help="the folder a gpu-check profile filled")
    ap.add_argument("--profile", help="the profile that ran")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--readme", metavar="FOLDER", help="only rewrite FOLDER/README.md from its summary-*.json")
    args = ap.parse_args(argv)
    if args.readme:
        with open(os.path.join(args.readme, "README.md"), "w") as f:
            f.write(readme(args.readme))
        return 0
    if not args.stage or not args.profile:
        ap.error("give STAGE and --profile, or --readme FOLDER")
    summary = summarize(args.stage, args.profile, args.dry_run)
    with open(os.path.join(args.stage, f"summary-{args.profile}.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.stage, f"summary-{args.profile}.txt"), "w") as f:
        f.write(table(summary))
    with open(os.path.join(args.stage, "README.md"), "w") as f:
        f.write(readme(args.stage))
    print(summary["tag"])
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
