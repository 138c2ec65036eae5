"""A griffe extension for the docs build: docstrings written with Sphinx roles
(``:class:`~jaxtraj.types.EnvPart```, ``:func:`init```) render as code spans in mkdocstrings
(``EnvPart``, ``init``), as Sphinx shows them, instead of the raw role text."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _code(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
