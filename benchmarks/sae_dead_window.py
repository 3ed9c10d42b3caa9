"""Dead latents of a run's SAEs under other dead-latent windows (and half the rate), on the
stage's own activation stream.

For each chosen (layer, site) of RUN, the SAE stage's stream is drawn again with the recipe
the run's SAEs were trained with (`saes/layer{L}_{site}/train_config.json`), once, and an SAE
is trained on it per variant: the aux-k loss's window at each of `--windows` tokens, and the
recipe's window with half its rate. Each SAE starts as the stage's would (`build_trainers`).
Printed per variant and point: latents silent on the first `--rows` held-out rows (their
tokens, padding left out), latents silent on their first 8192 tokens (about the stage's 64
rows), and NMSE on the held-out rows.

    python benchmarks/sae_dead_window.py RUN [--points 0:mlp_out 3:resid_mid 0:resid_mid]
        [--windows 1000000 131072 65536 32768 16384] [--rows 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # one bar per SAE would bury the table
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script

import torch  # noqa: E402

from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "sae_dead_window.txt"  # under benchmarks/results/
STAGE_TOKENS = 8192  # the SAE stage's 64 evaluation rows of 128 tokens


def held_out_activations(model, store, points, rows: int) -> dict:
    """Each point's activations `[tokens, d_model]` on the first `rows` held-out rows (kept tokens only)."""
    from circuits.sites import hook_name

    head = store.held_out.head(rows)
    tokens = head.batch(slice(None))
    keep = head.keep(tokens)
    out = {point: [] for point in points}
    with torch.no_grad():
        for start in range(0, len(tokens), 32):
            _, cache = model.run_with_cache(tokens[start : start + 32], names_filter=[hook_name(*p) for p in points])
            for point in points:
                out[point].append(cache[hook_name(*point)][keep[start : start + 32]].float())
    return {point: torch.cat(parts) for point, parts in out.items()}


def silent(sae, x: torch.Tensor) -> int:
    """Latents that never fire on x `[tokens, d_in]`."""
    values, indices = sae.encode(x)
    fired = torch.zeros(sae.d_sae, dtype=torch.bool)
    fired[indices[values > 0]] = True
    return int((~fired).sum())


def main() -> None:
    from pipelines.data.tokens import open_token_store
    from pipelines.engine.paths import RunPaths
    from pipelines.lm.model import load_model
    from sae.config import SAETrainConfig
    from sae.io import TRAIN_CONFIG_FILE
    from sae.stream import ActivationStream
    from sae.train import TensorBatches, build_trainers, run_training

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run folder after train-saes")
    parser.add_argument("--points", nargs="+", default=["0:mlp_out", "3:resid_mid", "0:resid_mid"], help="LAYER:SITE")
    parser.add_argument("--windows", nargs="+", type=int, default=[1_000_000, 131_072, 65_536, 32_768, 16_384],
                        help="dead-latent windows to train with, in tokens")
    parser.add_argument("--rows", type=int, default=1024, help="held-out rows the dead latents are counted on")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    points = [(int(layer), site) for layer, site in (p.split(":") for p in args.points)]
    run = RunPaths(args.run)
    recipes = {point: json.loads((run.sae(*point) / TRAIN_CONFIG_FILE).read_text()) for point in points}
    if len({json.dumps(r, sort_keys=True) for r in recipes.values()}) != 1:
        raise SystemExit(f"{args.run}: the chosen points' SAEs were trained with different recipes")
    cfg = SAETrainConfig.from_json(next(iter(recipes.values())))
    model, _ = load_model(run.lm)
    stores = sorted(p for p in (args.run / "tokens").iterdir() if p.is_dir())
    if len(stores) != 1:
        raise SystemExit(f"{args.run}/tokens: expected one token store, found {len(stores)}")
    store = open_token_store(stores[0])
    stream = ActivationStream(model, store.train, points, cfg.buffer_tokens, cfg.batch_size, cfg.seed,
                              cfg.model_batch_rows, precision=cfg.autocast, total_batches=cfg.train_steps)
    drawn = {point: [] for point in points}
    for _, batch in zip(range(cfg.train_steps), stream):
        for point in points:
            drawn[point].append(batch[point].clone())
    held = held_out_activations(model, store, points, args.rows)
    variants = [(f"window {w:,}", cfg.replace(dead_after_tokens=w)) for w in args.windows]
    variants.append((f"window {cfg.dead_after_tokens:,}, half the rate", cfg.replace(lr=cfg.lr / 2)))
    print(f"{args.run}: lr {cfg.lr:.3g}, {cfg.train_steps} steps of {cfg.batch_size}; dead latents on "
          f"{held[points[0]].shape[0]:,} held-out tokens / on their first {STAGE_TOKENS:,}; NMSE")
    for name, recipe in variants:
        cells = []
        for point in points:
            trainer = build_trainers([point], model.cfg.d_model, recipe, "cpu")
            run_training(trainer, TensorBatches(drawn[point], recipe.batch_size, key=point), recipe)
            sae, x = trainer[point].sae, held[point]
            with torch.no_grad():
                nmse = float((x - sae(x)).pow(2).sum() / (x - x.mean(0)).pow(2).sum())
                cells.append(f"L{point[0]} {point[1]}: {silent(sae, x)} / {silent(sae, x[:STAGE_TOKENS])}, {nmse:.4f}")
        print(f"{name:28s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
