"""Bad input on the command line, the configs, corpora, labels and the explorer's server
(issue 27): each case is a one-line error naming the option, file or line, or it behaves right.

The tests that need a trained run share one tiny run (`run`); the others need none.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
import re
import shutil
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
    "--and-data", "--need", "--min-cosine", "--label-share", "--label-lift", "--split-cosine", "--split-lift",
    "--boost-sd")] + [("--and-data", "inf"), ("--boost-sd=", "-inf")])
def test_float_options_refuse_nan_naming_the_option(tmp_path, capsys, flag, value):
    err = _error(capsys, ["verdicts", "--out", str(tmp_path / "run"), flag + value if flag.endswith("=") else flag,
                          *([] if flag.endswith("=") else [value])])
    assert flag.strip("-=").replace("-", "_") in err and "finite" in err
    assert not (tmp_path / "run").exists()


def test_a_json_config_with_nan_is_refused(tmp_path, capsys):
    config = tmp_path / "demo.json"
    config.write_text('{"verdicts": {"rules": {"and_data": NaN}}}')
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


# ------------------------------------------------------------------ 6, 10, 14. corpus spans and lexicon lines


def _jsonl(path: Path, spans: list, line: int = 11, n: int = 30) -> Path:
    """A JSONL corpus of `n` good documents and, at `line`, one with `spans`."""
    import json

    good = [json.dumps({"text": f"Tom was happy on day {i}. He did not like rain."}) for i in range(n)]
    bad = json.dumps({"text": "Sam was sad.", "spans": spans})
    path.write_text("\n".join(good[:line - 1] + [bad] + good[line - 1:]) + "\n")
    return path


@pytest.mark.parametrize("spans", [[{"start": 0, "end": 5}], [[0, 5]], [["a", "b", "negation"]], [[-1, 3, "x"]],
                                   [[0, 99, "x"]], [[5, 2, "x"]], [[0, 3, ""]], [7], [[True, 3, "x"]]])
def test_a_bad_span_names_the_file_the_line_and_what_a_span_holds(tmp_path, capsys, spans):
    corpus = _jsonl(tmp_path / "corpus.jsonl", spans)
    err = _error(capsys, ["train-lm", "--out", str(tmp_path / "run"), "--corpus", str(corpus), "--preset", "tiny"])
    assert str(corpus) in err and "line 11" in err and "start" in err and "end" in err and "label" in err


def test_good_spans_are_read_at_their_characters():
    from pipelines.data.corpus import CorpusConfig, iter_documents

    import json
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "c.jsonl"
        path.write_text(json.dumps({"text": "Sam was sad.", "spans": [[0, 3, "name"], {"start": 8, "end": 11,
                                                                                         "label": "mood"}]}) + "\n")
        docs = next(iter_documents(str(path), CorpusConfig()))
    assert docs.spans == [[(0, 3, "name"), (8, 11, "mood")]]


def test_an_error_after_a_progress_bar_starts_on_its_own_line(tmp_path, capsys):
    from pipelines.data.corpus import BATCH_DOCS

    # the tokenizer learns from the first batch of documents: the bad line, in the second, is met while the
    # tokenize bar is open
    corpus = _jsonl(tmp_path / "corpus.jsonl", [[5, 2, "x"]], line=BATCH_DOCS + 2, n=BATCH_DOCS + 10)
    assert main(["train-lm", "--out", str(tmp_path / "run"), "--corpus", str(corpus), "--preset", "tiny",
                 "--train-docs", "5", "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert "tokenize" in err and f"line {BATCH_DOCS + 2}" in err
    assert "\nerror: " in "\n" + err and not re.search(r"[^\n]error: ", err), err


@pytest.mark.parametrize("line, what", [("\tpositive", "word"), ("nice\t", "class")])
def test_a_lexicon_line_with_an_empty_word_or_class_names_the_file_and_line(tmp_path, line, what):
    from pipelines.data.labels import read_lexicon

    path = tmp_path / "words.tsv"
    path.write_text(f"good\tpositive\n{line}\nbad\tnegative\n")
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}, line 2: .*empty {what}"):
        read_lexicon(path)


def test_skipped_lexicon_lines_are_counted(tmp_path, capsys):
    from pipelines.data.labels import read_lexicon

    path = tmp_path / "words.tsv"
    path.write_text("good\tpositive\nvery good\tpositive\nmeh\t0\nlonely\nbad\tnegative\n# note\n")
    assert read_lexicon(path) == {"good": "positive", "bad": "negative"}
    said = capsys.readouterr().err
    assert str(path) in said and "3 lines" in said
    assert "1 phrase" in said and "1 zero score" in said and "1 without a class" in said


# ------------------------------------------------------------------ 6. --show


@pytest.mark.parametrize("value", ["-1", "x"])
def test_show_takes_a_count_of_zero_or_more(tmp_path, capsys, value):
    assert main(["verdicts", "--out", str(tmp_path / "run"), f"--show={value}"]) == 2
    assert "--show" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ 8, 15. Ray


def test_a_ray_address_where_nothing_listens_is_a_one_line_error_in_seconds(tmp_path, capsys):
    import time

    pytest.importorskip("ray")
    start = time.monotonic()
    err = _error(capsys, ["verdicts", "--out", str(tmp_path / "run"), "--ray", "127.0.0.1:1"])
    assert "--ray 127.0.0.1:1" in err and "no Ray cluster answers" in err
    assert time.monotonic() - start < 60
    assert not (tmp_path / "run").exists()


def test_connect_checks_the_address_too():
    from pipelines.engine.cluster import connect
    from pipelines.runtime import Runtime

    pytest.importorskip("ray")
    with pytest.raises(ValueError, match="no Ray cluster answers"):
        connect(Runtime(threads=1, ray="ray://127.0.0.1:1"))


def test_a_killed_drivers_marker_is_removed_by_the_next_driver(tmp_path):
    """A SIGKILLed driver leaves its marker; the next driver of the run (the lock says no other
    is alive) removes it, whatever its own tasks do (here they fail at once)."""
    pytest.importorskip("ray")
    from pipelines.engine.cluster import MARKER, TaskFailed, disconnect, run_on_ray
    from pipelines.engine.tasks import Task
    from pipelines.runtime import Runtime

    stale = tmp_path / MARKER.format("0123456789ab")
    stale.write_text("host 1\n")

    class Inputs:
        def folders(self):
            return {"run": str(tmp_path), "model": str(tmp_path / "none"), "tokens": str(tmp_path / "none")}

    try:
        with pytest.raises(TaskFailed):
            run_on_ray(Runtime(threads=1, ray="local", workers=1), print, Inputs(), [Task("t", None)], "test")
    finally:
        disconnect()
    assert not list(tmp_path.glob(MARKER.format("*")))


# ------------------------------------------------------------------ stages on a tiny run (1, 2, 3, 7, 12, 17)

TINY_LM = ["--preset", "tiny", "--train-tokens", "40000", "--vocab-size", "600", "--threads", "1"]
TINY_SAES = ["--train-tokens", "20480", "--batch-size", "1024", "--k", "4", "--threads", "1"]
CIRCUITS = ["--top-n", "8", "--max-rank", "4", "--corr-rows", "32", "--min-active", "3", "--threads", "1"]
VERDICTS = ["--rows", "32", "--min-cell", "3", "--n-ablate", "2", "--threads", "1"]


def _ok(argv: list[str]) -> None:
    assert main(argv) == 0, argv


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad-input")
    base = ["--out", str(out)]
    _ok(["corpus", *base, "--n-stories", "1500", "--seed", "2"])
    _ok(["train-lm", *base, *TINY_LM])
    _ok(["train-saes", *base, *TINY_SAES])
    _ok(["circuits", *base, *CIRCUITS])
    _ok(["features", *base, "--rows", "32", "--threads", "1"])
    _ok(["verdicts", *base, *VERDICTS])
    return out


@pytest.fixture(scope="module")
def other_saes(run, tmp_path_factory) -> Path:
    """Layer 0's SAEs of the same model trained with another seed."""
    other = tmp_path_factory.mktemp("other-saes") / "run"
    shutil.copytree(run, other)
    _ok(["train-saes", "--out", str(other), "--layers", "0", *TINY_SAES, "--seed", "5"])
    return other / "saes"


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


