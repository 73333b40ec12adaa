"""MkDocs hook: fills `<!-- reference: NAME -->` markers with tables generated from the code.

NAME is one of engine, speculative, serve-args, cli (deployments/reference.py builds the tables from
EngineConfig, SpeculativeConfig, ServeArgs and `tandem serve`'s parser). A marker is a line of its own;
an unknown NAME fails the build.
"""
from __future__ import annotations

import posixpath
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # mkdocs runs from .venv/bin: the repository may not be on the path
    sys.path.insert(0, str(ROOT))

from deployments import reference  # noqa: E402

MARKER = re.compile(r"^[ \t]*<!--[ \t]*reference:[ \t]*(\S*?)[ \t]*-->[ \t]*$", re.MULTILINE)


def render(markdown: str, src_uri: str = "reference/index.md") -> str:
    """`markdown` with every marker replaced; `src_uri` is the page's path under docs/ (for the links
    between the reference pages). ValueError on an unknown NAME."""
    base = posixpath.relpath("reference", posixpath.dirname(src_uri) or ".")
    base = "" if base == "." else base + "/"

    def table(match: re.Match) -> str:
        try:
            return reference.table(match.group(1), base)
        except ValueError as e:
            raise ValueError(f"{src_uri}: {e}") from None

    return MARKER.sub(table, markdown)


def on_page_markdown(markdown, page, config, files):
    return render(markdown, page.file.src_uri)
