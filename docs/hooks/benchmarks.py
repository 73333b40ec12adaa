"""MkDocs hook: fills `<!-- benchmark: NAME -->` markers with tables built from benchmarks/results/.

NAME is a results file's stem (`<!-- benchmark: stall_bench -->` reads benchmarks/results/stall_bench.json);
several stems of the same kind may share one table (`<!-- benchmark: soak soak_default_app -->`).
`headline` is the one NAME that is not a file: llamacpp_bench's ratios per machine with serve_vs_llama's
beside them. A marker is a line of its own. An unknown NAME, a results file without a table spec here, a
file that does not parse or a row this spec does not know fails the build, so the page never drifts from
the results.

Files written by `benchmarks/machine.py` hold one row per machine (CPU model, sometimes per `isa` too);
their tables have a row per machine, or a row per machine and case where one machine's row holds
several cases (prefix_bench, logit_parity, int8_linear_bench, structured_bench). The "recorded" column is the row's date and the commit that added it (found with
`git log -S` on one of its numbers; blank without git); files from before per-machine rows get one
"recorded" line above their table.
"""
from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"^[ \t]*<!--[ \t]*benchmark:[ \t]*([^>]*?)[ \t]*-->[ \t]*$", re.MULTILINE)


# ---------------------------------------------------------------------------------------- formatting

def num(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def ratio(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}x"


def pct(x, digits: int = 0) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def rng(r, digits: int = 2) -> str:
    return f"{r[0]:.{digits}f}-{r[1]:.{digits}f}" if r else ""


def machine(cpu: str) -> str:
    """'Intel(R) Xeon(R) Processor (avx2 avx512f ... amx_tile amx_int8 amx_bf16)' -> 'Intel Xeon (avx512f ..., amx)'."""
    m = re.fullmatch(r"(.*?)\s*\(([^()]*)\)", cpu or "")
    if not m:
        return cpu or "not recorded"
    name = re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b", "", m.group(1))
    name = re.sub(r"\s+", " ", name).strip()
    flags = m.group(2).split()
    if any(f.startswith("amx") for f in flags):
        flags = [f for f in flags if not f.startswith("amx")] + ["amx"]
    if "avx512f" in flags and "avx2" in flags:
        flags.remove("avx2")  # every AVX-512 CPU has it
    return f"{name} ({', '.join(flags)})" if flags else name


def md_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header)] + [line(r) for r in rows])


# ------------------------------------------------------------------------------ when a row was recorded

def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _floats(x):
    if isinstance(x, float):
        yield json.dumps(x)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _floats(v)
    elif isinstance(x, list):
        for v in x:
            yield from _floats(v)


@lru_cache(maxsize=None)
def _committed(rel: str) -> str:
    return _git("show", f"HEAD:{rel}")


_RECORDED: dict[tuple, str] = {}


def recorded(path: Path, row: dict | None = None, parts: str | None = None) -> str:
    """As _recorded; with `parts` (a key of the row holding a list of sub-rows that runs write one kind
    at a time, as llamacpp_bench's decode and prefill rows), the commits that added each sub-row."""
    key = (str(path), json.dumps(row, sort_keys=True), parts)
    if key not in _RECORDED:
        if parts and row and row.get(parts):
            found = [_recorded(path, sub).split(" · ") for sub in row[parts]]
            commits = list(dict.fromkeys(f[-1] for f in found if len(f) == 2))
            date = row.get("date") or max((f[0] for f in found if len(f) == 2), default="")
            _RECORDED[key] = " · ".join(x for x in (date, ", ".join(commits)) if x)
        else:
            _RECORDED[key] = _recorded(path, row)
    return _RECORDED[key]


def _recorded(path: Path, row: dict | None) -> str:
    """'DATE · COMMIT': the row's date (else the commit's) and the commit that added the row (for a
    file without rows per machine: the last commit that wrote the file); 'not committed' for a row
    the working tree has and HEAD doesn't."""
    date = (row or {}).get("date", "")
    if not path.is_relative_to(ROOT):  # a copy elsewhere (the tests'): no history
        return date
    rel = path.relative_to(ROOT).as_posix()
    if row is None:
        if _committed(rel) and _committed(rel) != path.read_text():
            return "not committed"
        found = _git("log", "-1", "--format=%h %ad", "--date=short", "--", rel)
    else:
        text, head = path.read_text(), _committed(rel)
        marks = sorted((s for s in set(_floats(row)) if text.count(s) == 1), key=len, reverse=True)
        if not marks:
            found = ""
        elif marks[0] not in head:
            return f"{date} · not committed".strip(" ·")
        else:
            found = _git("log", "-1", f"-S{marks[0]}", "--format=%h %ad", "--date=short", "--", rel)
    commit, _, commit_date = found.partition(" ")
    return " · ".join(x for x in (date or commit_date, commit) if x)


def recorded_line(paths: list[Path]) -> str:
    where = "; ".join(f"`{p.name}` {recorded(p) or 'not committed'}" for p in paths)
    return f"*Machine not recorded (see [how to read these numbers](#how-to-read-these-numbers)). Recorded: {where}.*"


# --------------------------------------------------------------------------------------- the specs

class Spec:
    """How one kind of results file becomes a table: `rows(data)` the records (one per table row),
    `columns` (header, cell) pairs; `per_machine` files get the machine and recorded columns first."""

    def __init__(self, columns: list[tuple[str, Callable]], rows: Callable | None = None,
                 per_machine: bool = False, isa: bool = False, parts: str | None = None,
                 note: Callable | None = None):
        self.columns, self._rows, self.per_machine, self.isa = columns, rows, per_machine, isa
        self.parts = parts  # see recorded()
        self.note = note  # data -> a line above the table (the file's settings and single numbers)

    def rows(self, data) -> list:
        if self._rows:
            return self._rows(data)
        if isinstance(data, list):
            return data
        return data["rows"] if "rows" in data else [data]


