"""Reasoning models' thinking, apart from their answer: vLLM's `--reasoning-parser` names.

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the answer starts in thinking (the template opens
  `<think>`, or the model writes it), which ends at `</think>`; an answer that never closes it is all
  thinking.
- `qwen3` (Qwen3, Qwen3-Thinking): thinking when the model writes `<think>` first, or when the chat
  template left the prompt in it (Qwen3-Thinking-2507's does; `enable_thinking: false` templates
  close it in the prompt instead); otherwise the answer is all content.

The split is incremental (a stream says thinking and content as they come, holding back only what
may be the beginning of a tag). A grammar (structured outputs, tool calls) applies after the thinking
ends: `after_reasoning` wraps it so the thinking is free text up to `</think>`.
"""
from __future__ import annotations

import json
from typing import Literal, get_args

from engine.tool_parsers import partial_suffix

ReasoningParserName = Literal["deepseek_r1", "qwen3"]
REASONING_PARSERS = get_args(ReasoningParserName)
START, END = "<think>", "</think>"


def check_reasoning_parser(name: str) -> None:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser '{name}': one of {', '.join(REASONING_PARSERS)}")


def starts_in_reasoning(parser: str, prompt_tail: str) -> bool:
    """Whether the answer begins inside the thinking, from the end of its prompt's text."""
    return parser == "deepseek_r1" or prompt_tail.rstrip().endswith(START)


class ReasoningSplitter:
    """Text in, (thinking, content) out. `opened`: the answer begins inside the thinking."""

    def __init__(self, parser: str, opened: bool):
        check_reasoning_parser(parser)
        self.state = "thinking" if opened else ("maybe" if parser == "qwen3" else "thinking")
        self.buffer = ""
        self.reasoning, self.content = "", ""
        self.leading = True  # at the start of the thinking (a repeated <think> is dropped) or the content

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buffer += text
        thinking, content = "", ""
        while True:
            if self.state == "maybe":  # qwen3: thinking only if the answer begins with <think>
                head = self.buffer.lstrip()
                if head.startswith(START):
                    self.buffer, self.state = head[len(START):], "thinking"
                    continue
                if not final and START.startswith(head):
                    break
                self.state = "content"
                continue
            if self.state == "thinking":
                if self.leading:
                    head = self.buffer.lstrip()
                    if START.startswith(head) and not final and head != START:
                        break  # may still be a <think> the model writes itself
                    if head.startswith(START):
                        self.buffer = head[len(START):]
                    self.leading = False
                end = self.buffer.find(END)
                if end >= 0:
                    thinking += self.buffer[:end]
                    self.buffer, self.state, self.leading = self.buffer[end + len(END):], "content", True
                    continue
                keep = 0 if final else partial_suffix(self.buffer, END)
                thinking += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            # content: the line breaks right after </think> are no content
            if self.leading:
                stripped = self.buffer.lstrip("\n")
                if not stripped and not final:
                    self.buffer = ""
                    break
                self.buffer, self.leading = stripped, False
            content += self.buffer
            self.buffer = ""
            break
        self.reasoning += thinking
        self.content += content
        return thinking, content


def after_reasoning(grammar: str) -> str:
    """`grammar` (llguidance's JSON form) applied after the thinking: free text up to `</think>`, a
    few line breaks, then the grammar."""
    try:
        inner = json.loads(grammar)
    except ValueError:  # Lark text
        inner = {"grammars": [{"name": "answer", "lark_grammar": grammar}]}
    grammars = [dict(g) for g in inner["grammars"]]
    name = grammars[0].get("name") or "answer"
    grammars[0]["name"] = name
    lark = ("%llguidance {}\n"
            f"start: thinking @{name} | thinking SEP @{name}\n"
            f"thinking[lazy]: TEXT {json.dumps(END)}\n"
            "SEP: /[ \\n]{1,4}/\nTEXT: /(.|\\n)*/\n")
    return json.dumps({**inner, "grammars": [{"name": "reasoning", "lark_grammar": lark}] + grammars})
