"""MkDocs hooks of the documentation site (mkdocs.yml names this file).

* The README is the site's front page and CHANGELOG.md its changelog page: both live at the
  repository's root, so they are added as generated pages, their links to ``docs/X`` rewritten
  to ``X``, and links to them to their pages.
* A link from a page to a file of the repository outside ``docs/`` (a record under
  ``benchmarks/results/``, an example, the LICENSE) must name a file or folder that exists, or
  the build warns (and ``mkdocs build --strict`` fails). It is written relative to the page's
  place in the built site, so the site read from ``site/`` in a checkout reaches the file.
* An API page names its module in a first line ``<!-- api: torch_sgn.pinn -->``; every name of
  that module's ``__all__`` that the page does not place itself (``::: torch_sgn.pinn.NAME``)
  is added at its end, so that the reference lists every public name.
* ``docs/ARCHITECTURE.md`` is the one page allowed to be missing (it describes the step core and
  lands with it): while it is absent, its nav entry and the links to it are left out.
"""

from __future__ import annotations

import ast
import logging
import os
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
ROOT_PAGES = {"index.md": "README.md", "CHANGELOG.md": "CHANGELOG.md"}
OPTIONAL = "ARCHITECTURE.md"
# A markdown link or image target: ](target) or ](target "title"), or a reference definition
# at the start of a line: [name]: target.
LINK = re.compile(r"(\]\(|^\[[^\]]+\]:\s*)([^)\s]+)((?:\s+\"[^\"]*\")?\)|$)", re.M)
API = re.compile(r"^<!-- api: ([\w.]+) -->", re.M)
REPO = "repo:"  # the scheme of a link to a repository file, resolved in on_page_content

log = logging.getLogger("mkdocs.hooks.torch_sgn")


def _optional_missing() -> bool:
    return not (DOCS / OPTIONAL).exists()


def on_config(config):
    if _optional_missing():
        config.nav = [
            entry
            for entry in config.nav
            if not (isinstance(entry, dict) and OPTIONAL in entry.values())
        ]
        log.info("%s is not written yet: left out of the nav", OPTIONAL)
    return config


def on_files(files: Files, config) -> Files:
    for dest, source in ROOT_PAGES.items():
        text = (ROOT / source).read_text()
        files.append(File.generated(config, dest, content=text))
    return files


def _source(page) -> Path:
    """Where the page's markdown lives in the repository."""
    uri = page.file.src_uri
    return ROOT / ROOT_PAGES[uri] if uri in ROOT_PAGES else DOCS / uri


def public_names(module: str) -> list:
    """The names a module of the package exports (its ``__all__``, read without importing it)."""
    path = ROOT / "src" / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{module} has no __all__")


def _complete_api(markdown: str) -> str:
    match = API.search(markdown)
    if not match:
        return markdown
    module = match.group(1)
    placed = set(re.findall(rf"^::: {re.escape(module)}\.(\w+)\s*$", markdown, re.M))
    missing = [name for name in public_names(module) if name not in placed]
    if not missing:
        return markdown
    return (
        markdown
        + "\n## Other public names\n\n"
        + "".join(f"::: {module}.{name}\n\n" for name in missing)
    )


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _complete_api(markdown)
    source = _source(page)
    in_docs_dir = page.file.src_uri not in ROOT_PAGES

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith(("#", "/")):
            return match.group(0)  # external, an anchor on the page, or absolute
        path, _, anchor = target.partition("#")
        resolved = (source.parent / path).resolve()
        if resolved == DOCS / OPTIONAL and _optional_missing():
            log.info("%s: link to %s left out (not written yet)", page.file.src_uri, OPTIONAL)
            return match.group(0).replace(match.group(2), "#")
        for dest, root_source in ROOT_PAGES.items():
            if resolved == ROOT / root_source:  # the README or CHANGELOG: their site pages
                here = os.path.dirname(page.file.src_uri) or "."
                new = os.path.relpath(dest, here) + (f"#{anchor}" if anchor else "")
                return match.group(1) + new + match.group(3)
        if resolved.is_relative_to(DOCS):
            if in_docs_dir:
                return match.group(0)  # MkDocs checks it (and its anchor)
            new = resolved.relative_to(DOCS).as_posix() + (f"#{anchor}" if anchor else "")
            return match.group(1) + new + match.group(3)
        if not resolved.exists():
            log.warning("%s: link to a missing file %s", page.file.src_uri, target)
            return match.group(0)
        if not resolved.is_relative_to(ROOT):
            log.warning("%s: link outside the repository %s", page.file.src_uri, target)
            return match.group(0)
        relative = resolved.relative_to(ROOT).as_posix() + ("/" if path.endswith("/") else "")
        new = REPO + relative + (f"#{anchor}" if anchor else "")
        return match.group(1) + new + match.group(3)

    return LINK.sub(rewrite, markdown)


def on_page_content(html: str, page, config, files) -> str:
    out_dir = (Path(config.site_dir) / page.file.dest_uri).parent
    root = Path(os.path.relpath(ROOT, out_dir)).as_posix()

    def resolve(match: re.Match) -> str:
        return f'{match.group(1)}="{root}/{match.group(2)}"'

    return re.sub(rf'(href|src)="{REPO}([^"]*)"', resolve, html)
