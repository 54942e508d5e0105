"""Remote mode: the counters of serving engines read from their Prometheus ``/metrics``, one record per
engine (a vLLM data-parallel rank, an SGLang server, our own server).

Three dialects are read, by metric-name prefix: vLLM v1 (``vllm:``; labels ``model_name`` and ``engine``, the
data-parallel rank), SGLang (``sglang:``) and this project's server (``cbp:``, vLLM's names and meanings). When a
text holds several (our server publishes ``cbp:`` and ``vllm:`` names side by side) the first of
:data:`DIALECTS` present wins. Counters may carry the ``_total`` suffix or not; ``_created`` samples are ignored.

All of it is what the servers choose to publish, at the moment of the scrape: running/waiting gauges are
sampled by the server (vLLM: at its logging interval), so they lag by seconds; histograms are cumulative since
the server started (:class:`MetricsScraper` also gives the median over its recent scrapes).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ui.remote.errors import from_exception, from_status, technical

DIALECTS = ("vllm", "sglang", "cbp")
MAX_METRICS_BYTES = 16 * 1024 * 1024  # one server's /metrics text (vLLM's is tens of KB)
MAX_ENGINES = 256  # rows kept per server

# our record's field -> the dialect's metric name (without prefix and suffixes)
_GAUGES = {
    "vllm": {"running": "num_requests_running", "waiting": "num_requests_waiting", "kv_usage": "kv_cache_usage_perc",
             "prefix_queries": "prefix_cache_queries", "prefix_hits": "prefix_cache_hits",
             "preemptions": "num_preemptions", "generation_tokens": "generation_tokens",
             "prompt_tokens": "prompt_tokens", "pending": "num_requests_pending"},
    "sglang": {"running": "num_running_reqs", "waiting": "num_queue_reqs", "kv_usage": "token_usage",
               "hit_rate": "cache_hit_rate", "gen_throughput": "gen_throughput",
               "generation_tokens": "generation_tokens", "prompt_tokens": "prompt_tokens",
               "preemptions": "num_retracted_reqs"},
}
_GAUGES["cbp"] = _GAUGES["vllm"]
_HISTOGRAMS = {
    "vllm": {"ttft": ("time_to_first_token_seconds",),
             "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds")},
    "sglang": {"ttft": ("time_to_first_token_seconds",),
               "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds")},
    "cbp": {"ttft": ("time_to_first_token_seconds",),
            "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds")},
}
_ENGINE_LABELS = ("engine", "dp_rank")  # which label names the engine of a sample (vLLM, SGLang)
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


@dataclass
class Histogram:
    """A cumulative Prometheus histogram: ``buckets`` as sorted ``(upper bound, cumulative count)`` (the last
    bound ``inf``), ``sum`` (seconds) and ``count`` (observations)."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    @property
    def mean(self) -> float | None:
        """Mean observation (seconds), None without observations."""
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) by linear interpolation inside its bucket, as Prometheus'
        ``histogram_quantile`` does (the last finite bound when it falls in the ``+Inf`` bucket); None without
        observations."""
        total = self.buckets[-1][1] if self.buckets else 0.0
        if total <= 0:
            return None
        rank, lo, below = q * total, 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lo
                return lo + (le - lo) * ((rank - below) / (cum - below) if cum > below else 1.0)
            lo, below = le, cum
        return lo

    def minus(self, older: Histogram) -> Histogram:
        """The observations made since ``older`` (same buckets assumed; a reset server gives ``self``)."""
        if older.count > self.count or len(older.buckets) != len(self.buckets):
            return self
        return Histogram([(le, c - o) for (le, c), (_, o) in zip(self.buckets, older.buckets)],
                         self.sum - older.sum, self.count - older.count)


@dataclass
class EngineCounters:
    """One engine's counters at one scrape; None where the server publishes no such metric.

    Attributes:
        url: the server scraped (its base URL).
        engine: the engine label (vLLM's data-parallel rank ``engine``, SGLang's ``dp_rank``; "" when absent).
        dialect: ``"vllm"``, ``"sglang"`` or ``"cbp"``.
        model_name: the ``model_name`` label.
        running, waiting: requests running / waiting (gauges sampled by the server: they lag by seconds).
        pending: requests streaming now (``num_requests_pending``: this project's server only).
        kv_usage: KV cache usage, 0..1.
        prefix_queries, prefix_hits: prefix-cache queried / hit tokens (cumulative).
        hit_rate: prefix-cache hit rate 0..1 (hits / queries; SGLang's own gauge).
        preemptions: cumulative preemptions (SGLang: retracted requests).
        generation_tokens, prompt_tokens: cumulative tokens.
        gen_throughput: generated tokens per second (SGLang's gauge; else from two scrapes, see
            :class:`MetricsScraper`).
        ttft, itl: time to first token and inter-token latency histograms (seconds, since server start).
        ttft_recent, itl_recent: the same over the scraper's recent window (None: not computed / no requests).
        block_size, num_gpu_blocks: from ``vllm:cache_config_info`` (tokens per block, blocks).
        scraped_at: wall-clock time of the scrape (seconds since the epoch).
        raw: every sample value of the text for this engine (summed over other labels), by full sample name.
    """

    url: str
    engine: str
    dialect: str
    model_name: str | None = None
    running: float | None = None
    waiting: float | None = None
    pending: float | None = None
    kv_usage: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    hit_rate: float | None = None
    preemptions: float | None = None
    generation_tokens: float | None = None
    prompt_tokens: float | None = None
    gen_throughput: float | None = None
    ttft: Histogram | None = None
    itl: Histogram | None = None
    ttft_recent: Histogram | None = None
    itl_recent: Histogram | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    scraped_at: float = 0.0
    raw: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        """``(url, engine)``: who this record is about."""
        return self.url, self.engine


def _base(name: str) -> str:
    for s in _SUFFIXES:
        if name.endswith(s):
            return name[: -len(s)]
    return name


def parse_metrics(text: str, url: str = "", scraped_at: float | None = None) -> list[EngineCounters]:
    """Per-engine counters of one ``/metrics`` text (Prometheus text format).

    Args:
        text: the exposition text.
        url: the server it came from (copied into each record).
        scraped_at: when it was read (seconds since the epoch; default now).

    Returns:
        one :class:`EngineCounters` per engine label value of the chosen dialect, sorted by engine; an empty
        list when the text has no ``vllm:``, ``sglang:`` or ``cbp:`` metric.

    Raises:
        ValueError: the text is not in the Prometheus text format.
    """
    at = time.time() if scraped_at is None else scraped_at
    samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.endswith("_created"):
                samples.append(s)
    present = {s.name.split(":", 1)[0] for s in samples if ":" in s.name}
    dialect = next((d for d in DIALECTS if d in present), None)
    if dialect is None:
        return []
    prefix = dialect + ":"

    def engine_of(labels: dict[str, str]) -> str | None:
        return next((labels[k] for k in _ENGINE_LABELS if k in labels), None)

    # one row per engine label; samples without one (vLLM has a few process-wide ones) go to every row, and
    # make a row of their own only when no sample names an engine
    labelled = {e for e in (engine_of(s.labels) for s in samples if s.name.startswith(prefix)) if e is not None}
    engines = sorted(labelled or {""}, key=lambda e: (len(e), e))
    records = {e: EngineCounters(url, e, dialect, scraped_at=at) for e in engines}
    hists: dict[tuple[str, str], Histogram] = {}
    buckets: dict[tuple[str, str], dict[float, float]] = {}
    for s in samples:
        eng = engine_of(s.labels)
        targets = list(records.values()) if eng is None else ([records[eng]] if eng in records else [])
        for rec in targets:
            if "le" not in s.labels:
                rec.raw[s.name] = rec.raw.get(s.name, 0.0) + float(s.value)
            if rec.model_name is None and "model_name" in s.labels:
                rec.model_name = s.labels["model_name"]
        if not s.name.startswith(prefix):
            continue
        base = _base(s.name[len(prefix):])
        for rec in targets:
            if base == "cache_config_info":
                if s.labels.get("block_size", "").isdigit():
                    rec.block_size = int(s.labels["block_size"])
                if s.labels.get("num_gpu_blocks", "").isdigit():
                    rec.num_gpu_blocks = int(s.labels["num_gpu_blocks"])
            elif s.name.endswith("_bucket") and "le" in s.labels:
                b = buckets.setdefault((rec.engine, base), {})
                le = float(s.labels["le"])
                b[le] = b.get(le, 0.0) + float(s.value)
            elif s.name.endswith(("_sum", "_count")) and (rec.engine, base) in buckets:
                h = hists.setdefault((rec.engine, base), Histogram())
                if s.name.endswith("_sum"):
                    h.sum += float(s.value)
                else:
                    h.count += float(s.value)
    for (eng, base), b in buckets.items():
        hists.setdefault((eng, base), Histogram()).buckets = sorted(b.items())
    for eng, rec in records.items():
        for attr, name in _GAUGES[dialect].items():
            values = [v for k, v in rec.raw.items() if k.startswith(prefix) and _base(k[len(prefix):]) == name
                      and not k.endswith(("_bucket", "_sum", "_count"))]
            if values:
                setattr(rec, attr, sum(values))
        for attr, names in _HISTOGRAMS[dialect].items():
            setattr(rec, attr, next((hists[(eng, n)] for n in names if (eng, n) in hists), None))
        if rec.hit_rate is None and rec.prefix_queries:
            rec.hit_rate = (rec.prefix_hits or 0.0) / rec.prefix_queries
    return list(records.values())


@dataclass
class ScrapeResult:
    """One server's scrape: its ``url``, the engines read (``engines``) and ``error`` (None when it worked:
    a connection error, an HTTP status or a parse error, in one line, what probably happened first)."""

    url: str
    engines: list[EngineCounters]
    error: str | None = None


def metrics_url(base_url: str) -> str:
    """``base_url``'s ``/metrics`` (a URL already ending in ``/metrics`` is kept; a trailing ``/v1`` dropped)."""
    u = base_url.rstrip("/")
    if u.endswith("/metrics"):
        return u
    return u.removesuffix("/v1") + "/metrics"


class MetricsScraper:
    """Scrapes every server's ``/metrics`` (one per replica or engine), keeps the latest per-engine records, and
    adds what needs two scrapes: generated tokens per second and the histograms over the last ``window_s``.

    Thread-safe: :meth:`scrape` may run in any thread (the page runs it in a worker thread).

    Args:
        urls: the servers' base URLs (``http://host:8000``; ``/metrics`` is appended).
        timeout: seconds per scrape and server, in all (servers are read in parallel).
        window_s: seconds of scrapes the ``*_recent`` histograms cover.
        transport: an ``httpx`` transport (tests); default: the network.
    """

    def __init__(self, urls: Sequence[str], timeout: float = 2.0, window_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.urls = list(urls)
        self.window_s = window_s
        self.timeout = timeout
        self._client = httpx.Client(timeout=timeout, transport=transport, follow_redirects=True)
        self._lock = threading.Lock()
        self._history: dict[tuple[str, str], deque[EngineCounters]] = {}
        self.latest: list[ScrapeResult] = []
        self.latest_at: float = 0.0

    def scrape(self) -> list[ScrapeResult]:
        """Read every server now; never raises for a server that fails (its result carries the error).

        Returns:
            one :class:`ScrapeResult` per URL, in the order given.
        """
        if len(self.urls) == 1:
            results = [self._scrape_one(self.urls[0])]
        else:  # in parallel: a slow server delays only its own row
            with ThreadPoolExecutor(max_workers=min(8, len(self.urls)), thread_name_prefix="scrape") as pool:
                results = list(pool.map(self._scrape_one, self.urls))
        with self._lock:
            for res in results:
                for rec in res.engines:
                    self._derive(rec)
            self.latest, self.latest_at = results, time.time()
        return results

    def _scrape_one(self, url: str) -> ScrapeResult:
        """One server's ``/metrics``, read within ``timeout`` seconds in all and at most
        :data:`MAX_METRICS_BYTES` (a server that trickles or floods gets an error row, not a stuck page)."""
        try:
            deadline = time.monotonic() + self.timeout
            chunks, size = [], 0
            with self._client.stream("GET", metrics_url(url)) as r:
                if r.status_code != 200:
                    return ScrapeResult(url, [], str(from_status(r.status_code, "", "/metrics")))
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    if size > MAX_METRICS_BYTES:
                        raise ValueError(f"/metrics is over {MAX_METRICS_BYTES // (1 << 20)} MiB")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"/metrics took over {self.timeout:g} s")
                    chunks.append(chunk)
            engines = parse_metrics(b"".join(chunks).decode("utf-8", "replace"), url)[:MAX_ENGINES]
            return ScrapeResult(url, engines, None if engines else "no vllm:, sglang: or cbp: metrics")
        except (httpx.HTTPError, TimeoutError) as exc:
            return ScrapeResult(url, [], str(from_exception(exc, url)))
        except ValueError as exc:
            return ScrapeResult(url, [], f"The server's /metrics could not be read ({technical(exc)})")

    def _derive(self, rec: EngineCounters) -> None:
        hist = self._history.setdefault(rec.key, deque())
        if hist and rec.gen_throughput is None and rec.generation_tokens is not None:
            prev = hist[-1]
            dt = rec.scraped_at - prev.scraped_at
            if dt > 0 and prev.generation_tokens is not None and rec.generation_tokens >= prev.generation_tokens:
                rec.gen_throughput = (rec.generation_tokens - prev.generation_tokens) / dt
        while hist and rec.scraped_at - hist[0].scraped_at > self.window_s:
            hist.popleft()
        if hist:
            old = hist[0]
            if rec.ttft is not None and old.ttft is not None:
                rec.ttft_recent = rec.ttft.minus(old.ttft)
            if rec.itl is not None and old.itl is not None:
                rec.itl_recent = rec.itl.minus(old.itl)
        hist.append(rec)

    def engines(self) -> list[EngineCounters]:
        """Every engine of the latest scrape, server by server."""
        with self._lock:
            return [e for res in self.latest for e in res.engines]

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()
