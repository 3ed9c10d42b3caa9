"""The small demo end to end on a GPU, against the same demo on the CPU (skipped where torch
sees no CUDA device, as on CI: run it where one is lent).

The code takes a device string everywhere; this is where that is checked. The two runs do not
agree bit for bit (the GPU sums in other orders, its index_add_ in no fixed one), so what must
agree is what the demo reports: the LM's held-out loss, the SAEs' quality, and a table for
every stage."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from pipelines.cli import main

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _demo(out: Path, device: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--small", "--device", device, "--threads", "1", "--out", str(out)]) == 0
    return printed.getvalue()


def test_the_small_demo_on_cuda_reports_what_it_reports_on_the_cpu(tmp_path):
    printed = {device: _demo(tmp_path / device, device) for device in ("cpu", "cuda")}
    summary = {d: json.loads((tmp_path / d / "lm" / "summary.json").read_text()) for d in printed}
    assert abs(summary["cuda"]["held_out_loss"] - summary["cpu"]["held_out_loss"]) < 0.01
    metrics = {d: pd.read_parquet(tmp_path / d / "tables" / "sae_metrics").sort_values(["layer", "site"])
               for d in printed}
    assert abs(metrics["cuda"]["nmse"].to_numpy() - metrics["cpu"]["nmse"].to_numpy()).max() < 0.02
    for table in ("gates", "interactions", "eigen", "features", "pair_gates", "group_gates", "gate_ablation",
                  "gate_verdicts", "graph_nodes"):
        assert len(pd.read_parquet(tmp_path / "cuda" / "tables" / table)), table
    assert "report:" in printed["cuda"] and (tmp_path / "cuda" / "report" / "index.html").is_file()
