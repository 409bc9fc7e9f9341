"""Medians over the interleaved pairs in DIR (handoff-{before,after}-N.json): python summarise.py DIR."""
import glob, json, statistics, sys, os
d = sys.argv[1]
rows = {"before": {}, "after": {}}
for f in sorted(glob.glob(os.path.join(d, "*.json"))):
    name = os.path.basename(f)[:-5]
    if not name.startswith("handoff-"):
        continue
    _, label, idx = name.split("-")
    try:
        r = json.load(open(f))
    except Exception:
        continue
    rows[label][int(idx)] = r
out = {}
for n in ("2", "64"):
    per = {}
    for label in rows:
        vals = {k: [rows[label][i]["by_sessions"][n][k] for i in sorted(rows[label])]
                for k in ("handoff_p50_us", "handoff_p99_us", "ratio_pipe_p50", "pipe_rtt_p50_us",
                          "relay_p50_us", "release_call_p50_us", "daemon_internal_mean_us")}
        per[label] = {k: {"median": round(statistics.median(v), 1), "runs": v} for k, v in vals.items()}
    pairs = sorted(set(rows["before"]) & set(rows["after"]))
    ratios = [rows["after"][i]["by_sessions"][n]["handoff_p50_us"] / rows["before"][i]["by_sessions"][n]["handoff_p50_us"]
              for i in pairs]
    pratios = [rows["after"][i]["by_sessions"][n]["ratio_pipe_p50"] / rows["before"][i]["by_sessions"][n]["ratio_pipe_p50"]
               for i in pairs]
    per["after_over_before_p50_per_pair"] = [round(x, 3) for x in ratios]
    per["after_over_before_p50_median"] = round(statistics.median(ratios), 3)
    per["after_over_before_ratio_pipe_p50_median"] = round(statistics.median(pratios), 3)
    out[n] = per
print(json.dumps(out, indent=1))
