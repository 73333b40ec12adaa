"""Chat messages -> prompt token ids through the model chat template (LLM.chat, HTTP and gRPC share it)."""
from __future__ import annotations

# Tokens that end a chat turn in the chat templates of the supported families.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


def end_of_turn_ids(tokenizer) -> list[int]:
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
    """`tools`: OpenAI's function tools, for templates that render them (others ignore them).
    Raises ValueError when the messages cannot be formatted."""
    if not messages:
        raise ValueError("messages must not be empty")
    messages = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
                for m in messages]
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                               **({"tools": tools} if tools else {}))
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise ValueError(f"messages could not be formatted with the model's chat template: {e}") from None
    return tokenizer.encode(prompt, add_special_tokens=False)  # the template already has BOS
