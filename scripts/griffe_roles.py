"""A griffe extension for the docs build: jaxtraj's docstrings are written for Sphinx
(reST roles and literal blocks) and rendered by mkdocstrings as Markdown. Four rewrites:

- Sphinx roles (``:class:`~jaxtraj.types.EnvPart```, ``:func:`init```) become links to the
  API reference, with the text Sphinx would show (``EnvPart``, ``init``) as a code span.
  A role's target is looked up as Sphinx would: a member of the docstring's class
  (inherited ones too) first, then the name in the docstring's scope (a relative
  ``.flush`` in its module), then the name as written, then jaxtraj's public name. Only a
  target that exists in the loaded package becomes a link, an *optional* cross-reference
  of mkdocs-autorefs (a target with no page, a private helper, stays a plain code span and
  the build does not warn); anything else (a peer's type) is a plain code span.
- A literal block (a paragraph ending in ``::`` and an indented block after it) becomes a
  fenced code block, and the ``::`` what Sphinx shows (``Example::`` reads ``Example:``,
  ``text ::`` reads ``text``, a lone ``::`` goes): Python where the block parses as Python,
  plain text otherwise (formulas, layouts).
- A parameter or attribute annotated ``Array``, ``PyTree`` or ``Any`` (or not at all)
  whose description begins with its shape and dtype (``[B, K]`` bool, ...; ``int32, ...``;
  ``leaves [B, ...]``) shows them in the Type column under the annotation, and the
  description no longer repeats them where they were a clause of their own.
- An Args or Attributes entry naming several (``a, b: text``) becomes one entry each.
"""

from __future__ import annotations

import ast
import re
import textwrap
from functools import cached_property
from html import escape

import griffe
from markupsafe import Markup

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


# -- literal blocks ----------------------------------------------------------------------

_FENCE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n.*?^[ \t]*\1[ \t]*$", re.M | re.S)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _language(code: str) -> str:
    if code.lstrip().startswith(">>>"):
        return "pycon"
    try:
        ast.parse(code)
    except SyntaxError:
        return "text"
    return "python"


