"""Build helpers for the documentation site (``mkdocs.yml`` loads this file twice).

- As an MkDocs hook (``hooks:``): a link from a page to a file of the repository outside
  ``docs/`` (``../examples/two_processes.py``) is not a page of the site; it becomes the
  path in code font, or a link into the repository when ``repo_url`` is set.  And the
  ``test="skip"`` that marks a code block tests/test_docs.py only compiles (it needs
  torchrun, Slurm or several machines) is removed from the fence, which the Markdown
  highlighter would not take.
- As a Griffe extension (``RestToMarkdown``, in the mkdocstrings handler's ``extensions``):
  lamploop's docstrings are Google style with a few reStructuredText habits, rewritten here
  for Markdown before Griffe parses them, so that ``mkdocs build --strict`` has nothing to
  warn about and the package keeps the docstrings that Sphinx users and ``help()`` read:

  - roles (``:func:`x```, ``:class:`~a.B```, ``:mod:`...```) become cross-references that
    link where the target is on the site and stay code elsewhere;
  - ``.. versionadded:: 0.2`` becomes a sentence;
  - a paragraph ending in ``::`` introduces a literal block: one colon is kept, and the
    indented block after it is Markdown's code block already;
  - doctest paragraphs (``>>>``) become ``pycon`` code blocks;
  - ``a, b: description`` in ``Args:`` (several parameters sharing one description, also
    over several lines) becomes one entry per parameter;
  - ``fit = blocking(fit_async)`` is documented as the function it is at run time: the
    async function's parameters, and the docstring the module gives it (read by importing
    the module, so that it is the one ``help(lamploop.fit)`` shows).
"""

from __future__ import annotations

import html
import importlib
import re
from typing import Any

import griffe

# ----------------------------------------------------------------------------- MkDocs hook

_OUTSIDE_LINK = re.compile(r"\[(?P<text>[^\]]+)\]\((?P<target>(?:\.\./)+[^)\s]+)\)")
_SKIP_MARKER = re.compile(
    r"""^(?P<fence>[ \t]*```+[ \t]*\w+)[ \t]+test=(?P<q>["'])skip(?P=q)[ \t]*$""", re.MULTILINE
)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Links leaving ``docs/`` point into the repository (code without a repo_url); skip markers go."""
    depth = page.file.src_uri.count("/")  # how many ../ stay inside docs/

    def replace(match: re.Match[str]) -> str:
        target = match["target"]
        ups = target.count("../")
        if ups <= depth:
            return match[0]
        path = target[3 * ups :]
        repo_url = config.get("repo_url")
        if repo_url:
            return f"[{match['text']}]({repo_url.rstrip('/')}/blob/main/{path})"
        text = match["text"].strip("`")
        return f"`{text}`"

    markdown = _SKIP_MARKER.sub(r"\g<fence>", markdown)
    return _OUTSIDE_LINK.sub(replace, markdown)


# ----------------------------------------------------------------------------- Griffe extension

_ROLE = re.compile(r":(?:py:)?(?P<role>func|meth|class|mod|data|attr|exc|obj|const):`(?P<body>[^`]+)`")
_VERSION = re.compile(
    r"^(?P<indent>\s*)\.\. (?P<what>versionadded|versionchanged|deprecated)::\s*(?P<rest>.*)$"
)
_VERSION_WORDS = {
    "versionadded": "Added in",
    "versionchanged": "Changed in",
    "deprecated": "Deprecated since",
}
_SECTION = re.compile(r"^(?P<indent>\s*)(?:Args|Arguments|Parameters|Params|Other Parameters):\s*$")
_NAME = re.compile(r"\s*(?P<name>\*{0,2}\w+)(?:\s*\((?P<note>[^)]*)\))?\s*(?P<sep>[,:])")


class RestToMarkdown(griffe.Extension):
    """Rewrite the reStructuredText habits of lamploop's docstrings into Markdown (see the module doc)."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        self._rewrite(obj)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module in _modules(pkg):
            for name, member in list(module.members.items()):
                made = _blocking_function(module, name, member)
                if made is not None:
                    module.set_member(name, made)
                    self._rewrite(made)

    def _rewrite(self, obj: griffe.Object) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        text = _split_grouped_parameters(docstring.value)
        text = _literal_blocks(text)
        text = _doctests(text)
        text = "\n".join(_version_line(line) for line in text.split("\n"))
        docstring.value = _ROLE.sub(lambda match: _reference(obj, match), text)


def _modules(module: griffe.Module) -> list[griffe.Module]:
    found = [module]
    for member in module.members.values():
        if not member.is_alias and member.is_module:
            found.extend(_modules(member))  # type: ignore[arg-type]
    return found


_BLOCKING = re.compile(r"blocking\((?P<target>\w+)\)")


