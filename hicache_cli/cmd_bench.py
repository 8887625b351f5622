"""``hicache bench``: the main job, plus ``serve``, ``run`` and ``replay`` sub-commands."""

from __future__ import annotations

import typer

bench_app = typer.Typer(
    help="Benchmark the cache: the all-in-one main job (no sub-command), the benchmark server "
         "(serve), the load generator (run), offline trace replay (replay), trace conversion "
         "to Parquet/Arrow (convert-trace), the server's tokenizer as a Hugging Face "
         "directory (export-tokenizer) and a server's KV events to a file (record-events).",
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Each sub-command module exposes register(bench_app); the main job is the group callback.
from hicache_cli.bench import replay_cmd  # noqa: E402

replay_cmd.register(bench_app)
from hicache_cli.bench import convert_cmd  # noqa: E402

convert_cmd.register(bench_app)
from hicache_cli.bench import run_cmd  # noqa: E402

run_cmd.register(bench_app)
from hicache_cli.bench import main_job  # noqa: E402

main_job.register(bench_app)
from hicache_cli.bench import serve_cmd  # noqa: E402

serve_cmd.register(bench_app)
from hicache_cli.bench import tokenizer_cmd  # noqa: E402

tokenizer_cmd.register(bench_app)
from hicache_cli.bench import record_cmd  # noqa: E402

record_cmd.register(bench_app)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
