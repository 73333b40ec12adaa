"""The examples in README.md and docs/**/*.md that are marked to run, run.

A fenced code block whose fence is preceded, on the line right before it, by

    <!-- test: offline -->   a ```python script, run as it is in a subprocess (the embedded models,
                             HF_HUB_OFFLINE=1, the repository root as the working directory);
    <!-- test: server -->    a ```python script or a ```bash block (curl) run against the default
                             application of serve_config.yaml, which this module starts once on free
                             loopback ports; the examples' 127.0.0.1:8000 / localhost:8000 (HTTP) and
                             127.0.0.1:9000 (gRPC) are rewritten to those ports.

is one test, named by its file and the fence's line: `test_example[docs/offline.md:42]`. Run one with
`-k 'offline.md:42'`. A script passes when it exits with 0; in a bash block `curl` fails on an HTTP
error (it runs as `curl --fail-with-body`), so an example that shows an error answer on purpose needs
`|| true`. A marker that is malformed, of an unknown kind, not directly followed by a fence, or on a
block of another language is a failing test of its own: a typo must not skip an example silently.
The server starts only when a server example is selected.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servers import serve_app

ROOT = Path(__file__).resolve().parent.parent
OFFLINE_TIMEOUT_S = 600  # a first load of a GGUF file dequantizes it (10-40 s a model); later loads are fast
SERVER_TIMEOUT_S = 300
TAIL_CHARS = 4000

# Pages that must each hold at least one marked example (besides README.md: one of each kind).
PAGES_WITH_EXAMPLES = ["docs/offline.md", "docs/serving/http.md", "docs/serving/grpc.md",
                       "docs/structured-outputs.md"]

KINDS = {"offline": {"python"}, "server": {"python", "bash"}}
LANGUAGES = {"python": "python", "py": "python", "python3": "python", "bash": "bash", "sh": "bash",
             "shell": "bash"}
MARKER_LIKE = re.compile(r"^\s*<!--\s*tests?\b", re.IGNORECASE)  # anything that looks like an attempt
MARKER = re.compile(r"^\s*<!--\s*test:\s*(?P<kind>[\w-]+)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")


@dataclasses.dataclass(frozen=True)
class Example:
    path: str  # relative to the root, with forward slashes
    line: int  # 1-based line of the opening fence (of the marker, for a marker with no fence after it)
    kind: str  # "offline", "server", or "" for a marker that is wrong
    language: str = ""  # "python" or "bash"
    code: str = ""
    error: str = ""  # why the marker is wrong

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def documents(root: Path) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.is_file()]


def examples_in(path: Path, root: Path) -> list[Example]:
    """The marked blocks of one Markdown file, and its wrong markers (as Examples with an error).
    Lines inside fenced blocks are never markers (a page may show the syntax in a code block)."""
    rel = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Example] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = FENCE.match(line)
        if fence:  # skip an unmarked block whole
            i = closing_fence(lines, i, fence) + 1
            continue
        if not MARKER_LIKE.match(line):
            i += 1
            continue
        marker = MARKER.match(line)
        if not marker:
            found.append(Example(rel, i + 1, "", error=f"malformed marker {line.strip()!r}: "
                                 "write <!-- test: offline --> or <!-- test: server -->"))
            i += 1
            continue
        kind = marker["kind"]
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if kind not in KINDS:
            found.append(Example(rel, i + 1, "", error=f"unknown kind {kind!r} (one of {', '.join(KINDS)})"))
            i += 1
            continue
        if not fence or not fence["info"]:
            found.append(Example(rel, i + 1, "", error=f"the marker {line.strip()!r} is not followed, on the "
                                 "next line, by the opening fence of a code block with a language"))
            i += 1
            continue
        start, end = i + 1, closing_fence(lines, i + 1, fence)
        info = fence["info"].split()[0].lstrip(".{").rstrip("}").lower()
        language = LANGUAGES.get(info, "")
        if language not in KINDS[kind]:
            found.append(Example(rel, start + 1, "", error=f"a {kind} example is a block of "
                                 f"{' or '.join(sorted(KINDS[kind]))}, not {info!r}"))
        else:
            indent = len(fence["indent"])
            body = [text[min(indent, len(text) - len(text.lstrip(" "))):] for text in lines[start + 1:end]]
            found.append(Example(rel, start + 1, kind, language, "\n".join(body) + "\n"))
        i = end + 1
    return found


def closing_fence(lines: list[str], opening: int, fence: re.Match) -> int:
    """Index of the line that closes the block opened at `opening` (the last line if none does)."""
    mark = fence["fence"]
    close = re.compile(rf"^\s*{re.escape(mark[0])}{{{len(mark)},}}\s*$")
    for j in range(opening + 1, len(lines)):
        if close.match(lines[j]):
            return j
    return len(lines) - 1


def collect(root: Path = ROOT) -> list[Example]:
    """Every marked example and wrong marker under `root`: wrong markers first (they cost nothing),
    then offline examples, then server ones (the server is up only at the end of the module)."""
    found = [e for path in documents(root) for e in examples_in(path, root)]
    order = {"": 0, "offline": 1, "server": 2}
    return sorted(found, key=lambda e: order[e.kind])  # stable: file order within a kind


EXAMPLES = collect()


# -- the server --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def docs_server():
    """The default application of serve_config.yaml, as `serve run serve_config.yaml` deploys it, on
    free loopback ports: yields (HTTP host:port, gRPC host:port)."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = config["applications"][0]
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TANDEM_API_KEY", raising=False)  # the examples call an open server
        with serve_app(app["name"], app["args"]) as (base, grpc_address):
            yield base.removeprefix("http://"), grpc_address


