"""How crowded the residual stream is where the input SAE reads it, in a trained run and in the
planted worlds (`pipelines.planted`): whether the planted benchmark's dense world, where a
bystander can read as an inhibitor and a distractor output as an AND, is denser than a
trained model.

For every active latent m of the input SAE on resid_mid, at held-out tokens:

- interference: the other active latents' part along m's direction, relative to m's own,
  `|sum_{j != m} z_j d_j . d_m / |d_m|| / (z_m |d_m|)`;
- norm rise: how much removing m alone raises an output that is quadratic in the normed MLP
  input, through the norm's factor only, `(mean(r^2) + eps) / (mean(r'^2) + eps) - 1` with
  `r' = r - z_m d_m` (the factor the exact interventions recompute,
  `circuits.gates.interventions`); the type rule's `--rise` is 0.1;

and L0, the active latents per token. Prints quantiles per layer of RUN and per planted world.

    python benchmarks/bench_superposition.py [--run RUN] [--rows 32] [--seeds 0,1,2]
"""

from __future__ import annotations

from pathlib import Path

import sys

import argparse

import pandas as pd
import torch

from circuits import forward
from circuits.sites import RESID_MID
from circuits.weights import SAEWeights
from pipelines.data.tokens import open_token_store
from pipelines.engine.paths import RunPaths
from pipelines.lm.model import load_model
from pipelines.planted import PlantedConfig, build_world
from sae.io import load_sae
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_superposition.txt"  # under benchmarks/results/

QUANTILES = (0.25, 0.5, 0.75, 0.9)


def crowding(r: torch.Tensor, sae: SAEWeights, eps: float) -> dict[str, torch.Tensor]:
    """`interference [p]` and `norm rise [p]` of the p active latents of residual rows
    `r [t, d]` (module docstring), and `L0 [t]`."""
    z = sae.encode(r)
    token, m = z.nonzero(as_tuple=True)
    own = z[token, m, None] * sae.W_dec[m]  # [p, d]
    length = sae.W_dec[m].norm(dim=1)
    others = (z @ sae.W_dec)[token] - own
    interference = ((others * sae.W_dec[m]).sum(-1) / length).abs() / (z[token, m] * length)
    rise = (r[token].square().mean(-1) + eps) / ((r[token] - own).square().mean(-1) + eps) - 1
    return {"interference": interference, "norm rise": rise, "L0": (z != 0).sum(1).double()}


def summary(name: str, found: dict[str, torch.Tensor]) -> dict:
    q = torch.tensor(QUANTILES, dtype=torch.float64)
    row = {"where": name, "L0": float(found["L0"].mean())}
    for key in ("interference", "norm rise"):
        values = torch.quantile(found[key].double(), q)
        row.update({f"{key} q{int(100 * p)}": float(v) for p, v in zip(QUANTILES, values)})
    return row


def resid_mids(model, tokens: torch.Tensor, layers: int) -> dict[int, torch.Tensor]:
    """resid_mid `[t, d]` of every layer for `tokens [batch, pos]`, from one pass."""
    with torch.no_grad():
        _, found = forward.blocks(model, forward.embed(model, tokens), 0, layers,
                                  [(layer, RESID_MID) for layer in range(layers)])
    return {layer: value.reshape(-1, value.shape[-1]) for (layer, _), value in found.items()}


def run_rows(folder: str, rows: int) -> list[dict]:
    run = RunPaths(folder)
    stores = sorted(run.tokens.iterdir()) if run.tokens.is_dir() else []
    if len(stores) != 1:
        raise SystemExit(f"{run.tokens}: expected one token store, found {len(stores)}")
    model, _ = load_model(run.lm)
    tokens = open_token_store(stores[0]).held_out.batch(slice(0, rows))
    found = []
    for layer, r in resid_mids(model, tokens, model.cfg.n_layers).items():
        sae = load_sae(run.sae(layer, RESID_MID)).weights
        found.append(summary(f"{folder} layer {layer}", crowding(r, sae, model.cfg.eps)))
    return found


def planted_rows(seed: int, rows: int) -> dict:
    world = build_world(PlantedConfig(seed=seed))
    tokens = torch.as_tensor(world.rows.tokens[:rows])
    r = resid_mids(world.model, tokens, 1)[0]
    return summary(f"planted seed {seed}", crowding(r, world.saes.sae_in.weights, world.model.cfg.eps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=None, help="a finished run with an LM and resid_mid SAEs (default: none)")
    parser.add_argument("--rows", type=int, default=32, help="held-out rows read (default: %(default)s)")
    parser.add_argument("--seeds", default="0,1,2", help="planted worlds (default: %(default)s)")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    found = run_rows(args.run, args.rows) if args.run else []
    found += [planted_rows(int(seed), args.rows) for seed in args.seeds.split(",")]
    pd.set_option("display.width", 200)
    print(pd.DataFrame(found).to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
