"""Tool-call formats for `tool_choice: "auto"`: how a model family writes its calls, the lazy grammar
that holds a call to the tools' schemas once it has begun, and an incremental parser that turns the
model's text into content and calls as it streams.

Names are vLLM's `--tool-call-parser` names:

- `hermes` (Qwen 2.5 / 3, Hermes, SmolLM3): text, then `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, each argument object streamed as it is written.
- `llama3_json` (Llama 3.1 / 3.2 JSON calling): an answer that begins with `{` is calls,
  `{"name": ..., "parameters": {...}}` separated by `;`.
- `pythonic` (Llama 3.2 / 4 pythonic, Gemma 3's documented format): an answer that begins with `[` is a
  list of calls, `[get_weather(city="Paris"), get_time()]`. Argument values are written as JSON (a
  string, number, object, array), booleans and null as Python's True / False / None.

The grammar is lazy in llguidance's sense: the text before a call is free; from the trigger on,
the call must name a known tool and its arguments must follow that tool's JSON schema. The grammar
goes through the same masks as any structured output, so drafts are checked against it and
speculation stays lossless. The parser never trusts the text, though (a caller may run it over
text no grammar held): malformed calls become content, and its work is linear in the text.
"""
from __future__ import annotations

import ast
import copy
import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args

MAX_CALLS = 64  # calls in one answer; the grammar allows no more, the parser reads no more
MAX_HEAD_CHARS = 160  # a call's opening (trigger to arguments) is never longer than this
# the calls' JSON has at most one space between its tokens (a weak model can otherwise spend its
# whole budget on whitespace inside a call); the same bound as tool_choice 'required'
CALL_WHITESPACE = "[ ]?"


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call: its name and the JSON schema of its arguments (an object)."""

    name: str
    parameters: dict
    description: str | None = None


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # a fragment of the call's arguments (JSON text); the fragments concatenate to the whole


Event = Union[Content, CallStart, CallArguments]


@dataclass
class ParsedCall:
    name: str
    arguments: str = ""
    complete: bool = False


def _schema_with_whitespace(schema: dict) -> str:
    bounded = dict(schema)
    bounded["x-guidance"] = {**bounded.get("x-guidance", {}), "whitespace_pattern": CALL_WHITESPACE}
    return json.dumps(bounded, ensure_ascii=False)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class ToolFormat:
    """One family's way of writing calls. Subclasses give the grammar and the parser."""

    name: str
    tags: tuple[str, ...] = ()  # the texts around a call that a tokenizer may hold as one added token
    # tag text -> its token id, for a tokenizer that has one (for_tokenizer): llguidance holds every
    # added token apart from text, so a grammar that spells "<tool_call>" as characters alone forbids
    # the one token Qwen writes it with
    tag_tokens: dict[str, int] = {}

    def for_tokenizer(self, hf_tokenizer) -> "ToolFormat":
        """This format for one tokenizer: each tag it holds as a single added token may be written as
        that token or as text."""
        added = {t.content: i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()}
        found = {tag: added[tag] for tag in self.tags if tag in added}
        if not found:
            return self
        bound = copy.copy(self)
        bound.tag_tokens = found
        return bound

    def _tag(self, text: str) -> str:
        """A grammar literal for `text`: its added token or its characters."""
        token = self.tag_tokens.get(text)
        return _lit(text) if token is None else f"(<[{token}]> | {_lit(text)})"

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        raise NotImplementedError

    def parser(self) -> "ToolCallParser":
        raise NotImplementedError

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        """Calls as this format writes them (an assistant turn's text, for templates without tools)."""
        raise NotImplementedError

    def instructions(self, tools: list[ToolSpec]) -> str:
        """The system prompt's part that lists the tools and says how to call them, for templates that
        don't render tools themselves."""
        listing = "\n".join(json.dumps({"type": "function", "function": {
            "name": t.name, **({"description": t.description} if t.description else {}),
            "parameters": t.parameters}}, ensure_ascii=False) for t in tools)
        return ("You may call one or more functions to assist with the user query. The functions you can call:\n"
                f"{listing}\n{self._how_to_call()}")

    def _how_to_call(self) -> str:
        raise NotImplementedError


# -- JSON calls: hermes, llama3_json ---------------------------------------------------------------

