"""Benchmark pages from the results: ``benchmarks/results/*.json`` -> ``docs/benchmarks/``.

The committed results files are read (``git ls-files``): commit a new results file, then
run this.

One Markdown page per results file (its tables, the machine and the date of the run) and
PNG plots for the larger runs, plus an index. Nothing is narrated: every figure on a page
is a number from the JSON, so it can be traced to the run that wrote it. The date is the
JSON's own ``date`` where the benchmark records one, else the date of the commit that last
changed the file (``git log``), else the file's modification time.

    python benchmarks/report.py            # rewrite docs/benchmarks/
    python benchmarks/report.py --check    # exit 1 if a page is out of date (CI)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "benchmarks"


# -- formatting ---------------------------------------------------------------------------


def fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        a = abs(v)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.3g}" if a < 10 else f"{v:.2f}".rstrip("0").rstrip(".")
        return f"{v:.3g}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    return str(v)


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def flat(d, prefix="") -> list[tuple[str, object]]:
    """Scalar leaves of a dict, with dotted paths (lists of scalars kept whole)."""
    out = []
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out += flat(v, path + ".")
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for i, x in enumerate(v):
                out += flat(x, f"{path}[{i}].")
        else:
            out.append((path, v))
    return out


def find_machine(d):
    if isinstance(d, dict):
        if isinstance(d.get("machine"), dict):
            return d["machine"]
        for v in d.values():
            m = find_machine(v)
            if m:
                return m
    if isinstance(d, list):
        for v in d:
            m = find_machine(v)
            if m:
                return m
    return None


def machine_line(m: dict | None) -> str:
    if not m:
        return "not recorded in the results file"
    cpu = m.get("cpu_model") or m.get("cpu") or m.get("processor") or "?"
    versions = m.get("versions", {})
    jax = m.get("jax") or versions.get("jax")
    backend = m.get("backend") or m.get("jax_backend")
    parts = [f"{cpu}, {m.get('cpu_count', '?')} cores", m.get("platform", "")]
    parts.append(f"Python {m.get('python', '?')}")
    if jax:
        parts.append(f"jax {jax}" + (f" ({backend})" if backend else ""))
    for lib in ("numpy", "pyarrow", "av"):
        v = m.get(lib) or versions.get(lib)
        if v:
            parts.append(f"{lib} {v}")
    return ", ".join(p for p in parts if p)


def run_date(path: Path, d: dict) -> str:
    for v in (d.get("date"), (d.get("machine") or {}).get("date")):
        if isinstance(v, str):
            return v[:10]
    try:
        git = subprocess.run(
            ["git", "log", "-1", "--format=%cs", "--", str(path.relative_to(ROOT))],
            cwd=ROOT, capture_output=True, text=True, timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        git = ""
    if git:
        return git + " (commit date)"
    mtime = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC)
    return mtime.date().isoformat() + " (file date)"


# -- per-benchmark tables and plots ------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=90, metadata={"Software": None})
    _plt().close(fig)
    return f"![{name}]({name})\n"


def page_gae(d: dict, out: Path) -> str:
    res = [r for r in d["results"] if r.get("status") == "ok"]
    peers = list(dict.fromkeys(r["peer"] for r in res))
    sizes = sorted({(r["T"], r["B"]) for r in res}, key=lambda s: s[0] * s[1])
    ms = {(r["peer"], r["T"], r["B"]): r["run_ms"] for r in res}
    text = f"Median run time, ms (warm; statistic: {d['settings'].get('statistic')}).\n\n"
    text += table(["[T, B]", *peers],
                  [[f"[{t}, {b}]", *[ms.get((p, t, b), "-") for p in peers]] for t, b in sizes])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [t * b for t, b in sizes]
    for p in peers:
        ys = [ms.get((p, t, b)) for t, b in sizes]
        ax.plot([a for a, y in zip(x, ys) if y], [y for y in ys if y], marker="o", label=p)
    ax.set(xscale="log", yscale="log", xlabel="T x B", ylabel="ms (median)", title="GAE")
    ax.legend(fontsize=7, ncol=2)
    return text + "\n" + _save(fig, out, "gae.png")


def page_collect(d: dict, out: Path) -> str:
    text = ""
    cases = d["cases"]
    names = list(dict.fromkeys(n for c in cases.values() for n in c["results"]))
    rows = [[n, *[cases[c]["results"].get(n, {}).get("ms", "-") for c in cases],
             *[cases[c]["results"].get(n, {}).get("x_memcpy", "-") for c in cases]] for n in names]
    text += "One training step collected and flushed, ms and x memcpy of the same bytes.\n\n"
    text += table(["contender", *[f"{c} ms" for c in cases], *[f"{c} x memcpy" for c in cases]],
                  rows)
    text += "\nSteps:\n\n" + table(
        ["case", *cases["bench"]["step"].keys()],
        [[c, *[v["step"].get(k) for k in cases["bench"]["step"]]] for c, v in cases.items()])
    rest = {k: v for k, v in d.items() if k not in ("cases", "machine", "benchmark")}
    text += "\nOther figures:\n\n" + table(["figure", "value"], [list(r) for r in flat(rest)])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(cases)
    for i, c in enumerate(cases):
        ys = [cases[c]["results"].get(n, {}).get("x_memcpy", 0) for n in names]
        ax.barh([j + i * width for j in range(len(names))], ys, height=width, label=c)
    ax.set_yticks([j + width / 2 for j in range(len(names))], names, fontsize=8)
    ax.set(xlabel="x memcpy (lower is faster)", title="collect one training step")
    ax.legend()
    return text + "\n" + _save(fig, out, "collect.png")


def _cpu(c: dict) -> str:
    """A host_env configuration's CPU per training step (older results have none)."""
    if "cpu_ms_per_training_step_median" not in c:
        return "-"
    own = f"{c['cpu_ms_per_training_step_median']:.0f}"
    kids = c.get("env_process_cpu_ms_per_training_step_median")
    return own if kids is None else f"{own}; {kids:.0f}"


