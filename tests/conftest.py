"""Shared test setup: nothing is fetched from a hub and wandb stays off."""

import os

import pytest
import torch

from pipelines.model import PRESETS, build_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="module")
def model():
    """A freshly initialised tiny bilinear LM (test modules may shadow it with their own)."""
    torch.manual_seed(0)
    return build_model(PRESETS["tiny"]).eval()
