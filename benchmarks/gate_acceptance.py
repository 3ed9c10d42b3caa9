"""The gate acceptance figures of finished runs: are the gates the toolkit ranks first computed
by the layer, or made by the output SAE's cut-off?

Per run and layer, for pairs and group gates: how many candidates are typed a bilinear `and`,
a `threshold` (activation-level) AND and a `square`; of the 8 best by circuit_rank, the median
cross-term share of the output's pre-activation (`cross_share`, the norm's factor frozen, where
the run's tables have it; and `layer_cross`, the closed form of the pre_* columns less the
output's constant, as the layer computes it, for any run), how many share a top token
(`features.top_token`; a group gate when a member of each side does) and how many the
model-run check confirms by the measures that do not read through the output SAE's TopK
(the MLP output along the feature, `mlp`, and the boosted tokens' log-probability,
`logprob`), as the run's `gate_verdicts` table says (`pipelines.analysis.verdicts.confirmations`;
null for runs of older code, whose verdicts lack those columns). The output's constant is the
tables' `pre_constant`, or for older runs `circuits.layer.encoder_offset` of the run's weights.

    python benchmarks/gate_acceptance.py RUN_DIR [RUN_DIR...] [--best 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, recorded  # noqa: E402
from circuits.gates.types import layer_shares  # noqa: E402
from circuits.layer import encoder_offset  # noqa: E402
from circuits.weights import from_hooked_transformer  # noqa: E402
from circuits.sites import OUTPUT_SITE  # noqa: E402
from pipelines.engine.paths import RunPaths  # noqa: E402
from pipelines.lm.model import load_model  # noqa: E402
from sae.io import load_sae  # noqa: E402

KINDS = {"pair": ("pair_gates", ("in_a", "in_b")), "group": ("group_gates", ("group_a", "group_b"))}
KEYS = ["layer", "outputs", "input_site", "out_feature"]
CONFIRMS = {"mlp_confirms": "mlp confirms", "logprob_confirms": "logprob confirms", "sae_confirms": "sae confirms"}


def constants(run: Path, layer: int) -> np.ndarray:
    """`[n_out]`: each output's pre-activation with no MLP input (the MLP's biases through the
    output SAE's encoder), from the run's model and output SAE: for runs whose tables lack
    `pre_constant`."""
    paths = RunPaths(run)
    model, _ = load_model(paths.lm)
    sae = load_sae(paths.sae(layer, OUTPUT_SITE)).weights
    return encoder_offset(from_hooked_transformer(model, layer), sae, torch.device("cpu")).numpy()


def top_tokens(run: Path) -> dict[tuple[int, int], str]:
    """(layer, input feature) -> its top token, for the input SAE's features."""
    features = pd.read_parquet(run / "tables" / "features")
    mine = features[features["site"] != OUTPUT_SITE]
    return {(int(l), int(f)): t for l, f, t in zip(mine["layer"], mine["feature"], mine["top_token"]) if isinstance(t, str)}


def share_a_top_token(row, layer: int, tokens: dict, kind: str) -> bool:
    a, b = ("members_a", "members_b") if kind == "pair" else ("necessary_a", "necessary_b")
    side = lambda members: {tokens.get((layer, int(m))) for m in members} - {None}  # noqa: E731
    members_a = [row["in_a"]] if kind == "pair" else row[a]
    members_b = [row["in_b"]] if kind == "pair" else row[b]
    return bool(side(members_a) & side(members_b))


def figures(run: Path, best: int) -> list[dict]:
    tokens = top_tokens(run)
    verdicts = pd.read_parquet(run / "tables" / "gate_verdicts")
    confirmed = [c for c in CONFIRMS if c in verdicts]
    found = []
    for kind, (table, sides) in KINDS.items():
        gates = pd.read_parquet(run / "tables" / table)
        for layer in sorted(gates["layer"].unique()):
            mine = gates[gates["layer"] == layer].copy()
            if "pre_constant" not in mine:
                mine["pre_constant"] = constants(run, int(layer))[mine["out_feature"].to_numpy()]
            shares = layer_shares(*(mine[f"pre_{r}"] for r in ("none", "a", "b", "ab")), mine["pre_constant"])
            mine["layer_cross"] = shares["layer_cross_share"]
            types = mine["gate_type"].value_counts()
            top = mine[mine["circuit_rank"].notna()].sort_values("circuit_rank").head(best)
            said = verdicts[(verdicts["layer"] == layer) & (verdicts["kind"] == kind)]
            said = said[KEYS + list(sides) + ["drop_a"] + confirmed].astype({s: "int64" for s in sides})
            checked = top[KEYS + list(sides)].merge(said, how="left", on=KEYS + list(sides))
            count = lambda c: int(checked[c].fillna(False).sum()) if c in checked else pd.NA  # noqa: E731
            frozen = top["cross_share"].median() if "cross_share" in top else np.nan
            found.append({
                "run": str(run), "layer": int(layer), "kind": kind, "and": int(types.get("and", 0)),
                "threshold": int(types.get("threshold", 0)), "and-unformed": int(types.get("and-unformed", 0)),
                "square": int(types.get("square", 0)),
                "best": len(top), "cross_share": frozen, "layer_cross": top["layer_cross"].median(),
                "top token shared": sum(share_a_top_token(r, int(layer), tokens, kind) for r in top.to_dict("records")),
                "ablated": int(checked["drop_a"].notna().sum()),
                **{name: count(c) for c, name in CONFIRMS.items()},
                "best typed and": int((top["gate_type"] == "and").sum()),
            })
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (a finished demo's --out)")
    parser.add_argument("--best", type=int, default=8, help="best candidates of each kind per layer read "
                                                            "(default: %(default)s, the verdicts' n_ablate)")
    add_output(parser, "gate_acceptance.txt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pd.set_option("display.width", 250)
    pd.set_option("display.max_columns", 30)
    rows = [row for run in args.runs for row in figures(run, args.best)]
    frame = pd.DataFrame(rows).astype({c: "Int64" for c in CONFIRMS.values()})
    with recorded(args.output):
        _print(frame, args.best)


def _print(frame: pd.DataFrame, best: int) -> None:
    print(f"counts: candidates typed `and` (bilinear; on older code the activation-level and), `threshold`, `and-unformed`, `square`; "
          f"of the {best} best by circuit_rank: median cross-term share (frozen norm; layer_cross as the layer "
          f"computes it), how many share a top token, how many were ablated, and how many each model-run measure "
          f"confirms (mlp and logprob read no TopK; sae is the SAE's activation)")
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
