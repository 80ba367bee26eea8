"""Prometheus metrics. Each app owns its own registry, so several servers can live in one process."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("clover_requests", "HTTP API requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("clover_prompt_tokens", "prompt tokens processed", registry=r)
        self.completion_tokens = Counter("clover_completion_tokens", "completion tokens generated", registry=r)
        self.forwards = Counter("clover_forwards", "engine forwards (one per engine step)", registry=r)
        self.tokens_per_forward = Histogram(
            "clover_tokens_per_forward", "per finished row: generated tokens / forwards",
            buckets=(0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 32), registry=r)
        self.forced_share = Histogram(
            "clover_forced_step_share", "per finished diffusion row: share of its denoise steps where no position "
            "reached the threshold (the most confident one was committed below it)",
            buckets=(0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1), registry=r)
        self.ttft = Histogram("clover_time_to_first_token_seconds", "request arrival to its first committed token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("clover_request_latency_seconds", "request arrival to its last row finishing",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("clover_queue_depth", "rows waiting for a batch slot", registry=r)
        self.running = Gauge("clover_running_rows", "rows in flight in the engines", registry=r)
        self.engine_alive = Gauge("clover_engine_alive", "1 while the engine thread can serve, 0 once it has died",
                                  registry=r)
        self.engine_alive.set(1)
        self.batch_size = Histogram("clover_batch_size", "rows per forward",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256), registry=r)

        self.block_width = Counter("clover_block_width_blocks", "diffusion blocks decoded, by block width",
                                   ["width"], registry=r)
        self.auto_width = Gauge("clover_auto_width", "block_size=auto: the width of the latest choice", registry=r)
        self.auto_expected = Gauge(
            "clover_auto_expected_tokens_per_second", "block_size=auto: at the latest choice, the expected tokens/s "
            "of each trained width (the choice is the largest)", ["width"], registry=r)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