def page_host_env(d: dict, out: Path) -> str:
    text = table(["setting", "value"], [list(r) for r in flat(
        {k: d[k] for k in ("sizes", "rounds", "training_steps_per_repetition",
                           "load_average_1min", "cpu_steal_share") if k in d})])
    plt = _plt()
    tasks = d["results"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4 * len(tasks), 4), sharey=True)
    for ax, (name, task) in zip(axes if len(tasks) > 1 else [axes], tasks.items()):
        cfg = task["configs"]
        text += (f"\n### {name}: {task['task']} ({task['library']}), B = {task['B']}, "
                 f"camera {task['camera']}\n\n")
        text += table(
            ["config", "what", "env steps/s (median)", "ratio to (a) (median)",
             "collector share (median)", "CPU ms / training step: this process; env processes"],
            [[k, c["label"], c["steps_per_s_median"], c.get("ratio_to_a_median", "-"),
              c.get("collector_share_median", "-"), _cpu(c)] for k, c in cfg.items()])
        keys = [k for k in cfg if not k.endswith("_null")]  # instant envs: another scale
        ax.bar(keys, [cfg[k].get("ratio_to_a_median", 0) for k in keys])
        ax.set_title(f"{name} (without the instant-env configs)", fontsize=8)
        ax.tick_params(axis="x", labelrotation=60, labelsize=7)
    (axes[0] if len(tasks) > 1 else axes).set_ylabel("ratio to (a), median")
    if d.get("targets"):
        text += "\n### Targets (issue 26)\n\n" + table(
            ["env", "config", "against", "target", "measured (median of per-round ratios)",
             "status", "CPU allows", "threads allow"],
            [[t["env"], t["config"], t["reference"], f">= {t['target']}x",
              "-" if t["ratio"] is None else f"{t['ratio']:.3f}x", t["status"],
              "-" if t.get("cpu_ceiling") is None else f"{t['cpu_ceiling']:.2f}x",
              "-" if t.get("threads_allow") is None else f"{t['threads_allow']:.2f}x"]
             for t in d["targets"]])
        if any(t.get("cpu_ceiling") is not None for t in d["targets"]):
            text += ("\nCPU allows: the ratio at which the configuration would run at the "
                     "CPU it used per training step (this process's threads and its env "
                     "processes, medians), spread over every core with every core busy "
                     "every moment: no schedule goes above it without spending less CPU. "
                     "Not for Ray's configurations, whose actors' CPU is not counted.\n")
        if any(t.get("threads_allow") is not None for t in d["targets"]):
            text += ("\nThreads allow (a runner of 2 thread ranks): (a2) against the same "
                     "reference, the median of its per-round ratios: the hand loop twice "
                     "over B/2, in two threads at once, each with its own policy calls, "
                     "nothing collected, in the same rounds: about the most 2 thread ranks of "
                     "this env could do here, the GIL included, with no hand-off and nothing "
                     "collected (not a strict bound: its loops call the policy on B/2 rows "
                     "each).\n")
    if d.get("env_scaling"):
        text += ("\n### What two env processes gain here\n\nEach env's raw vector env (no "
                 "adapter, no policy), a training step's vector steps in fresh processes: "
                 "one of B, one of B/2 alone, two of B/2 at once (the slower sets the pace). "
                 "Near or below 1x, parallel env processes step no faster on this machine "
                 "than one process of both, and a runner can only gain what inference "
                 "takes.\n\n") + table(
            ["env", "B alone (ms)", "B/2 alone (ms)", "two B/2 at once (ms)",
             "two at once against B alone", "two B/2, one EnvPool thread each",
             "four B/4 at once", "two groups of B/2 over one asynchronous EnvPool pool of B"],
            [[name, sc["alone_B"]["ms_per_training_step"],
              sc["alone_half"]["ms_per_training_step"],
              sc["two_halves_at_once"]["ms_per_training_step"],
              f"{sc['speedup_2_processes']:.2f}x", _ceiling(sc, "two_halves_at_once_one_thread_each",
                                                           "speedup_2_processes_one_thread"),
              _ceiling(sc, "four_quarters_at_once", "speedup_4_processes"),
              _ceiling(sc, "async_two_groups", "speedup_async_two_groups")]
             for name, sc in d["env_scaling"].items()])
        text += ("\nThe one-thread and four-process columns (where measured): ms per training "
                 "step, and B alone over it: the most a runner of those ranks could gain over "
                 "(a)'s env stepping, with inference and collection free. The last (EnvPool): "
                 "EnvPool's own asynchronous API stepping two groups of B/2 over one pool of "
                 "B, each group's next step sent as soon as its last is back, the policy on "
                 "a group's rows in the same thread while the pool steps the other, nothing "
                 "collected: the leanest overlap two ranks could have; ms per training step, "
                 "and the hand loop's (the same policy, a pool of B stepped synchronously, "
                 "timed alternately in the same process) over it.\n")
    return text + "\n" + _save(fig, out, "host_env.png")