def literal_blocks(text: str) -> str:
    """``text`` with each reST literal block (``para::`` + an indented block) fenced."""
    lines, out, i, fenced = text.split("\n"), [], 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        if fenced or not line.rstrip().endswith("::"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == i + 1 or j == len(lines) or _indent(lines[j]) <= base:
            out.append(line)  # no blank line and indented block after it: not a literal block
            i += 1
            continue
        end = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
            end += 1
        while not lines[end - 1].strip():
            end -= 1
        code = textwrap.dedent("\n".join(lines[j:end]))
        head = line.rstrip()[:-2]
        if head.strip():  # "Example::" reads "Example:"; "text ::" reads "text"
            out.append(head.rstrip() if head[-1].isspace() else head + ":")
            out.append("")
        pad = " " * base
        out.append(f"{pad}```{_language(code)}")
        out += [(pad + c) if c.strip() else "" for c in code.split("\n")]
        out.append(f"{pad}```")
        i = end
    return "\n".join(out)


_ITEMS = re.compile(
    r"^(\s*)(Args|Arguments|Params|Parameters|Attributes|Other Parameters|Keyword Args|"
    r"Keyword Arguments):\s*$"
)
_SHARED = re.compile(r"^(\s+)(\w+(?:, \w+)+): (.*)$")


def shared_items(text: str) -> str:
    """``text`` with an Args or Attributes entry that names several (``a, b: text``)
    written as one entry each, as Google style has them (griffe would read ``a,`` as the
    name and ``b`` as its type)."""
    lines, out, section = text.split("\n"), [], None
    for i, line in enumerate(lines):
        if (m := _ITEMS.match(line)) is not None:
            section = len(m.group(1))
        elif section is not None and line.strip() and len(line) - len(line.lstrip()) <= section:
            section = None
        m = _SHARED.match(line) if section is not None else None
        if m is None:
            out.append(line)
            continue
        pad = m.group(1)
        more = []
        for follow in lines[i + 1 :]:
            if not follow.strip() or len(follow) - len(follow.lstrip()) <= len(pad):
                break
            more.append(follow)
        *names, last = m.group(2).split(", ")
        for name in names:
            out += [f"{pad}{name}: {m.group(3)}", *more]
        out.append(f"{pad}{last}: {m.group(3)}")  # its continuation lines follow as they are
    return "\n".join(out)


def _outside_fences(text: str, rewrite) -> str:
    parts, at = [], 0
    for m in _FENCE.finditer(text):
        parts += [rewrite(text[at : m.start()]), m.group(0)]
        at = m.end()
    return "".join([*parts, rewrite(text[at:])])


# -- shapes and dtypes in the Type column ---------------------------------------------------

_DTYPES = ("bool", "bfloat16", "float16", "float32", "float64", "complex64", "int8", "int16",
           "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_VAGUE = {"Array", "jax.Array", "jnp.ndarray", "np.ndarray", "PyTree", "Any", ""}
_SHAPE = r"``?(\[[^`]*\])``?"  # a code span that is a shape: ``[B, K]``
_DT = "|".join(_DTYPES)
_HEAD = re.compile(
    rf"(?P<sym>``[^`\[]+``, )?(?P<opt>optional )?"  # ``r_t``, ...; optional ...
    rf"(?:(?P<dt1>{_DT})\b(?:,? (?=`))?)?"  # bool ``[B]``; bool, ``[B]``; bool, ...
    rf"(?:{_SHAPE}(?: \(or {_SHAPE}\)| or {_SHAPE})?)?"  # [B, K, A] (or [B, K*A]); [B] or [B, K]
    rf"(?(dt1)|(?: (?P<dt2>{_DT})\b)?)"  # [B] bool
)
_LEAVES = re.compile(rf"\bleaves {_SHAPE}")


def shape_of(annotation: str, description: str) -> tuple[str, str] | None:
    """``(shape and dtype, description)`` read off the start of the description of a
    parameter annotated vaguely (``Array``, ``PyTree``, ``Any``, nothing), or ``None``
    where it does not begin with them. Where they were a clause of their own
    (``[B] bool, ...``) the description returned no longer has them."""
    if annotation.replace(" | None", "") not in _VAGUE:
        return None
    first = description.split("\n\n", 1)[0]
    if annotation.startswith(("PyTree", "Any")) or not annotation:
        leaves = _LEAVES.search(first)
        if leaves:
            return f"leaves {leaves.group(1)}", description
    m = _HEAD.match(description)
    shapes = [g for g in (m.group(4), m.group(5), m.group(6)) if g]
    dtype = m.group("dt1") or m.group("dt2")
    if not (shapes or dtype):
        return None
    shown = " ".join([*([dtype] if dtype else []), " or ".join(shapes)]).strip()
    rest = description[m.end() :]
    if rest[:1] in (",", ";", ":"):  # a clause of its own: the Type column has it now
        if m.group("opt"):
            return shown, description
        return shown, (m.group("sym") or "") + rest[1:].lstrip()
    if rest[:1] not in (" ", ".", "") or re.search(_SHAPE, rest.split(". ", 1)[0]):
        return None  # more shapes follow in the prose: leave them there
    return shown, description


class Shaped(griffe.Expr):
    """An annotation followed by the shape and dtype, under it in a Type cell."""

    def __init__(self, annotation: str | griffe.Expr | None, shape: str) -> None:
        self.annotation, self.shape = annotation, shape

    def iterate(self, *, flat: bool = True):
        if self.annotation is None or str(self.annotation) == "":
            yield self.shape
            return
        if isinstance(self.annotation, str):
            yield self.annotation
        elif flat:
            yield from self.annotation.iterate(flat=True)
        else:
            yield self.annotation
        if flat:  # str(): plain text
            yield f" {self.shape}"
        else:  # the template wraps the expression in one <code>: the shape on a line below
            yield Markup('</code><br><code class="doc-shape">') + self.shape


def _shapes(sections: list) -> None:
    for section in sections:
        if section.kind.value not in ("parameters", "attributes", "other parameters"):
            continue
        for item in section.value:
            annotation = "" if item.annotation is None else str(item.annotation)
            found = shape_of(annotation, item.description)
            if found is not None:
                item.annotation = Shaped(item.annotation, found[0])
                item.description = found[1]


class ShapedDocstring(griffe.Docstring):
    """A docstring whose parsed sections carry the shapes in their annotations. Parsed
    when mkdocstrings renders it, as any docstring, so its warnings are the same."""

    @cached_property
    def parsed(self) -> list:
        sections = self.parse()
        _shapes(sections)
        return sections


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        # Once the whole package is loaded, so that names defined or imported later in a
        # module resolve too, and annotations are known for the Type column.
        for obj in _objects(pkg, set()):
            if obj.docstring is not None:
                text = literal_blocks(shared_items(obj.docstring.value))
                link = _linker(obj)
                obj.docstring.value = _outside_fences(text, lambda t: _ROLE.sub(link, t))
                obj.docstring.__class__ = ShapedDocstring
