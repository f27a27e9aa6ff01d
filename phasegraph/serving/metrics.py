"""Prometheus metrics of the server: the AsyncEngine's counters, read when scraped, and the
latencies the HTTP layer measures. Every name starts with ``phasegraph_``; docs/serving.md
lists them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from phasegraph.serving.async_engine import AsyncEngineBase

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineCollector:
    """The engine's side, from :meth:`AsyncEngine.stats` at every scrape (a custom collector:
    the engine thread keeps plain counters, and nothing is done per token for Prometheus)."""

    def __init__(self, aengine: AsyncEngineBase) -> None:
        self.aengine = aengine
        self.accept_width = aengine.accept_width

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        s = self.aengine.stats()
        yield CounterMetricFamily("phasegraph_generation_tokens", "Tokens generated (rate() of it: tokens/s)",
                                  value=s.generated_tokens)
        yield CounterMetricFamily("phasegraph_prompt_tokens", "Prompt tokens of the finished requests",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("phasegraph_engine_steps", "Engine steps run", value=s.steps)
        yield CounterMetricFamily("phasegraph_engine_step_seconds", "Engine thread's wall time in engine steps",
                                  value=s.step_seconds)
        yield CounterMetricFamily("phasegraph_serving_seconds", "Engine thread's wall time on the serving "
                                  "layer's work between steps (handing deltas over, waking event loops)",
                                  value=s.serving_seconds)
        finished = CounterMetricFamily("phasegraph_requests_finished", "Requests finished, by finish reason",
                                       labels=["finish_reason"])
        for reason, count in sorted(s.finished.items()):
            finished.add_metric([reason], count)
        yield finished
        yield CounterMetricFamily("phasegraph_requests_rejected", "Requests refused because the queue was full",
                                  value=s.rejected)
        yield self._accept_histogram(s.accept_lengths)
        seconds = CounterMetricFamily("phasegraph_phase_seconds", "Host wall time spent in each phase",
                                      labels=["phase"])
        runs = CounterMetricFamily("phasegraph_phase_runs", "Runs of each phase", labels=["phase"])
        for phase in sorted(s.phase_seconds):
            seconds.add_metric([phase], s.phase_seconds[phase])
            runs.add_metric([phase], s.phase_runs.get(phase, 0))
        yield seconds
        yield runs
        yield GaugeMetricFamily("phasegraph_kv_pages_used", "KV pages in use (target and draft share them)",
                                value=s.kv_total_pages - s.kv_free_pages)
        yield GaugeMetricFamily("phasegraph_kv_pages_total", "KV pages the allocator can hand out",
                                value=s.kv_total_pages)
        yield GaugeMetricFamily("phasegraph_kv_pages_cached", "KV pages the prefix cache holds (those no "
                                "request borrows count as free: they are evicted when needed)", value=s.kv_cached_pages)
        yield CounterMetricFamily("phasegraph_prefill_tokens", "Tokens of every prefill, cached ones included",
                                  value=s.prefill_tokens)
        yield CounterMetricFamily("phasegraph_prefix_cache_hit_tokens", "Prefill tokens read from the prefix "
                                  "cache", value=s.cached_tokens)
        yield GaugeMetricFamily("phasegraph_prefix_cache_hit_rate", "Share of prefill tokens read from the "
                                "prefix cache since the start", value=s.cached_tokens / max(s.prefill_tokens, 1))
        depth = GaugeMetricFamily("phasegraph_queue_depth", "Requests in the engine, waiting or running",
                                  labels=["state"])
        depth.add_metric(["waiting"], s.waiting)
        depth.add_metric(["running"], s.running)
        yield depth
        yield GaugeMetricFamily("phasegraph_queue_requests", "Requests the bounded queue holds (added, unfinished)",
                                value=s.queued)
        yield GaugeMetricFamily("phasegraph_queue_capacity", "The bounded queue's size (--max-queue)",
                                value=s.max_queue)

    def _accept_histogram(self, counts: dict[int, int]) -> HistogramMetricFamily:
        """Verify steps by accept length (accepted drafts + 1), one bucket per length."""
        width = max([self.accept_width, *counts])
        buckets, total = [], 0
        for n in range(1, width + 1):
            total += counts.get(n, 0)
            buckets.append((str(float(n)), total))
        buckets.append(("+Inf", total))
        return HistogramMetricFamily("phasegraph_accept_length", "Accept length of each verify step",
                                     buckets=buckets, sum_value=sum(n * c for n, c in counts.items()))


class ServerMetrics:
    """One server's registry: the engine's collector and the latencies measured per request."""

    def __init__(self, aengine: AsyncEngineBase) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(aengine))
        self.time_to_first_token = Histogram(
            "phasegraph_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram(
            "phasegraph_inter_token_latency_seconds", "Between two streamed chunks of a request (a chunk "
            "holds every token of one step)", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_latency = Histogram(
            "phasegraph_request_latency_seconds", "From a request's arrival to its last token",
            buckets=LATENCY_BUCKETS, registry=self.registry)