def need(d: dict, key: str):
    if key not in d:
        raise ValueError(f"no {key!r} in {sorted(d)}")
    return d[key]


# llamacpp_bench: each machine row holds sub-rows named like these
LLAMA_ROWS = {
    "plain SmolLM2": "plain SmolLM2-135M Q4_1",
    "plain Gemma": "plain Gemma-3-270M Q4_K_M",
    "speculative": "speculative SmolLM2 F32 <- Q4_1, K=3",
    "default app": "default app Qwen2.5-Coder 1.5B <- 0.5B vs llama-speculative, K=3",
    "default app vs plain": "default app vs llama.cpp plain Qwen2.5-Coder-1.5B",
    "plain Qwen": "plain Qwen2.5-Coder-1.5B Q4_K_M",
    "TLI app": "TLI app Gemma 3 <- SmolLM2 vs llama.cpp plain Gemma",
    "pp512 SmolLM2": "prefill pp512 SmolLM2-135M Q4_1 (TTFT)",
    "pp512 Gemma": "prefill pp512 Gemma-3-270M Q4_K_M (TTFT)",
}


def llama_subrows(machine_row: dict) -> dict:
    subs = {r["row"]: r for r in machine_row["rows"]}
    unknown = set(subs) - set(LLAMA_ROWS.values())
    if unknown:
        raise ValueError(f"llamacpp_bench rows this page does not know: {sorted(unknown)}")
    return {short: subs.get(name) for short, name in LLAMA_ROWS.items()}


def llama_cell(short: str, with_rates: bool) -> Callable:
    def cell(m: dict) -> str:
        r = llama_subrows(m)[short]
        if r is None:
            return ""
        text = f"**{ratio(r['ratio'])}**"
        if with_rates:
            text += f" ({num(r['llama_cpp_tok_s'])} / {num(r['tandem_tok_s'])})"
            if "tandem_acceptance" in r:
                text += f", accepted {r['llama_cpp_acceptance']:.2f} / {r['tandem_acceptance']:.2f}"
            if "prefill_alone_ratio" in r:
                text += f", prefill alone {ratio(r['prefill_alone_ratio'])}"
        return text

    return cell


def isa(row: dict) -> str:
    return row.get("isa", "native")


def serve_key(row: dict) -> tuple:
    return row["cpu"], isa(row)


def headline_rows(_data=None) -> list[dict]:
    """One record per machine and isa: llamacpp_bench's row (machines recorded) and serve_vs_llama's."""
    llama = [r for r in load("llamacpp_bench") if r.get("cpu", "not recorded") != "not recorded"]
    # per stream count, the default app's rows where a machine has them (rows with a model), else the TLI app's
    served = sorted(load("serve_vs_llama"), key=lambda r: "model" in r)
    serve = {n: {serve_key(r): r for r in served if r["concurrency"] == n} for n in (1, 8)}
    keys = list(dict.fromkeys([serve_key(r) for r in llama] + [k for rows in serve.values() for k in rows]))
    by_key = {serve_key(r): r for r in llama}
    return [{"cpu": k[0], "isa": k[1], "llama": by_key.get(k), "serve": serve[8].get(k), "serve_1": serve[1].get(k)}
            for k in keys]


def serve_pair(m: dict) -> str:
    """Rows from before the field: the TLI app (then the default) against llama-server's plain Gemma."""
    if "model" not in m:
        return "TLI app (Gemma 3 <- SmolLM2); plain Gemma"
    return f"`{m['model']}`; " + ("the same pair" if m["llama_cpp_draft"] else "its target, plain")


def headline_cell(short: str) -> Callable:
    def cell(h: dict) -> str:
        return llama_cell(short, False)(h["llama"]) if h["llama"] else ""

    return cell


def serve_ratio(key: str) -> Callable:
    def cell(h: dict) -> str:
        s = h[key]
        return f"**{ratio(s['tandem_over_llama'])}** ({s['date']})" if s else ""

    return cell


def stall(side: dict) -> dict:
    return need(side, "stall")


def trials(side: dict) -> str:
    t = stall(side).get("trials")
    return f"{len(t)}" if t else "1"


def long_stream(side: dict) -> str:
    s = side.get("long_stream")
    if not s:
        return "-"
    text = f"{num(s['ms_per_token_50_150'])} -> {num(s['ms_per_token_late'])} ms ({ratio(s['late_over_early'])})"
    if "tokens_per_chunk" in s:
        text += f", {s['tokens_per_chunk']:.1f} tokens a chunk"
    return text


def chunked_over_one_step(m: dict) -> str:
    chunked = stall(m["tandem"])["long_prompt_ttft_ms"]
    one_step = stall(m["tandem, one-step prefill"])["long_prompt_ttft_ms"]
    return f"{100 * (chunked / one_step - 1):+.1f}%"


def paced_over_unpaced(m: dict) -> str:
    """--unpaced runs: the paced chunks' worst gap and TTFT against the same chunks unpaced."""
    if "tandem, unpaced chunks" not in m:
        return "-"
    paced, unpaced = stall(m["tandem"]), stall(m["tandem, unpaced chunks"])
    return (f"gap {MS(paced['worst_gap_ms'])} vs {MS(unpaced['worst_gap_ms'])}, TTFT "
            f"{MS(paced['long_prompt_ttft_ms'])} vs {MS(unpaced['long_prompt_ttft_ms'])}")


def ab_rates(b: dict) -> str:
    return f"{num(b['base_tok_s'])} / {num(b['new_tok_s'])}"


LOAD_METHODS = {"whole": "whole model read, converted, built, then sliced",
                "sharded": "sharded: meta device, only this rank's slices read"}


