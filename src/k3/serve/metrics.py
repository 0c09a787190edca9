"""`/metrics`: the engine's counters in Prometheus's text format (prometheus_client, a registry per call)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from k3.inference.engine import EngineStats


class _EngineCollector:
    def __init__(self, stats: EngineStats, http_requests: dict[tuple[str, int], int]):
        self.stats, self.http_requests = stats, http_requests

    def collect(self):
        s = self.stats
        yield CounterMetricFamily("k3_requests", "sequences submitted to the engine", value=s.requests)
        yield CounterMetricFamily("k3_prompt_tokens", "prompt tokens submitted", value=s.prompt_tokens)
        yield CounterMetricFamily("k3_generation_tokens", "tokens generated", value=s.generated_tokens)
        yield GaugeMetricFamily("k3_generation_tokens_per_second", "tokens generated per second, last 10 s",
                                value=s.tokens_per_second)
        yield GaugeMetricFamily("k3_queue_depth", "sequences waiting for a batch row", value=s.waiting)
        yield GaugeMetricFamily("k3_running", "sequences decoding in the batch", value=s.running)
        yield GaugeMetricFamily("k3_prefilling", "sequences admitted and prefilling", value=s.prefilling)
        yield GaugeMetricFamily("k3_batch_occupancy", "running sequences / --max-batch",
                                value=s.running / s.max_batch)
        yield GaugeMetricFamily("k3_mean_batch_rows", "rows per decode step since the start",
                                value=s.decode_rows / s.decode_steps if s.decode_steps else 0.0)
        ttft = sorted(s.time_to_first_token)
        yield SummaryMetricFamily("k3_time_to_first_token_seconds", "submission to first token (last 1,024)",
                                  count_value=len(ttft), sum_value=sum(ttft))
        for q in (0.5, 0.99):
            yield GaugeMetricFamily(f"k3_time_to_first_token_seconds_p{round(q * 100)}",
                                    f"time to first token, quantile {q} of the last 1,024",
                                    value=ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else 0.0)
        yield CounterMetricFamily("k3_prefix_cache_lookups", "prompts looked up in the prefix cache",
                                  value=s.prefix_lookups)
        yield CounterMetricFamily("k3_prefix_cache_hits", "prompts that reused a cached prefix", value=s.prefix_hits)
        yield GaugeMetricFamily("k3_prefix_cache_hit_rate", "hits / lookups",
                                value=s.prefix_hits / s.prefix_lookups if s.prefix_lookups else 0.0)
        yield CounterMetricFamily("k3_prefix_cache_tokens_reused", "prompt tokens not prefilled thanks to the cache",
                                  value=s.prefix_tokens_reused)
        yield GaugeMetricFamily("k3_prefix_cache_bytes", "bytes held by the prefix cache", value=s.prefix_bytes)
        http = CounterMetricFamily("k3_http_requests", "HTTP requests answered", labels=["path", "status"])
        for (path, status), n in sorted(self.http_requests.items()):
            http.add_metric([path, str(status)], n)
        yield http


def render_metrics(stats: EngineStats, http_requests: dict[tuple[str, int], int]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(stats, http_requests))
    return generate_latest(registry).decode()
