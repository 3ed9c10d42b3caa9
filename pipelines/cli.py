"""The `bilinear-circuits` command line: a thin layer over `pipelines.stages`.

Options come from the config dataclasses (`pipelines.options`). Arguments are checked, and
the model's config read, before anything heavy loads, so usage errors come at once. Every
command holds the run directory's lock while it works, and reports errors, a busy run or
Ctrl-C as one line (exit 2, or 130 for an interruption) instead of a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from pipelines.options import add_config, config_from

DEFAULT_RUN = Path("results/demo")
# benchmarks/bench_threads.py on this 2-core machine: idle, 2 torch threads ran each stage
# 1.5-1.8x faster than 1; beside one busy process, 1 thread ran 1.6-3x faster than 2 (every
# thread waits on the slowest at each operation). So by default a command takes the cores
# that are not busy when it starts.
DEFAULT_THREADS = 0


def auto_threads(sample_s: float = 0.3) -> int:
    """Cores not busy with other work now: the core count minus the cores the other
    processes kept busy over a short sample of /proc/stat (the load average lags by a
    minute: a finished job would still count). Elsewhere, the load average."""
    cores = os.cpu_count() or 1

    def ticks() -> tuple[int, int] | None:
        try:
            values = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle and iowait
        return sum(values) - idle, sum(values)

    before = ticks()
    if before is None:
        busy = os.getloadavg()[0]
    else:
        time.sleep(sample_s)
        after = ticks()
        busy = cores * (after[0] - before[0]) / max(1, after[1] - before[1])
    return max(1, min(cores, cores - round(busy)))


def _offline() -> None:
    """Nothing is fetched at run time; wandb stays off unless the user enabled it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")


# ------------------------------------------------------------------ shared options


def _common(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument("--out", type=Path, default=DEFAULT_RUN,
                   help="run directory (default: %(default)s); see results/README.md for its layout")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help="torch CPU threads (default: 0, the cores not busy with other work when the command starts)")
    if device:
        p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N (default: auto)")


def _corpus_options(p: argparse.ArgumentParser) -> None:
    from pipelines.data.corpus import CorpusConfig

    p.add_argument("--corpus", default=None,
                   help="corpus: Parquet/JSONL/text file (also .gz/.bz2/.xz/.zst), a datasets folder, or "
                        "hf:NAME[:SPLIT] (default: the corpus the model was trained on)")
    add_config(p, CorpusConfig)


def _model_options(p: argparse.ArgumentParser, layers: str = "all") -> None:
    _common(p)
    _corpus_options(p)
    p.add_argument("--model", type=Path, default=None, help="model folder in our format (default: OUT/lm)")
    p.add_argument("--layers", default=layers, help="'all' or a comma list such as 0,2 (default: %(default)s)")


