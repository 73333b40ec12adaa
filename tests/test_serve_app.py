"""Ray Serve apps built with build_app() on a local cluster: speculation on vs off, API keys, queue
limits, client disconnects. Tiny random models keep each app cheap."""
import asyncio
import re
import time

import httpx
import openai
import pytest
import ray
from ray import serve

from deployments.app import build_app
from browser import answer, browser_page, fill, run, sse_events, wait_text
from servers import free_port, owned_by_session

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"
SPEC = {"model": DRAFT, "num_speculative_tokens": 3}



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text("s3cret\n")
    apps = {
        "plain": {"model": TARGET, "disable_playground": True},
        "spec": {"model": TARGET, "speculative_config": SPEC},
        "keyed": {"model": TARGET, "api_key_file": str(key_file), "served_model_name": "tiny"},
        "small": {"model": TARGET, "speculative_config": SPEC, "max_num_seqs": 1, "max_queued_requests": 1},
    }
    grpc_ports = {}
    for name, args in apps.items():
        grpc_ports[name] = free_port()
        serve.run(build_app({**args, "grpc_port": grpc_ports[name]}), name=name, route_prefix=f"/{name}")
    assert all(owned_by_session(p) for p in [port, *grpc_ports.values()])  # our own servers answer
    yield {"http": f"http://127.0.0.1:{port}", "grpc": {n: f"127.0.0.1:{p}" for n, p in grpc_ports.items()}}
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def base(server):
    return server["http"]


def client(base, app, key="EMPTY"):
    return openai.OpenAI(api_key=key, base_url=f"{base}/{app}/v1", max_retries=0)


