"""Defects of the run engine (issue 8), each driven through the command line.

Every test here failed on the code before the engine was rebuilt; they go through `main`,
the public entry point, so the same file ran against the old and the new code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines.cli import main
from tests.children import child_env

pytestmark = pytest.mark.slow

TINY_LM = ["--preset", "tiny", "--train-tokens", "40000", "--vocab-size", "600"]
TINY_SAES = ["--train-tokens", "40960", "--k", "4"]
CIRCUITS = ["--top-n", "10", "--max-rank", "4", "--corr-rows", "64"]
VERDICTS = ["--rows", "64", "--n-ablate", "2", "--min-cell", "5"]


def _ok(argv: list[str]) -> None:
    assert main(argv) == 0, argv


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine")
    base = ["--out", str(out)]
    _ok(["corpus", *base, "--n-stories", "2000", "--seed", "1"])
    _ok(["train-lm", *base, *TINY_LM])
    _ok(["train-saes", *base, *TINY_SAES])
    _ok(["circuits", *base, *CIRCUITS])
    _ok(["features", *base, "--rows", "64"])
    _ok(["verdicts", *base, *VERDICTS])
    return out


@pytest.fixture(scope="module")
def other_lm(run, tmp_path_factory) -> Path:
    """A second model on the same corpus, trained with another seed."""
    out = tmp_path_factory.mktemp("other")
    _ok(["train-lm", "--out", str(out), "--corpus", str(run / "corpus"), *TINY_LM, "--seed", "7"])
    return out / "lm"


def _error(capsys, argv: list[str]) -> str:
    """Run a command that must fail with a message (exit 2) and return the message."""
    assert main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error:"), err  # one line, not a traceback
    return err.strip().splitlines()[-1]


def _sae_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "sae_weights.safetensors"))


# ------------------------------------------------------------------ 1. SAEs of another model


def test_saes_of_another_model_are_not_reused(run, other_lm, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = _sae_weights(copy / "saes/layer0_resid_mid")
    _ok(["train-saes", "--out", str(copy), "--model", str(other_lm), *TINY_SAES])
    after = _sae_weights(copy / "saes/layer0_resid_mid")
    assert not torch.equal(before["W_dec"], after["W_dec"])


# ------------------------------------------------------------------ 2. mismatched SAEs


@pytest.mark.parametrize("command, options, table", [("circuits", CIRCUITS, "interactions"),
                                                      ("verdicts", VERDICTS, "gate_verdicts")])
@pytest.mark.parametrize("sae_in, sae_out", [
    ("layer1_resid_mid", "layer1_mlp_out"),  # another layer's SAEs
    ("layer0_mlp_out", "layer0_resid_mid"),  # swapped
    ("layer0_mlp_out", "layer0_mlp_out"),  # an output SAE as the input
])
def test_mismatched_saes_are_refused(run, tmp_path, capsys, sae_in, sae_out, command, options, table):
    err = _error(capsys, [command, "--out", str(tmp_path), "--corpus", str(run / "corpus"),
                          "--model", str(run / "lm"), "--layer", "0",
                          "--sae-in", str(run / "saes" / sae_in), "--sae-out", str(run / "saes" / sae_out),
                          *options])
    assert "hook" in err
    assert not (tmp_path / "tables" / table).exists()


def test_hookless_sae_needs_an_explicit_override(run, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    shutil.copytree(run / "saes/layer0_resid_mid", foreign)
    cfg = json.loads((foreign / "cfg.json").read_text())
    cfg.get("metadata", {}).pop("hook_name", None)
    cfg.pop("hook_name", None)
    (foreign / "cfg.json").write_text(json.dumps(cfg))
    argv = ["circuits", "--out", str(tmp_path / "out"), "--corpus", str(run / "corpus"),
            "--model", str(run / "lm"), "--layer", "0", "--sae-in", str(foreign),
            "--sae-out", str(run / "saes/layer0_mlp_out"), *CIRCUITS]
    assert "hook" in _error(capsys, argv)
    _ok([*argv, "--allow-hookless-saes"])
    # the report reads the same SAEs, so it takes the same flag
    report = ["report", "--out", str(tmp_path / "out"), "--model", str(run / "lm"), "--layer", "0",
              "--sae-in", str(foreign), "--sae-out", str(run / "saes/layer0_mlp_out")]
    assert "hook" in _error(capsys, report)
    _ok([*report, "--allow-hookless-saes"])


# ------------------------------------------------------------------ 3. report with other SAEs


def test_report_refuses_saes_other_than_the_tables_were_computed_with(run, capsys):
    err = _error(capsys, ["report", "--out", str(run), "--layer", "0",
                          "--sae-in", str(run / "saes/layer1_resid_mid"),
                          "--sae-out", str(run / "saes/layer1_mlp_out")])
    assert "computed with" in err or "hook" in err


def test_report_refuses_tables_of_replaced_saes(run, other_lm, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    # new SAEs (for another model), but the tables still come from the old ones
    shutil.rmtree(copy / "saes/layer1_mlp_out")
    shutil.copytree(run / "saes/layer0_mlp_out", copy / "saes/layer1_mlp_out")
    cfg_file = copy / "saes/layer1_mlp_out/cfg.json"
    cfg_file.write_text(cfg_file.read_text().replace("blocks.0.hook_mlp_out", "blocks.1.hook_mlp_out"))
    assert "computed with" in _error(capsys, ["report", "--out", str(copy)])


# ------------------------------------------------------------------ 4. NaN and Inf


def test_nan_in_sae_weights_is_refused(run, tmp_path, capsys):
    bad = tmp_path / "nan_sae"
    shutil.copytree(run / "saes/layer0_resid_mid", bad)
    weights = _sae_weights(bad)
    weights["W_dec"][3, 2] = float("nan")
    save_file(weights, str(bad / "sae_weights.safetensors"))
    err = _error(capsys, ["circuits", "--out", str(tmp_path / "out"), "--corpus", str(run / "corpus"),
                          "--model", str(run / "lm"), "--layer", "0", "--sae-in", str(bad),
                          "--sae-out", str(run / "saes/layer0_mlp_out"), *CIRCUITS])
    assert "W_dec" in err and "NaN" in err


def test_inf_in_model_weights_is_refused(run, tmp_path, capsys):
    bad = tmp_path / "inf_lm"
    shutil.copytree(run / "lm", bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["blocks.0.mlp.W_in"][0, 0] = float("inf")
    save_file(weights, str(bad / "model.safetensors"))
    err = _error(capsys, ["circuits", "--out", str(tmp_path / "out"), "--corpus", str(run / "corpus"),
                          "--model", str(bad), "--layer", "0", "--sae-in", str(run / "saes/layer0_resid_mid"),
                          "--sae-out", str(run / "saes/layer0_mlp_out"), *CIRCUITS])
    assert "blocks.0.mlp.W_in" in err


# ------------------------------------------------------------------ 5. nonsense numbers


@pytest.mark.parametrize("argv, flag", [
    (["features", "--rows", "0"], "rows"),
    (["circuits", "--corr-rows", "0"], "corr-rows"),
    (["circuits", "--corr-rows", "-1"], "corr-rows"),
    (["verdicts", "--rows", "0"], "rows"),
    (["verdicts", "--n-ablate", "-1"], "n-ablate"),
    (["verdicts", "--min-cosine", "2"], "min-cosine"),
    (["verdicts", "--groups", "eigen,nonsense"], "groups"),
    (["train-lm", "--train-tokens", "-5"], "train-tokens"),
    (["train-lm", "--vocab-size", "0"], "vocab-size"),
    (["corpus", "--n-stories", "0"], "n-stories"),
])
def test_nonsense_numbers_are_refused_and_overwrite_nothing(run, capsys, argv, flag):
    tables = sorted((run / "tables").rglob("*.parquet"))
    stamps = {p: p.stat().st_mtime_ns for p in tables}
    err = _error(capsys, [argv[0], "--out", str(run), *argv[1:]])
    assert flag in err.replace("_", "-").lower()
    assert {p: p.stat().st_mtime_ns for p in tables} == stamps


# ------------------------------------------------------------------ 6. digests of content, not names


def test_a_run_is_reused_whatever_its_path_is_spelled(run, tmp_path, capsys, monkeypatch):
    copy = tmp_path / "moved"
    shutil.copytree(run, copy)
    monkeypatch.chdir(tmp_path)
    _ok(["circuits", "--out", "moved", *CIRCUITS])
    assert "none, all up to date" in capsys.readouterr().out
    _ok(["circuits", "--out", str(copy.resolve()), *CIRCUITS])
    assert "none, all up to date" in capsys.readouterr().out
    verdicts = sorted((copy / "tables" / "gate_verdicts").rglob("*.parquet"))
    before = {p: p.stat().st_mtime_ns for p in verdicts}
    _ok(["verdicts", "--out", "moved", *VERDICTS])
    assert verdicts and {p: p.stat().st_mtime_ns for p in verdicts} == before


def test_a_failed_train_lm_does_not_pin_the_run_to_its_corpus(tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("too short.\n")
    out = ["--out", str(tmp_path / "run")]
    _error(capsys, ["train-lm", *out, "--corpus", str(tiny), *TINY_LM])
    good = tmp_path / "good.txt"
    good.write_text("\n\n".join(f"story number {i} was about a cat and a dog." for i in range(3000)))
    _ok(["train-lm", *out, "--corpus", str(good), *TINY_LM])


# ------------------------------------------------------------------ 7. convert over a model


def test_convert_refuses_to_overwrite_a_model_without_force(run, tmp_path, capsys):
    from tests.test_convert import published_config, published_weights, write_published

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = (copy / "lm/model.safetensors").read_bytes()
    src = write_published(tmp_path / "published", published_weights(), published_config())
    assert "--force" in _error(capsys, ["convert", str(src), "--out", str(copy / "lm")])
    assert (copy / "lm/model.safetensors").read_bytes() == before
    _ok(["convert", str(src), "--out", str(copy / "lm"), "--force"])


# ------------------------------------------------------------------ 8. two commands at once


def test_a_second_command_on_a_busy_run_is_refused_naming_the_holder(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    busy = subprocess.Popen(
        [sys.executable, "-m", "pipelines", "train-lm", "--out", str(copy), "--corpus", str(run / "corpus"),
         "--preset", "tiny", "--train-tokens", "4000000", "--vocab-size", "600", "--force"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
    try:
        deadline = time.time() + 60
        while not (copy / ".lock").is_file() or str(busy.pid) not in (copy / ".lock").read_text():
            assert time.time() < deadline, "the running command took no lock"
            time.sleep(0.2)
        err = _error(capsys, ["circuits", "--out", str(copy), *CIRCUITS])
        assert str(busy.pid) in err and "train-lm" in err
    finally:
        busy.kill()
        busy.wait()


# ------------------------------------------------------------------ 9. checkpoints, leftovers


def test_lm_checkpoint_interval_is_a_setting(run, tmp_path, monkeypatch):
    import pipelines.lm.training as training

    calls = {"n": 0}
    real = training.clip_grad_norm_

    def interrupt_after_25_steps(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 25:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "clip_grad_norm_", interrupt_after_25_steps)
    out = ["--out", str(tmp_path / "run"), "--corpus", str(run / "corpus")]
    assert main(["train-lm", *out, *TINY_LM, "--train-tokens", "80000", "--checkpoint-every", "10"]) == 130
    state = torch.load(tmp_path / "run/lm/train_state.pt", weights_only=False)
    assert state["step"] == 20


def test_leftover_temporaries_of_a_killed_command_are_removed(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    leftover = copy / ".activations.0123abcd.tmp"
    (leftover / "layer0_resid_mid").mkdir(parents=True)
    _ok(["train-saes", "--out", str(copy), *TINY_SAES])
    assert not leftover.exists()


# ------------------------------------------------------------------ 10. messages, not tracebacks


def _parquet_corpus(tmp_path: Path, texts) -> str:
    path = tmp_path / "corpus.parquet"
    pd.DataFrame({"text": texts}).to_parquet(path)
    return str(path)


def test_null_texts_are_skipped_with_a_count(tmp_path, capsys):
    texts = [None if i % 10 == 0 else f"the cat number {i} sat on the mat." for i in range(4000)]
    _ok(["train-lm", "--out", str(tmp_path / "run"), "--corpus", _parquet_corpus(tmp_path, texts), *TINY_LM])
    assert "skipped 400 documents" in capsys.readouterr().out


def test_a_text_column_of_numbers_is_refused(tmp_path, capsys):
    corpus = _parquet_corpus(tmp_path, list(range(5000)))
    err = _error(capsys, ["train-lm", "--out", str(tmp_path / "run"), "--corpus", corpus, *TINY_LM])
    assert "corpus.parquet" in err and "text" in err


def test_unreadable_bytes_name_the_file(tmp_path, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 society was here.\n\n".encode("latin-1") * 100)
    err = _error(capsys, ["train-lm", "--out", str(tmp_path / "run"), "--corpus", str(bad), *TINY_LM])
    assert "latin1.txt" in err and "UTF-8" in err


def test_offline_hub_corpus_gives_a_message(tmp_path, capsys):
    err = _error(capsys, ["train-lm", "--out", str(tmp_path / "run"), "--corpus", "hf:no-such/dataset", *TINY_LM])
    assert "no-such/dataset" in err


def test_read_only_out_is_refused_before_any_work(run, tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        err = _error(capsys, ["circuits", "--out", str(locked / "run"), "--corpus", str(run / "corpus"),
                              "--model", str(run / "lm"), *CIRCUITS])
        assert "locked" in err
    finally:
        locked.chmod(0o700)


def test_read_only_out_as_root_is_refused_before_any_work(run, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the run directory should be")
    err = _error(capsys, ["circuits", "--out", str(blocker / "run"), "--corpus", str(run / "corpus"),
                          "--model", str(run / "lm"), *CIRCUITS])
    assert "file" in err


def test_repeated_sites_are_refused(run, capsys):
    assert "mlp_out" in _error(capsys, ["train-saes", "--out", str(run), "--sites", "mlp_out,mlp_out"])


def test_a_string_where_a_config_number_belongs(tmp_path, capsys):
    config = tmp_path / "demo.json"
    config.write_text(json.dumps({"n_candidates": "eight"}))
    err = _error(capsys, ["demo", "--out", str(tmp_path / "run"), "--config", str(config)])
    assert "n_candidates" in err


def test_ctrl_c_gives_a_message_and_exit_130(run, tmp_path, capsys, monkeypatch):
    import pipelines.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_circuits", interrupted, raising=False)
    parser_func = cli.build_parser
    monkeypatch.setattr(cli, "build_parser", lambda: _with_func(parser_func(), "circuits", interrupted))
    try:
        code = main(["circuits", "--out", str(tmp_path), *CIRCUITS])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main as a traceback")
    assert code == 130
    assert "interrupted" in capsys.readouterr().err


def _with_func(parser, command, func):
    for action in parser._subparsers._group_actions:
        action.choices[command].set_defaults(func=func)
    return parser


# ------------------------------------------------------------------ 11. smaller ones


def test_layer_reads_back_as_an_integer(run):
    assert pd.read_parquet(run / "tables" / "gates")["layer"].dtype == "int64"


def test_report_layers_option_is_honoured(run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    _ok(["report", "--out", str(copy), "--layers", "0"])
    page = (copy / "report/index.html").read_text()
    assert "layer 0" in page and "layer 1" not in page


def _bars(err: str) -> dict[str, str]:
    """The last state each progress bar printed on stderr, by its description."""
    last = {}
    for state in re.split(r"[\r\n]+", err):
        found = re.match(r"\s*([^:|]+): *\d+%\|", state)
        if found:
            last[found.group(1).strip()] = state
    return last


def test_every_progress_bar_finishes(run, tmp_path, capsys):
    """No bar is left behind at 0% (sae-lens's was), and the report shows its progress."""
    retrain, report = tmp_path / "retrain", tmp_path / "report"
    shutil.copytree(run, retrain)
    shutil.copytree(run, report)
    capsys.readouterr()
    _ok(["train-saes", "--out", str(retrain), "--train-tokens", "20480", "--k", "4"])
    _ok(["verdicts", "--out", str(report), *VERDICTS, "--n-ablate", "1"])  # another recipe: computed again
    _ok(["report", "--out", str(report)])
    bars = _bars(capsys.readouterr().err)
    assert "report" in bars and any(name.startswith("train") for name in bars), bars
    unfinished = {name: state for name, state in bars.items() if "100%|" not in state}
    assert not unfinished, unfinished


def test_help_texts_state_what_the_defaults_are(capsys):
    import pipelines.cli as cli

    helps = {}
    for command in ("train-lm", "circuits", "verdicts"):
        assert cli.main([command, "--help"]) == 0
        helps[command] = " ".join(capsys.readouterr().out.split())
    assert "per output feature and kind" in helps["circuits"]
    assert "default: 4000000" in helps["train-lm"]
    assert ("confirmed by ablation in the model (plus each layer's best of each kind that a gate tag marks) (default: 8)"
            in helps["verdicts"])


def test_usage_errors_do_not_load_the_model(run, monkeypatch, capsys):
    import pipelines.lm.model as model_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(model_module, "load_model", no_loading)
    _error(capsys, ["circuits", "--out", str(run), "--corr-rows", "0"])
    _error(capsys, ["circuits", "--out", str(run), "--layers", "7"])
    _error(capsys, ["verdicts", "--out", str(run), "--n-ablate", "-1"])
    _error(capsys, ["verdicts", "--out", str(run), "--layers", "7"])


def test_no_stale_design_references():
    root = Path(__file__).resolve().parents[1]
    for path in [*root.glob("pipelines/**/*.py"), *root.glob("tests/*.py")]:
        if path.name == Path(__file__).name:
            continue
        assert "DESIGN.md" not in path.read_text(), path


def test_tokens_of_a_copied_run_are_reused(run, tmp_path, capsys):
    """The lexicon counts by its content, not by where its file lies (a copied run's corpus
    folder ships its own copy of the lexicon)."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = sorted(p.name for p in (copy / "tokens").iterdir())
    _ok(["circuits", "--out", str(copy), *CIRCUITS])
    assert sorted(p.name for p in (copy / "tokens").iterdir()) == before
