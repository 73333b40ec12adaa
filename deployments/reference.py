"""The reference tables of the docs (docs/reference/*.md), generated from the code.

Four tables, one per place a setting is written:
  engine       EngineConfig: `LLM(...)`'s keyword arguments
  speculative  SpeculativeConfig: the `speculative_config` object, wherever it is given
  serve-args   ServeArgs: an application's `args` in serve_config.yaml
  cli          `tandem serve`'s flags (deployments/cli.py's parser), each setting a serve arg

The MkDocs hook docs/hooks/reference.py replaces a line `<!-- reference: NAME -->` with `table(NAME)`.
A key that exists in one place and not in another must be listed below with the reason;
tests/test_reference.py fails otherwise (and when a listed key no longer needs its exemption).
"""
from __future__ import annotations

import argparse
import html
import json
import types
import typing
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

from deployments.app import ServeArgs
from deployments.cli import serve_parser
from engine.config import EngineConfig, SpeculativeConfig

# Engine keys that are not serve args (and so have no `tandem serve` flag either).
ENGINE_ONLY: dict[str, str] = {
    "distributed_executor_backend": "a served app always runs its model groups as Ray actors "
                                    "(ServeArgs.engine_config sets `ray`)",
}

# Serve args that are not engine keys: they belong to the serving front end, not to the engine.
SERVING_ONLY: dict[str, str] = {
    "served_model_name": "the model's name in the API; the engine never sees it",
    "api_key": "authentication happens in the HTTP and gRPC front ends",
    "api_key_env": "authentication happens in the HTTP and gRPC front ends",
    "api_key_file": "authentication happens in the HTTP and gRPC front ends",
    "grpc_host": "the gRPC server runs in the coordinator, beside the engine",
    "grpc_port": "the gRPC server runs in the coordinator, beside the engine",
    "grpc_share_port": "the gRPC server runs in the coordinator, beside the engine",
    "max_request_bytes": "a limit of the HTTP front end, checked before a request reaches the engine",
    "max_queued_requests": "admission of the serving engine (AsyncEngine); an offline LLM queues every prompt",
    "coordinator_resources": "where Ray Serve places the coordinator replicas",
    "enable_auto_tool_choice": "tool_choice is a chat API field; offline, LLM.chat(tools=...) lets the model choose",
    "tool_call_parser": "tool_choice is a chat API field; offline, LLM.chat takes tool_parser",
    "reasoning_parser": "reasoning is split from the answer by the chat API's responses",
    "chat_template": "chat templates are applied by the request layer; offline, LLM.chat takes chat_template",
    "disable_playground": "the playground is a page of the HTTP front end",
}

# `tandem serve` flags that set no serve arg of their own name: what each sets, and why.
CLI_ONLY: dict[str, tuple[str, str]] = {
    "host": ("the HTTP address; also `grpc_host`",
             "Ray Serve's HTTP options are not application args (`http_options.host` in serve_config.yaml)"),
    "port": ("the HTTP port",
             "Ray Serve's HTTP options are not application args (`http_options.port` in serve_config.yaml)"),
    "no_grpc": ("`grpc_port: null`", "a switch for the one serve arg value a flag can't spell"),
}

# Serve args with no `tandem serve` flag: set them in serve_config.yaml.
NO_CLI_FLAG: dict[str, str] = {
    "api_key_env": "`tandem serve` reads `TANDEM_API_KEY` itself; `--api-key-file` names a file",
    "grpc_host": "set by `--host`: gRPC binds where HTTP binds",
    "grpc_share_port": "several replicas on one node are a serve_config.yaml deployment, not `tandem serve`'s",
    "coordinator_resources": "placing replicas on a cluster is a serve_config.yaml deployment, not `tandem serve`'s",
}

NAMES = ("engine", "speculative", "serve-args", "cli")


def _env_vars(key: str) -> list[str]:
    return [var for var, field in EngineConfig.ENV_FIELDS.items() if field == key]


def cli_actions() -> list[argparse.Action]:
    """The parser's arguments, less --help."""
    return [a for a in serve_parser()._actions if not isinstance(a, argparse._HelpAction)]


def flag_name(action: argparse.Action) -> str:
    """An argument's name: its first long flag (`--cpu-kernels` of `--cpu-kernels/--no-cpu-kernels`), or
    the positional's metavar (MODEL)."""
    return next((f for f in action.option_strings if f.startswith("--")), None) or action.dest.upper()


def cli_flag_of(key: str) -> str | None:
    """The `tandem serve` flag that sets serve arg `key`, if any."""
    return next((flag_name(a) for a in cli_actions() if a.dest == key), None)


def cli_anchor(flag: str) -> str:
    return flag.lstrip("-").lower()


def _field_default(model: type[BaseModel], key: str) -> Any:
    default = model.model_fields[key].default
    return "required" if default is PydanticUndefined else default


def effective_serve_default(key: str) -> Any:
    """A serve arg's default; None on an engine key means the engine's default."""
    value = _field_default(ServeArgs, key)
    if value is None and key in EngineConfig.model_fields:
        return _field_default(EngineConfig, key)
    return value


