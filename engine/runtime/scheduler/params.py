"""Values the scheduler takes and gives: sampling parameters, its configuration, outputs."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable

from engine.core.errors import InputError

GREEDY_TEMPERATURE = 1e-6   # below this, sampling is greedy (logits / T would overflow)
_SEED_RANGE = (-(1 << 63), 1 << 64)     # what torch.Generator.manual_seed accepts


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = -1                   # <= 0: off
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
            raise InputError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    chunked_prefill_size: int = 512       # prompt tokens per step (all prefilling requests)
    disable_radix_cache: bool = False
    max_waiting_requests: int = 4096

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size must be >= 1")


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclasses.dataclass
class RequestOutput:
    """What one step produced for one request (sent to the request's callback)."""

    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    meta: dict[str, Any] | None = None   # on finish: prompt/completion/cached tokens, timings
    error: str | None = None


Callback = Callable[[RequestOutput], None]
