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
`logprob`; `pipelines.analysis.verdicts.confirmations`, computed here from the ablation
tables so that runs of older code, without those columns, are read the same way).

    python benchmarks/gate_acceptance.py RUN_DIR [RUN_DIR...] [--best 8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, recorded  # noqa: E402
from circuits.gates.types import layer_shares  # noqa: E402
from circuits.sites import OUTPUT_SITE  # noqa: E402
from pipelines.analysis.verdicts import VerdictConfig, confirmations, drops  # noqa: E402
from pipelines.engine.paths import RunPaths  # noqa: E402
from sae.io import load_sae  # noqa: E402

KINDS = {"pair": ("pair_gates", "gate_ablation", ("in_a", "in_b")),
         "group": ("group_gates", "group_ablation", ("group_a", "group_b"))}
KEYS = ["layer", "outputs", "input_site", "out_feature"]


def constants(run: Path, layer: int) -> np.ndarray:
    """`[n_out]`: each output's pre-activation with no MLP input (the MLP's biases through the
    output SAE's encoder), from the run's model and output SAE."""
    paths = RunPaths(run)
    state = load_file(paths.model.weights)
    sae = load_sae(paths.sae(layer, OUTPUT_SITE)).weights
    bias = state[f"blocks.{layer}.mlp.b_in"] @ state[f"blocks.{layer}.mlp.W_out"] + state[f"blocks.{layer}.mlp.b_out"]
    return sae.pre(bias.to(sae.W_enc.dtype)).detach().numpy()


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


def figures(run: Path, best: int, cfg: VerdictConfig) -> list[dict]:
    tokens = top_tokens(run)
    found = []
    for kind, (table, ablation_table, sides) in KINDS.items():
        gates = pd.read_parquet(run / "tables" / table)
        ablation = pd.read_parquet(run / "tables" / ablation_table)
        for layer in sorted(gates["layer"].unique()):
            mine = gates[gates["layer"] == layer].copy()
            constant = constants(run, int(layer))
            mine["pre_constant"] = constant[mine["out_feature"].to_numpy()]
            shares = layer_shares(*(mine[f"pre_{r}"] for r in ("none", "a", "b", "ab")), mine["pre_constant"])
            mine["layer_cross"] = shares["layer_cross_share"]
            types = mine["gate_type"].value_counts()
            top = mine[mine["circuit_rank"].notna()].sort_values("circuit_rank").head(best)
            mine_ablation = ablation[ablation["layer"] == layer].copy()
            mine_ablation["pre_constant"] = constant[mine_ablation["out_feature"].to_numpy()]
            checked = top.merge(drops(mine_ablation, KEYS + list(sides)), how="left", on=KEYS + list(sides))
            said = confirmations(checked, cfg)
            frozen = top["cross_share"].median() if "cross_share" in top else np.nan
            found.append({
                "run": str(run), "layer": int(layer), "kind": kind, "and": int(types.get("and", 0)),
                "threshold": int(types.get("threshold", 0)), "and-unformed": int(types.get("and-unformed", 0)),
                "square": int(types.get("square", 0)),
                "best": len(top), "cross_share": frozen, "layer_cross": top["layer_cross"].median(),
                "top token shared": sum(share_a_top_token(r, int(layer), tokens, kind) for r in top.to_dict("records")),
                "ablated": int(checked["drop_a"].notna().sum()),
                "mlp confirms": int(said["mlp_confirms"].fillna(False).sum()),
                "logprob confirms": int(said["logprob_confirms"].fillna(False).sum()),
                "sae confirms": int(said["sae_confirms"].fillna(False).sum()),
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
    rows = [row for run in args.runs for row in figures(run, args.best, VerdictConfig())]
    frame = pd.DataFrame(rows)
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
