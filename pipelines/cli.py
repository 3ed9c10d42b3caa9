"""The `bilinear-circuits` command line: a thin layer over `pipelines.stages`.

Options come from the job configs (`pipelines.jobs`) and the runtime (`pipelines.runtime`)
through `pipelines.options`. Arguments are checked, and the model's config read, before
anything heavy loads, so usage errors come at once. Every command holds the run directory's
lock while it works (`explore --serve` and `graph --serve` serve once it has let it go), and reports errors, a busy run or Ctrl-C as one line (exit 2, or 130
for an interruption) instead of a traceback; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.calls import TABLE_STAGES
from pipelines.options import add_config, config_from, whole_number

DEFAULT_RUN = Path("results/demo")


def _offline() -> None:
    """Nothing is fetched at run time; wandb stays off unless the user enabled it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")


# ------------------------------------------------------------------ shared options


def _common(p: argparse.ArgumentParser, device: bool = True, ray: bool = False, threads: bool = True) -> None:
    """--out, --debug and the runtime's options the command uses (--threads, --device, and
    --ray/--workers for the stages that fan out)."""
    from pipelines.engine.cluster import LOCAL
    from pipelines.runtime import Runtime

    p.add_argument("--out", type=Path, default=DEFAULT_RUN,
                   help="run directory (default: %(default)s); see results/README.md for its layout")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    only = (("threads",) if threads else ()) + (("device",) if device else ()) + (("workers",) if ray else ())
    if only:
        add_config(p, Runtime, only=only)
    if ray:
        p.add_argument("--ray", nargs="?", const=LOCAL, default=None, metavar="ADDRESS",
                       help="run the stage's tasks on Ray: without ADDRESS on a Ray runtime started here (or the "
                            "cluster RAY_ADDRESS names), with one on that cluster (needs `pip install "
                            "'bilinear-circuits[ray]'`; the run directory must be on storage every worker shares)")


def _runtime(args: argparse.Namespace):
    """The command's runtime from its options, with the threads and device decided."""
    from pipelines.runtime import Runtime

    runtime = config_from(args, Runtime)
    ray = getattr(args, "ray", None)
    if ray is not None:
        from pipelines.engine.cluster import LOCAL, check_address, import_ray

        import_ray()  # no Ray, or no cluster at the address: say so before any work
        if ray == LOCAL and os.environ.get("RAY_ADDRESS"):
            ray = os.environ["RAY_ADDRESS"]
        if ray != LOCAL:
            check_address(ray)
    return runtime.replace(ray=ray).resolved()


def _corpus_options(p: argparse.ArgumentParser) -> None:
    from pipelines.data.corpus import CorpusConfig

    p.add_argument("--corpus", default=None,
                   help="corpus: Parquet/JSONL/text file (also .gz/.bz2/.xz/.zst), a datasets folder, or "
                        "hf:NAME[:SPLIT] (default: the corpus the model was trained on)")
    add_config(p, CorpusConfig)


def _model_options(p: argparse.ArgumentParser, ray: bool = False, corpus: bool = True) -> None:
    _common(p, ray=ray)
    if corpus:
        _corpus_options(p)
    p.add_argument("--model", type=Path, default=None, help="model folder in our format (default: OUT/lm)")
    p.add_argument("--layers", default="all", help="'all' or a comma list such as 0,2 (default: %(default)s)")
    p.add_argument("--layer", dest="layers", default=argparse.SUPPRESS, help="one layer (same as --layers L)")


def _layers(text: str, n_layers: int) -> list[int]:
    from pipelines.calls import check_layers

    if text == "all":
        return list(range(n_layers))
    try:
        layers = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise ValueError(f"--layers takes 'all' or comma-separated layer numbers, not {text!r}") from None
    return check_layers(layers, n_layers)


class _Context:
    """What the analysis commands share: run, model, corpus, layers, runtime."""

    def __init__(self, args: argparse.Namespace):
        from pipelines.engine.paths import RunPaths
        from pipelines.inputs import ModelInputs

        self.args = args
        self.run = RunPaths(args.out)
        self.runtime = _runtime(args)
        self.model_dir = Path(args.model or self.run.lm)
        self.inputs = ModelInputs(self.model_dir, self.runtime.device)
        self.layers = _layers(args.layers, self.inputs.config.n_layers)

    def corpus(self):
        """(source, CorpusConfig): the given corpus, else the one the model was trained on."""
        from pipelines.calls import corpus_source
        from pipelines.data.corpus import CorpusConfig

        try:
            source, recorded = corpus_source(self.run, self.model_dir, self.args.corpus)
        except FileNotFoundError:
            raise FileNotFoundError(f"no corpus known for {self.model_dir}: pass --corpus PATH") from None
        return source, config_from(self.args, CorpusConfig, recorded)

    def work(self):
        """The stages' inputs: this run, the model and the corpus's token store."""
        from pipelines.calls import stage_inputs

        return stage_inputs(self.run, self.inputs, *self.corpus())


