"""Prometheus metrics of one engine (``GET /metrics``), read from the engine's public telemetry only: our own
``cbp:`` names, and beside them the same values under vLLM v1's ``vllm:`` names and labels (``model_name``,
``engine`` = the data-parallel rank, "0" here) plus ``vllm:cache_config_info`` and
``vllm:iteration_tokens_total``, so dashboards and tools written for vLLM read our server unchanged."""

from __future__ import annotations

import bisect
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine import AsyncEngine, FinishedRequestStats

# Histogram buckets: vLLM's (seconds; tokens).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class RepeatedHistogram:
    """A cumulative histogram that takes one value observed many times at once (``observe(value, times)``), for
    the inter-token latency: each finished request's mean gap, once per gap, in O(1)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, times: int = 1) -> None:
        """Count ``value`` ``times`` times (``times`` <= 0: nothing)."""
        if times <= 0:
            return
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += times
            self.sum += value * times

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        """The histogram as a Prometheus metric family (cumulative buckets)."""
        with self._lock:
            counts, total = list(self.counts), self.sum
        fam = HistogramMetricFamily(name, doc, labels=labels)
        cumulative, buckets = 0, []
        for bound, n in zip((*map(str, self.bounds), "+Inf"), counts):
            cumulative += n
            buckets.append((bound, cumulative))
        fam.add_metric(values, buckets, sum_value=total)
        return fam


class EngineMetrics:
    """Prometheus metrics of one engine in its own :class:`CollectorRegistry` (one per app, so tests
    can build several apps). Meanings are vLLM's; names use ``{prefix}:`` instead of ``vllm:``.

    Gauges and counters are read from the engine at each scrape; the histograms and ``request_success`` are
    fed as each request finishes (``Telemetry.on_finished``, on the engine thread, from the records the
    telemetry kept before for the requests finished earlier), so they cover every request of the engine (UI
    chats too), however many finish between two scrapes. The engine's telemetry starts afresh when it is
    reconfigured (the talk preset): the finish listener is carried over by ``AsyncEngine.on_finished``, and the
    counters read from the telemetry go on from the old telemetry's final totals, so none ever goes back.
    """

    def __init__(self, engine: AsyncEngine, model_name: str, prefix: str = "cbp",
                 registry: CollectorRegistry | None = None, *, vllm_names: bool = True,
                 engine_label: str | None = None) -> None:
        """Args: ``vllm_names``: also publish the ``vllm:`` names (a companion :class:`EngineMetrics` in the same
        registry, label ``engine="0"``); ``engine_label``: add an ``engine`` label with this value."""
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.label_names = ["model_name"] + (["engine"] if engine_label is not None else [])
        self.label_values = [model_name] + ([engine_label] if engine_label is not None else [])
        p, labels, values = prefix, self.label_names, self.label_values

        def hist(name, doc, buckets):
            return Histogram(f"{p}:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(*values)

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
                               labels + ["finished_reason"], registry=self.registry)
        self.rejected = None if engine_label is not None else Counter(f"{p}:api_rejected_requests",
                                "API requests refused before reaching the engine, by reason "
                                "(invalid, too_large, method_not_allowed, overloaded, rate_limited, unavailable).",
                                labels + ["reason"], registry=self.registry)
        # vLLM's names only: per-token latency (each request's mean gap, once per gap; yielded by collect)
        self.itl = RepeatedHistogram(TPOT_BUCKETS) if engine_label is not None else None
        self.registry.register(self)
        self.vllm = EngineMetrics(engine, model_name, "vllm", self.registry, vllm_names=False, engine_label="0") \
            if vllm_names and prefix != "vllm" else None
        self._telemetry = engine.telemetry  # the one the counters below were last read from
        self._base: dict[str, float] = {}  # counter -> the totals of the telemetries before it
        self._base_steps: dict[int, int] = {}  # the same for the step-token histogram
        self._switch = threading.Lock()  # two scrapes at once see one switch of telemetry
        for record in engine.on_finished(self.observe):
            self.observe(record)

    def reject(self, reason: str) -> None:
        """Count one refused API request."""
        if self.rejected is not None:
            self.rejected.labels(*self.label_values, reason).inc()

    def observe(self, r: FinishedRequestStats) -> None:
        """Count one finished request in the histograms and ``request_success`` (any thread; called by the
        engine's telemetry as the request finishes)."""
        if r.ttft is not None:
            self.ttft.observe(r.ttft)
        if r.tpot is not None:
            self.tpot.observe(r.tpot)
            if self.itl is not None:
                self.itl.observe(r.tpot, r.num_output_tokens - 1)
        self.e2e.observe(r.e2e)
        self.prompt_len.observe(r.num_prompt_tokens)
        self.gen_len.observe(r.num_output_tokens)
        self.success.labels(*self.label_values, r.finish_reason or "unknown").inc()

    @staticmethod
    def _totals(tel) -> dict[str, float]:
        """The cumulative counters one telemetry holds (from its start)."""
        snap = tel.latest()
        return {"prompt_tokens": tel.total_prompt_tokens, "generation_tokens": tel.total_generated_tokens,
                "prefix_cache_queries": getattr(snap, "prefix_cache_queries", 0),
                "prefix_cache_hits": getattr(snap, "prefix_cache_hits", 0),
                "num_preemptions": snap.num_preemptions if snap else 0}

    def _current(self):
        """The engine's telemetry; when the engine was reconfigured since the last scrape, the old one's final
        totals (it no longer changes) are added to the counters' bases first."""
        tel = self.engine.telemetry
        with self._switch:
            if tel is self._telemetry:
                return tel
            old, self._telemetry = self._telemetry, tel
            for k, v in self._totals(old).items():
                self._base[k] = self._base.get(k, 0) + v
            for tokens, n in old.step_token_counts().items():
                self._base_steps[tokens] = self._base_steps.get(tokens, 0) + n
            return tel

    def collect(self):
        """Live gauges and cumulative counters (called by the registry at each scrape), read from the
        engine's latest telemetry snapshot and totals, never from the scheduler itself."""
        p, m, names = self.prefix, self.label_values, self.label_names
        tel = self._current()
        snap = tel.latest()
        totals = {k: v + self._base.get(k, 0) for k, v in self._totals(tel).items()}

        def gauge(name, doc, value):
            g = GaugeMetricFamily(f"{p}:{name}", doc, labels=names)
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(f"{p}:{name}", doc, labels=names)
            c.add_metric(m, value)
            return c

        if p == "vllm":
            cfg = self.engine.config
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
                                     labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "engine"])
            info.add_metric([str(cfg.block_size), str(cfg.num_blocks), str(cfg.enable_prefix_caching),
                             m[-1]], 1.0)
            yield info
            # every step since the start (the engine counts them by their scheduled tokens as it records them)
            counts = dict(self._base_steps)
            for tokens, n in tel.step_token_counts().items():
                counts[tokens] = counts.get(tokens, 0) + n
            fam = HistogramMetricFamily("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                        labels=names)
            ordered, cumulative, i, buckets = sorted(counts.items()), 0, 0, []
            for bound in TOKEN_BUCKETS:
                while i < len(ordered) and ordered[i][0] <= bound:
                    cumulative += ordered[i][1]
                    i += 1
                buckets.append((str(float(bound)), cumulative))
            buckets.append(("+Inf", sum(counts.values())))
            fam.add_metric(m, buckets, sum_value=float(sum(t * n for t, n in counts.items())))
            yield fam
            if self.itl is not None:
                yield self.itl.family(f"{p}:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                      "seconds (each request's mean gap, once per gap).", names, m)

        yield gauge("num_requests_running", "Number of requests in model execution batches.",
                    snap.num_running if snap else 0)
        yield gauge("num_requests_waiting", "Number of requests waiting to be processed.",
                    snap.num_waiting if snap else 0)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    snap.kv_usage if snap else 0.0)
        if p != "vllm":  # ours only
            yield gauge("num_requests_pending", "Requests streaming now (admitted to the engine, not finished).",
                        self.engine.num_pending)
            yield gauge("engine_healthy", "1 while the engine thread runs, else 0.",
                        1 if self.engine.is_running else 0)
        yield counter("prompt_tokens", "Number of prefill tokens processed (counted when a request ends).",
                      totals["prompt_tokens"])
        yield counter("generation_tokens", "Number of generation tokens processed.", totals["generation_tokens"])
        yield counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      totals["prefix_cache_queries"])
        yield counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      totals["prefix_cache_hits"])
        yield counter("num_preemptions", "Cumulative number of preemption from the engine.", totals["num_preemptions"])

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
