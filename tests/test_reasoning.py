"""Reasoning parsers without a model: a thinking model's text split into thinking and answer, whole
and in any pieces, for each parser and whether the prompt left the answer inside the thinking; the
grammar that applies after the thinking (llguidance with SmolLM2's real tokenizer)."""
import json
import random

import pytest

from engine.reasoning import ReasoningSplitter, after_reasoning, starts_in_reasoning
from engine.structured import StructuredOutputsParams, grammar_text

# (parser, opened, text, thinking, answer)
CASES = [
    ("deepseek_r1", True, "Let me think.\nOK.\n</think>\n\nThe answer is 4.", "Let me think.\nOK.\n", "The answer is 4."),
    ("deepseek_r1", True, "<think>\nhmm</think>4", "\nhmm", "4"),  # a <think> the model writes again
    ("deepseek_r1", True, "still thinking when cut off", "still thinking when cut off", ""),
    ("qwen3", False, "<think>\nA short thought.\n</think>\n\nParis.", "\nA short thought.\n", "Paris."),
    ("qwen3", False, "Paris is the capital.", "", "Paris is the capital."),
    ("qwen3", False, "<thin ice", "", "<thin ice"),
    ("qwen3", True, "Thinking...</think>\n\nDone.", "Thinking...", "Done."),
    ("qwen3", True, "a < b, so </thinking> is no tag</think>yes", "a < b, so </thinking> is no tag", "yes"),
]


@pytest.mark.parametrize("parser,opened,text,thinking,answer", CASES)
def test_thinking_and_answer_split_whole_and_in_any_pieces(parser, opened, text, thinking, answer):
    rng = random.Random(0)
    for trial in range(30):
        if trial == 0:
            pieces = [text]
        elif trial == 1:
            pieces = list(text)
        else:
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        splitter = ReasoningSplitter(parser, opened)
        said = [splitter.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(t for t, _ in said) == splitter.reasoning == thinking
        assert "".join(c for _, c in said) == splitter.content == answer
        if answer:  # no piece of a tag is ever said
            assert "</think" not in splitter.content and "<think>" not in splitter.reasoning


def test_the_prompt_decides_where_the_answer_begins():
    assert starts_in_reasoning("deepseek_r1", "<|Assistant|>")
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking off


def test_a_grammar_applies_after_the_thinking():
    from llguidance import LLMatcher

    from engine.models.loading import load_tokenizer, resolve_model
    from engine.structured import ll_tokenizer, parser_limits

    tokenizer = load_tokenizer(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))
    ll = ll_tokenizer(tokenizer, {tokenizer.eos_token_id})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = StructuredOutputsParams(json=schema, after_reasoning=True)
    assert params.key() != StructuredOutputsParams(json=schema).key()  # compiled and cached apart
    grammar = grammar_text(params)
    assert json.loads(grammar)["grammars"][0]["name"] == "reasoning"

    def accepts(text: str) -> bool:
        m = LLMatcher(ll, grammar, log_level=0, limits=parser_limits())
        return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()

    assert accepts('free {thinking}, "<tool_call>" and all</think>\n\n{"a": 1}')
    assert accepts('</think>{"a": 2}')
    assert not accepts('thinking</think>\n\nnot json')
    assert not accepts('{"a": 1}')  # the thinking must end first
    assert after_reasoning(grammar_text(StructuredOutputsParams(choice=["yes", "no"])))
