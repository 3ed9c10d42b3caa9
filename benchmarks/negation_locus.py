"""Where each run's model computes the negation: the figures of `pipelines.analysis.negation`.

    python3 benchmarks/negation_locus.py RUN_DIR [RUN_DIR ...] [--rows 512] [--json OUT_DIR]

For every run (a demo's folder, after its `verdicts`): the printed summary of the negation locus
(direct effects of each layer on the lexicon logit difference; per layer and context class the
SAE feature, logit direction, best cross direction and HOSVD direction with the largest cross
term between the negation and context groups), then per layer how many SAE features carry a
cross term of a given share, the best five, and the demo's group gates between the same groups
(`gate_verdicts`) with their cross shares. Nothing is written into the runs; `--json` saves
each scan as OUT_DIR/<run name>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from circuits.sites import RESID_MID  # noqa: E402
from pipelines import schemas  # noqa: E402
from pipelines.analysis.negation import NegationScan, describe_locus, scan_negation  # noqa: E402
from pipelines.analysis.verdicts import VerdictConfig  # noqa: E402
from pipelines.data.tokens import open_token_store  # noqa: E402
from pipelines.engine.files import read_json, write_json  # noqa: E402
from pipelines.engine.paths import RunPaths  # noqa: E402
from pipelines.inputs import ModelInputs, plan_layers  # noqa: E402

SHARES = (0.05, 0.1, 0.25)


def scan(folder: Path, rows: int) -> dict:
    run = RunPaths(folder)
    stores = sorted(p for p in run.tokens.iterdir() if p.is_dir()) if run.tokens.is_dir() else []
    if len(stores) != 1:
        raise SystemExit(f"{folder}: expected one token store under {run.tokens}, found {len(stores)}")
    config = read_json(run.demo_config) or {}
    rules = VerdictConfig.from_json(config["verdicts"]["rules"]) if "verdicts" in config else VerdictConfig()
    lm = ModelInputs(run.lm)
    plans = plan_layers(run, lm, list(range(lm.config.n_layers)), None, RESID_MID)
    plans = {layer: plan for layer, plan in plans.items() if plan.has_saes()}
    features, labels = (schemas.read(run.tables, n, list(plans)) for n in ("features", "feature_labels"))
    return scan_negation(lm, open_token_store(stores[0]), plans, features, labels, rules, NegationScan(rows=rows))


def details(folder: Path, found: dict, min_active: float) -> None:
    frame = pd.DataFrame(found["directions"])
    if frame.empty:
        return
    sae = frame[(frame["kind"] == "sae") & (frame["active"].fillna(0) >= min_active)]
    print(f"\nSAE features active on at least {min_active:.0%} of the negated positions, by |cross share|:")
    for (layer, source, ctx), mine in sae.groupby(["layer", "source", "context"]):
        counts = ", ".join(f">= {s:.0%}: {int((mine['share_cross'].abs() >= s).sum())}" for s in SHARES)
        best = mine.reindex(mine["share_cross"].abs().sort_values(ascending=False).index).head(5)
        shown = "; ".join(f"out {r.direction} {r.share_cross:+.1%} (w {r.w_cross_share:.2f})" for r in best.itertuples())
        print(f"  layer {layer}, {source} groups, {ctx}: {len(mine)} features ({counts}); best: {shown}")
    verdicts = schemas.select(schemas.read(RunPaths(folder).tables, "gate_verdicts"))
    if verdicts is None or "negation_gate" not in verdicts:
        return
    gates = verdicts[(verdicts["kind"] == "group") & verdicts["negation_gate"].fillna(False).astype(bool)]
    gates = gates.sort_values("circuit_rank").groupby("layer").head(1)
    for g in gates.itertuples():
        labels = f"{g.label_a} x {g.label_b}"
        mine = frame[(frame["layer"] == g.layer) & (frame["kind"] == "sae") & (frame["direction"] == str(g.out_feature))
                     & (frame["source"] == "labels") & frame["group_b"].map(lambda b: b in labels)]
        shares = "; ".join(_row(r) for r in mine.itertuples())
        print(f"  best negation group gate of layer {g.layer}: out {g.out_feature} <- {labels}, {g.gate_type}: "
              f"{shares or 'its groups are not the scan label groups'}")


def _row(r) -> str:
    return (f"{r.context} contexts: cross {r.share_cross:+.1%} (the norm recomputed {r.share_cross_renormed:+.1%}; removing "
            f"both sides keeps {r.square_kept:.0%} of the input's mean square), own "
            f"negation {r.share_own_a:+.1%}, own context {r.share_own_b:+.1%}, rest {r.share_rest:+.1%}; active "
            f"{r.active:.0%}; weights: cross share {r.w_cross_share:.2f}, eigenvalues {r.lambda_pos:+.3f}/{r.lambda_neg:+.3f}")


def chosen(found: dict, outputs: list[str]) -> None:
    """The rows of the SAE features named as LAYER:FEATURE."""
    frame = pd.DataFrame(found["directions"])
    for spec in outputs:
        layer, feature = (int(v) for v in spec.split(":"))
        for r in frame[(frame["layer"] == layer) & (frame["kind"] == "sae") & (frame["direction"] == str(feature))
                       ].itertuples():
            print(f"  layer {layer} out {feature}, {r.source} groups, {_row(r)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=NegationScan.rows, help="held-out rows read")
    parser.add_argument("--min-active", type=float, default=NegationScan.min_active)
    parser.add_argument("--json", type=Path, help="folder to save each run's scan in")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--outputs", nargs="*", default=[], metavar="LAYER:FEATURE",
                        help="SAE output features whose rows to print in full")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for folder in args.runs:
        start = time.perf_counter()
        found = scan(folder, args.rows)
        print(f"\n=== {folder} ({time.perf_counter() - start:.0f} s)")
        print("\n".join(describe_locus(found, args.min_active)))
        details(folder, found, args.min_active)
        chosen(found, args.outputs)
        if args.json:
            write_json(args.json / f"{folder.resolve().name}.json", found)


if __name__ == "__main__":
    main()
