"""Bad input on the command line, the configs, corpora, labels and the explorer's server
(issue 27): each case is a one-line error naming the option, file or line, or it behaves right.

The tests that need a trained run share one tiny run (`run`); the others need none.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import typing
from pathlib import Path

import pytest

import circuits
import pipelines
import sae
from circuits.config import SEED_MAX, Config
from pipelines.cli import main


def _error(capsys, argv: list[str]) -> str:
    """Run a command that must fail with one line (exit 2); return that line."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error:"), err
    return lines[-1]


def _configs() -> list[type[Config]]:
    """Every config class of the project."""
    for package in (circuits, pipelines, sae):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    found, todo = set(), [Config]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.split(".")[0] in ("circuits", "pipelines", "sae") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def _fields(kind) -> list[tuple[type[Config], str]]:
    """(config class, field) of every field whose annotation holds `kind`."""
    out = []
    for cls in _configs():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            if hint is kind or kind in typing.get_args(hint):
                out.append((cls, f.name))
    return out


# ------------------------------------------------------------------ 4. NaN and infinities


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_field_refuses_nan_and_infinities(value):
    fields = _fields(float)
    assert len(fields) > 20
    for cls, name in fields:
        with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name}.*finite"):
            cls(**{name: value})


@pytest.mark.parametrize("flag, value", [(flag, "nan") for flag in (
    "--and-data", "--drop-one", "--min-cosine", "--label-share", "--label-lift", "--split-cosine", "--split-lift",
    "--boost-sd")] + [("--and-data", "inf"), ("--boost-sd=", "-inf")])
def test_float_options_refuse_nan_naming_the_option(tmp_path, capsys, flag, value):
    err = _error(capsys, ["verdicts", "--out", str(tmp_path / "run"), flag + value if flag.endswith("=") else flag,
                          *([] if flag.endswith("=") else [value])])
    assert flag.strip("-=").replace("-", "_") in err and "finite" in err
    assert not (tmp_path / "run").exists()


def test_a_json_config_with_nan_is_refused(tmp_path, capsys):
    config = tmp_path / "demo.json"
    config.write_text('{"verdicts": {"verdicts": {"and_data": NaN}}}')
    err = _error(capsys, ["demo", "--out", str(tmp_path / "run"), "--config", str(config)])
    assert "and_data" in err and "finite" in err


# ------------------------------------------------------------------ 5, 12. seeds


def test_every_seed_field_is_bounded_to_what_every_generator_accepts():
    fields = [(cls, name) for cls, name in _fields(int) if "seed" in name]
    assert len(fields) >= 8
    for cls, name in fields:
        for bad in (-1, SEED_MAX + 1, 2**63, 10**23):
            with pytest.raises(ValueError, match=rf"{cls.__name__}\.{name}"):
                cls(**{name: bad})
        cls(**{name: SEED_MAX})


def test_derived_seeds_of_the_largest_seed_fit_torch():
    """The stages derive seeds (seed * prime + step); with the largest seed they still fit
    a torch generator, which takes at most 2**64 - 1."""
    import torch

    for factor, offset in ((1_000_003, 10**6), (7919, 10**6), (104729, 10**9), (1000, 10**3)):
        torch.Generator().manual_seed(SEED_MAX * factor + offset)


@pytest.mark.parametrize("argv", [["corpus", "--seed"], ["train-lm", "--seed"], ["verdicts", "--seed"],
                                  ["features", "--seed"], ["train-saes", "--seed"], ["demo", "--seed"]])
def test_a_seed_too_large_names_the_option(tmp_path, capsys, argv):
    err = _error(capsys, [argv[0], "--out", str(tmp_path / "run"), *argv[1:], str(10**23)])
    assert "seed" in err and str(SEED_MAX) in err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ 13. no folder for a failed command


@pytest.mark.parametrize("argv", [["report"], ["verdicts"], ["circuits"], ["features"], ["train-saes"], ["explore"],
                                  ["train-lm", "--corpus", "absent.txt"]])
def test_a_command_that_fails_on_its_inputs_creates_no_run_folder(tmp_path, capsys, argv):
    out = tmp_path / "missing" / "run"
    _error(capsys, [argv[0], "--out", str(out), *argv[1:]])
    assert not out.exists() and not out.parent.exists()


def test_a_failed_command_leaves_an_existing_run_folder_and_its_lock_file(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    _error(capsys, ["report", "--out", str(out)])
    assert out.is_dir()


# ------------------------------------------------------------------ the explorer's command and server (6, 9, 11, 16)


def test_explore_on_a_missing_folder_is_refused_and_creates_nothing(tmp_path, capsys):
    err = _error(capsys, ["explore", "--out", str(tmp_path / "absent")])
    assert "absent" in err
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_a_port_out_of_range_is_refused_before_the_explorer_is_written(tmp_path, capsys, port):
    (tmp_path / "run").mkdir()
    assert main(["explore", "--out", str(tmp_path / "run"), "--serve", f"--port={port}"]) == 2
    assert "--port" in capsys.readouterr().err
    assert not (tmp_path / "run" / "explorer").exists()


def _serve_once(monkeypatch, during):
    """Make `serve_forever` call `during()` and stop as Ctrl-C would."""
    import http.server

    def once(self, *args, **kwargs):
        during(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(http.server.ThreadingHTTPServer, "serve_forever", once)


def test_serving_the_explorer_leaves_the_run_free_for_other_commands(tmp_path, monkeypatch, capsys):
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    free = []

    def try_lock(server):
        with open(run / ".lock", "a+") as handle:  # another open file: flock sees another holder
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(handle, fcntl.LOCK_UN)
                free.append(True)
            except BlockingIOError:
                free.append(False)

    _serve_once(monkeypatch, try_lock)
    assert main(["explore", "--out", str(run), "--serve", "--port", "0"]) == 0
    assert free == [True]


@pytest.mark.parametrize("path", ["/index.html%00.js", "/%00", "/data/%00meta.js"])
def test_a_null_byte_in_a_request_is_answered_not_raised(tmp_path, capsys, path):
    import threading
    import urllib.error
    import urllib.request

    from pipelines.engine.paths import RunPaths
    from pipelines.explorer.site import make_server, write_explorer

    run = RunPaths(tmp_path / "run")
    run.root.mkdir()
    write_explorer(run)
    server = make_server(run.explorer, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}{path}", timeout=10)
        assert answer.value.code in (400, 404)
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capsys.readouterr().err