def test_speculation_on_equals_off(base):
    prompts = ["hello world", "the cat sat", "zebra"]
    for p in prompts:
        kw = dict(prompt=p, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
        off = client(base, "plain").completions.create(model=TARGET, **kw)
        on = client(base, "spec").completions.create(model=TARGET, **kw)
        assert on.choices[0].text == off.choices[0].text and on.usage.completion_tokens == 40


def test_prompt_forms_n_echo_and_token_ids(base):
    c = client(base, "spec")
    multi = c.completions.create(model=TARGET, prompt=["ab", "cd"], max_tokens=5, temperature=0, n=2)
    assert sorted(ch.index for ch in multi.choices) == [0, 1, 2, 3]
    by_index = {ch.index: ch.text for ch in multi.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n copies agree
    echo = c.completions.create(model=TARGET, prompt="ab", max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == "ab" + by_index[0]
    ids = httpx.post(f"{base}/spec/v1/completions",
                     json={"model": TARGET, "prompt": [5, 6, 7], "max_tokens": 3}).json()
    assert ids["usage"]["prompt_tokens"] == 3
    seeded = [c.completions.create(model=TARGET, prompt="ab", max_tokens=12, seed=7).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_chat_on_tiny_model(base):
    chat = client(base, "spec").chat.completions.create(
        model=TARGET, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1


def test_api_key(base):
    with pytest.raises(openai.AuthenticationError):
        client(base, "keyed").models.list()
    r = httpx.get(f"{base}/keyed/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    models = client(base, "keyed", key="s3cret").models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client(base, "keyed", key="s3cret").completions.create(model="tiny", prompt="a", max_tokens=2)
    assert client(base, "plain").models.list().data  # open when no key is configured
    assert httpx.get(f"{base}/keyed/health").status_code == 200  # probes need no key


def test_queue_full_is_429_then_recovers(base):
    async def main():
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": TARGET, "prompt": "hello", "max_tokens": 150, "ignore_eos": True}
            results = await asyncio.gather(*(http.post(f"{base}/small/v1/completions", json=body)
                                             for _ in range(6)))
            return [r.status_code for r in results], [r.json() for r in results]
    codes, bodies = asyncio.run(main())
    assert 429 in codes and 200 in codes  # one runs, one waits, the rest are turned away
    rejected = bodies[codes.index(429)]["error"]
    assert rejected["type"] == "rate_limit_error" and "queue is full" in rejected["message"]
    assert client(base, "small").completions.create(model=TARGET, prompt="ok", max_tokens=3)


def metric(base: str, app: str, name: str) -> float:
    for line in httpx.get(f"{base}/{app}/metrics").text.splitlines():
        if line.startswith(f"tandem:{name}"):
            return float(line.split()[-1])
    raise AssertionError(f"metric {name} not exported")


def wait_until_idle(base: str, app: str, timeout_s: float = 20.0) -> None:
    """The abort travels proxy -> replica -> engine loop; allow it time on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while metric(base, app, "num_requests_running") != 0:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.2)


def test_disconnect_frees_the_slot(base):
    # the only slot of "small" is taken by a long stream; the client drops it after a few chunks
    start = metric(base, "small", "generation_tokens_total")
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{base}/small/v1/completions",
                         json={"model": TARGET, "prompt": "hello", "max_tokens": 2000, "stream": True,
                               "ignore_eos": True}) as r:
            lines = [line for line, _ in zip(r.iter_lines(), range(4)) if line]
            assert lines and lines[0].startswith("data: ")
    wait_until_idle(base, "small")
    generated = metric(base, "small", "generation_tokens_total")
    assert generated - start < 1000  # it stopped early: aborted, not finished
    time.sleep(1.0)
    assert metric(base, "small", "generation_tokens_total") == generated  # nothing runs on
    assert metric(base, "small", "num_requests_running") == 0
    # the slot is free: the next max_num_seqs (=1) request runs at once
    out = client(base, "small").completions.create(model=TARGET, prompt="abc", max_tokens=5, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5


# -- gRPC: the same apps through Ray Serve's gRPC proxy ---------------------------------------------

@pytest.fixture(scope="module")
def stubs(server):
    import grpc

    from tandem_proto import tandem_pb2_grpc

    channels = {name: grpc.insecure_channel(address) for name, address in server["grpc"].items()}
    yield {name: tandem_pb2_grpc.TandemServiceStub(c) for name, c in channels.items()}
    for c in channels.values():
        c.close()


def key_md(key):
    return [("authorization", f"Bearer {key}")]


def test_grpc_unary_and_stream_equal_http(base, stubs):
    from tandem_proto import tandem_pb2 as pb

    http = client(base, "spec").completions.create(model=TARGET, prompt="the cat", max_tokens=30, temperature=0,
                                                   extra_body={"ignore_eos": True})
    req = pb.GenerateRequest(model=TARGET, prompt="the cat", max_tokens=30, temperature=0, ignore_eos=True)
    unary = stubs["spec"].Generate(req)
    assert unary.text == http.choices[0].text and len(unary.token_ids) == 30
    assert unary.finish_reason == "length" and unary.usage.completion_tokens == 30
    assert unary.spec_decode.num_drafts > 0 and unary.spec_decode.mean_acceptance_length >= 1
    parts = list(stubs["spec"].GenerateStream(req))
    assert "".join(p.text for p in parts) == unary.text
    assert [t for p in parts for t in p.token_ids] == list(unary.token_ids)
    assert parts[-1].finish_reason == "length" and parts[-1].usage.total_tokens == unary.usage.total_tokens
    models = stubs["spec"].ListModels(pb.ListModelsRequest())
    assert [m.id for m in models.models] == [TARGET]
    assert stubs["spec"].Health(pb.HealthRequest()).status == "ok"
    chat = stubs["spec"].Generate(pb.GenerateRequest(model=TARGET, messages=[pb.ChatMessage(role="user", content="hi")],
                                            max_tokens=5, temperature=0))
    assert chat.usage.completion_tokens >= 1


def test_cache_salt_over_http_and_grpc(base, stubs):
    """vLLM's cache_salt: accepted on both transports (the same greedy text: a salt changes what is
    shared, never the output), refused when empty or too long, with the API's own error."""
    import grpc

    from tandem_proto import tandem_pb2 as pb

    c = client(base, "spec")
    kw = dict(model=TARGET, prompt="the salted cat sat", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(**kw).choices[0].text
    salted = c.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "cache_salt": "tenant-a"}})
    assert salted.choices[0].text == plain
    for bad in ("", "s" * 1025):
        with pytest.raises(openai.BadRequestError) as err:
            c.completions.create(**{**kw, "extra_body": {"cache_salt": bad}})
        assert "cache_salt" in str(err.value)
    reply = stubs["spec"].Generate(pb.GenerateRequest(model=TARGET, prompt="the salted cat sat", max_tokens=12,
                                                      temperature=0, ignore_eos=True, cache_salt="tenant-b"))
    assert reply.text == plain
    with pytest.raises(grpc.RpcError) as err:
        stubs["spec"].Generate(pb.GenerateRequest(model=TARGET, prompt="x", cache_salt=""))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_errors(base, stubs):
    import grpc

    from tandem_proto import tandem_pb2 as pb

    def code_of(call):
        try:
            result = call()
        except grpc.RpcError as err:
            assert err.details()
            return err.code()
        raise AssertionError(f"no error; got {result!r}")

    ok = dict(model=TARGET, prompt="hi", max_tokens=3)
    assert code_of(lambda: stubs["spec"].Generate(pb.GenerateRequest(**{**ok, "model": "gpt-4"}))) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stubs["spec"].Generate(pb.GenerateRequest(**ok, temperature=-1))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stubs["spec"].Generate(pb.GenerateRequest(**{**ok, "prompt": "x" * 5000}))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: list(stubs["spec"].GenerateStream(pb.GenerateRequest(**{**ok, "prompt": ""})))) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stubs["keyed"].Generate(pb.GenerateRequest(**{**ok, "model": "tiny"}))) == grpc.StatusCode.UNAUTHENTICATED
    assert stubs["keyed"].Generate(pb.GenerateRequest(**{**ok, "model": "tiny"}), metadata=key_md("s3cret")).text
    # a normal request right after
    assert stubs["spec"].Generate(pb.GenerateRequest(**ok)).usage.completion_tokens >= 1


def test_grpc_queue_full_and_cancel(base, stubs):
    import grpc

    from tandem_proto import tandem_pb2 as pb

    long = pb.GenerateRequest(model=TARGET, prompt="hello", max_tokens=150, ignore_eos=True)
    futures = [stubs["small"].Generate.future(long) for _ in range(6)]
    codes = []
    for f in futures:
        try:
            f.result(timeout=120)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as e:
            codes.append(e.code())
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes
    # a cancelled stream aborts its request
    start = metric(base, "small", "generation_tokens_total")
    call = stubs["small"].GenerateStream(pb.GenerateRequest(model=TARGET, prompt="hello", max_tokens=2000, ignore_eos=True))
    next(call)
    call.cancel()
    wait_until_idle(base, "small")
    generated = metric(base, "small", "generation_tokens_total")
    assert generated - start < 1000  # it stopped early: cancelled, not finished
    time.sleep(1.0)
    assert metric(base, "small", "generation_tokens_total") == generated
    assert metric(base, "small", "num_requests_running") == 0


def test_metrics_match_per_request_stats(base, stubs):
    """/metrics counters move by exactly the spec-decode stats the requests report."""
    from tandem_proto import tandem_pb2 as pb

    names = ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
             "spec_decode_num_accepted_tokens_total", "generation_tokens_total"]
    before = {n: metric(base, "spec", n) for n in names}
    replies = [stubs["spec"].Generate(pb.GenerateRequest(model=TARGET, prompt=p, max_tokens=n, temperature=t,
                                                ignore_eos=True, seed=1))
               for p, n, t in [("abc", 20, 0.0), ("hello there", 13, 1.0), ("x", 7, 0.5)]]
    after = {n: metric(base, "spec", n) for n in names}
    assert after["spec_decode_num_drafts_total"] - before["spec_decode_num_drafts_total"] == \
        sum(r.spec_decode.num_drafts for r in replies)
    assert after["spec_decode_num_draft_tokens_total"] - before["spec_decode_num_draft_tokens_total"] == \
        sum(r.spec_decode.num_draft_tokens for r in replies)
    assert after["spec_decode_num_accepted_tokens_total"] - before["spec_decode_num_accepted_tokens_total"] == \
        sum(r.spec_decode.num_accepted_tokens for r in replies)
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 20 + 13 + 7
    text = httpx.get(f"{base}/spec/metrics").text
    assert 'tandem:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text
    assert "tandem:engine_step_seconds_bucket" in text and 'finished_reason="length"' in text