def description(model: type[BaseModel], key: str) -> str:
    """A key's description; a serve arg that is an engine key without its own takes the engine's."""
    text = model.model_fields[key].description
    if not text and model is ServeArgs and key in EngineConfig.model_fields:
        text = EngineConfig.model_fields[key].description
    return text or ""


# --- formatting ------------------------------------------------------------------------------------

def cell(text: str) -> str:
    """Markdown table cell text: one line, pipes escaped, `<` and `>` escaped outside code spans."""
    parts = str(text).replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = html.escape(parts[i], quote=False)
    return "`".join(parts).replace("|", "\\|")


def code(value: Any) -> str:
    return f"`{value}`"


def show_value(value: Any) -> str:
    """A default as a YAML/JSON reader writes it."""
    if isinstance(value, str) and value == "required":
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return code(json.dumps(value))
    if isinstance(value, float):
        return code(f"{value:g}")
    if isinstance(value, (list, dict)):
        return code(json.dumps(value))
    return code(value)


def type_name(annotation: Any, base: str = "") -> str:
    """A field's type in words (None dropped: the default column says `unset`)."""
    origin = get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return " or ".join(type_name(a, base) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(code(v) for v in get_args(annotation))
    if origin is list:
        return f"list of {type_name(get_args(annotation)[0], base)}"
    if origin is dict:
        key, value = get_args(annotation)
        return f"map of {type_name(key, base)} to {type_name(value, base)}"
    if annotation is SpeculativeConfig:
        return f"object ([speculative config]({base}speculative.md))"
    if annotation is SecretStr:
        return "str (secret)"
    return getattr(annotation, "__name__", str(annotation))


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _anchor(name: str) -> str:
    return f'<a id="{name}"></a>'


# --- the tables ------------------------------------------------------------------------------------

def engine_rows(base: str = "") -> list[list[str]]:
    rows = []
    for key, field in EngineConfig.model_fields.items():
        text = description(EngineConfig, key)
        env = _env_vars(key)
        if env:
            names = " (or ".join(code(v) for v in env) + ")" * (len(env) - 1)
            text += f" Read from {names} when not given."
        rows.append([_anchor(key) + code(key), cell(type_name(field.annotation, base)),
                     show_value(_field_default(EngineConfig, key)), cell(text)])
    return rows


def speculative_rows(base: str = "") -> list[list[str]]:
    return [[_anchor(key) + code(key), cell(type_name(field.annotation, base)),
             show_value(_field_default(SpeculativeConfig, key)), cell(description(SpeculativeConfig, key))]
            for key, field in SpeculativeConfig.model_fields.items()]


def serve_arg_rows(base: str = "") -> list[list[str]]:
    rows = []
    for key, field in ServeArgs.model_fields.items():
        default = show_value(_field_default(ServeArgs, key))
        if key in EngineConfig.model_fields:
            engine = f"[yes]({base}engine.md#{key})"
            if _field_default(ServeArgs, key) is None and _field_default(EngineConfig, key) is not None:
                default = f"the engine's ({show_value(_field_default(EngineConfig, key))})"
        else:
            engine = "no"
        flag = cli_flag_of(key)
        rows.append([_anchor(key) + code(key), cell(type_name(field.annotation, base)), default, engine,
                     f"[{code(flag)}]({base}cli.md#{cli_anchor(flag)})" if flag else "",
                     cell(description(ServeArgs, key))])
    return rows


def cli_rows(base: str = "") -> list[list[str]]:
    rows = []
    for action in cli_actions():
        flags = ", ".join(code(f) for f in action.option_strings) or code(flag_name(action))
        if action.dest in CLI_ONLY:
            sets = cell(CLI_ONLY[action.dest][0])
        else:
            sets = f"[{code(action.dest)}]({base}serve-args.md#{action.dest})"
        # None: the flag leaves the serve arg unset, so the serve arg's default (or the engine's) holds
        value = action.default
        if value is None and action.dest not in CLI_ONLY:
            value = effective_serve_default(action.dest)
        if not action.option_strings:
            default = "required"
        elif isinstance(value, bool):
            default = "on" if value else "off"
        else:
            default = show_value(value)
        text = action.help or ""
        if action.choices:
            text += "; one of " + ", ".join(code(c) for c in action.choices)
        rows.append([_anchor(cli_anchor(flag_name(action))) + flags, sets, default, cell(text)])
    return rows


def table(name: str, base: str = "") -> str:
    """The markdown table NAME (one of NAMES); `base` is the path from the page to docs/reference/."""
    if name == "engine":
        return _table(["key", "type", "default", "description"], engine_rows(base))
    if name == "speculative":
        return _table(["key", "type", "default", "description"], speculative_rows(base))
    if name == "serve-args":
        return _table(["key", "type", "default", "engine key", "CLI flag", "description"], serve_arg_rows(base))
    if name == "cli":
        return _table(["flag", "sets", "default", "help"], cli_rows(base))
    raise ValueError(f"unknown reference table {name!r}; known: {', '.join(NAMES)}")