# ------------------------------------------------------------------ commands


def cmd_corpus(args: argparse.Namespace) -> None:
    from pipelines.data.stories import StoryConfig
    from pipelines.engine.paths import RunPaths
    from pipelines.stages import ensure_corpus

    cfg = config_from(args, StoryConfig)
    path = ensure_corpus(RunPaths(args.out), cfg, force=args.force)
    print(f"corpus: {cfg.n_stories} stories in {path}")


def cmd_train_lm(args: argparse.Namespace) -> None:
    from pipelines.calls import builtin_corpus_config
    from pipelines.data.corpus import CorpusConfig
    from pipelines.data.stories import StoryConfig
    from pipelines.data.tokenizer import TokenizerConfig
    from pipelines.engine.paths import RunPaths
    from pipelines.jobs import LMJob
    from pipelines.lm.model import PRESETS, ModelConfig
    from pipelines.lm.training import LMTrainConfig
    from pipelines import summary
    from pipelines.stages import ensure_corpus, ensure_lm

    run = RunPaths(args.out)
    model_cfg = config_from(args, ModelConfig, PRESETS[args.preset])
    runtime = _runtime(args)
    # every option is checked before the built-in corpus is written
    job = LMJob(corpus=config_from(args, CorpusConfig), model=model_cfg, tokenizer=config_from(args, TokenizerConfig),
                train=config_from(args, LMTrainConfig))
    source = args.corpus
    if source is None:
        source = str(ensure_corpus(run, StoryConfig()) if not run.corpus.is_dir() else run.corpus)
        job = job.replace(corpus=config_from(args, CorpusConfig, builtin_corpus_config(run.corpus)))
    outcome = ensure_lm(run, source=source, job=job, runtime=runtime, force=args.force)
    print(f"model: {run.lm} ({model_cfg.n_layers} layers, d_model {model_cfg.d_model})")
    summary.lm(outcome)


def cmd_convert(args: argparse.Namespace) -> None:
    from pipelines.lm.convert import convert_checkpoint

    cfg = convert_checkpoint(args.source, args.out, tokenizer=args.tokenizer, force=args.force,
                             scale_attn=args.attention_scale)
    print(f"converted {args.source} -> {args.out} ({cfg.n_layers} layers, d_model {cfg.d_model})")


def cmd_train_saes(args: argparse.Namespace) -> None:
    from pipelines.jobs import SAEJob
    from pipelines.options import job_from
    from pipelines import summary
    from pipelines.stages import ensure_saes

    job = job_from(args, SAEJob)
    ctx = _Context(args)
    metrics = ensure_saes(ctx.work(), job=job, layers=ctx.layers, runtime=ctx.runtime)
    summary.sae_metrics(metrics, job.dead_warning)
    print(f"SAEs in {ctx.run.saes}; metrics in {ctx.run.tables / 'sae_metrics'}")


def cmd_stage(args: argparse.Namespace) -> None:
    """A table stage's command (`TABLE_STAGES`): its job from the flags, the plan of the
    chosen layers (usage errors before any work), the stage, and what its command shows."""
    import importlib

    from pipelines.calls import stage_plan, table_stage
    from pipelines.options import job_from

    stage = importlib.import_module(f"pipelines.stages.{args.stage}")
    job = job_from(args, stage.COMMAND.job)
    ctx = _Context(args)
    plan = stage_plan(args.stage, job, ctx.run, ctx.inputs, ctx.layers)  # before the corpus is tokenized
    result = table_stage(args.stage, ctx.work(), job, plan, ctx.runtime)
    stage.COMMAND.show(args, ctx.run, plan, result)


def cmd_report(args: argparse.Namespace) -> None:
    from pipelines.jobs import SiteChoice
    from pipelines.report.config import ReportConfig
    from pipelines.report.page import write_report

    cfg = config_from(args, ReportConfig)
    ctx = _Context(args)
    plan = config_from(args, SiteChoice).plan(ctx.run, ctx.inputs, ctx.layers)
    with ctx.runtime.torch_threads():
        path = write_report(ctx.run, cfg, ctx.inputs, plan, processes=ctx.runtime.threads)
    print(f"report: {path}")