class JsonCallFormat(ToolFormat):
    """Calls as JSON objects `{"name": NAME, "<args_key>": {...}}`: after a trigger (hermes) or as the
    whole answer (llama3_json)."""

    args_key: str
    trigger: str | None  # None: the calls are the whole answer, from its first character
    opening: str  # between the trigger and the object
    closing: str  # after the object
    separator_pattern: str  # a regex (Lark) for what comes between two calls

    def _body(self, tool: ToolSpec) -> str:
        head = f'{{"name": "{tool.name}", "{self.args_key}": '
        return f'{_lit(self.opening) + " " if self.opening else ""}{_lit(head)} %json ' \
               f'{_schema_with_whitespace(tool.parameters)} "}}"{" " + _lit(self.closing) if self.closing else ""}'

    def _trigger_rule(self) -> str:
        """Free text, then the trigger: a lazy lexeme where it is characters; where it is an added token
        (no lexeme may hold one), text ends where the token comes."""
        token = self.tag_tokens.get(self.trigger)
        return f"call_trig[lazy]: TEXT {_lit(self.trigger)}" if token is None else f"call_trig: TEXT <[{token}]>"

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        bodies = "\n".join(f"body_{i}: {self._body(t)}" for i, t in enumerate(tools))
        body = " | ".join(f"body_{i}" for i in range(len(tools)))
        more = "" if not parallel else f" (SEP {self._tag(self.trigger) + ' ' if self.trigger else ''}body){{0,{MAX_CALLS - 1}}}"
        if self.trigger is not None:
            return (f"%llguidance {{}}\nstart: TEXT | calls\ncalls: call_trig body{more}\n"
                    f"{self._trigger_rule()}\nbody: {body}\n{bodies}\n"
                    f"SEP: /{self.separator_pattern}/\nTEXT: /(.|\\n)*/\n")
        return (f"%llguidance {{}}\nstart: PLAIN | calls\ncalls: body{more}\nbody: {body}\n{bodies}\n"
                f"SEP: /{self.separator_pattern}/\nPLAIN: /([^{{](.|\\n)*)?/\n")

    def parser(self) -> "ToolCallParser":
        return JsonCallParser(self)

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        objs = [self.opening + json.dumps({"name": n, self.args_key: a}, ensure_ascii=False) + self.closing
                for n, a in calls]
        return ("\n" if self.trigger else "; ").join((self.trigger or "") + o for o in objs)


class Hermes(JsonCallFormat):
    name, args_key, trigger, opening, closing = "hermes", "arguments", "<tool_call>", "\n", "\n</tool_call>"
    separator_pattern = "[ \\n]*"
    tags = ("<tool_call>", "</tool_call>")  # Qwen 2.5 / 3: one added token each

    def _body(self, tool: ToolSpec) -> str:
        head = f'{{"name": "{tool.name}", "arguments": '
        return f'"\\n"? {_lit(head)} %json {_schema_with_whitespace(tool.parameters)} "}}" "\\n"? ' \
               f'{self._tag("</tool_call>")}'

    def _how_to_call(self) -> str:
        return ("For each function call, return a JSON object with the function name and arguments within "
                "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")


class Llama3Json(JsonCallFormat):
    name, args_key, trigger, opening, closing = "llama3_json", "parameters", None, "", ""
    separator_pattern = "; ?"

    def _how_to_call(self) -> str:
        return ("To call a function, respond only with JSON in the form {\"name\": function name, \"parameters\": "
                "dictionary of argument name and its value}; separate several calls with '; '. Do not use "
                "variables.")


# -- pythonic calls --------------------------------------------------------------------------------

class Pythonic(ToolFormat):
    name = "pythonic"

    def grammar(self, tools: list[ToolSpec], parallel: bool) -> str:
        rules = []
        for i, tool in enumerate(tools):
            props = tool.parameters.get("properties") or {}
            required = set(tool.parameters.get("required") or [])
            names = list(props)
            # arguments in the schema's order; an optional one may be left out: args_{i}_{j} are the
            # arguments from the j-th on with no comma before, rest_{i}_{j} the same after a comma
            n = len(names)
            for j, key in enumerate(names):
                value = _python_value(props[key])
                rules.append(f"arg_{i}_{j}: {_lit(key + '=')} {value}")
                skip_a = f" | args_{i}_{j + 1}" if key not in required else ""
                skip_r = f" | rest_{i}_{j + 1}" if key not in required else ""
                rules.append(f"args_{i}_{j}: arg_{i}_{j} rest_{i}_{j + 1}{skip_a}")
                rules.append(f"rest_{i}_{j}: \", \" arg_{i}_{j} rest_{i}_{j + 1}{skip_r}")
            rules.append(f"args_{i}_{n}: \"\"")
            rules.append(f"rest_{i}_{n}: \"\"")
            rules.append(f"call_{i}: {_lit(tool.name + '(')} args_{i}_0 \")\"")
        call = " | ".join(f"call_{i}" for i in range(len(tools)))
        more = f' (", " call){{0,{MAX_CALLS - 1}}}' if parallel else ""
        return (f"%llguidance {{}}\nstart: PLAIN | calls\ncalls: \"[\" call{more} \"]\"\ncall: {call}\n"
                + "\n".join(rules) + "\nPLAIN: /([^\\[](.|\\n)*)?/\n")

    def parser(self) -> "ToolCallParser":
        return PythonicParser()

    def write_calls(self, calls: list[tuple[str, dict]]) -> str:
        def value(v: Any) -> str:
            return {True: "True", False: "False", None: "None"}[v] if v is None or isinstance(v, bool) \
                else json.dumps(v, ensure_ascii=False)
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={value(v)}" for k, v in a.items()) + ")"
                               for n, a in calls) + "]"

    def _how_to_call(self) -> str:
        return ("If you decide to call functions, respond only with a Python list of calls in the form "
                "[func_name1(param_name1=value1, param_name2=value2), func_name2(param=value)], and no other text.")