def three(m: dict, f: Callable) -> str:
    return " / ".join(f(need(m, side)) for side in ("tandem", "tandem, one-step prefill", "llama.cpp"))


PREFIX_CASES = [
    ("warm / cold TTFT, ~1500-token shared prefix", lambda s: ratio(s["shared_prefix"]["warm_over_cold"], 3)),
    ("cold TTFT, median", lambda s: f"{median(s['shared_prefix']['cold_ttft_ms']):.0f} ms"),
    ("warm TTFT, median", lambda s: f"{median(s['shared_prefix']['warm_ttft_ms']):.0f} ms"),
    ("6-turn chat, TTFT per turn (ms)", lambda s: ", ".join(f"{x:.0f}" for x in s["chat"]["ttft_ms_per_turn"])),
    ("a ~6000-token prompt: status, TTFT",
     lambda s: f"{s['long_prompt']['status']}, {s['long_prompt']['ttft_ms']:.0f} ms"),
    ("of 12 short requests, most running at once (1 GiB KV, context 8192)",
     lambda s: str(s["concurrency_1gib_8192"]["most_running_at_once"])),
    ("prefix-cache hits / queries, target; draft",
     lambda s: f"{s['prefix_cache_hits']['target']:.0f} / {s['prefix_cache_queries']['target']:.0f}; "
               f"{s['prefix_cache_hits']['draft']:.0f} / {s['prefix_cache_queries']['draft']:.0f}"),
]
PREFIX_SIDES = ("tandem", "tandem, every request drafting", "llama.cpp")


def median(xs: list) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def prefix_rows(data: list) -> list:
    for m in data:
        unknown = set(m) - {"cpu", "threads", "rounds", "date", *PREFIX_SIDES}
        if unknown:
            raise ValueError(f"prefix_bench keys this page does not know: {sorted(unknown)}")
    return [{**m, "_m": m, "_case": c} for m in data for c in PREFIX_CASES]


def prefix_cell(side: str) -> Callable:
    def cell(r: dict) -> str:
        try:
            return r["_case"][1](r[side])
        except KeyError:
            return "-"

    return cell


PARITY_KEY = re.compile(r"(.+), (int8|blocks|float32)")


def parity_rows(data: list) -> list:
    out = []
    for m in data:
        for k, v in m.items():
            if k in ("cpu", "date"):
                continue
            if not PARITY_KEY.fullmatch(k):
                raise ValueError(f"logit_parity key this page does not know: {k!r}")
            out.append({"cpu": m["cpu"], "date": m.get("date"), "_m": m, "_key": k, **v})
    return out


INT8_ROWS = (1, 5, 8, 40, 64, 256)


def int8_rows(data: list) -> list:
    out = []
    for m in data:
        by_linear: dict[str, dict[int, dict]] = {}
        for r in m["rows"]:
            if r["rows"] not in INT8_ROWS:
                raise ValueError(f"int8_linear_bench row count this page does not show: {r['rows']}")
            by_linear.setdefault(r["linear"], {})[r["rows"]] = r
        for linear, cells in by_linear.items():
            first = next(iter(cells.values()))["int8_ms"]
            targets = list(first) if isinstance(first, dict) else [None]
            for t in targets:
                out.append({"cpu": m["cpu"], "date": m.get("date"), "_m": m, "linear": linear,
                            "target": t, "cells": cells})
    return out


def int8_cell(n: int) -> Callable:
    def cell(r: dict) -> str:
        c = r["cells"].get(n)
        if not c:
            return ""
        t = c["int8_ms"][r["target"]] if r["target"] else c["int8_ms"]
        return ratio(c["blocks_ms"] / t, 1)

    return cell


STRUCT_CASES = ("plain", "speculative", "adaptive")
STRUCT_VARIANTS = ("free", "schema", "schema-T0.7")
STRUCT_NAMES = {"plain": "plain Gemma", "speculative": "K = 3", "adaptive": "adaptive K (default app)"}


def struct_rows(data: list) -> list:
    out = []
    for m in data:
        for batch, b in m["batches"].items():
            unknown = {k.split("/")[0] for k in b["rows"]} - set(STRUCT_CASES)
            if unknown:
                raise ValueError(f"structured_bench cases this page does not know: {sorted(unknown)}")
            for case in STRUCT_CASES:
                out.append({"cpu": m["cpu"], "_m": m, "batch": batch, "case": case, "b": b})
    return out


def struct_cell(f: Callable, fmt: Callable) -> Callable:
    def cell(r: dict) -> str:
        vals = []
        for v in STRUCT_VARIANTS:
            key = f"{r['case']}/{v}"
            row = r["b"]["rows"].get(key)
            vals.append(fmt(f(row, r["b"], key)) if row else "-")
        return " / ".join(vals)

    return cell


def struct_accept(row, b, key):
    a = row.get("acceptance_rate")
    return None if a is None or (a == 0 and key.startswith("adaptive")) else a


SERVE_PATHS = {"http": "HTTP", "engine": "engine, Ray actors", "local": "engine, models in process"}
SERVE_RUN_KEYS = {"cpu", "date", "paths", "model", "requests", "max_tokens", "rounds", "acceptance", "paired",
                  "paired_engine_local"}


def serve_rows(data: list) -> list:
    out = []
    for m in data:
        unknown = set(m) - SERVE_RUN_KEYS - set(SERVE_PATHS)
        if unknown:
            raise ValueError(f"serve_bench keys this page does not know: {sorted(unknown)}")
        out += [{"_m": m, "path": p, "c": c, **v} for p in SERVE_PATHS for c, v in m.get(p, {}).items()]
    return out