def test_completion_logprobs_streamed_and_echoed(base):
    kw = dict(model=TARGET, prompt="the cat", max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    done = client(base, "spec").completions.create(**kw)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == done.choices[0].text and lp.text_offset[0] == 0
    assert all(v <= 0 for v in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    off = client(base, "plain").completions.create(**kw).choices[0].logprobs
    assert off.tokens == lp.tokens and max(abs(a - b) for a, b in zip(off.token_logprobs, lp.token_logprobs)) < 1e-4
    chunks = list(client(base, "spec").completions.create(**kw, stream=True))
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert max(abs(a - b) for a, b in zip(streamed, lp.token_logprobs)) < 1e-6 and len(streamed) == 8
    echo = client(base, "spec").completions.create(**{**kw, "max_tokens": 3}, echo=True)
    elp, n_prompt = echo.choices[0].logprobs, echo.usage.prompt_tokens
    assert echo.choices[0].text.startswith("the cat")
    assert len(elp.tokens) == n_prompt + 3 and elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])


def test_chat_logprobs_penalties_and_bias(base):
    messages = [{"role": "user", "content": "hi there"}]
    r = client(base, "spec").chat.completions.create(model=TARGET, messages=messages, max_tokens=6, temperature=0,
                                                    logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(x.top_logprobs) == 2 for x in content)
    assert all(bytes(x.bytes).decode() == x.token for x in content)
    # penalties apply with speculation on as off
    kw = dict(model=TARGET, prompt="zebra zebra", max_tokens=30, temperature=0, presence_penalty=1.5,
              frequency_penalty=0.5, extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    on, off = (client(base, app).completions.create(**kw).choices[0].text for app in ("spec", "plain"))
    assert on == off
    plain_text = client(base, "plain").completions.create(model=TARGET, prompt="zebra zebra", max_tokens=30, temperature=0,
                                                         extra_body={"ignore_eos": True}).choices[0].text
    assert on != plain_text
    forced = client(base, "spec").completions.create(model=TARGET, prompt="the cat", max_tokens=5, temperature=0,
                                                    logit_bias={"9": 100}, extra_body={"ignore_eos": True})
    nine = httpx.post(f"{base}/spec/detokenize", json={"tokens": [9]}).json()["prompt"]
    assert forced.choices[0].text == nine * 5


def test_tokenize_and_detokenize(base):
    tok = httpx.post(f"{base}/spec/tokenize", json={"model": TARGET, "prompt": "hello", "add_special_tokens": False})
    body = tok.json()
    assert tok.status_code == 200 and body["count"] == len(body["tokens"]) == 5 and body["max_model_len"] > 0
    assert httpx.post(f"{base}/spec/detokenize", json={"model": TARGET, "tokens": body["tokens"]}).json() == {"prompt": "hello"}
    chat = httpx.post(f"{base}/spec/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    for path, payload, status in [("detokenize", {"tokens": [-1]}, 400), ("detokenize", {"tokens": [10**9]}, 400),
                                  ("tokenize", {}, 400), ("tokenize", {"prompt": "x", "model": "gpt-4"}, 404),
                                  ("tokenize", {"prompt": "x", "frobnicate": 1}, 400),
                                  ("tokenize", {"prompt": "hello " * 50_000}, 400),  # more than any context
                                  ("detokenize", {"tokens": [5] * 100_000}, 400)]:
        r = httpx.post(f"{base}/spec/{path}", json=payload)
        assert r.status_code == status and r.json()["error"]["message"], (path, payload)
    assert httpx.post(f"{base}/keyed/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(f"{base}/keyed/tokenize", json={"prompt": "x"},
                      headers={"Authorization": "Bearer s3cret"}).status_code == 200


# the field types vLLM's own /tokenizer_info schema test checks
TOKENIZER_INFO_TYPES = {"add_bos_token": bool, "add_prefix_space": bool, "clean_up_tokenization_spaces": bool,
                        "split_special_tokens": bool, "bos_token": str, "eos_token": str, "pad_token": str,
                        "unk_token": str, "chat_template": str, "errors": str, "model_max_length": int,
                        "additional_special_tokens": list, "added_tokens_decoder": dict}


def test_tokenizer_info(base):
    info = httpx.get(f"{base}/spec/tokenizer_info").json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    for field, kind in TOKENIZER_INFO_TYPES.items():
        assert info.get(field) is None or isinstance(info[field], kind), field
    # what a remote tokenizer (lm-evaluation-harness's) reads, consistent with /tokenize
    tok = httpx.post(f"{base}/spec/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert tok["count"] == 1 and info["model_max_length"] == tok["max_model_len"]
    assert info["add_bos_token"] is False  # the char tokenizer adds nothing
    assert "{%" in info["chat_template"]  # the template chat completions use
    # nothing of where the files were: no name_or_path, no *_file, no absolute path anywhere
    assert not {"name_or_path", "vocab_file", "tokenizer_file", "merges_file", "cache_dir", "token"} & set(info)
    assert not re.search(r'"(/|~/|[A-Za-z]:\\\\)', httpx.get(f"{base}/spec/tokenizer_info").text)
    assert httpx.get(f"{base}/keyed/tokenizer_info").status_code == 401
    keyed = httpx.get(f"{base}/keyed/tokenizer_info", headers={"Authorization": "Bearer s3cret"})
    assert keyed.status_code == 200 and keyed.json()["tokenizer_class"] == info["tokenizer_class"]


def test_token_ids_from_tokenize_complete_as_the_text_does(base):
    """A client that tokenizes through /tokenize and sends the ids gets the text's greedy completion:
    the same prompt tokens, BOS (where the tokenizer adds one) once. tests/test_serve_config.py checks
    the same on Gemma, whose tokenizer adds BOS."""
    c = client(base, "spec")
    for text in ["the cat sat", "hello world"]:
        ids = httpx.post(f"{base}/spec/tokenize", json={"model": TARGET, "prompt": text}).json()["tokens"]
        kw = dict(model=TARGET, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        as_text, as_ids = c.completions.create(prompt=text, **kw), c.completions.create(prompt=ids, **kw)
        assert as_ids.choices[0].text == as_text.choices[0].text
        assert as_ids.usage.prompt_tokens == as_text.usage.prompt_tokens == len(ids)


def test_grpc_logprobs_and_penalties(base, stubs):
    from tandem_proto import tandem_pb2 as pb

    req = pb.GenerateRequest(model=TARGET, prompt="the cat", max_tokens=6, temperature=0, ignore_eos=True,
                             logprobs=2, prompt_logprobs=1)
    unary = stubs["spec"].Generate(req)
    assert [x.token_id for x in unary.logprobs] == list(unary.token_ids)
    assert all(len(x.top_logprobs) == 2 and x.logprob <= 0 and x.rank == 1 for x in unary.logprobs)
    assert len(unary.prompt_logprobs) == unary.usage.prompt_tokens
    assert not unary.prompt_logprobs[0].HasField("logprob") and unary.prompt_logprobs[1].HasField("logprob")
    http = client(base, "spec").completions.create(model=TARGET, prompt="the cat", max_tokens=6, temperature=0, logprobs=2,
                                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    assert max(abs(a.logprob - b) for a, b in zip(unary.logprobs, http.token_logprobs)) < 1e-4
    parts = list(stubs["spec"].GenerateStream(req))
    assert [x.token_id for p in parts for x in p.logprobs] == list(unary.token_ids)
    assert len(parts[0].prompt_logprobs) == unary.usage.prompt_tokens
    forced = stubs["spec"].Generate(pb.GenerateRequest(model=TARGET, prompt="the cat", max_tokens=4, temperature=0,
                                                       ignore_eos=True, logit_bias={9: 100.0}, presence_penalty=0.0))
    assert list(forced.token_ids) == [9] * 4


TRACED = dict(model=TARGET, prompt="the cat sat", max_tokens=30, temperature=0, ignore_eos=True)


def streamed_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return sse_events(r.read().decode())


def test_spec_trace_whole_and_streamed_agree_with_the_stats(base):
    url = f"{base}/spec/v1/completions"
    whole = httpx.post(url, json={**TRACED, "spec_trace": True}).json()
    choice = whole["choices"][0]
    trace, tokens = choice["spec_trace"], choice["spec_trace"]["tokens"]
    assert len(tokens) == whole["usage"]["completion_tokens"] == 30
    assert trace["stats"]["num_drafts"] > 0
    assert sum(t["draft"] for t in tokens) == trace["stats"]["num_accepted_tokens"]
    assert tokens[-1]["end"] == len(choice["text"]) and [t["end"] for t in tokens] == sorted(t["end"] for t in tokens)
    # streamed: the same trace, piece by piece, and the counters once, on the last chunk
    events = streamed_events(url, {**TRACED, "spec_trace": True})
    traces = [c["spec_trace"] for e in events for c in e["choices"] if "spec_trace" in c]
    assert [t for x in traces for t in x["tokens"]] == tokens
    assert [x["stats"] for x in traces if "stats" in x] == [trace["stats"]] and "stats" in traces[-1]
    assert "".join(c["text"] for e in events for c in e["choices"]) == choice["text"]
    # not asked for: nothing new on the wire, whole or streamed
    assert "spec_trace" not in httpx.post(url, json=TRACED).json()["choices"][0]
    assert not any("spec_trace" in c for e in streamed_events(url, TRACED) for c in e["choices"])
    # chat, through the official client: the extension rides as an extra field
    chat = client(base, "spec").chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "hi"}],
                                                         max_tokens=20, temperature=0, extra_body={"spec_trace": True})
    chat_trace = chat.choices[0].model_extra["spec_trace"]
    assert len(chat_trace["tokens"]) == chat.usage.completion_tokens
    assert chat_trace["tokens"][-1]["end"] == len(chat.choices[0].message.content)


def test_speculative_false_turns_drafting_off_for_that_request_only(base):
    url = f"{base}/spec/v1/completions"
    on = httpx.post(url, json={**TRACED, "spec_trace": True}).json()["choices"][0]
    off = httpx.post(url, json={**TRACED, "spec_trace": True, "speculative": False}).json()["choices"][0]
    assert off["text"] == on["text"]  # greedy: the same answer
    assert off["spec_trace"]["stats"]["num_drafts"] == 0 and not any(t["draft"] for t in off["spec_trace"]["tokens"])
    assert [t["round"] for t in off["spec_trace"]["tokens"]] == list(range(30))  # one token a round
    assert on["spec_trace"]["stats"]["num_drafts"] > 0
    bad = httpx.post(url, json={**TRACED, "speculative": "sometimes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"


def test_spec_trace_over_grpc_equals_http(base, stubs):
    from tandem_proto import tandem_pb2 as pb

    http = httpx.post(f"{base}/spec/v1/completions", json={**TRACED, "spec_trace": True}).json()["choices"][0]
    expected = [(t["end"], t["round"], t["draft"], t["k"]) for t in http["spec_trace"]["tokens"]]
    fields = {k: v for k, v in TRACED.items()}
    req = pb.GenerateRequest(**fields, spec_trace=True)
    unary = stubs["spec"].Generate(req)
    assert [(o.end, o.round, o.draft, o.k) for o in unary.origins] == expected
    assert sum(o.draft for o in unary.origins) == unary.spec_decode.num_accepted_tokens
    parts = list(stubs["spec"].GenerateStream(req))
    assert [(o.end, o.round, o.draft, o.k) for p in parts for o in p.origins] == expected
    assert not stubs["spec"].Generate(pb.GenerateRequest(**fields)).origins  # not asked for
    off = stubs["spec"].Generate(pb.GenerateRequest(**fields, speculative=False))
    assert off.text == unary.text and off.spec_decode.num_drafts == 0


def test_playground_is_served_with_strict_headers_and_can_be_turned_off(base):
    root = httpx.get(f"{base}/spec/")
    assert root.status_code == 307 and root.headers["location"] == "/spec/playground"  # under its route prefix
    page = httpx.get(f"{base}/spec/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe" not in csp and page.headers["x-content-type-options"] == "nosniff"
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)  # nothing from anywhere but the app
    for name, kind in [("playground.js", "text/javascript"), ("playground.css", "text/css")]:
        asset = httpx.get(f"{base}/spec/playground/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert "http://" not in asset.text and "https://" not in asset.text
    missing = httpx.get(f"{base}/spec/playground/secrets.txt")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{base}/keyed/playground").status_code == 200  # the page is public; the API is not
    for path in ("/plain/playground", "/plain/playground/playground.js", "/plain/"):  # disable_playground
        assert httpx.get(f"{base}{path}").status_code == 404


def test_playground_in_a_browser_sends_the_typed_key_in_the_header_only(base):
    with browser_page() as page:
        calls = []
        page.on("request", lambda r: calls.append((r.url, r.headers.get("authorization"))))
        page.goto(f"{base}/keyed/playground")
        wait_text(page, "#status", "API key")
        fill(page, mode="completion", prompt="the cat sat", max_tokens=12, temperature=0)
        run(page)  # no key: the API's 401, shown
        assert "401" in page.text_content("#status") and answer(page) == ""
        fill(page, api_key="s3cret")
        page.dispatch_event("#api-key", "change")
        page.wait_for_selector("#model option[value='tiny']", state="attached")
        run(page)
        expected = client(base, "keyed", key="s3cret").completions.create(
            model="tiny", prompt="the cat sat", max_tokens=12, temperature=0)
        assert answer(page) == expected.choices[0].text and answer(page)
        assert page.text_content("#m-tokens") == "12"
        api = [(url, auth) for url, auth in calls if "/v1/" in url]
        assert [auth for _, auth in api][-2:] == ["Bearer s3cret"] * 2  # the models list, then the completion
        assert not any("s3cret" in url for url, _ in calls)  # never in a URL
        stored = page.evaluate("() => localStorage.length + sessionStorage.length + document.cookie.length")
        assert stored == 0  # and never stored by the page
