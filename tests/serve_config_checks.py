"""Checks every shipped serve config passes, started as a user starts it (`serve run <config>`) and
driven with the official openai client, raw HTTP and gRPC. A test module imports them with
`from serve_config_checks import *` and defines the fixtures they take: `server` (a ServedConfig),
`client` (an openai.OpenAI on it) and `plain` (an offline LLM of the target, decoding plainly)."""
import dataclasses

import httpx
import openai
import pytest

from engine import SamplingParams

__all__ = ["ServedConfig", "expect_error", "test_seed_client_snippet", "test_speculative_server_equals_plain_offline",
           "test_streaming_equals_non_streaming", "test_chat_completion_and_stream",
           "test_bad_inputs_get_openai_errors_and_server_keeps_serving", "test_health_and_metrics",
           "test_grpc_matches_http"]


@dataclasses.dataclass(frozen=True)
class ServedConfig:
    base: str  # http://127.0.0.1:PORT
    grpc_port: int
    model: str  # the target, as /v1/models lists it


def test_seed_client_snippet(server, client):
    # seed §3, unchanged but for base_url
    models = client.models.list()
    model = models.data[0].id
    assert model == server.model
    completion = client.completions.create(model=model, prompt="The future of AI is", echo=False, n=1,
                                           stream=False)
    assert completion.choices[0].text
    assert 1 <= completion.usage.completion_tokens <= 16  # OpenAI's default max_tokens
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_speculative_server_equals_plain_offline(server, client, plain):
    """Greedy text through the spec-decoding server equals plain decoding of the target, in process."""
    prompts = ["The future of AI is", "def add(a, b):"]
    served = [client.completions.create(model=server.model, prompt=p, max_tokens=32, temperature=0).choices[0].text
              for p in prompts]
    offline = [o.outputs[0].text for o in plain.generate(prompts, SamplingParams(temperature=0, max_tokens=32))]
    assert served == offline


def test_streaming_equals_non_streaming(server, client):
    full = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=40, temperature=0)
    stream = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_completion_and_stream(server, client):
    messages = [{"role": "user", "content": "Name a primary color."}]
    chat = client.chat.completions.create(model=server.model, messages=messages, max_tokens=24, temperature=0)
    answer = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and answer
    assert not any(t in answer for t in ("<end_of_turn>", "<|im_end|>", "<|endoftext|>"))  # no end marker shown
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=24, temperature=0, stream=True) if c.choices)
    assert streamed == answer




def expect_error(response: httpx.Response, status: int, type_: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code", "request_id"} and body["error"]["message"]
    assert "Traceback" not in response.text
    if type_:
        assert body["error"]["type"] == type_


def test_bad_inputs_get_openai_errors_and_server_keeps_serving(server, client):
    url = f"{server.base}/v1/completions"
    ok = {"model": server.model, "prompt": "Hello", "max_tokens": 4}
    expect_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400)
    expect_error(httpx.post(url, json={**ok, "temperature": -1}), 400, "invalid_request_error")
    expect_error(httpx.post(url, json={**ok, "top_p": 0}), 400)
    expect_error(httpx.post(url, json={**ok, "max_tokens": 0}), 400)
    expect_error(httpx.post(url, json={**ok, "prompt": 42}), 400)
    expect_error(httpx.post(url, json={**ok, "model": "gpt-4"}), 404)
    expect_error(httpx.post(url, json={**ok, "prompt": "word " * 40000}), 400)  # past the target's 32768 tokens
    expect_error(httpx.post(f"{server.base}/v1/chat/completions", json={"model": server.model, "messages": []}), 400)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    assert client.completions.create(model=server.model, prompt="Hello", max_tokens=4).choices[0].text


def test_health_and_metrics(server, client):
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    client.completions.create(model=server.model, prompt="Count: one, two,", max_tokens=16, temperature=0)
    text = httpx.get(f"{server.base}/metrics").text
    assert "tandem:spec_decode_num_drafts_total" in text
    drafts = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith("tandem:spec_decode_num_drafts_total")]
    assert drafts and drafts[0] > 0


def test_grpc_matches_http(server, client):
    import grpc

    from tandem_proto import tandem_pb2 as pb
    from tandem_proto import tandem_pb2_grpc

    http = client.completions.create(model=server.model, prompt="The sky is", max_tokens=16, temperature=0)
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        stub = tandem_pb2_grpc.TandemServiceStub(channel)
        reply = stub.Generate(pb.GenerateRequest(model=server.model, prompt="The sky is", max_tokens=16, temperature=0))
    assert reply.text == http.choices[0].text
    assert reply.usage.completion_tokens == http.usage.completion_tokens
