"""One validation: EngineCore.check_request returns a typed error (the field at fault, a message)
without side effects, and every API maps that field, never the message's text: the offline LLM
raises it (a ValueError), the request layer (HTTP and gRPC share it) puts it in OpenAI's `param`.
On the tiny random model in this process: no server, no weights to load."""
import asyncio

import pytest

from deployments.api_errors import RequestError
from deployments.requests import RequestLayer
from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.structured import StructuredOutputsParams

MODEL = "random:tiny-llama"


@pytest.fixture(scope="module")
def engine():
    engine = AsyncEngine(EngineConfig(model=MODEL, max_model_len=128, kv_cache_memory_bytes=4 << 20))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def layer(engine):
    return RequestLayer(engine, MODEL, MODEL)


def test_check_request_names_the_field_and_has_no_side_effects(engine):
    core = engine.core
    vocab, limit = core.vocab_size, core.max_model_len
    cases = {
        "prompt": ([], SamplingParams()),
        "max_tokens": ([1, 2, 3], SamplingParams(max_tokens=limit)),
        "stop_token_ids": ([1, 2, 3], SamplingParams(stop_token_ids=[vocab])),
        "logit_bias": ([1, 2, 3], SamplingParams(logit_bias={vocab + 5: 1.0})),
    }
    for param, (ids, params) in cases.items():
        error = core.check_request(ids, params)
        assert isinstance(error, InvalidRequest) and error.param == param, (param, error)
    assert core.check_request([1] * limit, SamplingParams()).param == "prompt"  # no room for one token
    structured = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"), max_tokens=4)
    assert core.check_request([1, 2, 3], structured) is None
    assert core.grammars._cache == {}  # checking compiled nothing
    core.compile_grammar(structured)
    assert len(core.grammars._cache) == 1


def test_a_grammar_that_does_not_compile_is_typed_too(engine):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: ("), max_tokens=4)
    with pytest.raises(InvalidRequest) as refused:
        engine.core.compile_grammar(bad)
    assert refused.value.param == "structured_outputs.grammar"
    assert str(refused.value) == f"structured_outputs.grammar: {refused.value.reason}"
    with pytest.raises(InvalidRequest) as again:  # a refusal is cached: the same error, typed
        engine.core.compile_grammar(bad)
    assert (again.value.param, str(again.value)) == (refused.value.param, str(refused.value))


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": 4, "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "hi", "max_tokens": 4, "stop_token_ids": [999999]}, "stop_token_ids"),
    ({"prompt": "hi", "max_tokens": 500}, "max_tokens"),
    ({"prompt": "word " * 400, "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}},
     "response_format"),
    ({"prompt": "hi", "max_tokens": 4, "structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
])
def test_the_request_layer_puts_the_engines_field_in_param(layer, body, param):
    with pytest.raises(RequestError) as refused:
        layer.prepare("completion", {"model": MODEL, **body}, "req-1")
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_a_grammar_error_under_response_format_is_named_as_the_client_wrote_it(layer):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}}
    with pytest.raises(RequestError) as refused:
        layer.prepare("completion", body, "req-2")
    assert refused.value.message.startswith("response_format.json_schema")
    assert "structured_outputs" not in refused.value.message


def test_the_engine_refuses_what_the_layer_would_have(engine):
    """AsyncEngine.add_request runs the same check: a caller that skips the request layer gets the
    same typed error, in its own task."""
    async def add():
        return engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=500))

    with pytest.raises(InvalidRequest) as refused:
        asyncio.run(add())
    assert refused.value.param == "max_tokens"


def test_offline_generate_raises_the_typed_error_before_queueing_anything():
    llm = LLM(model=MODEL, max_model_len=128)
    with pytest.raises(ValueError) as refused:  # InvalidRequest is a ValueError, as before
        llm.generate(["hi", {"prompt_token_ids": [1, 2]}],
                     [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, stop_token_ids=[10 ** 6])])
    assert isinstance(refused.value, InvalidRequest) and refused.value.param == "stop_token_ids"
    assert not llm.core.has_work()  # the first, valid prompt was not queued either
