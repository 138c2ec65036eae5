"""A griffe extension for the docs build: docstrings written with Sphinx roles
(``:class:`~jaxtraj.types.EnvPart```, ``:func:`init```) become links to the API reference,
with the text Sphinx would show (``EnvPart``, ``init``) as a code span.

A role's target is resolved in the scope of the object whose docstring holds it (a
relative name such as ``init`` or ``.flush``), else taken as written (a bare name as
jaxtraj's public one). The link is an *optional* cross-reference of mkdocs-autorefs: where
the target is not on a page (a private helper, a peer's type), the text stays a plain code
span and the build does not warn."""

from __future__ import annotations

import re
from html import escape

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _target(obj: griffe.Object, name: str) -> str:
    """``name`` as a full path, resolved from ``obj``'s scope where it can be."""
    if name.startswith("."):  # relative to the module
        return obj.module.path + name
    head, _, rest = name.partition(".")
    scope = obj if obj.is_module or obj.is_class else obj.parent
    while scope is not None:
        try:
            base = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError, KeyError):
            scope = scope.parent
            continue
        return f"{base}.{rest}" if rest else base
    return name if "." in name else f"jaxtraj.{name}"  # unresolved: the public name, if any


def _linker(obj: griffe.Object):
    def link(match: re.Match) -> str:
        tilde, name = match.groups()
        shown = name.lstrip(".").rsplit(".", 1)[-1] if tilde else name.lstrip(".")
        target = escape(_target(obj, name), quote=True)
        return f'<autoref identifier="{target}" optional><code>{escape(shown)}</code></autoref>'

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
