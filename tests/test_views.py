"""The report and the explorer show the same rows of a table: the scatter of an output
feature's activation against its approximations comes, in both, from `lowrank_samples`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines import schemas
from pipelines.engine.paths import RunPaths
from pipelines.explorer import data as xdata
from pipelines.report import page
from pipelines.report.inputs import load_report_data


def test_the_report_and_the_explorer_scatter_the_same_rows(tmp_path):
    run = RunPaths(tmp_path / "run")
    rng = np.random.default_rng(0)
    rows = [{"out_feature": f, "sample": s, "n_eigs": r, "activation": float(rng.random()),
             "approx": float(rng.normal()), "offset": -0.25}
            for f in range(3) for s in range(1, 6) for r in range(1, 5)]
    schemas.write(pd.DataFrame(rows).assign(outputs="sae", input_site="resid_mid"), run.tables, "lowrank_samples",
                  layer=1, part="resid_mid-sae")
    drawn = {}
    data = load_report_data(run, [1], "resid_mid", tmp_path)
    assert page._scatter(data, 1, 2, _Pictures(drawn), "L1_F2") is not None
    report = {(name, round(float(x), 9), round(float(y), 9)) for name, xs, ys, _ in drawn["scatter"][0]
              for x, y in zip(xs, ys)}

    bundle = xdata.data_bundle(xdata.load_tables(run), 1, "resid_mid", "samples")
    samples = xdata.decode_table(bundle["lowrank_samples"])
    mine = samples[samples["out_feature"] == 2]
    explorer = {(f"rank {r}", round(a + o, 9), round(act, 9))
                for r, a, o, act in zip(mine["n_eigs"], mine["approx"], mine["offset"], mine["activation"])}
    # ranks 1, 2 and the largest stored (4), five sampled tokens each, in both views
    assert {name for name, _, _ in report} == {"rank 1", "rank 2", "rank 4"}
    assert len(report) == len(explorer) == 15
    # the same points, to the explorer's 4 significant digits
    for (name, x, y), (other, ex, ey) in zip(sorted(report, key=_order), sorted(explorer, key=_order)):
        assert name == other and np.isclose(x, ex, rtol=2e-3, atol=1e-6) and np.isclose(y, ey, rtol=1e-3)


def _order(point: tuple) -> tuple:
    name, _, activation = point
    return name, float(f"{activation:.3g}")


class _Pictures:
    """Keeps what a figure was asked to draw."""

    def __init__(self, drawn: dict):
        self.drawn = drawn

    def draw(self, name: str, figure, *args) -> str:
        self.drawn[figure.__name__] = args
        return name
