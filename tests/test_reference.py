"""The generated reference (docs/reference/*.md): every engine key, speculative config key, serve arg and
`tandem serve` flag is in its table with a description, and a key that exists in one place and not in
another is an explicit exemption in deployments/reference.py, with its reason."""
import argparse
import importlib.util
from pathlib import Path
from types import SimpleNamespace, UnionType
from typing import Union, get_args, get_origin

import pytest

from deployments import reference
from deployments.app import ServeArgs
from deployments.cli import serve_args_from_cli
from engine.config import EngineConfig, SpeculativeConfig

ROOT = Path(__file__).resolve().parent.parent
ENGINE, SERVE, SPEC = set(EngineConfig.model_fields), set(ServeArgs.model_fields), set(SpeculativeConfig.model_fields)
PAGES = {"engine": "reference/engine.md", "speculative": "reference/speculative.md",
         "serve-args": "reference/serve-args.md", "cli": "reference/cli.md"}


def load_hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flags() -> dict[str, argparse.Action]:
    return {a.dest: a for a in reference.cli_actions()}


def non_none(annotation) -> set:
    """The types a field takes besides None (`X | None` -> {X})."""
    if get_origin(annotation) in (Union, UnionType):
        return {a for a in get_args(annotation) if a is not type(None)}
    return {annotation}


# --- one key, every place ---------------------------------------------------------------------------

def test_every_engine_key_is_a_serve_arg_and_a_flag():
    assert set(reference.ENGINE_ONLY) <= ENGINE
    assert ENGINE - SERVE == set(reference.ENGINE_ONLY), "an engine key that is not a serve arg: add it, or list it in ENGINE_ONLY"
    without_flag = {k for k in ENGINE - set(reference.ENGINE_ONLY) if k not in flags()}
    assert without_flag == set(), "an engine key without a `tandem serve` flag"


def test_every_serve_arg_is_an_engine_key_or_serving_only():
    assert SERVE - ENGINE == set(reference.SERVING_ONLY), "a serve arg that is no engine key: list it in SERVING_ONLY"
    assert SERVE - set(flags()) == set(reference.NO_CLI_FLAG), "a serve arg without a flag: add one, or list it in NO_CLI_FLAG"


def test_every_flag_sets_a_serve_arg_or_is_cli_only():
    assert set(flags()) - SERVE == set(reference.CLI_ONLY), "a flag that sets no serve arg: list it in CLI_ONLY"
    # what the parser hands on is serve args only
    assert set(serve_args_from_cli(["m"])["args"]) <= SERVE
    every = serve_args_from_cli(["m", "--no-grpc", "--disjoint-cores", "--no-cpu-kernels", "--tokenizer", "t"])["args"]
    assert every["grpc_port"] is None and every["tokenizer"] == "t" and every["cpu_kernels"] is False


def test_every_exemption_gives_its_reason():
    for name in ("ENGINE_ONLY", "SERVING_ONLY", "NO_CLI_FLAG"):
        for key, reason in getattr(reference, name).items():
            assert isinstance(reason, str) and reason.strip(), f"{name}[{key!r}] has no reason"
    for key, (sets, reason) in reference.CLI_ONLY.items():
        assert sets.strip() and reason.strip(), f"CLI_ONLY[{key!r}]"


def test_defaults_and_types_agree_where_a_key_is_in_two_places():
    for key in ENGINE & SERVE:
        engine, serve = EngineConfig.model_fields[key], ServeArgs.model_fields[key]
        assert non_none(serve.annotation) == non_none(engine.annotation), f"{key}: ServeArgs's type is not the engine's"
        # a serve arg's None means "the engine's default"
        assert serve.default is None or serve.default == engine.default, f"{key}: defaults differ"
        assert reference.effective_serve_default(key) == reference._field_default(EngineConfig, key)
    for dest, action in flags().items():
        if dest in reference.CLI_ONLY:
            continue
        serve = ServeArgs.model_fields[dest]
        # a flag's None leaves the serve arg unset (its own default holds)
        assert action.default is None or action.default == serve.default, f"--{dest}: default differs from the serve arg's"
        if action.choices:
            assert set(action.choices) == {c for a in non_none(serve.annotation) for c in get_args(a)}, dest
    assert flags()["host"].default == ServeArgs.model_fields["grpc_host"].default  # --host sets grpc_host