def _blocking_function(module: griffe.Module, name: str, member: Any) -> griffe.Function | None:
    """``name = blocking(async_function)`` as a plain function with that signature and its run-time doc."""
    if member.is_alias or not member.is_attribute:
        return None
    match = _BLOCKING.fullmatch(str(member.value or ""))
    target = module.members.get(match["target"]) if match else None
    if target is None or target.is_alias or not target.is_function:
        return None
    runtime_doc = getattr(importlib.import_module(module.path), name).__doc__ or ""
    parameters = griffe.Parameters(
        *(
            griffe.Parameter(p.name, annotation=p.annotation, kind=p.kind, default=p.default)
            for p in target.parameters
        )
    )
    function = griffe.Function(
        name,
        lineno=member.lineno,
        endlineno=member.endlineno,
        parameters=parameters,
        returns=target.returns,
    )
    source = target.docstring
    function.docstring = griffe.Docstring(
        runtime_doc,
        lineno=member.lineno,
        parent=function,
        parser=source.parser if source else None,
        parser_options=source.parser_options if source else None,
    )
    return function


def _version_line(line: str) -> str:
    match = _VERSION.match(line)
    if match is None:
        return line
    rest = match["rest"].strip()
    version, _, note = rest.partition(" ")
    sentence = f"*{_VERSION_WORDS[match['what']]} version {version}.*"
    return f"{match['indent']}{sentence}{' ' + note if note else ''}"


def _reference(obj: griffe.Object, match: re.Match[str]) -> str:
    body = match["body"].strip()
    explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", body)
    if explicit:
        title, target = explicit["title"], explicit["target"]
    else:
        short = body.startswith("~")
        target = body.lstrip("~")
        title = target.rsplit(".", 1)[-1] if short else target
    target = target.removesuffix("()")
    if match["role"] in {"func", "meth"} and not title.endswith("()"):
        title += "()"
    identifier = _resolve(obj, target)
    if identifier is not None:
        identifier = _canonical(obj, identifier, match["role"])
    code = f"<code>{html.escape(title)}</code>"
    if identifier is None:
        return code
    return f'<autoref identifier="{html.escape(identifier)}" optional>{code}</autoref>'


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path ``target`` names from ``obj``'s scope (the object, its parents, their imports)."""
    if target.startswith("lamploop."):
        return target
    head, _, tail = target.partition(".")
    scope: griffe.Object | None = obj if obj.is_module or obj.is_class else obj.parent
    while scope is not None:
        try:
            path = scope.resolve(head)
        except (griffe.NameResolutionError, ValueError, KeyError):
            scope = scope.parent
            continue
        return f"{path}.{tail}" if tail else path
    return None


def _canonical(obj: griffe.Object, identifier: str, role: str) -> str:
    """Where ``identifier`` is defined (aliases followed); ``lamploop.fit``, the module, means its ``fit``."""
    try:
        found: Any = obj.modules_collection[identifier]
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return identifier
    if found.is_module and role != "mod" and found.name in found.members:
        found = found.members[found.name]
    try:
        return str(found.final_target.path if found.is_alias else found.path)
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return identifier


def _split_grouped_parameters(text: str) -> str:
    """``a, b (note): description`` in an ``Args:`` section becomes one entry per name."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        section = _SECTION.match(lines[i])
        out.append(lines[i])
        i += 1
        if section is None:
            continue
        item_indent: int | None = None
        while i < len(lines):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if line.strip() and indent <= len(section["indent"]):
                break  # the section is over
            if not line.strip():
                out.append(line)
                i += 1
                continue
            item_indent = indent if item_indent is None else item_indent
            end = i + 1
            while end < len(lines) and (
                not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > item_indent
            ):
                end += 1
            while end > i + 1 and not lines[end - 1].strip():
                end -= 1
            out.extend(_split_item(lines[i:end], item_indent))
            i = end
    return "\n".join(out)


def _split_item(item: list[str], indent: int) -> list[str]:
    joined = "\n".join(item)
    names: list[tuple[str, str | None]] = []
    position = 0
    while True:
        match = _NAME.match(joined, position)
        if match is None:
            return item
        names.append((match["name"], match["note"]))
        position = match.end()
        if match["sep"] == ":":
            break
    if len(names) < 2:
        return item
    description = joined[position:].strip()
    first, *rest = description.split("\n")
    pad = " " * indent
    entries: list[str] = []
    for name, note in names:
        lead = f"({note}) " if note else ""
        entries.append(f"{pad}{name}: {lead}{first}")
        entries.extend(rest)
    return entries


def _literal_blocks(text: str) -> str:
    """``Usage::`` introducing an indented block: keep one colon (the block is Markdown code already)."""
    return re.sub(r"(?m)(\S)::$", r"\1:", text)


def _doctests(text: str) -> str:
    """Top-level paragraphs of ``>>>`` lines become ``pycon`` code blocks."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith(">>>") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            out.extend(["```pycon", *lines[i:end], "```"])
            i = end
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)