def _layer_files(run: Path, layer: int) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted((run / "tables").rglob(f"layer{layer}/*.parquet"))}


def test_verdicts_refuse_saes_other_than_the_tables_were_computed_with(run, other_saes, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    before = _layer_files(copy, 0)
    err = _error(capsys, ["verdicts", "--out", str(copy), "--layer", "0", "--sae-in",
                          str(other_saes / "layer0_resid_mid"), "--sae-out", str(other_saes / "layer0_mlp_out"),
                          *VERDICTS])
    assert "other SAEs" in err and "layer 0" in err
    assert _layer_files(copy, 0) == before


def test_verdicts_after_circuits_of_explicit_saes_refuse_the_runs_own(run, other_saes, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    _ok(["circuits", "--out", str(copy), "--layer", "0", "--sae-in", str(other_saes / "layer0_resid_mid"),
         "--sae-out", str(other_saes / "layer0_mlp_out"), *CIRCUITS])
    err = _error(capsys, ["verdicts", "--out", str(copy), *VERDICTS])
    assert "other SAEs" in err and "layer 0" in err


def test_verdicts_refuse_to_run_without_the_features_tables(run, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    shutil.rmtree(copy / "tables" / "features")
    err = _error(capsys, ["verdicts", "--out", str(copy), *VERDICTS, "--n-ablate", "1"])
    assert "run `features` first" in err


def test_corpus_refuses_to_replace_the_corpus_the_model_was_trained_on(run, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    before = {p: p.read_bytes() for p in sorted((copy / "corpus").iterdir())}
    err = _error(capsys, ["corpus", "--out", str(copy), "--n-stories", "10"])
    assert "--force" in err and "trained on" in err
    assert {p: p.read_bytes() for p in sorted((copy / "corpus").iterdir())} == before
    _ok(["corpus", "--out", str(copy), "--n-stories", "1500", "--seed", "2"])  # the same corpus: nothing to do
    _ok(["corpus", "--out", str(copy), "--n-stories", "10", "--force"])


@pytest.mark.parametrize("stage, argv, name", [
    ("features", ["--rows", "16"], "feature_tables"),
    ("verdicts", [*VERDICTS, "--n-ablate", "1"], "judge_tables"),
    ("circuits", [*CIRCUITS, "--top-n", "6"], "analyse_layer"),
])
def test_a_run_that_fails_keeps_the_stamps_of_the_finished_one(run, tmp_path, capsys, monkeypatch, stage, argv,
                                                               name):
    import importlib

    copy = _copy(run, tmp_path)
    before = {p.name: p.read_bytes() for p in (copy / "tables" / ".stamps").iterdir()}

    def fails(*args, **kwargs):
        raise ValueError("failed mid-run")

    monkeypatch.setattr(importlib.import_module(f"pipelines.stages.{stage}"), name, fails)
    assert "failed mid-run" in _error(capsys, [stage, "--out", str(copy), *argv])
    assert {p.name: p.read_bytes() for p in (copy / "tables" / ".stamps").iterdir()} == before


def test_circuits_run_each_block_once_per_batch_across_layers(run, tmp_path, monkeypatch):
    from circuits import forward

    copy = _copy(run, tmp_path)
    for stamp in (copy / "tables" / ".stamps").iterdir():
        if stamp.name.startswith("circuits"):
            stamp.unlink()
    seen = []
    mlp = forward.mlp
    monkeypatch.setattr(forward, "mlp", lambda m, layer, x: seen.append(layer) or mlp(m, layer, x))
    _ok(["circuits", "--out", str(copy), *CIRCUITS])
    # one batch of 32 rows: layer 1's pass resumes from the stream layer 0's left (not 0, 0, 1)
    assert seen == [0, 1]


def test_verdicts_show_a_progress_bar(run, tmp_path, capsys):
    copy = _copy(run, tmp_path)
    capsys.readouterr()
    _ok(["verdicts", "--out", str(copy), *VERDICTS, "--n-ablate", "1"])
    err = capsys.readouterr().err
    assert re.search(r"verdicts: 100%\|.*2/2", err), err
