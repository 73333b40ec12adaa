"""/metrics in Prometheus text format, read from the engine's counters at scrape time
(vLLM's spec-decode metric names)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.async_engine import AsyncEngine


class EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine.core.scheduler.stats
        labels = ["model_name"]
        value = [self.model_name]

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"tandem:{name}", doc, labels=labels)
            c.add_metric(value, v)
            return c

        yield counter("spec_decode_num_drafts", "Verification steps with at least one draft token",
                      stats.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed", stats.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", stats.num_accepted_tokens)
        per_pos = CounterMetricFamily("tandem:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position", labels=labels + ["position"])
        for pos, n in enumerate(stats.num_accepted_tokens_per_pos):
            per_pos.add_metric(value + [str(pos)], n)
        yield per_pos
        yield counter("generation_tokens", "Tokens generated (verified), across requests",
                      self.engine.core.scheduler.num_generated_tokens)
        running = GaugeMetricFamily("tandem:num_requests_running", "Requests in the batch", labels=labels)
        running.add_metric(value, self.engine.num_running())
        yield running
        waiting = GaugeMetricFamily("tandem:num_requests_waiting", "Requests waiting for a slot", labels=labels)
        waiting.add_metric(value, self.engine.num_waiting())
        yield waiting


_registries: dict[int, CollectorRegistry] = {}


def metrics_text(engine: AsyncEngine, model_name: str = "") -> bytes:
    registry = _registries.get(id(engine))
    if registry is None:
        registry = _registries[id(engine)] = CollectorRegistry()
        registry.register(EngineCollector(engine, model_name))
    return generate_latest(registry)