def cmd_explore(args: argparse.Namespace):
    from pipelines.engine.paths import RunPaths
    from pipelines.explorer.site import serve, write_explorer

    run = RunPaths(args.out)
    index = write_explorer(run)
    print(f"explorer: {index}")
    if args.serve:  # serving reads only what was just written: no lock held while it runs
        return lambda: serve(run.explorer, args.host, args.port)
    return None


def cmd_graph(args: argparse.Namespace):
    from pipelines.engine.paths import RunPaths
    from pipelines.graph.build import read_prompts
    from pipelines.graph.export import read_index
    from pipelines.graph.serve import graph_server, served_lines
    from pipelines.graph.stage import describe, make_graphs
    from pipelines.inputs import ModelInputs
    from pipelines.jobs import GraphJob
    from pipelines.options import job_from

    run = RunPaths(args.out)
    if args.prompt is not None or args.prompts is not None or not args.serve:
        job = job_from(args, GraphJob)
        prompts, where = read_prompts(args.prompt, args.prompts)
        read_index(run.graph_index)  # an index the graphs cannot be added to: said before any work
        runtime = _runtime(args)
        inputs = ModelInputs(Path(args.model or run.lm), runtime.device)
        with runtime.torch_threads():
            graphs = make_graphs(run, inputs, job, prompts, args.layer, where=where, target_name="--target")
        for pg in graphs:
            print("\n".join(describe(pg)))
        print(f"graphs in {run.graphs}; tables graph_nodes, graph_edges, graph_and_edges in {run.tables}")
    if args.serve:  # serving only reads: no lock held while it runs, as for explore --serve
        server = graph_server(run, args.port)
        return lambda: server.run_until_interrupted(served_lines(run, server))
    return None


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
    run_demo(RunPaths(args.out), cfg, _runtime(args))


