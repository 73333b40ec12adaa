"""Chat messages -> prompt token ids through the model's chat template (LLM.chat, HTTP and gRPC share it).

Messages are OpenAI's, already checked: `role` and `content`; an assistant turn may carry
`tool_calls` (arguments as a dict) and a `tool` turn a `tool_call_id`. A template that renders tools
itself (Qwen, Llama 3.1, Hermes: its source uses `tools`) gets them as they are. A template without
tool support (Gemma 3's, SmolLM2's) gets a plain-text conversation instead: the tools and how to call
them in the system turn, earlier calls written in the tool-call format as the assistant's text, tool
results as a user turn in <tool_response> tags (consecutive turns of one role merged, since such
templates require user and assistant to alternate).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.tool_parsers import ToolFormat

# Tokens that end a chat turn in the chat templates of the supported families.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


def end_of_turn_ids(tokenizer) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]


def renders_tools(tokenizer, chat_template: str | None = None) -> bool:
    """Whether the chat template renders tools itself (its source refers to them)."""
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, *, tool_format: "ToolFormat | None" = None,
                    tool_instructions: bool = False, chat_template: str | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    """`tools`: OpenAI's function tools. `tool_format`: how calls are written where the template can't
    (hermes when None); `tool_instructions`: list the tools in the system turn for such a template
    (auto tool choice). Raises ValueError when the messages cannot be formatted."""
    if not messages:
        raise ValueError("messages must not be empty")
    messages = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in messages]
    kwargs = dict(template_kwargs or {})
    if renders_tools(tokenizer, chat_template):
        if tools:
            kwargs["tools"] = tools
    else:
        messages = plain_conversation(messages, tools if tool_instructions else None, tool_format)
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                               chat_template=chat_template, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise ValueError(f"messages could not be formatted with the model's chat template: {e}") from None
    return tokenizer.encode(prompt, add_special_tokens=False)  # the template already has BOS


def plain_conversation(messages: list[dict], tools: list[dict] | None, tool_format: "ToolFormat | None") -> list[dict]:
    """The conversation as plain user / assistant / system text, for a template without tools."""
    from engine.tool_parsers import FORMATS, ToolSpec

    fmt = tool_format or FORMATS["hermes"]
    out: list[dict] = []
    if tools:
        specs = [ToolSpec(t["function"]["name"], t["function"].get("parameters") or {"type": "object", "properties": {}},
                          t["function"].get("description")) for t in tools]
        listing = fmt.instructions(specs)
        if messages[0]["role"] == "system":
            messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{listing}"}] + messages[1:]
        else:
            messages = [{"role": "system", "content": listing}] + messages
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = (content + "\n" if content else "") + fmt.write_calls(calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and out[-1]["role"] == role and role != "system":
            out[-1] = {"role": role, "content": f"{out[-1]['content']}\n{content}"}
        else:
            out.append({"role": role, "content": content})
    return out
