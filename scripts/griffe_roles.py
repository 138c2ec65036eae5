"""A griffe extension for the docs build: docstrings written with Sphinx roles
(``:class:`~jaxtraj.types.EnvPart```, ``:func:`init```) become links to the API reference,
with the text Sphinx would show (``EnvPart``, ``init``) as a code span.

A role's target is looked up as Sphinx would: a member of the docstring's class (inherited
ones too) first, then the name in the docstring's scope (a relative ``.flush`` in its
module), then the name as written, then jaxtraj's public name. Only a target that exists in
the loaded package becomes a link, an *optional* cross-reference of mkdocs-autorefs (a
target with no page, a private helper, stays a plain code span and the build does not
warn); anything else (a peer's type) is a plain code span."""

from __future__ import annotations

import re
from html import escape

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")
_LOOKUP_ERRORS = (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError)


def _exists(pkg: griffe.Module, path: str) -> bool:
    root, _, rest = path.partition(".")
    if root != pkg.path:
        return False
    try:
        pkg[rest] if rest else pkg
    except _LOOKUP_ERRORS:
        return False
    return True


def _target(obj: griffe.Object, name: str) -> str | None:
    """The full path ``name`` names from ``obj``'s docstring, or ``None``."""
    bare = name.lstrip(".")
    head, _, rest = bare.partition(".")
    candidates = []
    cls = obj if obj.is_class else obj.parent if obj.parent is not None else None
    if cls is not None and cls.is_class and head in cls.all_members:
        candidates.append(f"{cls.path}.{bare}")
    if name.startswith("."):
        candidates.append(f"{obj.module.path}.{bare}")
    scope = obj if obj.is_module or obj.is_class else obj.parent
    try:
        base = scope.resolve(head)
        candidates.append(f"{base}.{rest}" if rest else base)
    except (griffe.NameResolutionError, AttributeError, *_LOOKUP_ERRORS):
        pass
    candidates += [bare, f"{obj.package.path}.{bare}"]
    return next((c for c in candidates if _exists(obj.package, c)), None)


def _code(text: str) -> str:
    # Raw HTML content is still Markdown: keep ``__init__`` and ``*args`` literal.
    return "<code>" + escape(text).replace("_", "&#95;").replace("*", "&#42;") + "</code>"


def _linker(obj: griffe.Object):
    def link(match: re.Match) -> str:
        tilde, name = match.groups()
        shown = name.lstrip(".").rsplit(".", 1)[-1] if tilde else name.lstrip(".")
        target = _target(obj, name)
        if target is None:
            return _code(shown)
        return f'<autoref identifier="{escape(target, quote=True)}" optional>{_code(shown)}</autoref>'

    return link


def _objects(obj: griffe.Object, seen: set):
    """``obj`` and everything defined under it (aliases are the objects they point to)."""
    if obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member, seen)


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        # Once the whole package is loaded, so that names defined or imported later in a
        # module resolve too.
        for obj in _objects(pkg, set()):
            if obj.docstring is not None:
                obj.docstring.value = _ROLE.sub(_linker(obj), obj.docstring.value)
