"""/metrics in Prometheus text format, read from the engine's counters at scrape time
(vLLM's spec-decode metric names)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.async_engine import AsyncEngine


class EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        snapshot = self.engine.stats()
        stats = snapshot.spec_decode
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
        counters = snapshot.counters
        yield counter("generation_tokens", "Tokens generated (verified), across requests",
                      counters.num_generation_tokens)
        yield counter("prompt_tokens", "Prompt tokens admitted", counters.num_prompt_tokens)
        finished = CounterMetricFamily("tandem:request_success", "Finished requests, by finish reason",
                                       labels=labels + ["finished_reason"])
        for reason, n in sorted(counters.num_requests_finished.items()):
            finished.add_metric(value + [reason], n)
        yield finished
        for name, doc, hist in (
                ("engine_step_seconds", "Wall time of one engine step", counters.step_time),
                ("time_to_first_token_seconds", "From a request's arrival to its first token", counters.time_to_first_token),
                ("inter_token_latency_seconds", "Between a request's streamed deltas", counters.inter_token_latency)):
            family = HistogramMetricFamily(f"tandem:{name}", doc, labels=labels)
            family.add_metric(value, hist.cumulative(), hist.total)
            yield family
        running = GaugeMetricFamily("tandem:num_requests_running", "Requests in the batch", labels=labels)
        running.add_metric(value, snapshot.num_running)
        yield running
        waiting = GaugeMetricFamily("tandem:num_requests_waiting", "Requests waiting to be admitted (new or preempted)",
                                    labels=labels)
        waiting.add_metric(value, snapshot.num_waiting)
        yield waiting
        yield from self._cache_metrics(snapshot.caches, labels, value)

    def _cache_metrics(self, caches: dict, labels: list[str], value: list[str]):
        """vLLM's cache metrics, one series per model (target, draft): each has its own blocks."""
        by_model = labels + ["model"]
        usage = GaugeMetricFamily("tandem:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)",
                                  labels=by_model)
        queries = CounterMetricFamily("tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels=by_model)
        hits = CounterMetricFamily("tandem:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   labels=by_model)
        preempted = CounterMetricFamily("tandem:num_preemptions", "Requests preempted for want of KV blocks "
                                        "(the target's pool decides; the draft's never preempts)", labels=by_model)
        for name, cache in caches.items():
            usage.add_metric(value + [name], cache.usage)
            queries.add_metric(value + [name], cache.queries)
            hits.add_metric(value + [name], cache.hits)
            preempted.add_metric(value + [name], cache.preemptions)
        yield from (usage, queries, hits, preempted)


_registries: dict[int, CollectorRegistry] = {}


def metrics_text(engine: AsyncEngine, model_name: str = "") -> bytes:
    registry = _registries.get(id(engine))
    if registry is None:
        registry = _registries[id(engine)] = CollectorRegistry()
        registry.register(EngineCollector(engine, model_name))
    return generate_latest(registry)


class RayMetricsPusher:
    """The same counters through ray.util.metrics, so they reach Ray's metrics export port (8080
    under KubeRay) with the rest of the cluster's metrics. Call push() periodically."""

    COUNTERS = {
        "spec_decode_num_drafts": "Verification steps with at least one draft token",
        "spec_decode_num_draft_tokens": "Draft tokens proposed",
        "spec_decode_num_accepted_tokens": "Draft tokens accepted",
        "generation_tokens": "Tokens generated",
        "prompt_tokens": "Prompt tokens admitted",
    }

    def __init__(self, engine: AsyncEngine, model_name: str):
        from ray.util import metrics

        self.engine, self.tags = engine, {"model_name": model_name}
        self.counters = {name: metrics.Counter(f"tandem_{name}", doc, tag_keys=("model_name",))
                         for name, doc in self.COUNTERS.items()}
        self.running = metrics.Gauge("tandem_num_requests_running", "Requests in the batch", tag_keys=("model_name",))
        self.waiting = metrics.Gauge("tandem_num_requests_waiting", "Requests waiting", tag_keys=("model_name",))
        self.last: dict[str, float] = {}

    def values(self) -> dict[str, float]:
        snapshot = self.engine.stats()
        stats, counters = snapshot.spec_decode, snapshot.counters
        return {"spec_decode_num_drafts": stats.num_drafts,
                "spec_decode_num_draft_tokens": stats.num_draft_tokens,
                "spec_decode_num_accepted_tokens": stats.num_accepted_tokens,
                "generation_tokens": counters.num_generation_tokens,
                "prompt_tokens": counters.num_prompt_tokens}

    def push(self) -> None:
        for name, value in self.values().items():
            delta = value - self.last.get(name, 0)
            if delta > 0:
                self.counters[name].inc(delta, tags=self.tags)
            self.last[name] = value
        self.running.set(self.engine.num_running(), tags=self.tags)
        self.waiting.set(self.engine.num_waiting(), tags=self.tags)