HTTP_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):8000(?!\d)")
GRPC_ADDRESS = re.compile(r"\b(?:127\.0\.0\.1|localhost):9000(?!\d)")


def rewrite(code: str, http: str, grpc: str) -> str:
    return GRPC_ADDRESS.sub(grpc, HTTP_ADDRESS.sub(http, code))


# -- running an example ------------------------------------------------------------------------------

CURL_FAILS_ON_HTTP_ERRORS = 'curl() { command curl --fail-with-body "$@"; }\n'


def run(example: Example, code: str, timeout_s: float) -> None:
    if example.language == "python":
        argv = [sys.executable, "-c", code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", CURL_FAILS_ON_HTTP_ERRORS + code]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{example.id}: no exit in {timeout_s:.0f} s\n--- stdout (tail) ---\n{tail(e.stdout)}\n"
                    f"--- stderr (tail) ---\n{tail(e.stderr)}", pytrace=False)
    if done.returncode != 0:
        pytest.fail(f"{example.id}: exit code {done.returncode}\n--- the example as run ---\n{code}"
                    f"--- stdout (tail) ---\n{tail(done.stdout)}\n--- stderr (tail) ---\n{tail(done.stderr)}",
                    pytrace=False)


def tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text or ""
    return text if len(text) <= TAIL_CHARS else "..." + text[-TAIL_CHARS:]


def test_pages_have_examples():
    """The pages where a user starts hold examples that run (no page loses its last marker unnoticed)."""
    kinds: dict[str, set[str]] = {}
    for e in EXAMPLES:
        kinds.setdefault(e.path, set()).add(e.kind)
    missing = [page for page in PAGES_WITH_EXAMPLES if not kinds.get(page, set()) - {""}]
    missing += [f"README.md ({kind})" for kind in KINDS if kind not in kinds.get("README.md", set())]
    assert not missing, f"no marked example (<!-- test: offline|server -->) in: {', '.join(missing)}"


def test_collector_reads_markers(tmp_path):
    """The collector itself: marked blocks of both kinds, unmarked ones skipped, a marker shown inside a
    code block ignored, and every kind of wrong marker reported where it is."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# t\n<!-- test: offline -->\n```python\nprint(1)\n```\n\n```bash\nexit 1\n```\n"
        "````markdown\n<!-- test: offline -->\n```python\nraise SystemExit(1)\n```\n````\n"
        "- item\n\n    <!-- test: server -->\n    ```bash\n    curl -s http://127.0.0.1:8000/health\n    ```\n")
    (tmp_path / "docs" / "bad.md").write_text(
        "<!-- test: ofline -->\n```python\n```\n"
        "<!-- test: offline -->\n\n```python\n```\n"
        "<!-- test offline -->\n```python\n```\n"
        "<!-- test: offline -->\n```bash\nls\n```\n"
        "<!-- test: server -->\n```\nls\n```\n")
    got = [(e.id, e.kind, e.language, e.code, bool(e.error)) for e in collect(tmp_path)]
    assert got == [
        ("docs/bad.md:1", "", "", "", True),  # unknown kind
        ("docs/bad.md:4", "", "", "", True),  # a blank line between marker and fence
        ("docs/bad.md:8", "", "", "", True),  # malformed
        ("docs/bad.md:12", "", "", "", True),  # an offline example is python
        ("docs/bad.md:15", "", "", "", True),  # no language
        ("README.md:3", "offline", "python", "print(1)\n", False),
        ("README.md:19", "server", "bash", "curl -s http://127.0.0.1:8000/health\n", False),
    ]
    assert rewrite("http://localhost:8000/v1 127.0.0.1:9000 127.0.0.1:80001", "127.0.0.1:5", "127.0.0.1:6") == \
        "http://127.0.0.1:5/v1 127.0.0.1:6 127.0.0.1:80001"


# last: the server, when one starts, is up only for the examples that need it
@pytest.mark.parametrize("example", [pytest.param(e, id=e.id) for e in EXAMPLES])
def test_example(example: Example, request):
    if example.error:
        pytest.fail(f"{example.id}: {example.error}", pytrace=False)
    if example.kind == "offline":
        run(example, example.code, OFFLINE_TIMEOUT_S)
    else:
        http, grpc = request.getfixturevalue("docs_server")
        run(example, rewrite(example.code, http, grpc), SERVER_TIMEOUT_S)
