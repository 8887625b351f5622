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
    min_new_tokens: int = 0           # EOS and stop tokens are masked until this many
    presence_penalty: float = 0.0     # OpenAI: minus this once a token appeared in the output
    frequency_penalty: float = 0.0    # OpenAI: minus this per earlier occurrence in the output
    repetition_penalty: float = 1.0   # CTRL-style, over prompt and output (SGLang's option)
    logprobs: bool = False            # report the sampled token's log-probability
    top_logprobs: int = 0             # ... and the top-k alternatives
    input_logprobs_from: int | None = None   # report prompt logprobs from this position on

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]:
            raise InputError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"{name} must be finite")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.top_logprobs < 0:
            raise InputError(f"top_logprobs must be >= 0, got {self.top_logprobs}")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    chunked_prefill_size: int = 512       # prompt tokens per step (all prefilling requests)
    disable_radix_cache: bool = False
    # no partial last-page reuse (Scheduler._admit): the tokens after the last whole cached page
    # are all computed, as SGLang and vLLM do (A/B runs)
    disable_partial_page_reuse: bool = False
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
    # per new token, when sampling.logprobs: (logprob, [(id, logprob)] top alternatives)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # on the first output, when sampling.input_logprobs_from is set: per prompt position
    # from there on, (token id, logprob or None, top alternatives)
    input_logprobs: list[tuple[int, float | None, list[tuple[int, float]]]] | None = None


Callback = Callable[[RequestOutput], None]
