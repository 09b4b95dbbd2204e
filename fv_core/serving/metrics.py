"""Prometheus metrics, one registry per app (so tests can run several apps in one process)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["CONTENT_TYPE", "Metrics"]

LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
RATE_WINDOW_S = 10.0  # steps/s is averaged over this window


class Metrics:
    """The server's gauges, counters and histograms."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.queued = Gauge("fv_queue_depth", "Jobs submitted and not yet started", registry=r)
        self.running = Gauge("fv_running_requests", "Jobs in progress", registry=r)
        self.steps = Counter("fv_steps", "Denoising steps finished", ["model"], registry=r)
        self.step_rate = Gauge(
            "fv_steps_per_second", f"Steps per second over the last {RATE_WINDOW_S:g} s", registry=r
        )
        self.step_rate.set_function(self._rate)
        self.refusals = Counter(
            "fv_admission_refusals", "Requests refused at admission", ["reason"], registry=r
        )
        self.jobs = Counter("fv_jobs", "Jobs finished, by model and outcome", ["model", "status"], registry=r)
        self.cache_steps = Counter(
            "fv_cache_steps",
            "Transformer steps computed or served from a caching interceptor, per request summed",
            ["model", "interceptor", "decision"],
            registry=r,
        )
        self.requests = Counter(
            "fv_generation_requests", "Generation requests accepted", ["model", "kind"], registry=r
        )
        self.latency = Histogram(
            "fv_job_latency_seconds",
            "Submit to finish, by model and outcome",
            ["model", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "fv_job_queue_seconds",
            "Submit to first step, by model",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_blocks = Histogram(
            "fv_kv_block_seconds",
            "Seconds per generated block of a block-causal loop, by model and KV policy",
            ["model", "policy"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.kv_retrievals = Counter(
            "fv_kv_retrievals",
            "Cached blocks a KV policy retrieved (per layer and pass)",
            ["model", "policy"],
            registry=r,
        )
        self.kv_evictions = Counter(
            "fv_kv_evictions", "Blocks a KV policy evicted", ["model", "policy"], registry=r
        )
        self.kv_cache_bytes = Gauge(
            "fv_kv_cache_bytes_peak",
            "Peak KV cache bytes of the last finished request",
            ["model", "policy"],
            registry=r,
        )
        self._step_times: deque[float] = deque()

    def cache_stats(self, model: str, result_metrics: dict) -> None:
        """Count the steps each caching interceptor computed and cached (its summary in the result's metrics)."""
        for summary in result_metrics.values():
            if isinstance(summary, dict) and {"interceptor", "computed", "cached"} <= summary.keys():
                for decision in ("computed", "cached"):
                    self.cache_steps.labels(model, summary["interceptor"], decision).inc(summary[decision])

    def kv_policy_stats(self, model: str, result_metrics: dict) -> None:
        """Record a KV policy's profile of one request (``result.metrics["kv_policy"]``)."""
        summary = result_metrics.get("kv_policy")
        if not isinstance(summary, dict):
            return
        policy = str(summary.get("policy"))
        for seconds in summary.get("block_seconds", []):
            self.kv_blocks.labels(model, policy).observe(seconds)
        self.kv_retrievals.labels(model, policy).inc(summary.get("retrievals", 0))
        self.kv_evictions.labels(model, policy).inc(len(summary.get("evicted_blocks", [])))
        self.kv_cache_bytes.labels(model, policy).set(summary.get("peak_cache_bytes", 0))

    def watch_engine(self, engine: Any) -> None:
        """Export an Engine's scheduling (read at each scrape): its policy, predicted vs measured step
        cost (a miscalibrated cost model shows), and its decisions."""
        self.registry.register(SchedulingCollector(engine))

    def step(self, model: str) -> None:
        self.steps.labels(model).inc()
        self._step_times.append(time.monotonic())

    def _rate(self) -> float:
        cutoff = time.monotonic() - RATE_WINDOW_S
        while self._step_times and self._step_times[0] < cutoff:
            self._step_times.popleft()
        return len(self._step_times) / RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SchedulingCollector:
    """Prometheus collector over an Engine's cost model and scheduling decisions."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        acc = self.engine.cost.accuracy()
        policy = GaugeMetricFamily(
            "fv_scheduling_policy", "The engine's scheduling policy", labels=["policy"]
        )
        policy.add_metric([self.engine.policy.policy], 1)
        yield policy
        yield CounterMetricFamily(
            "fv_step_cost_predicted_seconds",
            "Predicted seconds of the body calls run (batch curve, else calibrated plans)",
            value=acc["predicted_s"],
        )
        yield CounterMetricFamily(
            "fv_step_cost_measured_seconds", "Measured seconds of the same calls", value=acc["measured_s"]
        )
        yield GaugeMetricFamily(
            "fv_step_cost_error_median",
            "Median |measured / predicted - 1| over the latest 256 calls",
            value=acc["median_rel_error"],
        )
        yield GaugeMetricFamily(
            "fv_step_cost_error_median_warm",
            "The same, over calls priced after warm-up (3 measured calls of their shape and rows)",
            value=acc["median_rel_error_warm"],
        )
        decisions = CounterMetricFamily(
            "fv_schedule_decisions",
            "Scheduler decisions: batch, alone (run-alone), preempt, probe, late, split (out of memory)",
            labels=["decision"],
        )
        for name, count in self.engine.decisions.as_dict().items():
            decisions.add_metric([name], count)
        yield decisions
