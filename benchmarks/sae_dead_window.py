"""Dead latents of a run's SAEs under other dead-latent windows (and half the rate), on the
stage's own activation stream.

For each chosen (layer, site) of RUN, the SAE stage's stream is drawn again with the recipe
the run's SAEs were trained with (`saes/layer{L}_{site}/train_config.json`), once, and an SAE
is trained on it per variant: the aux-k loss's window at each of `--windows` tokens, and the
recipe's window with half its rate. Each SAE starts as the stage's would (`build_trainers`) and
is scored by the stage's own `sae.metrics.evaluate_sae`. Printed per variant and point: the
latents silent on the first `--rows` held-out rows, those silent on the stage's evaluation
rows (`eval_rows` of the recipe), and NMSE on the `--rows` rows.

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


def main() -> None:
    from pipelines.calls import corpus_source, stage_inputs
    from pipelines.data.corpus import CorpusConfig
    from pipelines.engine.paths import RunPaths
    from pipelines.inputs import ModelInputs
    from sae.config import SAETrainConfig
    from sae.io import TRAIN_CONFIG_FILE
    from sae.metrics import clean_losses, evaluate_sae
    from sae.stream import ActivationStream
    from sae.train import TensorBatches, build_trainers, inference_weights, run_training

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
    source, corpus = corpus_source(run, run.lm)
    inputs = stage_inputs(run, ModelInputs(run.lm, "cpu"), source, corpus or CorpusConfig())
    model, store = inputs.lm.model, inputs.store
    stream = ActivationStream(model, store.train, points, cfg.buffer_tokens, cfg.batch_size, cfg.seed,
                              cfg.model_batch_rows, precision=cfg.autocast, total_batches=cfg.train_steps)
    drawn = {point: [] for point in points}
    for _, batch in zip(range(cfg.train_steps), stream):
        for point in points:
            drawn[point].append(batch[point].clone())
    held = {}  # rows: (tokens, kept positions, clean losses), computed once for every SAE
    for rows in (args.rows, cfg.eval_rows):
        head = store.held_out.head(rows)
        tokens = head.batch(slice(None))
        held[rows] = (tokens, head.keep(tokens), clean_losses(model, tokens, cfg.model_batch_rows))
    variants = [(f"window {w:,}", cfg.replace(dead_after_tokens=w)) for w in args.windows]
    variants.append((f"window {cfg.dead_after_tokens:,}, half the rate", cfg.replace(lr=cfg.lr / 2)))
    print(f"{args.run}: lr {cfg.lr:.3g}, {cfg.train_steps} steps of {cfg.batch_size}; dead latents on "
          f"{args.rows} held-out rows / on the stage's {cfg.eval_rows}; NMSE on the {args.rows}")
    for name, recipe in variants:
        cells = []
        for point in points:
            trainer = build_trainers([point], model.cfg.d_model, recipe, "cpu")
            run_training(trainer, TensorBatches(drawn[point], recipe.batch_size, key=point), recipe)
            weights = inference_weights(trainer[point].sae)
            many, stage = (evaluate_sae(model, weights, tokens, *point, keep, recipe.model_batch_rows, clean)
                           for tokens, keep, clean in (held[args.rows], held[cfg.eval_rows]))
            dead = lambda m: round(m.dead_fraction * weights.d_sae)  # noqa: E731
            cells.append(f"L{point[0]} {point[1]}: {dead(many)} / {dead(stage)}, {many.nmse:.4f}")
        print(f"{name:28s} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