def _python_value(schema: Any) -> str:
    """A value's grammar: True / False / None for a boolean or null, JSON for everything else."""
    if isinstance(schema, dict) and schema.get("type") == "boolean" and "enum" not in schema and "const" not in schema:
        return '("True" | "False")'
    if isinstance(schema, dict) and schema.get("type") == "null":
        return '"None"'
    return f"%json {_schema_with_whitespace(schema if isinstance(schema, dict) else {})}"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Pythonic())}
ToolCallParserName = Literal["hermes", "llama3_json", "pythonic"]
assert set(get_args(ToolCallParserName)) == set(FORMATS)


def tool_format(name: str, hf_tokenizer=None) -> ToolFormat:
    """The format `name`, bound to `hf_tokenizer`'s tag tokens when given (ToolFormat.for_tokenizer)."""
    try:
        fmt = FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser '{name}': one of {', '.join(sorted(FORMATS))}") from None
    return fmt if hf_tokenizer is None else fmt.for_tokenizer(hf_tokenizer)


# -- parsing ---------------------------------------------------------------------------------------

class ToolCallParser:
    """Text in (as it streams), events out. `feed` returns what can be said for sure so far; `finish`
    says the rest. `content` and `calls` hold the whole answer read so far."""

    def __init__(self):
        self.text = ""
        self.pos = 0  # everything before it is said
        self.content = ""
        self.calls: list[ParsedCall] = []
        self.raw = False  # the rest of the text is content: no (more) calls in it
        self._events: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        self.text += text
        while not self.raw and self._step():
            pass
        if self.raw:
            self._say(self.text[self.pos:])
            self.pos = len(self.text)
        return self._take()

    def finish(self) -> list[Event]:
        self._finish()
        self._say(self.text[self.pos:])
        self.pos = len(self.text)
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _say(self, text: str) -> None:
        if text:
            self.content += text
            self._events.append(Content(text))

    def _start_call(self, name: str) -> None:
        self.calls.append(ParsedCall(name))
        self._events.append(CallStart(len(self.calls) - 1, name))

    def _arguments(self, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            self._events.append(CallArguments(len(self.calls) - 1, text))

    def _step(self) -> bool:
        """Move on as far as the text allows; False when more text is needed."""
        raise NotImplementedError

    def _finish(self) -> None:
        """The text has ended: what is still held back."""


_WS = re.compile(r"\s*")
_NAME = r'"((?:[^"\\\n]|\\.){1,64})"'


class JsonCallParser(ToolCallParser):
    def __init__(self, fmt: JsonCallFormat):
        super().__init__()
        self.fmt = fmt
        self.head = re.compile(r'\s*\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"' + fmt.args_key + r'"\s*:\s*(?=\S)')
        self.tail = re.compile(r"\s*\}" + (r"\s*" + re.escape(fmt.closing.strip()) if fmt.closing.strip() else ""))
        self.state = "text" if fmt.trigger else "start"
        self.scanner: JsonScanner | None = None
        self.call_from = 0  # where the text of a call not yet known to be one begins

    def _step(self) -> bool:
        text, trigger = self.text, self.fmt.trigger
        if self.state == "start":  # llama3_json: calls only if the answer begins with '{'
            if self.pos == len(text):
                return False
            self.state = "head" if text[self.pos] == "{" else "raw"
            self.raw, self.call_from = self.state == "raw", self.pos
            return True
        if self.state == "text":
            found = text.find(trigger, self.pos)
            if found >= 0:
                before = text[self.pos:found].rstrip()  # whitespace before a call is no content
                self._say(before)
                self.call_from = self.pos + len(before)
                self.pos, self.state = found + len(trigger), "head"
                return True
            # say all but a possible trigger's beginning, and whitespace that may come before a call
            end = len(text) - partial_suffix(text, trigger, self.pos)
            safe = len(text[self.pos:end].rstrip()) + self.pos
            self._say(text[self.pos:safe])
            self.pos = safe
            return False
        if self.state == "head":
            m = self.head.match(text, self.pos)
            if m is None:
                if len(text) - self.pos > MAX_HEAD_CHARS or not _could_begin(text[self.pos:]):
                    self._malformed()
                return False
            if len(self.calls) >= MAX_CALLS:
                self._malformed()
                return False
            try:
                name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                self._malformed()
                return False
            self._start_call(name)
            self.pos, self.state, self.scanner = m.end(), "args", JsonScanner(objects_only=True)
            return True
        if self.state == "args":
            end = self.scanner.scan(text, self.pos)
            stop = len(text) if end is None or end < 0 else end
            self._arguments(text[self.pos:stop])
            self.pos = stop
            if end is None:
                return False
            if end < 0:
                self.raw, self.state = True, "raw"  # not an object: the rest is content
                return False
            self.calls[-1].complete, self.state = False, "tail"
            return True
        if self.state == "tail":
            m = self.tail.match(text, self.pos)
            if m is None:
                if len(text) - self.pos > MAX_HEAD_CHARS:
                    self.raw, self.state = True, "raw"
                return False
            self.calls[-1].complete = True
            self.pos, self.state = m.end(), "between"
            return True
        if self.state == "between":  # another call, or the end
            rest = text[self.pos:]
            lead = rest[:len(rest) - len(rest.lstrip(" \n\t;"))]
            after = rest[len(lead):]
            if not after:
                return False
            nxt = trigger or "{"
            if after.startswith(nxt):
                self.call_from = self.pos
                self.pos += len(lead) + (len(trigger) if trigger else 0)
                self.state = "head"
                return True
            if nxt.startswith(after):
                return False
            self.raw, self.state = True, "raw"  # text after the calls: content
            return False
        return False

    def _malformed(self) -> None:
        """What looked like a call's opening is not one: it is content after all."""
        if self.state == "head":
            self.pos = self.call_from
        self.raw, self.state = True, "raw"

    def _finish(self) -> None:
        if self.state == "head":
            self._malformed()
        elif self.state == "between":
            rest = self.text[self.pos:]
            if not rest.strip(" \n\t;"):
                self.pos = len(self.text)


class PythonicParser(ToolCallParser):
    """`[name(key=value, ...), ...]`; a call is said once it is whole (its arguments turned into JSON)."""

    CALL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_-]{0,63})\(")
    KEY = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]{0,63})\s*=\s*")

    def __init__(self):
        super().__init__()
        self.state = "start"
        self.reader: _CallReader | None = None  # the call being read

    def _step(self) -> bool:
        text = self.text
        if self.state == "start":
            if self.pos == len(text):
                return False
            if text[self.pos] != "[":
                self.raw, self.state = True, "raw"
                return False
            self.state, self.begin = "calls", self.pos
            self.cursor = self.pos + 1
            return True
        if self.state == "calls":
            if len(self.calls) >= MAX_CALLS:
                self._malformed()
                return False
            if self.reader is None:
                self.reader = _CallReader(self.cursor)
            parsed = self.reader.read(text)
            if parsed is None:
                return False
            if parsed == -1:
                self._malformed()
                return False
            name, args, end = parsed
            m = _LIST_GOES_ON.match(text, end)
            if m is None:  # the call is said once what follows it (',' or ']') is known
                if text[end:].strip():
                    self._malformed()
                return False
            self._say_call(name, args)
            self.cursor, self.reader = m.end(), None
            if m.group(1) == "]":
                self.pos, self.state = m.end(), "done"
            return True
        if self.state == "done":
            if text[self.pos:].strip():
                self.raw, self.state = True, "raw"  # text after the list: content
            else:
                self.pos = len(text)
            return False
        return False

    def _say_call(self, name: str, args: dict) -> None:
        self._start_call(name)
        self._arguments(json.dumps(args, ensure_ascii=False))
        self.calls[-1].complete = True

    def _malformed(self) -> None:
        # calls already said stay calls; the text from the first unreadable one on is content
        if self.calls and self.state == "calls":
            self.pos = self.cursor
        elif self.state == "calls":
            self.pos = self.begin
        self.raw, self.state = True, "raw"

    def _finish(self) -> None:
        if self.state != "calls":
            return
        parsed = (self.reader or _CallReader(self.cursor)).read(self.text) if len(self.calls) < MAX_CALLS else -1
        if parsed not in (None, -1) and not self.text[parsed[2]:].strip():
            self._say_call(parsed[0], parsed[1])  # a whole call whose list was cut short
            self.cursor = len(self.text)
        self._malformed()


