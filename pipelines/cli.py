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
    train_cfg = LMTrainConfig(**({} if args.train_tokens is None else {"train_tokens": args.train_tokens}))
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


def _layers(text: str, n_layers: int) -> list[int]:
    if text == "all":
        return list(range(n_layers))
    try:
        layers = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise ValueError(f"--layers takes 'all' or comma-separated layer numbers, not {text!r}") from None
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise ValueError(f"layers {bad} do not exist: the model has {n_layers} (0..{n_layers - 1})")
    return layers


def _model_args(p: argparse.ArgumentParser, layers_default: str = "all") -> None:
    _run_arg(p)
    _corpus_arg(p)
    p.add_argument("--model", type=Path, default=None,
                   help="model folder in our format (default: OUT/lm); its tokenizer.json is used")
    p.add_argument("--layers", default=layers_default, help="'all' or a comma list such as 0,2 (default: %(default)s)")


def _load(args: argparse.Namespace):
    """(run, model, tokenizer, corpus source, layers) from the common arguments."""
    from pipelines.model import load_model
    from pipelines.stages import corpus_source
    from pipelines.tokenizer import load_tokenizer

    run = RunPaths(args.out)
    model_dir = args.model or run.lm
    model, cfg = load_model(model_dir)
    return run, model, load_tokenizer(model_dir), corpus_source(run, args.corpus), _layers(args.layers, cfg.n_layers)


def _sae_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sae-in", type=Path, default=None, help="input-side (resid_mid) SAE folder, with --layer")
    p.add_argument("--sae-out", type=Path, default=None, help="output-side (mlp_out) SAE folder, with --layer")
    p.add_argument("--layer", dest="layers", default=argparse.SUPPRESS, help="one layer (same as --layers L)")


def _sae_paths(args: argparse.Namespace, layers: list[int]) -> dict[int, tuple[Path, Path]] | None:
    """Explicit (input, output) SAE folders for the single chosen layer, if given."""
    if not (args.sae_in or args.sae_out):
        return None
    if not (args.sae_in and args.sae_out) or len(layers) != 1:
        raise ValueError("--sae-in and --sae-out go together, with a single --layer")
    return {layers[0]: (args.sae_in, args.sae_out)}


def cmd_train_saes(args: argparse.Namespace) -> None:
    from sae.config import SAETrainConfig
    from pipelines.stages import ensure_saes

    run, model, tok, corpus, layers = _load(args)
    cfg = SAETrainConfig(expansion=args.expansion, k=args.k, train_tokens=args.train_tokens)
    metrics = ensure_saes(run, model, tok, corpus, layers, args.sites.split(","), cfg)
    cols = ["layer", "site", "d_sae", "k", "nmse", "l0", "dead_fraction", "loss_added"]
    print(metrics[cols].to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(f"SAEs in {run.saes}; metrics in {run.tables / 'sae_metrics'}")


def cmd_circuits(args: argparse.Namespace) -> None:
    from circuits.layer import CircuitConfig
    from pipelines.stages import ensure_circuits

    run, model, tok, corpus, layers = _load(args)
    cfg = CircuitConfig(top_n=args.top_n, max_rank=args.max_rank)
    done = ensure_circuits(run, model, tok, corpus, layers, cfg, args.corr_rows, _sae_paths(args, layers))
    print(f"circuit tables for layers {layers} in {run.tables} (computed now: {done or 'none, all up to date'})")


def cmd_features(args: argparse.Namespace) -> None:
    from pipelines.features import FeatureConfig
    from pipelines.stages import ensure_features

    run, model, tok, corpus, layers = _load(args)
    df = ensure_features(run, model, tok, corpus, layers, args.sites.split(","), FeatureConfig(n_rows=args.rows))
    print(f"{len(df)} features described in {run.tables / 'features'}")


def cmd_report(args: argparse.Namespace) -> None:
    from pipelines.report import ReportConfig, write_report
    from pipelines.stages import token_rows

    cfg = ReportConfig()
    run, model, tok, corpus, layers = _load(args)
    tokens = None if args.corpus is None else token_rows(corpus, tok, model.cfg.n_ctx)[1].tokens[: cfg.scatter_rows]
    path = write_report(run, cfg, tokens, model=model, sae_paths=_sae_paths(args, layers),
                        model_dir=args.model or run.lm)
    print(f"report: {path}")


def cmd_demo(args: argparse.Namespace) -> None:
    from pipelines.demo import DemoConfig, run_demo

    run_demo(RunPaths(args.out), DemoConfig.small() if args.small else DemoConfig())


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

    p = sub.add_parser("train-saes", help="train TopK SAEs on resid_mid and mlp_out",
                       description="Train one TopK SAE (sae-lens) per chosen layer and site into "
                                   "OUT/saes/layer{l}_{site}/ and write OUT/tables/sae_metrics/. "
                                   "Finished SAEs are kept; an interrupted run resumes.")
    _model_args(p)
    p.add_argument("--sites", default="resid_mid,mlp_out", help="comma list of sites (default: %(default)s)")
    p.add_argument("--expansion", type=int, default=4, help="latents per model dimension (default: %(default)s)")
    p.add_argument("--k", type=int, default=None, help="active latents per token (default: scaled from the paper's 30 of 2048)")
    p.add_argument("--train-tokens", type=int, default=2_000_000, help="tokens per SAE (default: %(default)s)")
    p.set_defaults(func=cmd_train_saes)

    p = sub.add_parser("circuits", help="interaction, eigen, low-rank and gate tables per layer",
                       description="Project each layer's bilinear MLP into its SAEs' bases and write "
                                   "the interactions, gates, eigen and lowrank tables under OUT/tables/. "
                                   "Layers already done with the same settings are skipped.")
    _model_args(p)
    _sae_args(p)
    p.add_argument("--top-n", type=int, default=50, help="interactions kept per output feature (default: %(default)s)")
    p.add_argument("--max-rank", type=int, default=8, help="largest low-rank approximation r (default: %(default)s)")
    p.add_argument("--corr-rows", type=int, default=1024, help="held-out corpus rows for correlations (default: %(default)s)")
    p.set_defaults(func=cmd_circuits)

    p = sub.add_parser("features", help="describe SAE features (contexts, logits, ground truth)",
                       description="Write OUT/tables/features/: frequency, top-activating contexts, "
                                   "boosted tokens and, on the built-in corpus, ground-truth shares.")
    _model_args(p)
    p.add_argument("--sites", default="resid_mid,mlp_out", help="comma list of sites (default: %(default)s)")
    p.add_argument("--rows", type=int, default=1024, help="held-out corpus rows scanned (default: %(default)s)")
    p.set_defaults(func=cmd_features)

    p = sub.add_parser("report", help="write the HTML report of a run",
                       description="Write OUT/report/index.html with PNG figures from the run's tables "
                                   "(and, for the scatter plots and heatmaps, its model and SAEs, or "
                                   "the explicit ones the tables were computed with).")
    _model_args(p)
    _sae_args(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("demo", help="run every stage on the built-in corpus",
                       description="Corpus, tokenizer, LM, SAEs, circuits, features and report under OUT "
                                   "(default results/demo/); finished stages are skipped. Ends with the "
                                   "top AND-gate candidates.")
    _run_arg(p)
    p.add_argument("--small", action="store_true", help="a minutes-long miniature (for tests)")
    p.set_defaults(func=cmd_demo)
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