# ------------------------------------------------------------------ the parser


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from circuits.sites import SITES
    from pipelines.data.stories import StoryConfig
    from pipelines.data.tokenizer import TokenizerConfig
    from pipelines.jobs import GraphJob, SAEJob, SiteChoice
    from pipelines.lm.model import PRESETS, ModelConfig
    from pipelines.lm.training import LMTrainConfig
    from pipelines.options import add_job
    from pipelines.report.config import ReportConfig

    parser = argparse.ArgumentParser(
        prog="bilinear-circuits",
        description="Train SAEs on a bilinear LM and read its circuits from the weights.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("corpus", help="write the built-in story corpus (Parquet)",
                       description="Generate the seeded TinyStories-like corpus with negation ground truth "
                                   "(labelled spans and a lexicon of sentiment words) into OUT/corpus/.")
    _common(p, device=False, threads=False)
    p.add_argument("--force", action="store_true", help="replace the corpus the run's model was trained on")
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
    p.add_argument("--debug", action="store_true", help="show the traceback of an error instead of one line")
    p.add_argument("--attention-scale", choices=["config", "on", "off"], default="config",
                   help="whether the attention output is scaled by 1/sqrt(2 n_layer): as the config's scale_attn "
                        "says (default), or state it for a config without that field")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("train-saes", help="train TopK SAEs on any of the sites " + ", ".join(SITES),
                       description="Train one TopK SAE per chosen layer and site into OUT/saes/layer{l}_{site}/ "
                                   "(sae-lens's format) from one stream of activations, and write "
                                   "OUT/tables/sae_metrics/. Reuses an SAE only for the same model, corpus and "
                                   "recipe; an interrupted run resumes from its last checkpoint (with --ray, for "
                                   "the same --workers).")
    _model_options(p, ray=True)
    add_job(p, SAEJob)
    p.set_defaults(func=cmd_train_saes)

    for name in TABLE_STAGES:
        command = importlib.import_module(f"pipelines.stages.{name}").COMMAND
        p = sub.add_parser(command.name, help=command.help, description=command.description)
        _model_options(p, ray=True)
        add_job(p, command.job, rename=command.rename)
        if command.options is not None:
            command.options(p)
        p.set_defaults(func=cmd_stage, stage=name)

    p = sub.add_parser("report", help="write the one-page HTML report of a run",
                       description="Write OUT/report/index.html with PNG figures from the run's tables, the "
                                   "model and its SAEs (or the explicit ones the tables were computed with).")
    _model_options(p, corpus=False)
    add_config(p, SiteChoice)
    add_config(p, ReportConfig)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("explore", help="write (and optionally serve) the interactive explorer",
                       description="Write OUT/explorer/, a static site that opens from the file system: every "
                                   "feature with its circuits, gates, spectra and contexts.")
    _common(p, device=False, threads=False)
    p.add_argument("--serve", action="store_true", help="serve the site over HTTP after writing it")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (default: %(default)s)")
    p.add_argument("--port", type=whole_number("--port", 0, 65535), default=8000, help="port to serve on, 0 for any free one (default: "
                                                            "%(default)s)")
    p.set_defaults(func=cmd_explore, creates_run=False)

    p = sub.add_parser("graph", help="exact attribution graphs of prompts, for circuit-tracer's viewer",
                       description="With attention patterns and norm scales frozen, split every active SAE latent's "
                                   "pre-activation and the target logits exactly over their sources (the bilinear MLP's "
                                   "quadratic form partitioned over its input's parts, with AND hyperedges), prune by "
                                   "influence as circuit-tracer does, and write OUT/graphs/<slug>.json in circuit-tracer's "
                                   "format, graph-metadata.json, and the tables graph_nodes, graph_edges, graph_and_edges.")
    _common(p)
    p.add_argument("--model", type=Path, default=None, help="model folder in our format (default: OUT/lm)")
    p.add_argument("--prompt", default=None, help="the text to attribute (after BOS)")
    p.add_argument("--prompts", type=Path, default=None, help="a text file of prompts, one per line")
    p.add_argument("--layer", type=int, default=None, help="the one layer whose SAEs are nodes: that of --sae-in and "
                                                            "--sae-out, or the run's own (other layers' MLPs are then "
                                                            "error nodes; default: every layer with SAEs)")
    p.add_argument("--serve", action="store_true", help="serve OUT/graphs in circuit-tracer's viewer on 127.0.0.1 "
                                                         "(after building any prompts given)")
    p.add_argument("--port", type=whole_number("--port", 0, 65535), default=8032,
                   help="port of --serve, 0 for any free one (default: %(default)s)")
    add_job(p, GraphJob)
    p.set_defaults(func=cmd_graph)

    p = sub.add_parser("demo", help="run every stage on the built-in corpus",
                       description="Corpus, tokenizer, LM, SAEs, circuits, features, verdicts, report and explorer "
                                   "under OUT (default results/demo/); finished stages are kept. Ends with each "
                                   "layer's best circuit candidates, pairs and group gates, and their verdicts.")
    _common(p, ray=True)
    p.add_argument("--small", action="store_true", help="a minutes-long miniature (for tests)")
    p.add_argument("--seed", type=int, default=None, help="one seed for every stage (default: the config's)")
    p.add_argument("--config", type=Path, default=None, help="a demo_config.json to run with")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pipelines.runtime import collect_cycles_rarely

    collect_cycles_rarely()
    _offline()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit:  # argparse has printed its usage message
        return int(exit.code or 0)
    from pipelines.runtime import reuse_freed_memory

    reuse_freed_memory()
    from pipelines.engine.cluster import disconnect

    try:
        return _run(args)
    finally:
        disconnect()


def _run(args: argparse.Namespace) -> int:
    """The command `args` names, its known errors as one line (a traceback with --debug)."""
    from pipelines.engine.cluster import TaskFailed
    from pipelines.engine.lock import RunBusyError, run_lock

    try:
        if args.command == "convert":
            args.func(args)
        else:
            with run_lock(args.out, args.command, create=getattr(args, "creates_run", True)):
                after = args.func(args)
            if after is not None:  # what a command does once the run is free again
                after()
    except KeyboardInterrupt:
        _close_bars()
        print("interrupted: finished work and the last checkpoint are kept; run the same command again to "
              "continue", file=sys.stderr)
        return 130
    except (FileNotFoundError, ValueError, PermissionError, RunBusyError, NotADirectoryError, FileExistsError,
            TaskFailed) as err:
        if args.debug:
            raise
        _close_bars()
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if args.debug:
            raise
        _close_bars()
        print(f"error: {err.strerror or err} ({err.filename or ''})", file=sys.stderr)
        return 2
    return 0


def _close_bars() -> None:
    """End the progress bars of the work an error cut short, so that the error's line is a
    line of its own (an open bar would have it glued on, and print again after it)."""
    from tqdm.std import tqdm

    for bar in list(tqdm._instances):
        bar.close()
