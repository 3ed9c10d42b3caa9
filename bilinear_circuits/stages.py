"""Each stage of a run, called from Python with its config dataclass as the command line calls
it: the same functions, the same reuse of finished outputs, the run folder locked meanwhile."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


def _runtime(runtime):
    from pipelines.runtime import Runtime

    return (runtime or Runtime()).resolved(announce=False)


@contextmanager
def _locked(folder: str | Path, command: str):
    from pipelines.engine.lock import run_lock

    with run_lock(Path(folder), command, create=True):
        yield


def make_corpus(folder: str | Path, config=None, force: bool = False) -> Path:
    """Write the built-in story corpus (`StoryConfig`) into `folder/corpus/`, as `corpus`
    does; returns its path."""
    from pipelines.data.stories import StoryConfig
    from pipelines.engine.paths import RunPaths
    from pipelines.stages import ensure_corpus

    with _locked(folder, "corpus"):
        return ensure_corpus(RunPaths(folder), config or StoryConfig(), force=force)


def train_lm(folder: str | Path, job=None, corpus: str | None = None, runtime=None, force: bool = False) -> dict:
    """Train the tokenizer and the bilinear LM (`LMJob`) into `folder/lm/`, as `train-lm` does,
    on `corpus` (a file, a datasets folder or `hf:NAME`; default: the built-in stories, written
    first if absent). Returns the training's outcome (losses, tokens, time)."""
    from pipelines.data.stories import StoryConfig
    from pipelines.data.story_corpus import story_lexicon
    from pipelines.engine.paths import RunPaths
    from pipelines.jobs import LMJob
    from pipelines.stages import ensure_corpus, ensure_lm

    run, job = RunPaths(folder), job or LMJob()
    with _locked(folder, "train-lm"):
        if corpus is None:
            corpus = str(ensure_corpus(run, StoryConfig()) if not run.corpus.is_dir() else run.corpus)
            job = job.replace(corpus=story_lexicon(run.corpus, job.corpus))
        return ensure_lm(run, source=corpus, job=job, runtime=_runtime(runtime), force=force)


def _work(folder: str | Path, model: str | Path | None, corpus: str | None, corpus_config, runtime):
    from pipelines.calls import corpus_source, stage_inputs
    from pipelines.data.corpus import CorpusConfig
    from pipelines.engine.paths import RunPaths
    from pipelines.inputs import ModelInputs

    run = RunPaths(folder)
    model_dir = Path(model) if model is not None else run.lm
    inputs = ModelInputs(model_dir, runtime.device)
    source, recorded = corpus_source(run, model_dir, corpus)
    return stage_inputs(run, inputs, source, corpus_config or recorded or CorpusConfig())


def train_saes(folder: str | Path, job=None, layers: list[int] | None = None, *, model: str | Path | None = None,
               corpus: str | None = None, corpus_config=None, runtime=None):
    """Train TopK SAEs (`SAEJob`) on `layers` (default every layer) into `folder/saes/`, as
    `train-saes` does; returns the `sae_metrics` table. `model`: a model folder (default
    `folder/lm`); `corpus`, `corpus_config`: what to read (default the model's training corpus)."""
    from pipelines.calls import check_layers
    from pipelines.jobs import SAEJob
    from pipelines.stages import ensure_saes

    runtime = _runtime(runtime)
    with _locked(folder, "train-saes"):
        work = _work(folder, model, corpus, corpus_config, runtime)
        chosen = check_layers(layers, work.lm.config.n_layers)
        return ensure_saes(work, job=job or SAEJob(), layers=chosen, runtime=runtime)


def run_stage(stage: str, folder: str | Path, job=None, layers: list[int] | None = None, *,
              model: str | Path | None = None, corpus: str | None = None, corpus_config=None, runtime=None):
    """Run table stage `stage` (`circuits`, `features` or `verdicts`) on `layers` (default every
    layer) of the run in `folder`, with its job config (`CircuitsJob`, `FeaturesJob`,
    `VerdictsJob`; default its defaults), as the command of that name does: parts already
    computed from the same inputs are kept. Returns what the stage reports (the parts computed
    now, or the verdicts' candidates)."""
    import importlib

    from pipelines.calls import TABLE_STAGES, check_layers, stage_plan, table_stage

    if stage not in TABLE_STAGES:
        raise ValueError(f"stage must be one of {', '.join(TABLE_STAGES)}, not {stage!r}")
    job = job or importlib.import_module(f"pipelines.stages.{stage}").COMMAND.job()
    runtime = _runtime(runtime)
    with _locked(folder, stage):
        work = _work(folder, model, corpus, corpus_config, runtime)
        plan = stage_plan(stage, job, work.run, work.lm, check_layers(layers, work.lm.config.n_layers))
        return table_stage(stage, work, job, plan, runtime)


def run_demo(folder: str | Path, config=None, runtime=None) -> None:
    """Every stage on the built-in corpus (`DemoConfig`; `DemoConfig.small()` for a minutes-long
    miniature), as `demo` does: finished stages are kept."""
    from pipelines.demo import DemoConfig, run_demo as demo
    from pipelines.engine.paths import RunPaths

    with _locked(folder, "demo"):
        demo(RunPaths(folder), config or DemoConfig(), _runtime(runtime))


def report(folder: str | Path, config=None, layers: list[int] | None = None, sites=None, runtime=None) -> Path:
    """Write the run's one-page HTML report (`ReportConfig`) for `layers` (default every layer),
    reading the SAEs `sites` names (a `SiteChoice`; default the run's own at `resid_mid`), as
    `report` does; returns the page's path."""
    from pipelines.calls import check_layers
    from pipelines.engine.paths import RunPaths
    from pipelines.inputs import ModelInputs
    from pipelines.jobs import SiteChoice
    from pipelines.report.config import ReportConfig
    from pipelines.report.page import write_report

    run, runtime = RunPaths(folder), _runtime(runtime)
    with _locked(folder, "report"):
        inputs = ModelInputs(run.lm, runtime.device)
        plan = (sites or SiteChoice()).plan(run, inputs, check_layers(layers, inputs.config.n_layers))
        with runtime.torch_threads():
            return write_report(run, config or ReportConfig(), inputs, plan, processes=runtime.threads)


def explore(folder: str | Path) -> Path:
    """Write the run's interactive explorer (a static site), as `explore` does; returns its
    index.html."""
    from pipelines.engine.paths import RunPaths
    from pipelines.explorer.site import write_explorer

    with _locked(folder, "explore"):
        return write_explorer(RunPaths(folder))


def convert(source: str | Path, out: str | Path, tokenizer: str | Path | None = None, force: bool = False,
            attention_scale: str = "config"):
    """Convert a checkpoint in the paper authors' layout into ours (config.json,
    model.safetensors, tokenizer.json in `out`), as `convert` does; returns its `ModelConfig`."""
    from pipelines.lm.convert import convert_checkpoint

    return convert_checkpoint(source, out, tokenizer=tokenizer, force=force, scale_attn=attention_scale)