def _sae_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sae-in", type=Path, default=None,
                   help="input-side SAE folder (sae-lens or the paper authors' format, on resid_mid or mlp_in), with --layer")
    p.add_argument("--sae-out", type=Path, default=None, help="output-side (mlp_out) SAE folder, with --layer")
    p.add_argument("--layer", dest="layers", default=argparse.SUPPRESS, help="one layer (same as --layers L)")
    p.add_argument("--input-site", choices=["resid_mid", "mlp_in"], default="resid_mid",
                   help="which of the run's input SAEs to use (default: %(default)s)")
    p.add_argument("--allow-hookless-saes", action="store_true",
                   help="accept SAEs that record no hook, taking them to read the given layer and site")


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, not {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available here")
    return name


def _layers(text: str, n_layers: int) -> list[int]:
    if text == "all":
        return list(range(n_layers))
    try:
        layers = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise ValueError(f"--layers takes 'all' or comma-separated layer numbers, not {text!r}") from None
    bad = [layer for layer in layers if not 0 <= layer < n_layers]
    if bad:
        raise ValueError(f"layers {bad} do not exist: the model has {n_layers} (0..{n_layers - 1})")
    return layers


def _sae_paths(args: argparse.Namespace, layers: list[int]) -> dict[int, tuple[Path, Path | None]] | None:
    """Explicit (input, output) SAE folders for the single chosen layer, if given."""
    if not (args.sae_in or args.sae_out):
        return None
    if not args.sae_in or len(layers) != 1:
        raise ValueError("--sae-in (with --sae-out for SAE outputs) goes with a single --layer")
    return {layers[0]: (args.sae_in, args.sae_out)}


class _Context:
    """What the analysis commands share: run, model, corpus, layers, device."""

    def __init__(self, args: argparse.Namespace):
        from pipelines.engine.paths import RunPaths
        from pipelines.stages import ModelInputs

        self.args = args
        self.run = RunPaths(args.out)
        self.device = _device(args.device)
        self.model_dir = Path(args.model or self.run.lm)
        self.inputs = ModelInputs(self.model_dir, self.device)
        self.layers = _layers(args.layers, self.inputs.config.n_layers)

    def corpus(self):
        """(source, CorpusConfig): the given corpus, else the one the model was trained on."""
        from pipelines.data.corpus import CorpusConfig
        from pipelines.stages import trained_corpus

        recorded = trained_corpus(self.model_dir)
        if self.args.corpus is not None:
            same = recorded is not None and Path(recorded[0]).resolve() == Path(self.args.corpus).resolve()
            return self.args.corpus, config_from(self.args, CorpusConfig, recorded[1] if same else None)
        if recorded is not None:
            return recorded[0], config_from(self.args, CorpusConfig, recorded[1])
        if self.run.corpus.is_dir():
            return str(self.run.corpus), config_from(self.args, CorpusConfig, _builtin_labels(self.run.corpus))
        raise FileNotFoundError(f"no corpus known for {self.model_dir}: pass --corpus PATH")

    def tokens(self):
        from pipelines.stages import ensure_tokens

        source, cfg = self.corpus()
        return ensure_tokens(self.run, source, self.inputs.tokenizer, self.inputs.config.n_ctx, cfg)


def _builtin_labels(folder: Path):
    """The built-in corpus ships its lexicon: use it unless the user names another."""
    from pipelines.data.corpus import LEXICON_FILE, CorpusConfig

    lexicon = folder / LEXICON_FILE
    return CorpusConfig(lexicon=str(lexicon)) if lexicon.is_file() else CorpusConfig()


# ------------------------------------------------------------------ commands


def cmd_corpus(args: argparse.Namespace) -> None:
    from pipelines.data.stories import StoryConfig
    from pipelines.engine.paths import RunPaths
    from pipelines.stages import ensure_corpus

    cfg = config_from(args, StoryConfig)
    path = ensure_corpus(RunPaths(args.out), cfg)
    print(f"corpus: {cfg.n_stories} stories in {path}")


def cmd_train_lm(args: argparse.Namespace) -> None:
    from pipelines.data.corpus import CorpusConfig
    from pipelines.data.stories import StoryConfig
    from pipelines.data.tokenizer import TokenizerConfig
    from pipelines.engine.paths import RunPaths
    from pipelines.lm.model import PRESETS, ModelConfig
    from pipelines.lm.training import LMTrainConfig
    from pipelines.stages import ensure_corpus, ensure_lm

    run = RunPaths(args.out)
    model_cfg = config_from(args, ModelConfig, PRESETS[args.preset])
    train_cfg = config_from(args, LMTrainConfig)
    tok_cfg = config_from(args, TokenizerConfig)
    device = _device(args.device)
    if args.corpus is None:
        source = str(ensure_corpus(run, StoryConfig()) if not run.corpus.is_dir() else run.corpus)
        corpus_cfg = config_from(args, CorpusConfig, _builtin_labels(run.corpus))
    else:
        source, corpus_cfg = args.corpus, config_from(args, CorpusConfig)
    summary = ensure_lm(run, source, corpus_cfg, model_cfg, tok_cfg, train_cfg, device, args.force)
    print(f"model: {run.lm} ({model_cfg.n_layers} layers, d_model {model_cfg.d_model})")
    print(f"held-out loss {summary['held_out_loss']:.3f} nats, {summary['bits_per_byte']:.3f} bits per byte; "
          f"unigram entropy {summary['unigram_entropy']:.3f} nats; {summary['tokens_per_s']:,.0f} tokens/s")
    if "negated_accuracy" in summary:
        print(f"class of the next lexicon word predicted right: plain {summary['plain_accuracy']:.1%}, "
              f"after a negation {summary['negated_accuracy']:.1%}")


def cmd_convert(args: argparse.Namespace) -> None:
    from pipelines.lm.convert import convert_checkpoint

    cfg = convert_checkpoint(args.source, args.out, tokenizer=args.tokenizer, force=args.force,
                             scale_attn=args.attention_scale)
    print(f"converted {args.source} -> {args.out} ({cfg.n_layers} layers, d_model {cfg.d_model})")


def cmd_train_saes(args: argparse.Namespace) -> None:
    from pipelines.stages import ensure_saes
    from sae.config import SAETrainConfig

    cfg = config_from(args, SAETrainConfig)
    sites = [s.strip() for s in args.sites.split(",") if s.strip()]
    ctx = _Context(args)
    if len(set(sites)) != len(sites):
        raise ValueError(f"--sites names a site twice: {args.sites}")
    metrics = ensure_saes(ctx.run, ctx.inputs, ctx.tokens(), ctx.layers, sites, cfg, ctx.device)
    cols = ["layer", "site", "d_sae", "k", "nmse", "l0", "dead_fraction", "loss_added"]
    print(metrics[cols].to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    print(f"SAEs in {ctx.run.saes}; metrics in {ctx.run.tables / 'sae_metrics'}")


def _outputs(text: str) -> tuple[str, ...]:
    specs = tuple(s.strip() for s in text.split(",") if s.strip())
    if not specs:
        raise ValueError("--outputs names no output")
    return specs


def cmd_circuits(args: argparse.Namespace) -> None:
    from circuits.layer import CircuitConfig
    from pipelines.stages import ensure_circuits

    cfg = config_from(args, CircuitConfig)
    if args.corr_rows < 1:
        raise ValueError(f"--corr-rows must be at least 1, got {args.corr_rows}")
    outputs = _outputs(args.outputs)
    ctx = _Context(args)
    done = ensure_circuits(ctx.run, ctx.inputs, ctx.tokens(), ctx.layers, cfg, args.corr_rows,
                           _sae_paths(args, ctx.layers), args.input_site, outputs, args.output_basis,
                           args.allow_hookless_saes)
    print(f"circuit tables for layers {ctx.layers} in {ctx.run.tables} "
          f"(computed now: {', '.join(done) if done else 'none, all up to date'})")


def cmd_features(args: argparse.Namespace) -> None:
    from pipelines.analysis.features import FeatureConfig
    from pipelines.stages import ensure_features

    cfg = config_from(args, FeatureConfig)
    sites = [s.strip() for s in args.sites.split(",") if s.strip()]
    ctx = _Context(args)
    df = ensure_features(ctx.run, ctx.inputs, ctx.tokens(), ctx.layers, sites, cfg, _sae_paths(args, ctx.layers),
                         args.allow_hookless_saes)
    print(f"{len(df)} features described in {ctx.run.tables / 'features'}")


def cmd_report(args: argparse.Namespace) -> None:
    from pipelines.report.page import ReportConfig, write_report

    cfg = config_from(args, ReportConfig)
    ctx = _Context(args)
    path = write_report(ctx.run, cfg, ctx.inputs, ctx.layers, ctx.tokens(), _sae_paths(args, ctx.layers),
                        args.input_site)
    print(f"report: {path}")


def cmd_explore(args: argparse.Namespace) -> None:
    from pipelines.engine.paths import RunPaths
    from pipelines.explorer.site import serve, write_explorer

    run = RunPaths(args.out)
    index = write_explorer(run)
    print(f"explorer: {index}")
    if args.serve:
        serve(run.explorer, args.host, args.port)


def cmd_demo(args: argparse.Namespace) -> None:
    from pipelines.demo import DemoConfig, run_demo
    from pipelines.engine.files import read_json
    from pipelines.engine.paths import RunPaths

    if args.config is not None:
        data = read_json(args.config)
        if data is None:
            raise ValueError(f"--config {args.config}: not a readable JSON file")
        cfg = DemoConfig.from_json(data)
    else:
        cfg = DemoConfig.small() if args.small else DemoConfig()
    if args.seed is not None:
        cfg = cfg.with_seed(args.seed)
    run_demo(RunPaths(args.out), cfg, _device(args.device))


# ------------------------------------------------------------------ the parser


def build_parser() -> argparse.ArgumentParser:
    from circuits.layer import CircuitConfig
    from pipelines.analysis.features import FeatureConfig
    from pipelines.data.stories import StoryConfig
    from pipelines.data.tokenizer import TokenizerConfig
    from pipelines.lm.model import PRESETS, ModelConfig
    from pipelines.lm.training import LMTrainConfig
    from pipelines.report.page import ReportConfig
    from sae.config import SAETrainConfig

    parser = argparse.ArgumentParser(
        prog="bilinear-circuits",
        description="Train SAEs on a bilinear LM and read its circuits from the weights.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("corpus", help="write the built-in story corpus (Parquet)",
                       description="Generate the seeded TinyStories-like corpus with negation ground truth "
                                   "(labelled spans and a lexicon of sentiment words) into OUT/corpus/.")
    _common(p, device=False)
    add_config(p, StoryConfig)
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser("train-lm", help="train the tokenizer and the bilinear LM",
                       description="Train a tokenizer and a bilinear LM into OUT/lm/. Resumes an interrupted "
                                   "run from its last checkpoint and keeps a finished one; refuses to replace a "
                                   "model trained on other inputs unless --force.")
    _common(p)
    _corpus_options(p)
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                   help="model shape: tiny (tests), demo, paper (6 layers, d_model 512) (default: %(default)s)")
    p.add_argument("--force", action="store_true", help="replace a model in OUT/lm trained on other inputs")
    add_config(p, ModelConfig, skip=("d_vocab", "seed"), default_text="the preset's")
    add_config(p, LMTrainConfig)
    add_config(p, TokenizerConfig)
    p.set_defaults(func=cmd_train_lm)

    p = sub.add_parser("convert", help="convert a published bilinear checkpoint to our format",
                       description="Convert a checkpoint in the paper authors' layout (HF-style config.json "
                                   "and weights, float32/bf16/fp16) into config.json, model.safetensors and "
                                   "tokenizer.json. Refuses to write over a model unless --force.")
    p.add_argument("source", type=Path, help="folder of the published checkpoint")
    p.add_argument("--out", type=Path, required=True, help="folder to write our checkpoint to")
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json to use when the source folder has none")
    p.add_argument("--force", action="store_true", help="write over an existing model in --out")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help="torch CPU threads (default: 0, the cores not busy when the command starts)")
    p.add_argument("--attention-scale", choices=["config", "on", "off"], default="config",
                   help="whether the attention output is scaled by 1/sqrt(2 n_layer): as the config's scale_attn "
                        "says (default), or state it for a config without that field")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("train-saes", help="train TopK SAEs on resid_mid, mlp_in and/or mlp_out",
                       description="Train one TopK SAE per chosen layer and site into OUT/saes/layer{l}_{site}/ "
                                   "(sae-lens's format) from one stream of activations, and write "
                                   "OUT/tables/sae_metrics/. Reuses an SAE only for the same model, corpus and "
                                   "recipe; an interrupted run resumes from its last checkpoint.")
    _model_options(p)
    p.add_argument("--sites", default="resid_mid,mlp_out",
                   help="comma list of resid_mid, mlp_in, mlp_out (default: %(default)s)")
    add_config(p, SAETrainConfig)
    p.set_defaults(func=cmd_train_saes)

    p = sub.add_parser("circuits", help="interaction, gate, eigen and low-rank tables per layer",
                       description="Project each layer's bilinear MLP into its SAEs' bases and write the "
                                   "interactions, gates, gate_truth, gate_ablation, eigen, eigen_inputs and "
                                   "lowrank tables under OUT/tables/. Layers already done from the same "
                                   "inputs are kept.")
    _model_options(p)
    _sae_options(p)
    p.add_argument("--outputs", default="sae",
                   help="comma list of output directions: sae (the output SAE's features), hosvd, "
                        "logit:GOOD-BAD or logit:WORD (unembedding directions), file:PATH (.npy/.safetensors) "
                        "(default: %(default)s)")
    p.add_argument("--output-basis", choices=["encoder", "decoder"], default="encoder",
                   help="read SAE outputs by their encoder rows (exact pre-activations) or decoder rows "
                        "(default: %(default)s)")
    p.add_argument("--corr-rows", type=int, default=1024,
                   help="held-out rows for correlations and gate statistics (default: %(default)s)")
    add_config(p, CircuitConfig)
    p.set_defaults(func=cmd_circuits)

    p = sub.add_parser("features", help="describe SAE features (contexts, tokens, logits, labels)",
                       description="Write OUT/tables/features/ and feature_labels/: frequency, contexts from "
                                   "distinct documents and several quantiles, token-feature flags, boosted "
                                   "tokens and, with labels, the share of activation per label class.")
    _model_options(p)
    _sae_options(p)
    p.add_argument("--sites", default="resid_mid,mlp_in,mlp_out",
                   help="comma list of the run's SAE sites to describe, where they exist (default: %(default)s)")
    add_config(p, FeatureConfig, rename={"n_rows": "rows"})
    p.set_defaults(func=cmd_features)

    p = sub.add_parser("report", help="write the one-page HTML report of a run",
                       description="Write OUT/report/index.html with PNG figures from the run's tables, the "
                                   "model and its SAEs (or the explicit ones the tables were computed with).")
    _model_options(p)
    _sae_options(p)
    add_config(p, ReportConfig)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("explore", help="write (and optionally serve) the interactive explorer",
                       description="Write OUT/explorer/, a static site that opens from the file system: every "
                                   "feature with its circuits, gates, spectra and contexts.")
    _common(p, device=False)
    p.add_argument("--serve", action="store_true", help="serve the site over HTTP after writing it")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to serve on (default: %(default)s)")
    p.set_defaults(func=cmd_explore)

    p = sub.add_parser("demo", help="run every stage on the built-in corpus",
                       description="Corpus, tokenizer, LM, SAEs, circuits, features, report and explorer under "
                                   "OUT (default results/demo/); finished stages are kept. Ends with each layer's "
                                   "best AND-gate candidates and their verdicts.")
    _common(p)
    p.add_argument("--small", action="store_true", help="a minutes-long miniature (for tests)")
    p.add_argument("--seed", type=int, default=None, help="one seed for every stage (default: the config's)")
    p.add_argument("--config", type=Path, default=None, help="a demo_config.json to run with")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    _offline()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:  # argparse has printed its usage message
        return int(exit.code or 0)
    from pipelines.engine.lock import RunBusyError, run_lock

    try:
        import torch

        threads = getattr(args, "threads", 0)
        if not threads:
            threads = auto_threads()
            # the thread count changes torch's CPU sums in the last bits: say it, to repeat a run
            print(f"{threads} torch thread(s): the cores not busy now (--threads N to fix)", file=sys.stderr)
        torch.set_num_threads(threads)
        if args.command == "convert":
            args.func(args)
        else:
            with run_lock(args.out, args.command):
                args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted: finished work and the last checkpoint are kept; run the same command again to "
              "continue", file=sys.stderr)
        return 130
    except (FileNotFoundError, ValueError, PermissionError, RunBusyError, NotADirectoryError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {err.strerror or err} ({err.filename or ''})", file=sys.stderr)
        return 2
    return 0
