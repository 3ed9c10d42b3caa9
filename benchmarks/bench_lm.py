"""Training throughput of the bilinear LM: prints tokens/s per preset.

    python benchmarks/bench_lm.py [--presets demo,tiny] [--steps 10] [--vocab 470]

The vocabulary defaults to the size the built-in corpus's tokenizer reaches (about 470).
"""

import argparse
import time

import torch

from pipelines.lm.model import PRESETS, ModelConfig, build_model
from pipelines.lm.training import LMTrainConfig


def tokens_per_s(cfg: ModelConfig, batch_size: int, steps: int) -> float:
    """Training tokens per second of `steps` AdamW steps on random tokens."""
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, cfg.d_vocab, (batch_size, cfg.n_ctx))
    for i in range(steps + 2):
        if i == 2:  # the first steps allocate; time the rest
            start = time.perf_counter()
        loss = model(x, return_type="loss")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return steps * batch_size * cfg.n_ctx / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,demo", help="comma list of tiny, demo, paper")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=470)
    args = parser.parse_args()
    batch = LMTrainConfig().batch_size
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {batch} rows")
    for name in args.presets.split(","):
        cfg = PRESETS[name].replace(d_vocab=args.vocab)
        rate = tokens_per_s(cfg, batch, args.steps)
        print(f"{name:6s} layers {cfg.n_layers} d_model {cfg.d_model} n_ctx {cfg.n_ctx}: "
              f"{rate:,.0f} training tokens/s")


if __name__ == "__main__":
    main()
