"""The documentation runs: every ```python block in README.md and docs/ is executed.

A page is one test; its blocks run in order in one namespace, as a reader would paste
them. A block not meant to run is preceded by ``<!-- notest: why -->`` (the reason is
required and printed). ``docs/lerobot.md`` belongs to another owner and carries no
markers: its one block loads a dataset with LeRobot itself, so it runs only where
``lerobot`` is importable (LeRobot lives in its own Python 3.12 virtualenv here).

The last test prints how many blocks ran and which were not run, and why. The API
reference and the error-codes page are checked against the code here too.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
NOTEST = re.compile(r"<!--\s*notest:\s*(.+?)\s*-->\s*$")

# Blocks of pages that are not ours to mark: first line -> (run it?, reason).
EXEMPT = {
    "from lerobot.datasets.lerobot_dataset import LeRobotDataset": (
        importlib.util.find_spec("lerobot") is not None,
        "loads a dataset with LeRobot, which is not installed in this environment "
        "(it lives in its own Python 3.12 virtualenv: docs/lerobot.md)",
    ),
}

RAN: dict[str, int] = {}
NOT_RUN: list[str] = []


def blocks(page: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason not to run or None)`` of every python block of a page."""
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        note = NOTEST.search(before)
        reason = note.group(1) if note else None
        first = m.group(2).lstrip().split("\n", 1)[0].strip()
        if first in EXEMPT and not EXEMPT[first][0]:
            reason = EXEMPT[first][1]
        out.append((line, m.group(2), reason))
    return out


ALL = {str(p.relative_to(ROOT)): blocks(p) for p in PAGES}
WITH_CODE = [name for name, bs in ALL.items() if bs]


@pytest.mark.parametrize("page", WITH_CODE)
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a block writes land in a temporary folder
    module = types.ModuleType("jaxtraj_docs_page")  # dataclasses look their module up
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace = module.__dict__
    ran = 0
    for line, code, reason in ALL[page]:
        if reason is not None:
            NOT_RUN.append(f"{page}:{line}: {reason}")
            continue
        try:
            exec(compile(code, f"{page}:{line}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"{page}, the block at line {line} failed: {e!r}") from e
        ran += 1
    RAN[page] = ran


def test_every_block_has_run_or_says_why(capsys):
    """Prints the count; when every page test ran in this session, it must be all."""
    total = sum(len(bs) for bs in ALL.values())
    noted = [(p, ln, r) for p, bs in ALL.items() for ln, _, r in bs if r is not None]
    ran = sum(RAN.values())
    with capsys.disabled():
        print(f"\ndocumentation: {ran} python blocks ran in {len(RAN)} pages "
              f"({total} blocks in {len(WITH_CODE)} pages, {len(noted)} not run)")
        for p, ln, r in noted:
            print(f"  not run: {p}:{ln}: {r}")
    if len(RAN) == len(WITH_CODE):
        assert ran == total - len(noted)
    assert all(r.strip() for _, _, r in noted)


def test_readme_quickstarts_run():
    assert len(ALL["README.md"]) >= 3 and all(r is None for _, _, r in ALL["README.md"])


# -- the reference and the error codes ------------------------------------------------------


def test_api_reference_covers_every_public_name():
    import jaxtraj

    api = (ROOT / "docs" / "api" / "jaxtraj.md").read_text()
    documented = set(re.findall(r"^::: jaxtraj\.(\w+)\s*$", api, re.M))
    modules = {"rollout", "pipeline"}  # documented on their own pages
    assert set(jaxtraj.__all__) - modules <= documented, set(jaxtraj.__all__) - documented
    for module in ("rollout", "pipeline", "lerobot", "runners", "runners.threads",
                   "runners.ray", "runners.sync", "runners.service", "envs", "checkpoint"):
        page = ROOT / "docs" / "api" / f"{module.split('.')[0]}.md"
        assert f"::: jaxtraj.{module}\n" in page.read_text(), module


def test_sphinx_roles_in_docstrings_become_api_links():
    """The docs build's griffe extension turns ``:class:`Mirror``` into an optional
    cross-reference to the name's full path, resolved where the docstring is."""
    griffe = pytest.importorskip("griffe")
    loaded = griffe.load(
        "jaxtraj", search_paths=[str(ROOT)],
        extensions=griffe.load_extensions(str(ROOT / "scripts" / "griffe_roles.py")),
    )
    text = loaded["collector"].docstring.value
    assert ":class:" not in text
    # a name imported into the module, and a fully qualified one shown by its last part
    assert '<autoref identifier="jaxtraj.mirror.Mirror" optional><code>Mirror</code>' in text
    assert ('<autoref identifier="jaxtraj.checks.HostChecks" optional>'
            '<code>jaxtraj.checks.HostChecks</code>') in text
    # a method of the docstring's class, inherited: GymnasiumEnv's ``:meth:`reset```
    env = loaded["envs.gymnasium.GymnasiumEnv"].docstring.value
    assert '<autoref identifier="jaxtraj.envs.gymnasium.GymnasiumEnv.reset" optional>' in env
    # every link's target is an object of the package (no made-up paths)
    targets, todo, seen = set(), [loaded], set()
    while todo:
        obj = todo.pop()
        if obj.path in seen:
            continue
        seen.add(obj.path)
        if obj.docstring is not None:
            targets |= set(re.findall(r'<autoref identifier="([^"]+)"', obj.docstring.value))
        todo += [m for m in obj.members.values() if not m.is_alias]
    assert len(targets) > 50
    missing = []
    for target in sorted(targets):
        try:
            loaded[target.removeprefix("jaxtraj.")]
        except KeyError:
            missing.append(target)
    assert not missing, missing


def test_docstrings_render_as_sphinx_would_with_shapes_in_the_type_column():
    """The same extension fences reST literal blocks (``Example::``) and puts the shape
    and dtype a vaguely annotated entry's description starts with in its Type column."""
    griffe = pytest.importorskip("griffe")
    loaded = griffe.load(
        "jaxtraj", search_paths=[str(ROOT)], docstring_parser="google",
        extensions=griffe.load_extensions(str(ROOT / "scripts" / "griffe_roles.py")),
    )
    envs = loaded["envs"].docstring.value
    assert "::" not in envs and "without running anything:\n\n```python\n" in envs

    def types(path):
        sections = loaded[path].docstring.parsed
        return {i.name: (str(i.annotation), i.description)
                for s in sections if s.kind.value == "attributes" for i in s.value}

    out = types("types.PolicyOutput")
    assert out["actions"][0] == "Array [B, K, A] or [B, K*A]"
    assert out["prev_logprobs"][0] == "Array | None"  # no shape in its description
    flags = types("types.EnvTransition")["terminations"]
    assert flags == ("Array | None bool [B] or [B, K]", "episode ended naturally.")


def test_error_codes_page_lists_every_code_with_a_fix():
    from jaxtraj import ErrorCode

    text = (ROOT / "docs" / "errors.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|$", text, re.M))
    codes = [c.name for c in ErrorCode if c != ErrorCode.OK]
    assert sorted(rows) == sorted(codes)
    assert all(fix.strip() for fix in rows.values())


def test_benchmark_pages_are_up_to_date():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MPLBACKEND": "Agg"})
    assert run.returncode == 0, run.stderr
