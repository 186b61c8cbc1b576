"""MkDocs hooks (mkdocs.yml ``hooks:``): pages kept outside docs/, and links written for GitHub.

README.md and CHANGELOG.md stay at the repository root, where GitHub and PyPI show them,
and the benchmark archive stays in benchmarks/results/ beside the scripts that made it;
the site makes pages of them (index.md, changelog.md, results/*.md) instead of keeping
copies in docs/. Every link in the sources is written for reading on GitHub, relative to
the file it is in (the README's ``docs/fencing.md``, a docs page's ``../README.md``); here
it is resolved in the repository and rewritten to the page the site makes of its target.
A link to any other file outside docs/ is left as it is, and ``mkdocs build --strict``
fails on it as on any broken link or anchor.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent


def _outside_pages() -> dict[str, str]:
    """Files outside docs/ that the site shows: path in the repository -> page."""
    pages = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
        pages[f"benchmarks/results/{path.name}"] = f"results/{path.name}"
    return pages


PAGES = _outside_pages()
_SOURCE = {page: source for source, page in PAGES.items()}
_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)\s#]+)(#[^)\s]*)?\)")
# A Sphinx role in a docstring (:meth:`renew`), which mkdocstrings renders as the role's
# name before the code: the code alone is kept.
_ROLE = re.compile(r":(?:attr|class|data|exc|func|meth|mod|obj|py:\w+):(?=<code>)")


def on_files(files: Files, config: Any) -> Files:
    for source, page in PAGES.items():
        text = (ROOT / source).read_text(encoding="utf-8")
        files.append(File.generated(config, page, content=text))
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    site_path = page.file.src_uri
    repo_path = _SOURCE.get(site_path, f"docs/{site_path}")

    def site_link(match: re.Match[str]) -> str:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(repo_path), match[1]))
        if target in PAGES:
            target_page = PAGES[target]
        elif target.startswith("docs/"):
            target_page = target.removeprefix("docs/")
        else:
            return match[0]
        link = posixpath.relpath(target_page, posixpath.dirname(site_path) or ".")
        return f"]({link}{match[2] or ''})"

    return _LINK.sub(site_link, markdown)


def on_page_content(html: str, page: Page, config: Any, files: Files) -> str:
    return _ROLE.sub("", html)
