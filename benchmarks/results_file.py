"""Where the benchmark scripts keep their figures: what a script prints also goes to a file
under `benchmarks/results/` (its `--output`), headed by the command that produced it, so the
docs' results page shows the current figures and never a copy typed by hand."""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CHILD_FLAGS = ("--child", "--one")  # how bench_stages, bench_saes_paper and bench_graph start their children


def run_recorded(main, name: str) -> None:
    """Run a benchmark script's `main` (whose parser has `add_output(parser, name)`), keeping
    what it prints in its `--output` file."""
    parser = argparse.ArgumentParser(add_help=False)
    add_output(parser, name)
    with recorded(parser.parse_known_args()[0].output):
        main()


def add_output(parser: argparse.ArgumentParser, name: str) -> None:
    """The `--output FILE` option, by default `benchmarks/results/<name>`; `-` prints only."""
    parser.add_argument("--output", default=str(RESULTS / name),
                        help="file the printed results are also written to, '-' for none (default: %(default)s)")


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


@contextlib.contextmanager
def recorded(output: str | None):
    """Print to the terminal and, when the block ends without an error, write the same text to
    `output` (atomically; `None` or '-' for none), after a line with the command."""
    if output in (None, "-"):
        yield
        return
    captured = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
        yield
    from pipelines.engine.files import write_text

    path = Path(output)
    write_text(path, f"<!-- {command_line()} -->\n{captured.getvalue()}")
    print(f"(written to {path})", file=sys.stderr)


def command_line() -> str:
    """The command this process runs, as a shell takes it back."""
    return "python " + " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
