"""SGLang's launch-line options that ``hicache bench serve`` has no flag of its own for.

An SGLang user's ``python -m sglang.launch_server …`` line should port by changing the command
name. Options whose meaning hicache has under SGLang's own name (``--page-size``,
``--hicache-ratio``, …) are plain flags; SGLang spellings of hicache flags (``--model-path``,
``--tp-size``, …) are aliases declared with the flag itself (serve_cmd.py). What is left arrives
here as the command's extra arguments, and each is one of:

* ``set``: a meaning hicache has, applied to the serve options (``--context-length``,
  ``--disaggregation-mode``);
* ``noop``: true here without asking (``--enable-metrics``: metrics are always on); accepted;
* ``note``: accepted, but it does nothing here, said in one line on stderr
  (``--mem-fraction-static``: L1 is sized in tokens);
* ``refuse``: no meaning here; a usage error (exit 2) naming what to use instead.

Anything else is an unknown option, refused with the closest known spelling.
docs/sglang-compat.md has the table for users.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Sequence

from engine.core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class SGLangOption:
    action: str                       # set | noop | note | refuse
    takes_value: bool
    say: str = ""                     # note: what happens; refuse: what to use instead
    apply: Callable[[dict, str], None] | None = None   # set: update the serve options


def _positive_int(flag: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise UsageError(f"{flag}: expected a whole number, got {value!r}") from None
    if n < 1:
        raise UsageError(f"{flag}: must be >= 1, got {n}")
    return n


def _context_length(opts: dict, value: str) -> None:
    opts["context_length"] = _positive_int("--context-length", value)


def _fraction(flag: str) -> Callable[[dict, str], None]:
    def check(opts: dict, value: str) -> None:
        try:
            f = float(value)
        except ValueError:
            raise UsageError(f"{flag}: expected a number in (0, 1], got {value!r}") from None
        if not 0 < f <= 1:
            raise UsageError(f"{flag}: must be in (0, 1], got {value}")
    return check


def _disaggregation_mode(opts: dict, value: str) -> None:
    if value == "null":
        return
    if value not in ("prefill", "decode"):
        raise UsageError(f"--disaggregation-mode: choose null, prefill or decode, got {value!r}")
    opts["disaggregation"] = value


def _only(flag: str, allowed: Sequence[str], hint: str) -> Callable[[dict, str], None]:
    def check(opts: dict, value: str) -> None:
        if value not in allowed:
            raise UsageError(f"{flag} {value}: {hint}")
    return check


_NOT_HERE = "has no meaning in hicache"

TABLE: dict[str, SGLangOption] = {
    "--context-length": SGLangOption("set", True, apply=_context_length),
    "--disaggregation-mode": SGLangOption("set", True, apply=_disaggregation_mode),
    "--enable-hierarchical-cache": SGLangOption("noop", False),      # L2 is on by default
    "--enable-metrics": SGLangOption("noop", False),                 # /metrics always serves
    "--enable-cache-report": SGLangOption("noop", False),            # cached_tokens always
    "--trust-remote-code": SGLangOption("noop", False),              # no remote code is run
    "--skip-server-warmup": SGLangOption("noop", False),
    "--mem-fraction-static": SGLangOption(
        "note", True, "L1 is sized in tokens here (--l1-tokens); the fraction is not used",
        apply=_fraction("--mem-fraction-static")),
    "--dtype": SGLangOption("set", True, apply=_only(
        "--dtype", ("auto",), "the model's own dtype is used (only auto is accepted)")),
    "--kv-cache-dtype": SGLangOption("set", True, apply=_only(
        "--kv-cache-dtype", ("auto",), "the KV cache has the model's dtype (only auto is "
                                       "accepted)")),
    "--hicache-io-backend": SGLangOption(
        "note", True, "L1<->L2 copies pick their own path (docs/design.md)"),
    "--disable-cuda-graph": SGLangOption("noop", False),
    "--random-seed": SGLangOption("refuse", True, "sampling is seeded per request "
                                  "(sampling_params.seed); --seed seeds a preset's weights"),
    "--tokenizer-path": SGLangOption("refuse", True, "the tokenizer comes with --model"),
    "--dp-size": SGLangOption("refuse", True, "run one server per replica behind a router"),
    "--data-parallel-size": SGLangOption("refuse", True, "run one server per replica behind "
                                         "a router"),
    "--ep-size": SGLangOption("refuse", True, f"expert parallelism {_NOT_HERE} (dense models)"),
    "--quantization": SGLangOption("refuse", True, f"quantized serving {_NOT_HERE}"),
    "--attention-backend": SGLangOption("refuse", True, "the kernels follow --device (exact "
                                        "on CPU, fused on CUDA)"),
    "--speculative-algorithm": SGLangOption("refuse", True, "use "
                                            "--speculative-num-draft-tokens N and "
                                            "--speculative-draft-preset"),
    "--schedule-policy": SGLangOption("refuse", True, "requests are served first come, first "
                                      "served; cache eviction is --eviction-policy"),
    "--api-key": SGLangOption("refuse", True, "the server has no API keys: keep it on "
                              "127.0.0.1 (--host) or behind a proxy that checks them"),
    "--hicache-storage-backend-extra-config": SGLangOption(
        "refuse", True, "put backend settings in a JSON file: --hicache-storage-backend-config"),
    "--lora-paths": SGLangOption("refuse", True, "adapters are named per request (lora_path) "
                                 "and keep their own cache namespace; no adapter weights are "
                                 "loaded"),
}


def apply_extra(args: Sequence[str], opts: dict, known: Sequence[str],
                note: Callable[[str], Any]) -> None:
    """Apply SGLang-only options found in ``args`` (the command's unparsed arguments) to the
    serve options ``opts``; ``known``: the command's own flags, for suggestions."""
    i = 0
    args = list(args)
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            raise UsageError(f"unexpected argument {tok!r} (options start with --)")
        flag, eq, inline = tok.partition("=")
        spec = TABLE.get(flag)
        if spec is None:
            close = difflib.get_close_matches(flag, list(known) + list(TABLE), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UsageError(f"no such option: {flag}{hint}")
        value = ""
        if spec.takes_value:
            if eq:
                value = inline
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                i += 1
                value = args[i]
            else:
                raise UsageError(f"{flag} needs a value")
        elif eq:
            raise UsageError(f"{flag} takes no value")
        i += 1
        if spec.action == "refuse":
            raise UsageError(f"{flag} (SGLang): {spec.say}")
        if spec.apply is not None:
            spec.apply(opts, value)
        if spec.action == "note":
            note(f"{flag} (SGLang) accepted: {spec.say}")
