"""Workloads for the load generator: what each simulated client sends, turn by turn.

A workload is a list of *sessions*. A session yields its first request, then, each time a
response comes back, the next one — so a multi-turn client can append the model's answer to its
history before asking again. Every token a session invents comes from a seeded generator keyed
by ``(seed, client, round)``: the same seed gives the same prompts, whatever order the
responses arrive in.

Two conversation shapes share one implementation:

* ``multiturn`` — N clients × R rounds; each round appends a fresh user turn of
  ``request_length`` tokens to the client's history (previous prompts and answers), like
  SGLang's ``bench_multiturn``.
* ``agentic`` — long contexts: a system/tool prefix shared by every client, a long per-client
  task context in the first turn, then short tool outputs each turn, so almost all of every
  prompt is history the cache has seen.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

DEFAULT_VOCAB = 256
"""Token ids below this are valid for any model we serve (the byte-level tokenizer's bytes)."""


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request to send. ``arrival`` (seconds from the start of the run) is set by trace
    replay; ``None`` means "as soon as the concurrency limit and request rate allow"."""

    session: int
    turn: int
    input_ids: tuple[int, ...]
    max_tokens: int
    arrival: float | None = None
    hint: Mapping[str, Any] | None = None
    """Client cache hints sent with the request (fields of the ``/generate`` body:
    docs/cache-hints.md)."""

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)


class Session(Protocol):
    def first(self) -> RequestSpec | None: ...

    def after(self, spec: RequestSpec, output_ids: Sequence[int] | None) -> RequestSpec | None:
        """The next request once ``spec`` finished; ``output_ids`` is ``None`` if it failed."""
        ...


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    total_requests: int | None
    """Requests the workload issues if nothing fails and no duration cuts it short."""


MAX_CLIENTS = 1 << 16
MAX_ROUNDS = 1 << 16
MAX_VOCAB = 1 << 31
MAX_PROMPT_TOKENS = 1 << 22
"""Bounds of a generated workload (docs/reliability.md, "Named limits"): prompts are made as
Python tuples, so their length is what a client's memory pays for."""


@dataclasses.dataclass(frozen=True)
class ConversationConfig:
    """Shape of a multi-turn workload (both ``multiturn`` and ``agentic``)."""

    num_clients: int = 8
    num_rounds: int = 4
    request_length: int = 256
    """New user tokens appended each round (agentic: the tool output of each turn)."""
    output_length: int = 16
    first_length: int | None = None
    """User tokens of the first round; ``None`` = ``request_length`` (agentic: the task context)."""
    system_length: int = 0
    """Tokens of a prefix shared by every client (system prompt and tool definitions)."""
    vocab_size: int = DEFAULT_VOCAB
    seed: int = 0
    hints: bool = False
    """The clients send cache hints: each turn its session and, once it saw a gap between two
    of its turns, a retention of that gap; the last turn closes the session."""

    def __post_init__(self) -> None:
        for name in ("num_clients", "num_rounds", "request_length", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name, hi in (("num_clients", MAX_CLIENTS), ("num_rounds", MAX_ROUNDS),
                         ("vocab_size", MAX_VOCAB)):
            if getattr(self, name) > hi:
                raise ValueError(f"{name.replace('_', '-')} must be at most {hi:,}, got "
                                 f"{getattr(self, name):,}")
        if self.max_prompt_tokens > MAX_PROMPT_TOKENS:
            raise ValueError(f"the last round's prompt would hold {self.max_prompt_tokens:,} "
                             f"tokens; at most {MAX_PROMPT_TOKENS:,} (lower the lengths or "
                             f"the rounds)")
        for name in ("output_length", "system_length"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.first_length is not None and self.first_length < 1:
            raise ValueError(f"first-length must be >= 1, got {self.first_length}")

    @property
    def max_prompt_tokens(self) -> int:
        """Prompt length of the last round when every answer has ``output_length`` tokens."""
        first = self.request_length if self.first_length is None else self.first_length
        return (self.system_length + first + (self.num_rounds - 1) * self.request_length
                + (self.num_rounds - 1) * self.output_length)


def _tokens(seed: int, key: Sequence[int], n: int, vocab: int) -> tuple[int, ...]:
    rng = np.random.default_rng([seed, *key])
    return tuple(int(t) for t in rng.integers(0, vocab, size=n, dtype=np.int64))


class ConversationSession:
    """One client: history grows by the user turn and the model's answer every round."""

    def __init__(self, cfg: ConversationConfig, client: int, system: tuple[int, ...]):
        self.cfg = cfg
        self.client = client
        self._system = system
        self._sent: float | None = None      # when this client's latest turn was made

    def _hint(self, turn: int) -> Mapping[str, Any] | None:
        """What a hinting client says with ``turn``: its session, and when it will be back —
        or, on its last turn, that the session ends (Dynamo's nvext spellings)."""
        if not self.cfg.hints:
            return None
        now = time.monotonic()
        gap = None if self._sent is None else max(now - self._sent, 1e-3)
        self._sent = now
        key = f"client-{self.cfg.seed}-{self.client}"
        if turn + 1 >= self.cfg.num_rounds:
            return {"session_id": key,
                    "nvext": {"session_control": {"session_id": key, "action": "close"}}}
        if gap is None:                      # no gap seen yet: nothing to declare
            return {"session_id": key}
        return {"session_id": key,
                "nvext": {"cache_control": {"type": "ephemeral", "ttl": f"{gap:.3f}s"}}}

    def _user_turn(self, rnd: int) -> tuple[int, ...]:
        cfg = self.cfg
        n = cfg.request_length if (rnd > 0 or cfg.first_length is None) else cfg.first_length
        return _tokens(cfg.seed, (1, self.client, rnd), n, cfg.vocab_size)

    def first(self) -> RequestSpec:
        return RequestSpec(self.client, 0, self._system + self._user_turn(0),
                           self.cfg.output_length, hint=self._hint(0))

    def after(self, spec: RequestSpec, output_ids: Sequence[int] | None) -> RequestSpec | None:
        # A failed turn ends the client: its history is unknown, and retrying a prompt the
        # server refused (e.g. beyond its context) would only repeat the error.
        if output_ids is None or spec.turn + 1 >= self.cfg.num_rounds:
            return None
        history = spec.input_ids + tuple(int(t) for t in output_ids)
        return RequestSpec(self.client, spec.turn + 1, history + self._user_turn(spec.turn + 1),
                           self.cfg.output_length, hint=self._hint(spec.turn + 1))


def conversation(name: str, cfg: ConversationConfig) -> Workload:
    system = _tokens(cfg.seed, (0,), cfg.system_length, cfg.vocab_size)
    sessions = tuple(ConversationSession(cfg, c, system) for c in range(cfg.num_clients))
    return Workload(name, sessions, cfg.num_clients * cfg.num_rounds)


def multiturn(num_clients: int = 8, num_rounds: int = 4, request_length: int = 256,
              output_length: int = 16, *, vocab_size: int = DEFAULT_VOCAB,
              seed: int = 0, hints: bool = False) -> Workload:
    """SGLang ``bench_multiturn``-style chat: every round appends one user turn and the answer."""
    return conversation("multiturn", ConversationConfig(
        num_clients=num_clients, num_rounds=num_rounds, request_length=request_length,
        output_length=output_length, vocab_size=vocab_size, seed=seed, hints=hints))


# GPU-sized defaults (30K+ token prompts); CPU runs pass smaller sizes (see AGENTIC_CPU).
AGENTIC_GPU = dict(num_clients=4, num_rounds=8, context_length=32768, system_length=4096,
                   request_length=1024, output_length=128)
AGENTIC_CPU = dict(num_clients=4, num_rounds=6, context_length=1536, system_length=512,
                   request_length=128, output_length=16)


def agentic(num_clients: int = 4, num_rounds: int = 8, context_length: int = 32768,
            system_length: int = 4096, request_length: int = 1024, output_length: int = 128, *,
            vocab_size: int = DEFAULT_VOCAB, seed: int = 0, hints: bool = False) -> Workload:
    """Agent loops over long contexts.

    Turn 0 sends ``context_length`` tokens: the shared ``system_length`` prefix plus the client's
    own task context. Every later turn appends the previous answer and ``request_length`` tokens
    of tool output, so a turn reuses all but ~``request_length + output_length`` tokens.
    """
    if context_length <= system_length:
        raise ValueError(f"context-length ({context_length}) must exceed system-length "
                         f"({system_length})")
    return conversation("agentic", ConversationConfig(
        num_clients=num_clients, num_rounds=num_rounds, request_length=request_length,
        output_length=output_length, first_length=context_length - system_length,
        system_length=system_length, vocab_size=vocab_size, seed=seed, hints=hints))