def _ceiling(sc: dict, row: str, ratio: str) -> str:
    if row not in sc:
        return "-"
    return f"{sc[row]['ms_per_training_step']:.1f} ms ({sc[ratio]:.2f}x)"


def page_rollout_ray(d: dict, out: Path) -> str:
    text = ""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    for config, v in d.items():
        runs = v["runs"]
        text += f"\n### Ray config: {config} (Ray {v.get('ray')}, {v.get('env_ranks')} env ranks)\n\n"
        text += table(["run", "halves/s", "MB/s", "bytes per chunk", "peak RSS MiB"],
                      [[k, r["halves_per_s"], r["MB_per_s"], r["bytes_per_chunk"],
                        r.get("peak_rss_mib_during", "-")] for k, r in runs.items()])
        ratios = {k: x for k, x in v.items() if "_over_" in k}
        if ratios:
            text += "\n" + table(["ratio", "value"], [[k, x] for k, x in ratios.items()])
        if config == "default":
            ax.barh(list(runs), [r["halves_per_s"] for r in runs.values()])
            ax.set(xscale="log", xlabel="halves/s", title=f"Ray runner ({config})")
            ax.tick_params(axis="y", labelsize=8)
    return text + "\n" + _save(fig, out, "rollout_ray.png")


def page_lerobot(d: dict, out: Path) -> str:
    text = table(
        ["episodes per call", "frames per call", "MB", "add_episodes ms", "write_table ms",
         "ratio to write_table", "ratio to write_table (defaults)"],
        [[r["episodes_per_call"], r["frames_per_call"], r["uncompressed_mb"],
          r["ms"]["add_episodes"], r["ms"]["write_table"], r["ratio_to_write_table"],
          r["ratio_to_write_table_defaults"]] for r in d["results"]])
    video = d.get("video", {})
    text += "\nVideo:\n\n" + table(["figure", "value"], [list(r) for r in flat(video)])
    return text


