"""A throwaway Python environment that holds what the lent GPU machine's image holds for
jaxtraj, and nothing else, for ``benchmarks/gpu.sh --rehearse``.

No package index is used: the distributions come from an environment already on this
machine (the one whose Python runs this file). ``DEST/venv`` is a fresh virtual
environment without pip; its site-packages has one ``.pth`` file naming ``DEST/site``, a
folder of symbolic links to exactly the files of ``PACKAGES`` and their dependency
closure (read with ``importlib.metadata``: ``Requires-Dist``, markers evaluated, extras
followed). Anything else installed next to them (rlax, gymnax, PyAV, Ray, ...) is not
importable there.

    python benchmarks/rehearse_env.py DEST     # prints DEST/venv/bin/python on its last line

Exit status 1 when a package of ``PACKAGES`` is not installed in this environment, or
when the new environment cannot import one of them or can import one of ``ABSENT``.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
from pathlib import Path

# What the image has that jaxtraj and its benchmarks use (the device tool's KINDS.md).
PACKAGES = ["jax", "jaxlib", "flax", "optax", "chex", "orbax-checkpoint", "pyarrow", "numpy",
            "pytest"]
# Import names checked in the new environment.
IMPORTS = ["jax", "jaxlib", "flax", "optax", "chex", "orbax.checkpoint", "pyarrow", "numpy",
           "pytest"]
# Peers the image lacks (torch is on the image but is no part of this list: the rehearsal
# shows the benchmarks' torch rows as missing).
ABSENT = ["rlax", "gymnax", "torchrl", "av", "ray", "gymnasium", "envpool", "flashbax", "torch"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist: md.Distribution, extras: set[str]):
    """``(name, extras)`` of each requirement of ``dist`` that applies here."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # without packaging: names only, requirements under a marker skipped
        Requirement = None
    for line in dist.requires or []:
        if Requirement is None:
            if ";" in line:
                continue
            yield re.split(r"[\s\[<>=!~(;]", line.strip(), maxsplit=1)[0], set()
            continue
        req = Requirement(line)
        if req.marker is not None:
            envs = [{"extra": e} for e in sorted(extras)] or [{"extra": ""}]
            if not any(req.marker.evaluate(env) for env in envs):
                continue
        yield req.name, set(req.extras)


def closure(names: list[str]) -> tuple[dict[str, md.Distribution], list[str]]:
    """Every distribution ``names`` need (themselves included) and the names not found."""
    found: dict[str, md.Distribution] = {}
    seen_extras: dict[str, set[str]] = {}
    missing: list[str] = []
    todo = [(n, set()) for n in names]
    while todo:
        name, extras = todo.pop()
        key = canonical(name)
        if key in found and extras <= seen_extras[key]:
            continue
        try:
            dist = found.get(key) or md.distribution(name)
        except md.PackageNotFoundError:
            if key not in missing:
                missing.append(key)
            continue
        found[key] = dist
        seen_extras[key] = seen_extras.get(key, set()) | extras
        todo.extend(requirements(dist, seen_extras[key]))
    return found, missing


def top_levels(dist: md.Distribution) -> set[str]:
    """The entries of site-packages that belong to ``dist`` (packages, modules, its
    ``.dist-info``); scripts and data outside site-packages are left out."""
    tops = set()
    for f in dist.files or []:
        parts = Path(f).parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith(".pth"):
            continue
        tops.add(parts[0])
    if not tops:  # no RECORD: top_level.txt and the metadata folder
        tops = set((dist.read_text("top_level.txt") or "").split())
        tops.add(Path(dist._path).name)  # noqa: SLF001 - the only way to its folder
    return tops


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[2].strip(), file=sys.stderr)
        return 2
    dest = Path(sys.argv[1]).resolve()
    dists, missing = closure(PACKAGES)
    absent_required = [p for p in PACKAGES if canonical(p) in missing]
    if absent_required:
        print(f"rehearse_env: {sys.executable} lacks {', '.join(absent_required)}: set "
              "REHEARSE_FROM to a Python that has them", file=sys.stderr)
        return 1
    site = dest / "site"
    site.mkdir(parents=True, exist_ok=True)
    linked = 0
    for dist in dists.values():
        for top in sorted(top_levels(dist)):
            src = Path(dist.locate_file(top))
            link = site / top
            if src.exists() and not link.exists():
                link.symlink_to(src)
                linked += 1
    venv = dest / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    Path(purelib, "_jaxtraj_rehearse.pth").write_text(f"{site}\n")
    names = sorted(f"{d.metadata['Name']}=={d.version}" for d in dists.values())
    print(f"rehearse_env: {len(dists)} distributions from {sys.prefix} ({linked} links in "
          f"{site}): {' '.join(names)}")
    if missing:
        print(f"rehearse_env: required by them but not installed there (left out): "
              f"{' '.join(sorted(missing))}")
    check = (
        "import importlib, importlib.util, sys\n"
        f"for m in {IMPORTS!r}: importlib.import_module(m)\n"
        f"bad = [m for m in {ABSENT!r} if importlib.util.find_spec(m) is not None]\n"
        "print(' '.join(bad)); sys.exit(1 if bad else 0)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    res = subprocess.run([str(py), "-c", check], capture_output=True, text=True, env=env)
    if res.returncode:
        print(f"rehearse_env: the new environment is wrong: {res.stdout.strip()} "
              f"{res.stderr.strip()[-2000:]}", file=sys.stderr)
        return 1
    print(f"rehearse_env: imports {', '.join(IMPORTS)}; not importable: {', '.join(ABSENT)}")
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
