"""Per-scheduler counters and histograms (read by the server's ``/metrics``)."""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from typing import Sequence


class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics)."""

    def __init__(self, buckets: Sequence[float]):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        if math.isnan(v):
            return
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        out, acc = [], 0
        for b, c in zip((*self.buckets, math.inf), self.counts):
            acc += c
            out.append((b, acc))
        return out


_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclasses.dataclass
class SchedulerMetrics:
    requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_prompt_tokens: int = 0
    cached_tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    steps: int = 0
    forward_seconds: float = 0.0
    # speculative decoding: draft tokens proposed / accepted, target verify passes, tokens they
    # emitted, seconds in the draft model
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_verify_steps: int = 0
    spec_emitted: int = 0
    spec_draft_seconds: float = 0.0
    queue_time: Histogram = dataclasses.field(default_factory=lambda: Histogram(_TIME_BUCKETS))
    ttft: Histogram = dataclasses.field(default_factory=lambda: Histogram(_TIME_BUCKETS))
    e2e_latency: Histogram = dataclasses.field(default_factory=lambda: Histogram(_TIME_BUCKETS))
