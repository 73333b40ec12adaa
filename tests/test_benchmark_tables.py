"""The benchmark tables of docs/performance.md (docs/hooks/benchmarks.py): every marker on the page
renders, each table has one row per row of its results file (counted here from the JSON, not by the
hook), every results file has a table on the page, and an unknown NAME, a file that doesn't parse or
a row the hook doesn't know fails instead of dropping something. Cheap: no benchmark runs."""
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"


def load_hook():
    spec = importlib.util.spec_from_file_location("docs_benchmarks_hook", ROOT / "docs" / "hooks" / "benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = load_hook()


def markers() -> list[list[str]]:
    return [m.group(1).split() for m in hook.MARKER.finditer(PAGE.read_text())]


def load(name: str):
    return json.loads((RESULTS / f"{name}.json").read_text())


def body_rows(markdown: str) -> list[str]:
    """The body rows of the one table in `markdown` (the lines after its |---| line)."""
    lines = markdown.splitlines()
    sep = [i for i, line in enumerate(lines) if re.fullmatch(r"\|(---\|)+", line)]
    assert len(sep) == 1, markdown
    return [line for line in lines[sep[0] + 1:] if line.startswith("|")]


def expected_rows(name: str) -> int:
    """How many table rows a results file should give, from the JSON's own shape."""
    data = load(name)
    if name == "prefix_bench":  # one row per machine and case
        return len(data) * len(hook.PREFIX_CASES)
    if name == "logit_parity":  # one row per machine, model and gguf_weights form
        return sum(sum(isinstance(v, dict) for v in m.values()) for m in data)
    if name == "int8_linear_bench":  # one row per machine, linear and kernel target
        return sum(len({r["linear"] for r in m["rows"]}) * len(m.get("targets") or [None]) for m in data)
    if name == "structured_bench":  # one row per machine, batch and case (plain, K = 3, adaptive)
        return sum(len(m["batches"]) * 3 for m in data)
    if name == "pard_bench":
        return len(data["speedups"])
    if name == "serve_bench":  # one row per machine, path and concurrency
        return sum(len(m[p]) for m in data for p in ("http", "engine", "local") if p in m)
    if name == "serve_bench_vs_plain":
        return sum(len(m["http"]) for m in data)
    if isinstance(data, list):
        return len(data)
    return len(data["rows"]) if "rows" in data else 1


def test_every_marker_renders():
    text = hook.render(PAGE.read_text())
    assert not hook.MARKER.search(text)
    assert markers(), "docs/performance.md has no benchmark tables"


@pytest.mark.parametrize("names", markers(), ids=" ".join)
def test_one_table_row_per_results_row(names):
    rows = body_rows(hook.table(names))
    if names == ["headline"]:
        llama = {(r["cpu"], r.get("isa", "native")) for r in load("llamacpp_bench") if r["cpu"] != "not recorded"}
        serve = {(r["cpu"], r.get("isa", "native")) for r in load("serve_vs_llama")}
        assert len(rows) == len(llama | serve)
        return
    assert len(rows) == sum(expected_rows(n) for n in names)


def test_per_machine_tables_name_each_machine():
    for names in markers():
        if names == ["headline"] or not hook.SPECS[hook.spec_name(names[0])].per_machine:
            continue
        text = hook.table(names)
        for name in names:
            for row in load(name):
                assert hook.machine(row["cpu"]) in text


def test_every_results_file_is_on_the_page():
    on_page = {n for names in markers() for n in names}
    files = {p.stem for p in RESULTS.glob("*.json")}
    assert files - on_page == set(), "results files without a table on docs/performance.md"


def test_machine_labels():
    assert hook.machine("Intel(R) Xeon(R) Processor (avx2 avx512f avx512_vnni amx_tile amx_int8)") == \
        "Intel Xeon (avx512f, avx512_vnni, amx)"
    assert hook.machine("AMD EPYC (avx2)") == "AMD EPYC (avx2)"
    assert hook.machine("not recorded") == "not recorded"


@pytest.fixture
def results(tmp_path, monkeypatch):
    """A copy of benchmarks/results/ the hook reads instead."""
    shutil.copytree(RESULTS, tmp_path / "results")
    monkeypatch.setattr(hook, "RESULTS", tmp_path / "results")
    return tmp_path / "results"


def test_unknown_name_fails():
    with pytest.raises(ValueError, match="no_such_bench"):
        hook.render("<!-- benchmark: no_such_bench -->\n")


def test_file_without_spec_fails(results):
    (results / "new_bench.json").write_text("[]")
    with pytest.raises(ValueError, match="no table spec"):
        hook.render("<!-- benchmark: new_bench -->\n")


def test_unparseable_file_fails(results):
    (results / "batch_bench.json").write_text("{not json")
    with pytest.raises(ValueError, match="does not parse"):
        hook.render("<!-- benchmark: batch_bench -->\n")


def test_unknown_llamacpp_row_fails(results):
    data = json.loads((results / "llamacpp_bench.json").read_text())
    data[-1]["rows"].append({**data[-1]["rows"][0], "row": "plain Qwen3 Q4_0"})
    (results / "llamacpp_bench.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="Qwen3"):
        hook.render("<!-- benchmark: llamacpp_bench -->\n")


def test_missing_field_fails(results):
    data = json.loads((results / "serve_vs_llama.json").read_text())
    del data[0]["tandem"]
    (results / "serve_vs_llama.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="serve_vs_llama"):
        hook.render("<!-- benchmark: serve_vs_llama -->\n")