def serve_note(data: list) -> str:
    """Each run's acceptance and its paired comparisons, by machine."""
    lines = []
    for m in data:
        paired = " ".join(
            f"Concurrency {c}: TPOT over HTTP {p['tpot_ratio']:.2f}x the engine's behind Ray actors, TTFT "
            f"{p['ttft_overhead_ms']:+.1f} ms" + (
                f"; behind Ray actors {m['paired_engine_local'][c]['tpot_ratio']:.2f}x with the models in process"
                if c in m.get("paired_engine_local", {}) else "") + " (medians paired by request)."
            for c, p in m.get("paired", {}).items())
        app = f" (`{m['model']}`)" if "model" in m else ""
        lines.append(f"{machine(m['cpu'])}{app}: acceptance rate {m['acceptance']['acceptance_rate']:.2f}, mean "
                     f"acceptance length {m['acceptance']['mean_acceptance_length']:.2f}. {paired}".strip())
    return "Milliseconds. " + " ".join(lines)


def vs_plain_rows(data: list) -> list:
    return [{"_m": m, "c": c, "spec": v, "plain": m["plain"][c], "ratio": m["speculative_over_plain"][c],
             "rounds": m["round_ratios"][c]} for m in data for c, v in m["http"].items()]


def pard_rows(data: dict) -> list:
    costs = {c["k"]: c for c in data["costs"]}
    missing = set(costs) - {s["k"] for s in data["speedups"]}
    if missing:
        raise ValueError(f"pard_bench costs without a speedup row: K = {sorted(missing)}")
    return [{**s, "cost": costs.get(s["k"])} for s in data["speedups"]]


def pard_cost(key: str) -> Callable:
    return lambda r: num(r["cost"][key]) if r["cost"] else ""


def soak_name(r: dict) -> str:
    return f"`{r['model']}` <- `{r['draft']}`, {r['max_num_seqs']} slots"


def spec_a(r: dict) -> str:
    return "-" if r["pair"] == "real" else f"{r['alpha_config']}"


MS = lambda x: f"{x:.0f} ms"  # noqa: E731
GIB = 2 ** 30

