"""Prometheus metrics for GET /metrics, with vLLM's metric names under the `taper:` prefix.

Engine state (running and waiting requests, KV-cache usage) and the engine's counters (tokens,
prefix-cache lookups, preemptions) are read from the engine when Prometheus scrapes, so /metrics
always agrees with the engine. Latencies are timed here, per request, as its outputs reach the
server: time to first token, the gaps between tokens, and the end-to-end time.
"""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.core.outputs import RequestOutput
from engine.core.stats import EngineStats

PREFIX = "taper:"

# vLLM's buckets, so dashboards built for it read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time (nothing while it loads). Data
    parallel's stats come by replica: each metric then has a sample per replica, labelled."""

    def __init__(self, stats: Callable[[], EngineStats | dict[int, EngineStats] | None],
                 model_name: str):
        self.stats, self.model_name = stats, model_name

    def collect(self):
        s = self.stats()
        if s is None:
            return
        if not isinstance(s, dict):
            yield from self._collect([(["model_name"], [self.model_name], s)])
            return
        yield from self._collect([(["model_name", "replica"], [self.model_name, str(i)], one)
                                  for i, one in sorted(s.items())])

    def _collect(self, samples):
        """samples: (label names, label values, EngineStats) of each engine."""
        names = samples[0][0] if samples else ["model_name"]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            for _, values, s in samples:
                g.add_metric(values, value(s))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(PREFIX + name, doc, labels=names)
            for _, values, s in samples:
                c.add_metric(values, value(s))
            return c

        yield gauge("num_requests_running", "Requests in the running batch.",
                    lambda s: s.num_requests_running)
        yield gauge("num_requests_waiting", "Requests waiting to run.",
                    lambda s: s.num_requests_waiting)
        yield gauge("kv_cache_usage_perc", "KV-cache usage: 1 means every block is held.",
                    lambda s: s.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      lambda s: s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      lambda s: s.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions (a request's KV cache freed to recompute).",
                      lambda s: s.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens of requests that produced a token.",
                      lambda s: s.prompt_tokens)
        yield counter("generation_tokens", "Generated tokens.", lambda s: s.generation_tokens)
        if len(samples) == 1 and samples[0][2].spec_method is not None:
            yield from _spec_decode_metrics(samples[0][2], self.model_name)


def _spec_decode_metrics(s: EngineStats, model_name: str):
    """Speculative decoding's counters (vLLM's names) and the two ratios they give, labelled
    with the method."""
    labels, values = ["model_name", "method"], [model_name, s.spec_method]
    for name, doc, value in [
            ("spec_decode_num_drafts", "Verify steps of a sequence with drafts.",
             s.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             s.spec_num_accepted_tokens)]:
        c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
        c.add_metric(values, value)
        yield c
    c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                            "Draft tokens accepted at each position of the drafts.",
                            labels=labels + ["position"])
    for i, n in enumerate(s.spec_accepted_per_position):
        c.add_metric(values + [str(i)], n)
    yield c
    for name, doc, value in [
            ("spec_decode_acceptance_rate", "Accepted draft tokens / draft tokens.",
             s.spec_acceptance_rate),
            ("spec_decode_mean_accepted_length",
             "Tokens a verify step emits per sequence: accepted drafts + 1.",
             s.spec_mean_accepted_length)]:
        g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
        g.add_metric(values, value)
        yield g


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats | None], model_name: str):
        self.registry = CollectorRegistry()   # collect() runs at scrape time only
        self.registry.register(_EngineCollector(stats, model_name))
        labels = ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to end.",
                             E2E_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Finished requests by reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self.model_name = model_name

    def request(self) -> "RequestTiming":
        """Start timing a request that arrived now."""
        return RequestTiming(self)

    def finished(self, reason: str):
        self._success.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTiming:
    """One request's clock: feeds the latency histograms and the usage's time costs."""

    def __init__(self, metrics: Metrics | None = None):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.done = False

    def on_output(self, out: RequestOutput):
        now = time.monotonic()
        m = self.metrics
        if out.new_token_ids:
            if self.first_token is None:
                self.first_token = now
                if m:
                    m.ttft.observe(now - self.arrival)
            elif m:
                m.itl.observe(now - self.last_token)
            self.last_token = now
        if out.finished:
            self._end(out.finish_reason or "stop", now)

    def discard(self):
        """The engine refused the request: it never ran, so it is not measured."""
        self.done = True

    def close(self):
        """The request ended without a finished output (the client left): an abort."""
        self._end("abort", time.monotonic())

    def _end(self, reason: str, now: float):
        if self.done:
            return
        self.done = True
        if self.metrics:
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.finished(reason)

    @property
    def prompt_time_ms(self) -> float:
        """Arrival to first token: queueing and prefill."""
        return 0.0 if self.first_token is None else (self.first_token - self.arrival) * 1e3

    @property
    def completion_time_ms(self) -> float:
        """First token to last: decoding."""
        if self.first_token is None:
            return 0.0
        return (self.last_token - self.first_token) * 1e3
