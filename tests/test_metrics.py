"""Spec-decode counters: the engine's totals are the sums of its requests' stats, and they reach
the periodic log line and /metrics unchanged."""
import logging

import pytest

from engine import LLM, SamplingParams
from engine.metrics import SpecDecodeLogger, SpecDecodeStats

TARGET, DRAFT = "random:tiny-llama:1", "random:tiny-llama:2"


@pytest.fixture(scope="module")
def run():
    llm = LLM(model=TARGET, speculative_config={"model": DRAFT, "num_speculative_tokens": 3})
    params = [SamplingParams(temperature=t, max_tokens=n, ignore_eos=True, seed=i)
              for i, (t, n) in enumerate([(0.0, 30), (1.0, 17), (0.7, 25), (0.0, 9)])]
    outs = llm.generate(["hello", "the cat", "abc", "zz"], params)
    return llm, outs


def test_engine_totals_equal_sum_of_requests(run):
    llm, outs = run
    total = SpecDecodeStats()
    for o in outs:
        total.merge(o.spec_decode_stats)
    engine = llm.spec_decode_stats
    assert (engine.num_drafts, engine.num_draft_tokens, engine.num_accepted_tokens) == \
        (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens)
    assert engine.num_accepted_tokens_per_pos == total.num_accepted_tokens_per_pos
    assert engine.num_drafts > 0
    # every step emits accepted + 1 tokens
    for o in outs:
        s = o.spec_decode_stats
        assert len(o.outputs[0].token_ids) <= s.num_accepted_tokens + s.num_drafts + 1
    counters = llm.core.scheduler.counters
    assert counters.num_generation_tokens == sum(len(o.outputs[0].token_ids) for o in outs) == 30 + 17 + 25 + 9
    assert counters.num_prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert counters.num_requests_finished == {"length": 4}
    assert counters.step_time.count > 0 and counters.step_time.cumulative()[-1][1] == counters.step_time.count


def test_per_position_counts_are_monotone(run):
    llm, _ = run
    per_pos = llm.spec_decode_stats.num_accepted_tokens_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # accepting position i needs all before it
    assert sum(per_pos) == llm.spec_decode_stats.num_accepted_tokens


def test_periodic_log_line(run, caplog):
    llm, _ = run
    stats = llm.spec_decode_stats
    logger = SpecDecodeLogger(interval_s=10.0)
    log = logging.getLogger("test.spec")
    assert logger.maybe_log(SpecDecodeStats(), 0.0, log) is None  # starts the clock
    assert logger.maybe_log(stats, 5.0, log) is None  # too soon
    with caplog.at_level(logging.INFO, logger="test.spec"):
        line = logger.maybe_log(stats, 11.0, log)
    assert line in caplog.text
    assert f"Mean acceptance length: {stats.mean_acceptance_length:.2f}" in line
    assert f"Accepted: {stats.num_accepted_tokens} tokens, Drafted: {stats.num_draft_tokens} tokens" in line
    assert logger.maybe_log(stats, 30.0, log) is None  # nothing new since the last line


def test_every_metric_the_grafana_dashboard_queries_is_exported():
    """k8s/grafana-dashboard.json against a live engine's /metrics text (one request served)."""
    import asyncio
    import json
    import re
    from pathlib import Path

    from deployments.metrics_export import metrics_text
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    engine = AsyncEngine(EngineConfig(model=TARGET, speculative_config={"model": DRAFT, "num_speculative_tokens": 3}),
                         use_ray=False)
    try:
        async def one():
            async for _ in engine.add_request("hello", SamplingParams(max_tokens=5, ignore_eos=True)):
                pass
        asyncio.run(one())
        exported = set(re.findall(r"^(tandem:[a-z_]+)", metrics_text(engine, "tiny").decode(), re.M))
    finally:
        engine.shutdown()
    dashboard = json.loads((Path(__file__).parent.parent / "k8s" / "grafana-dashboard.json").read_text())
    queried = {name for p in dashboard["panels"] for t in p["targets"] for name in re.findall(r"tandem:[a-z_]+", t["expr"])}
    assert len(queried) >= 12
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
    counters = engine.core.scheduler.counters
    assert counters.time_to_first_token.count == 1 and counters.inter_token_latency.count >= 1