SPECS: dict[str, Spec] = {
    "headline": Spec([
        ("CPU", lambda h: machine(h["cpu"])),
        ("kernels", lambda h: h["isa"]),
        ("recorded", lambda h: recorded(RESULTS / "llamacpp_bench.json", h["llama"], "rows") if h["llama"] else ""),
        ("default app vs llama-speculative", headline_cell("default app")),
        ("default app vs llama.cpp plain", headline_cell("default app vs plain")),
        ("plain Qwen 1.5B Q4_K_M", headline_cell("plain Qwen")),
        ("plain SmolLM2 Q4_1", headline_cell("plain SmolLM2")),
        ("plain Gemma 3 Q4_K_M", headline_cell("plain Gemma")),
        ("speculative SmolLM2", headline_cell("speculative")),
        ("TLI app", headline_cell("TLI app")),
        ("prefill pp512 SmolLM2", headline_cell("pp512 SmolLM2")),
        ("prefill pp512 Gemma", headline_cell("pp512 Gemma")),
        ("1 stream over HTTP", serve_ratio("serve_1")),
        ("8 streams over HTTP", serve_ratio("serve")),
    ], rows=headline_rows),
    "llamacpp_bench": Spec([
        ("rounds", lambda m: str(m["rounds"])),
        ("default app (Qwen 1.5B <- 0.5B) vs llama-speculative, K=3", llama_cell("default app", True)),
        ("default app vs llama.cpp plain Qwen 1.5B", llama_cell("default app vs plain", True)),
        ("plain Qwen2.5-Coder 1.5B Q4_K_M", llama_cell("plain Qwen", True)),
        ("plain SmolLM2 Q4_1", llama_cell("plain SmolLM2", True)),
        ("plain Gemma 3 Q4_K_M", llama_cell("plain Gemma", True)),
        ("speculative SmolLM2 F32 <- Q4_1, K=3", llama_cell("speculative", True)),
        ("TLI app vs plain Gemma", llama_cell("TLI app", True)),
        ("pp512 SmolLM2 (TTFT)", llama_cell("pp512 SmolLM2", True)),
        ("pp512 Gemma (TTFT)", llama_cell("pp512 Gemma", True)),
    ], per_machine=True, isa=True, parts="rows"),
    "serve_vs_llama": Spec([
        ("Tandem's app; llama-server", serve_pair),
        ("streams x tokens, rounds", lambda m: f"{m['concurrency']} x {m['max_tokens']}, {m['rounds']}"),
        ("output tok/s, Tandem / llama-server",
         lambda m: f"{num(m['tandem']['output_throughput'])} / {num(m['llama.cpp']['output_throughput'])}"),
        ("Tandem / llama-server (rounds)",
         lambda m: f"**{ratio(m['tandem_over_llama'])}** ({rng([min(m['round_ratios']), max(m['round_ratios'])])})"),
        ("TTFT p50", lambda m: f"{MS(m['tandem']['ttft_ms']['p50'])} / {MS(m['llama.cpp']['ttft_ms']['p50'])}"),
        ("TTFT p90", lambda m: f"{MS(m['tandem']['ttft_ms']['p90'])} / {MS(m['llama.cpp']['ttft_ms']['p90'])}"),
        ("TPOT p50", lambda m: f"{num(m['tandem']['tpot_ms']['p50'])} / {num(m['llama.cpp']['tpot_ms']['p50'])} ms"),
    ], per_machine=True, isa=True),
    "stall_bench": Spec([
        ("trials", lambda m: trials(m["tandem"])),
        ("streams' worst gap", lambda m: three(m, lambda s: MS(stall(s)["worst_gap_ms"]))),
        ("worst gap / median gap", lambda m: three(m, lambda s: f"{stall(s)['worst_ratio']:.1f}x")),
        ("long prompt's TTFT", lambda m: three(m, lambda s: MS(stall(s)["long_prompt_ttft_ms"]))),
        ("chunked TTFT over one-step", chunked_over_one_step),
        ("paced vs unpaced chunks", paced_over_unpaced),
        ("long stream, Tandem: tokens 50-150 -> 900-1000", lambda m: long_stream(m["tandem"])),
        ("long stream, llama-server", lambda m: long_stream(m["llama.cpp"])),
    ], per_machine=True, isa=True),
    "prefix_bench": Spec([
        ("case", lambda r: r["_case"][0]),
        ("Tandem (default app)", prefix_cell("tandem")),
        ("Tandem, every request drafting", prefix_cell("tandem, every request drafting")),
        ("llama-server", prefix_cell("llama.cpp")),
    ], rows=prefix_rows, per_machine=True),
    "structured_bench": Spec([
        ("batch", lambda r: r["batch"]),
        ("case", lambda r: STRUCT_NAMES[r["case"]]),
        ("tok/s: free / schema / schema T 0.7", struct_cell(lambda row, b, k: row["tok_s"], num)),
        ("vs plain", struct_cell(lambda row, b, k: b.get("speedup", {}).get(k),
                                 lambda x: ratio(x) if x is not None else "-")),
        ("acceptance", struct_cell(struct_accept, lambda x: f"{x:.3f}" if x is not None else "-")),
        ("mean accepted length", struct_cell(lambda row, b, k: row.get("mean_acceptance_length")
                                             if struct_accept(row, b, k) is not None else None,
                                             lambda x: f"{x:.2f}" if x is not None else "-")),
        ("grammar share of forward", struct_cell(lambda row, b, k: row["grammar_share_of_forward"],
                                                 lambda x: pct(x, 1))),
        ("valid JSON (schema)", lambda r: str(r["b"]["rows"][f"{r['case']}/schema"]["valid_json"])),
    ], rows=struct_rows, per_machine=True),
    "logit_parity": Spec([
        ("model", lambda r: PARITY_KEY.fullmatch(r["_key"]).group(1)),
        ("gguf_weights", lambda r: PARITY_KEY.fullmatch(r["_key"]).group(2)),
        ("largest logit difference (prefill / decode+verify)",
         lambda r: f"{r['max_abs_diff']:.3g} "
                   f"({r['max_abs_diff_prefill']:.3g} / {r['max_abs_diff_decode_verify']:.3g})"),
        ("largest logit", lambda r: num(r["max_abs_logit"])),
        ("mean KL", lambda r: f"{max(r['mean_kl'], 0.0):.2g}"),
        ("argmax equal", lambda r: f"{r['argmax_agrees']} of {r['positions']}"),
    ], rows=parity_rows, per_machine=True),
    "int8_linear_bench": Spec([
        ("linear", lambda r: r["linear"]),
        ("int8 kernel target", lambda r: r["target"] or "best"),
    ] + [(f"{n} row{'s' if n > 1 else ''}", int8_cell(n)) for n in INT8_ROWS],
        rows=int8_rows, per_machine=True),
    "ab_decode": Spec([
        ("base", lambda m: f"`{m['base']}`"),
        ("model", lambda m: m["model"].split("/")[-1]),
        ("rounds", lambda m: str(len(m["runs"]["base"]))),
        ("batch 1: base / new tok/s", lambda m: ab_rates(m["batch_1"])),
        ("new / base (rounds)", lambda m: f"{ratio(m['batch_1']['ratio'], 3)} ({rng(m['batch_1']['range'])})"),
        ("batch 8: base / new tok/s", lambda m: ab_rates(m["batch_8"])),
        ("new / base (rounds) ", lambda m: f"{ratio(m['batch_8']['ratio'], 3)} ({rng(m['batch_8']['range'])})"),
    ], per_machine=True),
    "decode_step": Spec([
        ("model", lambda r: r["model"]),
        ("dtype", lambda r: r["dtype"]),
        ("floor ms", lambda r: num(r["floor_ms"])),
        ("ours, 1 token", lambda r: num(r["ours_1"])),
        ("ours, 5 tokens", lambda r: num(r["ours_5"])),
        ("5/1", lambda r: f"{r['ours_5_over_1']:.2f}"),
        ("oneDNN, 1 / 5 tokens", lambda r: f"{num(r['onednn_1'])} / {num(r['onednn_5'])}" if "onednn_1" in r else "-"),
        ("HF, 1 token", lambda r: num(r["hf_1"])),
        ("HF, 5 tokens", lambda r: num(r["hf_5"])),
        ("HF 5/1", lambda r: f"{r['hf_5_over_1']:.2f}"),
        ("HF / ours", lambda r: ratio(r["hf_1_over_ours_1"])),
    ], note=lambda d: f"Milliseconds per forward; {d['context']} tokens cached, {d['threads']} threads; the floor is "
                      f"the weights' bytes at {d['bandwidth_gb_s']:.1f} GB/s, the fastest float32 matrix-vector "
                      "rate measured in the same run."),
    "gpu_speed": Spec([
        ("device", lambda r: r["device"]),
        ("date", lambda r: r["date"]),
        ("target / draft", lambda r: f"`{r['target']}` / `{r['draft']}`, {r['dtype']}"),
        ("K, acceptance length", lambda r: f"{r['k']}, {r['mean_acceptance_length']:.2f}"),
        ("step", lambda r: "compiled, CUDA graphs" if "plain_eager_tok_s" in r else "eager (before graphs)"),
        ("plain tok/s", lambda r: num(r["plain_tok_s"])),
        ("speculative tok/s", lambda r: num(r["spec_tok_s"])),
        ("speculative / plain", lambda r: ratio(r["speedup"])),
        ("eager: plain, speculative tok/s", lambda r: f"{num(r['plain_eager_tok_s'])}, {num(r['spec_eager_tok_s'])}"
                                                       if "plain_eager_tok_s" in r else "-"),
        ("batch 8 / 32: speculative / plain", lambda r: f"{ratio(r['batch8_speedup'])} / {ratio(r['batch32_speedup'])}"
                                                         if "batch32_speedup" in r else "-"),
        ("plain step ms", lambda r: num(r["plain_step_ms"])),
        ("weights at copy bandwidth ms", lambda r: f"{num(r['roofline_step_ms'])} ({pct(r['roofline_fraction'])})"),
        ("speculative round ms", lambda r: num(r["spec_round_ms"])),
    ]),
    "batch_bench": Spec([
        ("speculation", lambda r: "on (self-draft, K=3)" if r["speculation"] else "off"),
        ("requests in flight", lambda r: str(r["concurrency"])),
        ("tok/s", lambda r: num(r["tok_s"])),
        ("vs 1 in flight", lambda r: ratio(r["vs_single"])),
    ], note=lambda d: f"{d['max_tokens']} tokens a request. One engine step at batch 1, speculation on: "
                      f"LocalExecutor {d['step_ms']['local']:.1f} ms, RayExecutor {d['step_ms']['ray']:.1f} ms "
                      f"({d['step_ms']['ray'] / d['step_ms']['local']:.2f}x)."),
    "trace_cost": Spec([
        ("model, requests per side", lambda m: f"`{m['model']}`, {m['requests_per_side']} x {m['max_tokens']} tokens"),
        ("median stream, without / with", lambda m: f"{m['without']['median_s']:.3f} / {m['with']['median_s']:.3f} s"),
        ("time, with / without", lambda m: f"**{ratio(m['time_ratio_with_over_without'], 3)}**"),
        ("bytes, without / with", lambda m: f"{m['without']['median_bytes']:,.0f} / {m['with']['median_bytes']:,.0f}"),
        ("bytes, with / without", lambda m: ratio(m["bytes_ratio_with_over_without"])),
    ], per_machine=True),
    "load_bench": Spec([
        ("method", lambda r: LOAD_METHODS.get(r["method"], r["method"])),
        ("peak RSS", lambda r: f"{r['peak_rss'] / GIB:.2f} GiB"),
        ("shard", lambda r: f"{r['shard_bytes'] / GIB:.2f} GiB"),
        ("peak / shard", lambda r: ratio(r["peak_over_shard"])),
        ("time", lambda r: f"{r['seconds']:.1f} s"),
    ], note=lambda d: f"`{d['preset']}`, rank {d['rank']} of {d['world']}, from a {d['checkpoint_dtype']} "
                      "safetensors directory, float32 on CPU."),
    "tli_bench": Spec([
        ("K", lambda r: str(r["k"])),
        ("drafting", lambda r: r["drafting"]),
        ("requests", lambda r: r["requests"]),
        ("acceptance", lambda r: f"{r['acceptance_rate']:.2f}"),
        ("mean length", lambda r: f"{r['mean_acceptance_length']:.2f}"),
        ("tok/s", lambda r: num(r["tok_s"])),
        ("vs plain", lambda r: ratio(r["speedup"])),
    ], note=lambda d: (
        f"{d['prompts']} prompts x {d['max_tokens']} tokens, one request at a time. Common tokens: "
        f"{d['intersection']['common']:,} ({pct(d['intersection']['target_share'], 1)} of Gemma's vocabulary, "
        f"{pct(d['intersection']['draft_share'], 1)} of SmolLM2's). "
        f"Plain Gemma: {d['plain_tok_s']['greedy']:.1f} tok/s "
        f"greedy, {d['plain_tok_s']['sampled']:.1f} sampled (T 0.8, top-p 0.95). Acceptance at K=3 (greedy) "
        f"re-tokenizing the target tokens the draft lacks: {d['retokenize_acceptance']['with']:.3f}; feeding it "
        f"`<unk>` instead: {d['retokenize_acceptance']['without']:.3f}."
        + (f" transformers' assisted generation on the same pair: {d['hf']['hf_assisted_tok_s']:.1f} tok/s against "
           f"its own plain decoding's {d['hf']['hf_plain_tok_s']:.1f} "
           f"({d['hf']['hf_assisted_tok_s'] / d['hf']['hf_plain_tok_s']:.2f}x)." if d.get("hf") else ""))),
    "spec_bench": Spec([
        ("pair", lambda r: "(a) real TLI pair" if r["pair"] == "real" else "(b) synthetic"),
        ("a", spec_a),
        ("K", lambda r: str(r["k"])),
        ("acceptance", lambda r: f"{r['acceptance_rate']:.2f}"),
        ("mean length", lambda r: f"{r['mean_acceptance_length']:.2f}"),
        ("plain tok/s", lambda r: num(r["plain_tok_s"])),
        ("speedup", lambda r: ratio(r["speedup"])),
        ("c", lambda r: f"{r['c']:.2f}" if "c" in r else ""),
        ("v", lambda r: f"{r['v']:.2f}" if "v" in r else ""),
        ("predicted", lambda r: f"{r['predicted']:.2f}" if "predicted" in r else ""),
        ("mean K", lambda r: f"{r['mean_k']:.1f}"),
    ]),
    "spec_bench_qwen-coder": Spec([
        ("K", lambda r: str(r["k"])),
        ("acceptance", lambda r: f"{r['acceptance_rate']:.2f}"),
        ("mean length", lambda r: f"{r['mean_acceptance_length']:.2f}"),
        ("plain tok/s", lambda r: num(r["plain_tok_s"])),
        ("speedup", lambda r: f"**{ratio(r['speedup'])}**"),
        ("predicted", lambda r: f"{r['predicted']:.2f}" if r.get("predicted") else ""),
        ("measured / predicted", lambda r: pct(r["speedup"] / r["predicted"]) if r.get("predicted") else ""),
        ("mean K", lambda r: f"{r['mean_k']:.1f}"),
    ], per_machine=True),
    "spec_bench_qwen-coder_chat": Spec([
        ("temperature", lambda r: f"{r['temperature']:g}"),
        ("K", lambda r: str(r["k"])),
        ("draft head", lambda r: f"{r['draft_head_tokens']:,} tokens" if r.get("draft_head_tokens") else "whole"),
        ("acceptance", lambda r: f"{r['acceptance_rate']:.2f}"),
        ("mean length", lambda r: f"{r['mean_acceptance_length']:.2f}"),
        ("c", lambda r: f"{r['c']:.2f}" if "c" in r else ""),
        ("plain tok/s", lambda r: num(r["plain_tok_s"])),
        ("speedup", lambda r: f"**{ratio(r['speedup'])}**"),
        ("predicted", lambda r: f"{r['predicted']:.2f}" if r.get("predicted") else ""),
        ("measured / predicted", lambda r: pct(r["speedup"] / r["predicted"]) if r.get("predicted") else ""),
    ], per_machine=True),
    "round_bench": Spec([
        ("pair", lambda r: r["pair"]),
        ("temperature", lambda r: f"{r['temperature']:g}"),
        ("K", lambda r: str(r["k"])),
        ("draft step ms (floor)", lambda r: f"{r['spec']['draft_step_ms']:.1f} ({r['draft_floor_ms']:.1f})"),
        ("target step ms (floor)", lambda r: f"{r['plain']['verify_forward_ms']:.1f} ({r['target_floor_ms']:.1f})"),
        ("round ms: draft / verify / sampling / host",
         lambda r: "{:.1f} / {:.1f} / {:.1f} / {:.1f}".format(
             r["spec"]["draft_forward"], r["spec"]["verify_forward"],
             r["spec"]["draft_sampling"] + r["spec"]["verify_sampling"], r["spec"]["engine_host"])),
        ("tokens / round", lambda r: f"{r['spec']['tokens']:.2f}"),
        ("c", lambda r: f"{r['c']:.2f}"),
        ("v", lambda r: f"{r['v']:.2f}"),
        ("speedup", lambda r: f"**{ratio(r['measured'])}**"),
        ("predicted", lambda r: ratio(r["predicted"])),
        ("measured / predicted", lambda r: pct(r["measured"] / r["predicted"])),
        ("at the floors", lambda r: ratio(r["at_floor"])),
    ], per_machine=True),
    "pard_bench": Spec([
        ("a", lambda r: str(r["alpha"])),
        ("K", lambda r: str(r["k"])),
        ("draft ms: sequential / parallel",
         lambda r: f"{pard_cost('sequential_ms')(r)} / {pard_cost('parallel_ms')(r)}"),
        ("plain tok/s", lambda r: f"{r['plain_tok_s']:.2f}"),
        ("sequential", lambda r: ratio(r["sequential_speedup"])),
        ("parallel", lambda r: ratio(r["parallel_speedup"])),
        ("parallel / sequential", lambda r: f"**{ratio(r['parallel_over_sequential'])}**"),
        ("mean length", lambda r: f"{r['mean_acceptance_length']:.2f}"),
    ], note=lambda d: f"Target `{d['target']}` <- draft `{d['draft']}`; one target step at 64 cached tokens: "
                      f"{d['costs'][0]['target_step_ms']:.0f} ms.", rows=pard_rows),
    "ahead_bench": Spec([
        ("pair", lambda r: r["pair"]),
        ("a", lambda r: str(r["alpha"]) if isinstance(r["alpha"], (int, float)) else "real"),
        ("K", lambda r: str(r["k"])),
        ("sequential tok/s", lambda r: f"{r['seq_tok_s']:.2f}"),
        ("draft-ahead (range)", lambda r: f"{ratio(r['speedup'])} ({rng(r['speedup_range'])})"),
        ("bound", lambda r: ratio(r["predicted"])),
        ("of bound", lambda r: pct(r["of_bound"])),
        ("auto (range)", lambda r: f"{ratio(r['auto'])} ({rng(r['auto_range'])})"),
        ("ahead", lambda r: pct(r["auto_rounds_ahead"])),
        ("D ms", lambda r: f"{r['draft_ms']:.0f}"),
        ("V ms", lambda r: f"{r['verify_ms']:.0f}"),
        ("V|A ms", lambda r: f"{r['verify_overlapped_ms']:.0f}"),
        ("A ms", lambda r: f"{r['ahead_ms']:.0f}"),
        ("blocks used", lambda r: pct(r["blocks_used"])),
    ], note=lambda d: f"{d['prompts']} prompts x {d['max_tokens']} tokens."),
    "sampling_bench": Spec([
        ("prompts, drafts, top-p",
         lambda r: f"{r['_f']['prompts']}, {r['_f']['drafts']}, {r['_f']['params']['top_p']}"),
        ("batch", lambda r: str(r["batch"])),
        ("K", lambda r: str(r["k"])),
        ("forward ms", lambda r: num(r["forward_ms"])),
        ("per-row loop ms", lambda r: num(r["before_ms"])),
        ("dense ms", lambda r: num(r["dense_ms"])),
        ("after ms", lambda r: num(r["after_ms"])),
        ("dense / forward", lambda r: pct(r["dense_share"])),
        ("after / forward", lambda r: f"**{pct(r['after_share'])}**"),
    ], rows=lambda d: [{**r, "_f": d} for r in d["rows"]]),
    "scale_bench": Spec([
        ("offered", lambda r: f"{r['_f']['rate']:g} req/s x {r['_f']['seconds']:g} s"),
        ("replicas", lambda r: str(r["replicas"])),
        ("requests (wrong)", lambda r: f"{r['requests']} ({r['incorrect']})"),
        ("tok/s", lambda r: num(r["tokens_per_s"])),
        ("TTFT p50", lambda r: MS(r["ttft_p50_ms"])),
        ("TTFT p99", lambda r: MS(r["ttft_p99_ms"])),
        ("latency p50", lambda r: MS(r["latency_p50_ms"])),
        ("latency p99", lambda r: MS(r["latency_p99_ms"])),
    ], note=lambda d: f"{d['max_tokens']}-token requests, `TANDEM_RANK_THREADS={d['rank_threads']}`.",
        rows=lambda d: [{**r, "_f": d} for r in d["rows"]]),
    "serve_bench": Spec([
        ("path", lambda r: SERVE_PATHS[r["path"]]),
        ("concurrency", lambda r: r["c"]),
        ("TTFT p50", lambda r: num(r["ttft_ms"]["p50"])),
        ("TTFT p99", lambda r: num(r["ttft_ms"]["p99"])),
        ("TPOT p50", lambda r: num(r["tpot_ms"]["p50"])),
        ("ITL p50", lambda r: num(r["itl_ms"]["p50"])),
        ("E2E p50", lambda r: num(r["e2e_ms"]["p50"])),
        ("req/s", lambda r: f"{r['request_throughput']:.2f}"),
        ("tok/s", lambda r: num(r["output_throughput"])),
    ], note=serve_note, rows=serve_rows, per_machine=True),
    "serve_bench_vs_plain": Spec([
        # rows from before the field: the default app was then the TLI pair
        ("app", lambda r: f"`{r['_m']['model']}`" if "model" in r["_m"] else "Gemma 3 <- SmolLM2 (TLI)"),
        ("concurrency", lambda r: r["c"]),
        ("default app tok/s", lambda r: num(r["spec"]["output_throughput"])),
        ("plain tok/s", lambda r: num(r["plain"]["output_throughput"])),
        ("ratio (rounds)", lambda r: f"{ratio(r['ratio'])} ({rng([min(r['rounds']), max(r['rounds'])])})"),
        ("TPOT p50, default app / plain",
         lambda r: f"{num(r['spec']['tpot_ms']['p50'])} / {num(r['plain']['tpot_ms']['p50'])} ms"),
    ], note=lambda d: " ".join("{}: acceptance rate {:.2f}, mean acceptance length {:.2f}.".format(
        machine(m["cpu"]), m["acceptance"]["acceptance_rate"], m["acceptance"]["mean_acceptance_length"])
        for m in d), rows=vs_plain_rows, per_machine=True),
    "soak": Spec([
        ("app", soak_name),
        ("clients", lambda r: str(r["clients"])),
        ("seconds", lambda r: f"{r['duration_s']:.1f}"),
        ("sent", lambda r: str(r["sent"])),
        ("ok", lambda r: str(r["ok"])),
        ("429", lambda r: str(r["429"])),
        ("expected 4xx", lambda r: str(r["expected_4xx"])),
        ("errors", lambda r: str(r["errors"])),
        ("corrupted", lambda r: str(r["corrupted"])),
        ("worker restarts", lambda r: str(r["worker_restarts"])),
        ("RSS before -> after", lambda r: f"{r['rss_before_mb']:.0f} -> {r['rss_after_mb']:.0f} MB"),
    ]),
}
# files of one kind: NAME's spec is the first of these prefixes it starts with
KINDS = {"sampling_bench_": "sampling_bench", "scale_bench_rate": "scale_bench", "soak_": "soak"}