_LIST_GOES_ON = re.compile(r"\s*(,|\])")


class _CallReader:
    """Reads one pythonic call from `start`, resuming where the last read stopped (linear in the
    call's text however it arrives). read() -> (name, arguments, end) once the call is whole; None:
    not yet; -1: not a call."""

    def __init__(self, start: int):
        self.i, self.name, self.args, self.first = start, None, {}, True
        self.key, self.value_start, self.scanner = None, 0, None

    def read(self, text: str):
        if self.name is None:
            m = PythonicParser.CALL.match(text, self.i)
            if m is None:
                return None if _could_begin_python(text[self.i:self.i + 80]) else -1
            self.name, self.i = m.group(1), m.end()
        while True:
            if self.scanner is None:
                ws = _WS.match(text, self.i).end()
                if ws == len(text):
                    return None
                if text[ws] == ")":
                    return self.name, self.args, ws + 1
                if not self.first:
                    if text[ws] != ",":
                        return -1
                    ws += 1
                k = PythonicParser.KEY.match(text, ws)
                if k is None:
                    rest = text[ws:ws + 80].strip()
                    return None if len(rest) < 70 and re.fullmatch(r"[A-Za-z0-9_]*\s*", rest) else -1
                self.key, self.value_start, self.scanner = k.group(1), k.end(), JsonScanner(objects_only=False)
            end = self.scanner.scan(text, self.value_start)
            if end is None:
                return None
            if end < 0:
                return -1
            value = _python_literal(text[self.value_start:end])
            if value is _NOT_A_VALUE:
                return -1
            self.args[self.key] = value
            self.i, self.first, self.scanner = end, False, None