def page_generic(d: dict, out: Path) -> str:
    rest = {k: v for k, v in d.items() if k not in ("machine", "benchmark")}
    return table(["figure", "value"], [list(r) for r in flat(rest) if not r[0].endswith("machine")
                                       and ".machine." not in r[0]])


PAGES = {"gae": page_gae, "collect": page_collect, "host_env": page_host_env,
         "rollout_ray": page_rollout_ray, "lerobot": page_lerobot}
SCRIPTS = {"rollout_async_memory": "rollout_async.py"}


def results_files() -> list[Path]:
    """The committed results files (git's view, so a run in progress or an uncommitted
    file does not change the pages); every ``*.json`` outside a git checkout."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--", "benchmarks/results/*.json"],
            cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
        ).stdout.split()
        paths = [ROOT / p for p in listed]
    except (OSError, subprocess.SubprocessError):
        paths = list(RESULTS.glob("*.json"))
    return sorted(p for p in paths if p.exists() and not p.stem.endswith("_quick"))


def build(out: Path) -> dict[str, str]:
    """Write the pages and plots to ``out``; return ``{file name: markdown}``."""
    out.mkdir(parents=True, exist_ok=True)
    pages, index = {}, []
    for path in results_files():
        d = json.loads(path.read_text())
        name = path.stem
        machine, date = machine_line(find_machine(d)), run_date(path, d)
        script = SCRIPTS.get(name, f"{name}.py")
        body = PAGES.get(name, page_generic)(d, out)
        pages[f"{name}.md"] = (
            f"# {name}\n\n"
            f"- results: `benchmarks/results/{path.name}`, written by "
            f"`python benchmarks/{script}`\n- machine: {machine}\n- date: {date}\n\n"
            f"{body}"
        )
        index.append([f"[{name}]({name}.md)", date, machine])
    pages["index.md"] = (
        "# Benchmarks\n\n"
        "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; every "
        "figure is a number from one run's JSON, on the machine and date given. Ratios were "
        "measured side by side in one run; absolute times follow the machine.\n\n"
        + table(["results", "date", "machine"], index)
    )
    for name, text in pages.items():
        (out / name).write_text(text)
    return pages


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true",
                        help="build into a temporary folder; exit 1 if a page in --out differs")
    args = parser.parse_args(argv)
    if not args.check:
        pages = build(args.out)
        print(f"wrote {len(pages)} pages to {os.path.relpath(args.out)}")
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        pages = build(Path(tmp))
    stale = [n for n, text in pages.items()
             if not (args.out / n).exists() or (args.out / n).read_text() != text]
    if stale:
        print(f"out of date: {stale}; run python benchmarks/report.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