def spec_name(name: str) -> str:
    if name in SPECS:
        return name
    for prefix, kind in KINDS.items():
        if name.startswith(prefix):
            return kind
    raise ValueError(f"benchmark {name!r}: no table spec in docs/hooks/benchmarks.py")


# ------------------------------------------------------------------------------------------ rendering

def load(name: str):
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"benchmark {name!r}: no file benchmarks/results/{name}.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"benchmarks/results/{name}.json does not parse: {e}") from None


def table(names: list[str]) -> str:
    """The markdown for one marker: NAMEs of one kind, their rows in one table."""
    kinds = {spec_name(n) for n in names}
    if len(kinds) != 1:
        raise ValueError(f"benchmarks {names}: one table needs files of one kind, not {sorted(kinds)}")
    spec = SPECS[kinds.pop()]
    header = [h for h, _ in spec.columns]
    rows, plain_files, notes = [], [], []
    for name in names:
        data = load(name) if name != "headline" else None
        path = RESULTS / f"{name}.json"
        try:
            for r in spec.rows(data):
                cells = [f(r) for _, f in spec.columns]
                if spec.per_machine:
                    source = r.get("_m", r)
                    cells = [machine(source.get("cpu")), recorded(path, source, spec.parts)] + \
                            ([isa(source)] if spec.isa else []) + cells
                rows.append(cells)
            if spec.note:
                notes.append(spec.note(data))
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            raise ValueError(f"benchmarks/results/{name}.json: {e!r}") from None
        if not spec.per_machine and name != "headline":
            plain_files.append(path)
    if spec.per_machine:
        header = ["CPU", "recorded"] + (["kernels"] if spec.isa else []) + header
    lines = ([recorded_line(plain_files)] if plain_files else []) + list(dict.fromkeys(notes))
    return "\n\n".join(lines + [md_table(header, rows)])


def render(markdown: str, src_uri: str = "performance.md") -> str:
    """`markdown` with every marker replaced. ValueError on an unknown NAME or an unreadable file."""

    def sub(match: re.Match) -> str:
        try:
            return "\n" + table(match.group(1).split()) + "\n"
        except ValueError as e:
            raise ValueError(f"{src_uri}: {e}") from None

    return MARKER.sub(sub, markdown)


def on_page_markdown(markdown, page, config, files):
    return render(markdown, page.file.src_uri)