_NOT_A_VALUE = object()


def _python_literal(text: str) -> Any:
    text = text.strip()
    consts = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}
    if text in consts:
        return consts[text]
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        return _NOT_A_VALUE


class JsonScanner:
    """Finds where one JSON (or Python literal) value ends, without parsing it: strings, brackets and
    depth, linear in the text and resumable. scan() -> the end index, None (not yet), or -1 (not a
    value of the kind asked for)."""

    SCALAR_END = set(",)]}\n")

    def __init__(self, objects_only: bool):
        self.objects_only = objects_only
        self.depth, self.quote, self.escape, self.started, self.kind = 0, "", False, False, ""
        self.i = None

    def scan(self, text: str, start: int) -> int | None:
        i = start if self.i is None else self.i
        n = len(text)
        while i < n:
            ch = text[i]
            if not self.started:
                if ch.isspace():
                    i += 1
                    continue
                self.started = True
                if ch in "{[":
                    if self.objects_only and ch != "{":
                        return -1
                    self.kind = "nested"
                elif self.objects_only:
                    return -1
                elif ch in "\"'":
                    self.kind = "string"
                else:
                    self.kind = "scalar"
            if self.kind == "scalar":
                if ch in self.SCALAR_END:
                    self.i = i
                    return i
                i += 1
                continue
            if self.quote:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == self.quote:
                    self.quote = ""
                    if self.kind == "string":
                        self.i = i + 1
                        return i + 1
                i += 1
                continue
            if ch in "\"'" and (ch == '"' or not self.objects_only):
                self.quote = ch
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.i = i + 1
                    return i + 1
            i += 1
        self.i = i
        return None


def partial_suffix(text: str, trigger: str, start: int = 0) -> int:
    """The length of the longest end of text[start:] that is a proper beginning of trigger."""
    for k in range(min(len(trigger) - 1, len(text) - start), 0, -1):
        if trigger.startswith(text[len(text) - k:]):
            return k
    return 0


def _could_begin(text: str) -> bool:
    """Whether more text could still make a call's opening of this (a cheap, bounded check)."""
    stripped = text.lstrip()
    return not stripped or stripped[0] == "{"


def _could_begin_python(text: str) -> bool:
    stripped = text.lstrip()
    return len(stripped) <= 65 and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*|", stripped) is not None
