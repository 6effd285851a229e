"""Prometheus metrics (prometheus-client), one registry per app so apps never share state.

Request counters and latency histograms are updated by the routes; the engine's
live numbers (KV blocks, queue lengths, prefix cache) are read at scrape time by
a collector, so /metrics is always current and the engine loop pays nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from r3srv.engine.async_llm import PAUSE_MODES
from r3srv.engine.llm_engine import MEMORY_TAGS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        s = self._stats()
        gauges = {
            "r3srv_kv_blocks_used": ("KV cache blocks in use", s.kv_blocks_used),
            "r3srv_kv_blocks_total": ("KV cache blocks in the pool", s.kv_blocks_total),
            "r3srv_state_slots_used": ("Linear-attention state slots in use (hybrid models)", s.state_slots_used),
            "r3srv_state_slots_total": ("Linear-attention state slots (hybrid models; 0 otherwise)", s.state_slots_total),
            "r3srv_num_requests_running": ("Requests being scheduled", s.num_running),
            "r3srv_num_requests_waiting": ("Requests waiting to be scheduled", s.num_waiting),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        released = GaugeMetricFamily(
            "r3srv_memory_released", "1 while /release_memory_occupation has given this memory back", labels=["tag"]
        )
        for tag in MEMORY_TAGS:
            released.add_metric([tag], float(tag in s.released_memory))
        yield released
        paused = GaugeMetricFamily("r3srv_generation_paused", "1 while /pause_generation holds generation, by mode",
                                   labels=["mode"])
        for mode in PAUSE_MODES:
            paused.add_metric([mode], float(s.paused == mode))
        yield paused
        counters = {
            "r3srv_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            "r3srv_prefix_cache_hits": ("Prompt tokens served from the prefix cache", s.prefix_cache_hits),
            "r3srv_num_preemptions": ("Requests preempted (recomputed later)", s.num_preemptions),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "r3srv_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.prompt_tokens = Counter("r3srv_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.generation_tokens = Counter("r3srv_generation_tokens", "Tokens generated", registry=self.registry)
        self.routed_experts_bytes = Counter(
            "r3srv_routed_experts_bytes", "Bytes of routed_experts sent (the base64 text; dict encodings: the whole object)",
            registry=self.registry
        )
        self.e2e_latency = Histogram(
            "r3srv_e2e_request_latency_seconds",
            "End-to-end generation latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "r3srv_time_to_first_token_seconds",
            "Time to the first generated token",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.weight_updates = Counter(
            "r3srv_weight_updates",
            "POST /update_weights_from_disk by outcome: loaded, rejected (bad checkpoint), failed",
            ["outcome"],
            registry=self.registry,
        )
        self.weight_update_seconds = Histogram(
            "r3srv_weight_update_seconds",
            "Time from an update's request to its new weights serving (waiting for requests in flight, then loading)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
