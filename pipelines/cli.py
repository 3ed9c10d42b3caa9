"""The `bilinear-circuits` command line: a thin layer over `pipelines.stages`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.paths import RunPaths

DEFAULT_RUN = Path("results/demo")


def _offline() -> None:
    """Nothing is fetched at run time; wandb stays off unless the user enabled it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")


def _run_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=DEFAULT_RUN,
                   help="run directory (default: %(default)s); see results/README.md for its layout")


def _corpus_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", default=None,
                   help="corpus: Parquet/JSONL/text file, a datasets folder, or hf:NAME[:SPLIT] "
                        "(default: the run's built-in story corpus)")


def cmd_corpus(args: argparse.Namespace) -> None:
    from pipelines.stages import ensure_corpus
    from pipelines.stories import StoryConfig

    path = ensure_corpus(RunPaths(args.out), StoryConfig(n_stories=args.n_stories, seed=args.seed))
    print(f"corpus: {args.n_stories} stories in {path}")


def cmd_train_lm(args: argparse.Namespace) -> None:
    from pipelines.lm_training import LMTrainConfig
    from pipelines.model import PRESETS
    from pipelines.stages import corpus_source, ensure_corpus, ensure_lm
    from pipelines.stories import StoryConfig
    from pipelines.tokenizer import TokenizerConfig

    run = RunPaths(args.out)
    if args.corpus is None and not run.corpus.is_dir():
        ensure_corpus(run, StoryConfig())
    train_cfg = LMTrainConfig(**({"train_tokens": args.train_tokens} if args.train_tokens else {}))
    _, cfg, summary = ensure_lm(
        run, corpus_source(run, args.corpus), PRESETS[args.preset],
        TokenizerConfig(vocab_size=args.vocab_size), train_cfg,
    )
    print(f"model: {run.lm} ({cfg.n_layers} layers, d_model {cfg.d_model}, vocab {cfg.d_vocab})")
    print(f"held-out loss {summary['held_out_loss']:.3f} nats; unigram entropy "
          f"{summary['unigram_entropy']:.3f} nats; {summary['tokens_per_s']:,.0f} tokens/s")
    if "negated_accuracy" in summary:
        print(f"valence of the next sentiment word predicted right: plain "
              f"{summary['plain_accuracy']:.1%}, after a negation {summary['negated_accuracy']:.1%}")


def cmd_convert(args: argparse.Namespace) -> None:
    from pipelines.convert import convert_checkpoint

    cfg = convert_checkpoint(args.source, args.out, tokenizer=args.tokenizer)
    print(f"converted {args.source} -> {args.out} ({cfg.n_layers} layers, d_model {cfg.d_model})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bilinear-circuits",
        description="Train SAEs on a bilinear LM and read its circuits from the weights.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("corpus", help="write the built-in story corpus (Parquet)",
                       description="Generate the seeded TinyStories-like corpus with negation "
                                   "ground truth into OUT/corpus/.")
    _run_arg(p)
    p.add_argument("--n-stories", type=int, default=20000, help="stories to generate (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default: %(default)s)")
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser("train-lm", help="train the tokenizer and the bilinear LM",
                       description="Train a tokenizer and a bilinear LM into OUT/lm/; resumes an "
                                   "interrupted run and skips a finished one.")
    _run_arg(p)
    _corpus_arg(p)
    p.add_argument("--preset", choices=["tiny", "demo", "large"], default="demo",
                   help="model size (default: %(default)s)")
    p.add_argument("--train-tokens", type=int, default=None, help="tokens to train on")
    p.add_argument("--vocab-size", type=int, default=1024, help="tokenizer vocabulary (default: %(default)s)")
    p.set_defaults(func=cmd_train_lm)

    p = sub.add_parser("convert", help="convert a published bilinear checkpoint to our format",
                       description="Convert a checkpoint in the paper authors' layout (HF-style "
                                   "config.json and weights) into config.json, model.safetensors "
                                   "and tokenizer.json.")
    p.add_argument("source", type=Path, help="folder of the published checkpoint")
    p.add_argument("--out", type=Path, required=True, help="folder to write our checkpoint to")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json to use when the source folder has none")
    p.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    _offline()
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
