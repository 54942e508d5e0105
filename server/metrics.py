"""Prometheus metrics of one engine (``GET /metrics``): vLLM's metric meanings, ``cbp:`` instead of
``vllm:``, read from the engine's public telemetry only."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.async_engine import AsyncEngine

# Histogram buckets: vLLM's (seconds; tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class EngineMetrics:
    """Prometheus metrics of one engine in its own :class:`CollectorRegistry` (one per app, so tests
    can build several apps). Meanings are vLLM's; names use ``{prefix}:`` instead of ``vllm:``.

    Gauges and counters are read from the engine at each scrape; histograms are fed from the engine's
    finished-request records (``Telemetry.finished_requests()``) at each scrape, so they cover every
    request of the engine (UI chats too), not only API ones.
    """

    def __init__(self, engine: AsyncEngine, model_name: str, prefix: str = "cbp",
                 registry: CollectorRegistry | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self._lock = threading.Lock()
        self._last_seen = None
        p, labels = prefix, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(f"{p}:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Histogram of time per output token in seconds (per request: (e2e - ttft) / "
                         "(generated tokens - 1)).", TPOT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                        E2E_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Number of prefill tokens processed (per request).",
                               TOKEN_BUCKETS)
        self.gen_len = hist("request_generation_tokens", "Number of generation tokens processed (per request).",
                            TOKEN_BUCKETS)
        self.success = Counter(f"{p}:request_success", "Count of finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.rejected = Counter(f"{p}:api_rejected_requests",
                                "API requests refused before reaching the engine, by reason "
                                "(invalid, too_large, method_not_allowed, overloaded, rate_limited, unavailable).",
                                ["model_name", "reason"], registry=self.registry)
        self.registry.register(self)

    def reject(self, reason: str) -> None:
        """Count one refused API request."""
        self.rejected.labels(self.model_name, reason).inc()

    def sync(self) -> None:
        """Feed the histograms with the requests finished since the last call."""
        with self._lock:
            records = self.engine.telemetry.finished_requests()
            start = 0
            if self._last_seen is not None:
                for i in range(len(records) - 1, -1, -1):
                    if records[i] is self._last_seen:
                        start = i + 1
                        break
            for r in records[start:]:
                if r.ttft is not None:
                    self.ttft.observe(r.ttft)
                if r.tpot is not None:
                    self.tpot.observe(r.tpot)
                self.e2e.observe(r.e2e)
                self.prompt_len.observe(r.num_prompt_tokens)
                self.gen_len.observe(r.num_output_tokens)
                self.success.labels(self.model_name, r.finish_reason or "unknown").inc()
            if records:
                self._last_seen = records[-1]

    def collect(self):
        """Live gauges and cumulative counters (called by the registry at each scrape), read from the
        engine's latest telemetry snapshot and totals, never from the scheduler itself."""
        p, m = self.prefix, [self.model_name]
        tel = self.engine.telemetry
        snap = tel.latest()

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("num_requests_running", "Number of requests in model execution batches.",
                    snap.num_running if snap else 0)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                    snap.num_waiting if snap else 0)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    snap.kv_usage if snap else 0.0)
        yield gauge("num_requests_pending", "Requests streaming now (admitted to the engine, not finished).",
                    self.engine.num_pending)
        yield gauge("engine_healthy", "1 while the engine thread runs, else 0.", 1 if self.engine.healthy else 0)
        yield counter("prompt_tokens", "Number of prefill tokens processed (counted when a request ends).",
                      tel.total_prompt_tokens)
        yield counter("generation_tokens", "Number of generation tokens processed.", tel.total_generated_tokens)
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      getattr(snap, "prefix_cache_queries", 0))
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      getattr(snap, "prefix_cache_hits", 0))
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.",
                      snap.num_preemptions if snap else 0)

    def render(self) -> bytes:
        """The registry in Prometheus text format (after :meth:`sync`)."""
        self.sync()
        return generate_latest(self.registry)