def test_serve_args_hand_every_engine_key_to_the_engine():
    spec = {"model": "random:tiny-llama:1", "num_speculative_tokens": 2}
    given = {"model": "m", "tokenizer": "t", "dtype": "float16", "max_model_len": 100, "tensor_parallel_size": 2,
             "max_num_seqs": 3, "block_size": 32, "max_num_batched_tokens": 64, "enable_prefix_caching": False,
             "seed": 5, "device": "cpu", "placement_strategy": "SPREAD", "disjoint_cores": True,
             "gguf_weights": "blocks", "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 1000,
             "speculative_config": spec, "cpu_kernels": False, "cpu_isa": "avx2", "rank_threads": 2,
             "placement_timeout_s": 5.0, "omp_spin_count": 1, "prefill_stall_ms": 250.0, "enforce_eager": True}
    assert set(given) == ENGINE & SERVE, "give this test a value for every shared key"
    config = ServeArgs.model_validate(given).engine_config()
    for key, value in given.items():
        if key != "speculative_config":
            assert getattr(config, key) == value and value != EngineConfig.model_fields[key].default, key
    assert config.speculative_config == SpeculativeConfig.model_validate(spec)
    assert config.distributed_executor_backend == "ray"  # ENGINE_ONLY's reason


# --- descriptions and the generated tables -----------------------------------------------------------

def test_every_key_and_flag_has_a_description():
    for model, keys in ((EngineConfig, ENGINE), (SpeculativeConfig, SPEC), (ServeArgs, SERVE)):
        missing = [k for k in keys if not reference.description(model, k).strip()]
        assert missing == [], f"{model.__name__}: keys without a description"
    assert [d for d, a in flags().items() if not (a.help or "").strip()] == []


def test_each_page_has_its_marker_once():
    for name, path in PAGES.items():
        text = (ROOT / "docs" / path).read_text()
        assert text.startswith("# ")
        assert text.count("<!-- reference:") == 1 and f"<!-- reference: {name} -->\n" in text, path


def test_the_hook_lists_every_key():
    hook = load_hook()
    built = {name: hook.render((ROOT / "docs" / path).read_text(), path) for name, path in PAGES.items()}
    assert all("<!-- reference" not in text for text in built.values())
    for name, keys in (("engine", ENGINE), ("speculative", SPEC), ("serve-args", SERVE)):
        rows = [line for line in built[name].splitlines() if line.startswith("| <a id=")]
        assert len(rows) == len(keys), name
        for key in keys:
            assert f'<a id="{key}"></a>`{key}`' in built[name], f"{name}: {key}"
    for var in EngineConfig.ENV_FIELDS:
        assert f"`{var}`" in built["engine"], var
    for action in reference.cli_actions():
        for flag in action.option_strings or [action.dest.upper()]:
            assert f"`{flag}`" in built["cli"], flag
    # links between the reference pages, from a page elsewhere too
    assert "(engine.md#dtype)" in built["serve-args"]
    assert "(../reference/speculative.md)" in hook.render("<!-- reference: engine -->", "serving/cli.md")


def test_speculative_page_as_mkdocs_builds_it():
    hook = load_hook()
    page = SimpleNamespace(file=SimpleNamespace(src_uri="reference/speculative.md"))
    markdown = hook.on_page_markdown((ROOT / "docs/reference/speculative.md").read_text(), page, {}, None)
    assert "`num_speculative_tokens`" in markdown and "| key | type | default | description |" in markdown
    assert "`use_heterogeneous_vocab`" in markdown and "required" in markdown


def test_an_unknown_reference_fails_the_build():
    hook = load_hook()
    with pytest.raises(ValueError, match="unknown reference table 'engines'"):
        hook.render("# x\n\n<!-- reference: engines -->\n", "reference/x.md")
    assert hook.render("no marker here\n") == "no marker here\n"


def test_cells_are_safe_markdown():
    assert reference.cell("a | b <key> `x<y>`") == "a \\| b &lt;key&gt; `x<y>`"
    for name in reference.NAMES:
        header, *rows = reference.table(name).splitlines()
        columns = header.count("|")
        for row in rows:  # no stray pipe splits a cell
            assert row.replace("\\|", "").count("|") == columns, row
