"""``hicache bench export-tokenizer``: the server's tokenizer as a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import typer

from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stdout


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("export-tokenizer")
    @handle_errors
    def export_tokenizer_cmd(
        directory: Path = typer.Argument(..., help="Directory to write (created if needed)."),
        model: str = typer.Option("tiny", "--model", help="Preset name, smollm2-135m, a "
                                  "*.gguf file or a checkpoint directory, as for `bench serve "
                                  "--model`."),
        fmt: OutputFormat = typer.Option(OutputFormat.human, "--format"),
    ) -> None:
        """Write tokenizer.json, tokenizer_config.json (with the chat template) and
        special_tokens_map.json: what `bench serve` reports as tokenizer_path, so clients
        such as SGLang's bench_serving or transformers' AutoTokenizer load it offline.

        Example: hicache bench export-tokenizer /tmp/tiny-tok --model tiny
        """
        from engine.runtime.tokenizer_export import FILES, export_tokenizer, tokenizer_for_model

        if directory.exists() and not directory.is_dir():
            fail(f"{directory} exists and is not a directory", code=2)
        try:
            tok, name, ctx = tokenizer_for_model(model)
        except ValueError as exc:
            fail(str(exc), code=2)
        d = export_tokenizer(tok, str(directory), name, ctx)
        if fmt is OutputFormat.json:
            emit_json({"directory": d, "model": name, "files": list(FILES),
                       "vocab_size": tok.vocab_size})
        else:
            stdout.print(f"wrote {', '.join(FILES)} to {d} (model {name}, vocabulary "
                         f"{tok.vocab_size})")
