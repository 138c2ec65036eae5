"""Combine the step results of ``benchmarks/gpu.sh`` into one results file and a summary
with the ratios issue 21 (item 2) asks a GPU run for, each against its target.

    python benchmarks/gpu_report.py WORK OUT_DIR [NOTE ...]

``WORK`` holds one ``<step>.json`` per step that wrote one and ``steps.tsv`` (name,
status, exit code, seconds, note; one line a step, tab-separated), as ``gpu.sh`` writes
them. Writes ``OUT_DIR/results.json`` (``{"steps": {name: that step's JSON}}``) and
``OUT_DIR/summary.json`` (the steps, the ratios, what could not be measured, the notes
given on the command line) and prints the ratios. Standard library only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GAE_BIG = (2048, 65536)


def _get(tree, *path):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


class Ratios:
    def __init__(self):
        self.rows, self.absent = [], []

    def add(self, what, value, target, kind, source, note=None):
        """``kind``: "max" (value at most target), "min" (at least), "below" (under)."""
        if value is None:
            self.absent.append(f"{what}: not measured ({source} has no such figure)")
            return
        met = {"max": lambda: value <= target, "min": lambda: value >= target,
               "below": lambda: value < target, "info": lambda: None}[kind]()
        row = {"what": what, "value": round(value, 4), "target": target, "kind": kind,
               "met": met, "source": source}
        if note:
            row["note"] = note
        self.rows.append(row)


def collect_ratios(r: Ratios, collect: dict | None, ran: dict) -> None:
    if collect is None:
        r.absent.append(f"collect: {ran.get('collect', 'no results')}")
        return
    for case, rep in collect.get("cases", {}).items():
        st = rep["step"]
        size = f"{case} B={st['B']} T={st['T']}, {st['bytes'] / 2**20:.0f} MiB"
        share = rep.get("facade_share_of_h2d_copy")
        if share:
            note = None if share["copy"] == "pinned_h2d_copy" else (
                "the device has no pinned_host memory: against a pageable copy")
            for name in ("jaxtraj_add", "jaxtraj_add_many"):
                r.add(f"host parts through the facade ({name}) as a share of one "
                      f"{share['copy']} of the same bytes, {size}", share[name], 0.8, "min",
                      f"collect.cases.{case}", note)
        else:
            r.absent.append(f"host facade vs pinned host-to-device copy ({case}): collect.py "
                            "ran without --h2d")
        res = rep["results"]
        for name in ("jaxtraj_jit", "jaxtraj_jit_stacked"):
            if name in res:
                r.add(f"device parts through the jitted inserts ({name}, recycling flush and "
                      f"one ready() sync included) vs a plain donated insert, {size}",
                      res[name]["x_floor"], 1.2, "max", f"collect.cases.{case}.results")
        st = rep.get("storage_auto")
        if st:
            for parts, alt in (("numpy_parts_ms", "device"), ("device_parts_ms", "host")):
                ms = st[parts]
                r.add(f"storage='auto' with {parts.split('_')[0]} parts on {st['backend']}: its "
                      f"time / storage='{alt}' ({ms['auto']:.2f} vs {ms[alt]:.2f} ms), {size}",
                      ms["auto"] / ms[alt], 1.05, "max", f"collect.cases.{case}.storage_auto",
                      "at most 1.05: auto chose the faster storage (or within 5%)")


def pipeline_ratios(r: Ratios, p: dict | None, ran: dict) -> None:
    if p is None:
        r.absent.append(f"pipeline: {ran.get('pipeline', 'no results')}")
        return
    e = p["epoch"]
    size = f"S={e['S']} T={e['T']} B={e['B']}, {e['out_bytes'] / 2**20:.0f} MiB packed"
    r.add(f"pipeline flush into fresh buffers vs a device copy of the packed bytes, {size}",
          p["x_jax_copy"], 2.0, "max", "pipeline")
    r.add(f"pipeline flush recycling the previous batches vs a device copy of the packed "
          f"bytes, {size}", p["recycled_flush_ms"] / p["jax_copy_ms"], 2.0, "max", "pipeline")
    r.add(f"pipeline recycle path: recycled / fresh flush, {size}",
          p["recycled_flush_ms"] / p["flush_ms"], 1.0, "max", "pipeline",
          "at most 1: recycling is no slower than fresh buffers")


def gae_ratios(r: Ratios, g: dict | None, ran: dict) -> None:
    if g is None:
        r.absent.append(f"gae_large: {ran.get('gae_large', 'no results')}")
        return
    rows = [x for x in g["results"] if x.get("status") == "ok"]
    sizes = sorted({(x["T"], x["B"]) for x in rows}, key=lambda s: s[0] * s[1])
    if not sizes:
        r.absent.append("GAE: no implementation ran")
        return
    T, B = GAE_BIG if GAE_BIG in sizes else sizes[-1]
    at = {x["peer"]: x for x in rows if (x["T"], x["B"]) == (T, B)}
    auto = at.get("jaxtraj auto")
    if auto is None:
        r.absent.append(f"GAE [{T}, {B}]: no 'jaxtraj auto' row")
        return
    backend = _get(g, "machine", "jax_backend")
    for peer in ("lax.scan (Brax)", "lax.scan (PureJaxRL)", "jaxtraj associative"):
        if peer not in at:
            r.absent.append(f"GAE [{T}, {B}] against {peer}: not in the results")
            continue
        note = None
        if peer == "jaxtraj associative":
            note = ("gae.py's associative scan is jaxtraj's own 'associative' method, which "
                    "'auto' resolves to off the CPU: about 1.0 by construction there; no "
                    "independent associative-scan peer exists in gae.py")
        for mode, key in (("warm", "run_ms"), ("cold", "cold_ms")):
            if key in auto and key in at[peer]:
                r.add(f"GAE [{T}, {B}] jaxtraj auto / {peer}, {mode} ({backend})",
                      auto[key] / at[peer][key], 1.0, "below", "gae_large", note)


def rollout_ratios(r: Ratios, ro: dict | None, ran: dict) -> None:
    res = _get(ro, "result")
    if res is None:
        r.absent.append(f"sync runner: {ran.get('rollout', 'no results')}")
        return
    env = res.get("env", "gymnax Pendulum-v1")
    r.add(f"sync runner vs its plain lax.scan (rollout_stacked), B={res['B']} T={res['T']} "
          f"K={res['K']}, env {env}", res["ratio"], 1.1, "max", "rollout.result")
    r.absent.append("recycle path of the rollout-mode flush: rollout.py times one flush "
                    "(rollout_flush_ms) without a recycled/fresh comparison")


def jit_insert_ratios(r: Ratios, j: dict | None, ran: dict) -> None:
    if j is None:
        r.absent.append(f"jit_insert: {ran.get('jit_insert', 'no results')}")
        return
    sh = j.get("shapes", {})
    size = f"B={sh.get('B')} T={sh.get('T')}, {sh.get('step_bytes', 0) / 2**20:.0f} MiB"
    targets = {  # issue 21: item 0's targets, and item 2's bound for a plain insert
        "scan_jaxtraj_over_flashbax": (1.05, "max"),
        "calls_jaxtraj_over_flashbax": (1.5, "max"),
        "scan_jaxtraj_over_dus": (1.2, "max"),
    }
    ratios = j.get("ratios", {})
    for key, value in ratios.items():
        target, kind = targets.get(key, (None, "info"))
        r.add(f"jit_insert {key}, {size}", value, target, kind, "jit_insert.ratios")
    if not any("flashbax" in k for k in ratios):
        r.absent.append("jit_insert against flashbax's add (item 0): flashbax missing, its "
                        "ratios left out")


def main() -> int:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    notes = sys.argv[3:]
    steps, ran = [], {}
    tsv = work / "steps.tsv"
    for line in (tsv.read_text().splitlines() if tsv.is_file() else []):
        name, status, rc, secs, note = (line.split("\t") + [""] * 5)[:5]
        steps.append({"name": name, "status": status, "rc": int(rc), "seconds": int(secs),
                      **({"note": note} if note else {})})
        ran[name] = f"{status}{': ' + note if note else ''}"
    results = {}
    for f in sorted(work.glob("*.json")):
        try:
            results[f.stem] = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            results[f.stem] = {"error": f"unreadable: {e}"}
    r = Ratios()
    collect_ratios(r, results.get("collect"), ran)
    pipeline_ratios(r, results.get("pipeline"), ran)
    gae_ratios(r, results.get("gae_large"), ran)
    rollout_ratios(r, results.get("rollout"), ran)
    if "jit_insert" in ran:
        jit_insert_ratios(r, results.get("jit_insert"), ran)
    machine = _get(results, "collect", "machine") or {}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"steps": results}, indent=1) + "\n")
    summary = {
        "devices": machine.get("devices"),
        "backend": machine.get("backend"),
        "jax": machine.get("jax"),
        "steps": steps,
        "ratios": r.rows,
        "not_measured": r.absent,
        "notes": notes,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("ratios (issue 21, item 2), each against its target:")
    for row in r.rows:
        sign = {"max": "<=", "min": ">=", "below": "<", "info": ""}[row["kind"]]
        verdict = {True: "met", False: "MISSED", None: "info"}[row["met"]]
        target = f"(target {sign} {row['target']})" if row["kind"] != "info" else "(no target)"
        print(f"  {verdict:<6} {row['value']:8.3f} {target:<16}  {row['what']}")
        if row.get("note"):
            print(f"         note: {row['note']}")
    for line in r.absent:
        print(f"  not measured: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
