"""A griffe extension of the documentation site: the docstrings' reStructuredText markup as
Markdown.

The docstrings are Google style, with Sphinx roles and directives inside (``:class:`SGN```,
``:math:`\\rho```, ``.. math::``, ``.. note::``), which mkdocstrings would print as they are.
The site has no math renderer (it is built and read offline), so math shows as code:

* a role ``:kind:`~a.b.name``` becomes ```name``` (``:kind:`a.b.name``` keeps the full name);
* ``.. math::`` followed by an indented block becomes that block, shown as code;
* ``.. note::`` and ``.. warning::`` become admonitions;
* a paragraph ending in ``::`` (reStructuredText's literal block) ends in ``:``, its indented
  block shown as code.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`(~?)([^`]+)`")
DIRECTIVE = re.compile(r"^(\s*)\.\. (note|warning)::[ \t]*(.*)$", re.M)
MATH = re.compile(r"^(\s*)\.\. math::[ \t]*$\n?", re.M)
LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)


def _role(match: re.Match) -> str:
    short, name = match.groups()
    return f"`{name.rsplit('.', 1)[-1] if short else name}`"


def _directive(match: re.Match) -> str:
    indent, kind, rest = match.groups()
    text = f"{indent}!!! {kind}"
    return text + (f"\n{indent}    {rest}" if rest else "")


def markdown(text: str) -> str:
    """The docstring ``text`` with its reStructuredText markup written as Markdown."""
    text = ROLE.sub(_role, text)
    text = DIRECTIVE.sub(_directive, text)
    text = MATH.sub("", text)
    return LITERAL.sub(r"\1:", text)


class RstToMarkdown(griffe.Extension):
    """Rewrites every docstring as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
