"""Throughput of the bilinear LM per preset: our plain forward pass against TransformerLens's.

    python benchmarks/bench_lm.py [--presets demo,tiny] [--steps 10] [--vocab 530] [--threads 1]

For each preset, on random tokens and the same weights, two jobs:

- training: AdamW steps of `LMTrainConfig`'s batch, the loss from `circuits.forward` (what
  `train-lm` runs) and from `HookedTransformer(tokens, return_type="loss")`;
- activations: `no_grad` passes of the batch recording every block's resid_mid and mlp_out,
  through `circuits.forward.blocks` (what `sae.activations` runs) and through
  TransformerLens's hooks (`run_with_hooks`, as it did before), neither unembedding.

The two take turns in rounds, so load from other processes slows both alike; the last
column is the ratio of their times. A second table times our training step in float32
against bfloat16 autocast (`LMTrainConfig.autocast`), taking turns the same way.
"""

import argparse
import time
from collections.abc import Callable

import torch

from circuits import forward
from circuits.sites import MLP_OUT, RESID_MID, hook_name
from pipelines.lm.model import PRESETS, build_model
from pipelines.lm.training import LMTrainConfig
from sae.activations import autocast, native_bf16
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_lm.txt"  # under benchmarks/results/

ROUNDS = 3


def _training_step(model, tokens: torch.Tensor, plain: bool, precision: str = "none") -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        if plain:
            with autocast(precision, "cpu"):
                loss = forward.next_token_loss(forward.run(model, tokens)[0], tokens).mean()
        else:
            loss = model(tokens, return_type="loss")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _activations(model, tokens: torch.Tensor, plain: bool) -> Callable[[], None]:
    points = [(layer, site) for layer in range(model.cfg.n_layers) for site in (RESID_MID, MLP_OUT)]
    found = {}
    hooks = [(hook_name(*p), lambda act, hook, p=p: found.__setitem__(p, act)) for p in points]

    @torch.no_grad()
    def run() -> None:
        if plain:
            forward.blocks(model, forward.embed(model, tokens), 0, model.cfg.n_layers, points)
        else:
            model.run_with_hooks(tokens, fwd_hooks=hooks, stop_at_layer=model.cfg.n_layers)

    return run


def _time(job: Callable[[], None], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        job()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,demo", help="comma list of tiny, demo, paper")
    parser.add_argument("--steps", type=int, default=10, help="steps per job and round")
    parser.add_argument("--vocab", type=int, default=530, help="the vocabulary the built-in corpus's tokenizer reaches")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch = LMTrainConfig().batch_size
    print(f"torch {torch.__version__}, {args.threads} threads, batch {batch} rows, {ROUNDS} rounds of {args.steps} steps")
    print(f"{'preset':6s} {'job':11s} {'TransformerLens tok/s':>22s} {'plain tok/s':>12s} {'speed-up':>8s}")
    presets = {name: PRESETS[name].replace(d_vocab=args.vocab) for name in args.presets.split(",")}
    tokens = {name: torch.randint(0, cfg.d_vocab, (batch, cfg.n_ctx), generator=torch.Generator().manual_seed(0))
              for name, cfg in presets.items()}
    for name, cfg in presets.items():
        for job, make in (("training", _training_step), ("activations", _activations)):
            rate, ratio = _rounds({plain: make(build_model(cfg, seed=0), tokens[name], plain) for plain in (False, True)},
                                  tokens[name].numel(), args.steps)
            print(f"{name:6s} {job:11s} {rate[False]:22,.0f} {rate[True]:12,.0f} {ratio:7.2f}x")
    print(f"\nour training step by precision (bf16 native here: {native_bf16('cpu')})")
    print(f"{'preset':6s} {'float32 tok/s':>14s} {'bf16 tok/s':>11s} {'speed-up':>8s}")
    for name, cfg in presets.items():
        rate, ratio = _rounds({p: _training_step(build_model(cfg, seed=0), tokens[name], True, p) for p in ("none", "bf16")},
                              tokens[name].numel(), args.steps)
        print(f"{name:6s} {rate['none']:14,.0f} {rate['bf16']:11,.0f} {ratio:7.2f}x")


def _rounds(jobs: dict, n_tokens: int, steps: int) -> tuple[dict, float]:
    """Tokens per second of each of two jobs, run in turns, and the first's time over the second's."""
    seconds = dict.fromkeys(jobs, 0.0)
    for job_fn in jobs.values():
        job_fn()  # the first step allocates
    for _ in range(ROUNDS):
        for key, job_fn in jobs.items():
            seconds[key] += _time(job_fn, steps)
    first, second = seconds.values()
    return {key: ROUNDS * steps * n_tokens / s for key, s in seconds.items()}, first / second


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
