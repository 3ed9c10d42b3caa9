"""What the command line and the Python API (`bilinear_circuits`) both call to run a stage on
a run directory: the corpus a model was trained on, the stages' inputs, and a table stage for
the chosen layers. The CLI fills the job configs from its flags; a library caller passes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module to build its parser: torch waits for a command
    from pipelines.data.corpus import CorpusConfig
    from pipelines.engine.paths import RunPaths
    from pipelines.inputs import LayerPlan, ModelInputs, StageInputs
    from pipelines.runtime import Runtime

TABLE_STAGES = ("circuits", "features", "verdicts")  # modules of pipelines.stages, one command each, in this order


def corpus_source(run: RunPaths, model_dir: Path, source: str | None = None) -> tuple[str, CorpusConfig | None]:
    """The corpus to read and the reading settings it was recorded with (None: none known, the
    defaults apply): `source` when given, else the corpus the model was trained on, else the
    run's built-in corpus with its lexicon."""
    from pipelines.inputs import trained_corpus

    recorded = trained_corpus(model_dir)
    if source is not None:
        same = recorded is not None and Path(recorded[0]).resolve() == Path(source).resolve()
        return str(source), recorded[1] if same else None
    if recorded is not None:
        return recorded
    if run.corpus.is_dir():
        return str(run.corpus), builtin_corpus_config(run.corpus)
    raise FileNotFoundError(f"no corpus known for the model {model_dir}: pass a corpus")


def builtin_corpus_config(folder: Path) -> CorpusConfig:
    """The reading settings of the built-in story corpus in `folder`: the defaults with the
    lexicon it ships."""
    from pipelines.data.corpus import CorpusConfig
    from pipelines.data.story_corpus import story_lexicon

    return story_lexicon(folder, CorpusConfig())


def stage_inputs(run: RunPaths, inputs: ModelInputs, source: str, corpus: CorpusConfig) -> StageInputs:
    """The analysis stages' inputs: the run, the model, and the corpus's token store (built
    once for this tokenizer and context, then reused)."""
    from pipelines.inputs import StageInputs
    from pipelines.stages import ensure_tokens

    store = ensure_tokens(run, source, inputs.tokenizer, inputs.config.n_ctx, corpus)
    return StageInputs(run, inputs, store)


def check_layers(layers: list[int] | None, n_layers: int, name: str = "layers") -> list[int]:
    """`layers` (None: every layer), sorted, each checked to exist."""
    if layers is None:
        return list(range(n_layers))
    chosen = sorted({int(layer) for layer in layers})
    bad = [layer for layer in chosen if not 0 <= layer < n_layers]
    if bad:
        raise ValueError(f"{name} {bad} do not exist: the model has {n_layers} (0..{n_layers - 1})")
    return chosen


def stage_plan(stage: str, job, run: RunPaths, inputs: ModelInputs, layers: list[int]) -> dict[int, LayerPlan]:
    """The per-layer plan of table stage `stage` (one of `TABLE_STAGES`) with its job config on
    `layers` (`SAEChoice.plan`): the usage errors of the stage, its job and the SAEs, made once
    before any work and handed to `table_stage`."""
    import importlib

    if stage not in TABLE_STAGES:
        raise ValueError(f"stage must be one of {', '.join(TABLE_STAGES)}, not {stage!r}")
    module = importlib.import_module(f"pipelines.stages.{stage}")
    if not isinstance(job, module.COMMAND.job):
        raise ValueError(f"the {stage} stage takes a {module.COMMAND.job.__name__}, not a {type(job).__name__}")
    return job.plan(run, inputs, layers)


def table_stage(stage: str, work: StageInputs, job, plan: dict[int, LayerPlan], runtime: Runtime):
    """Run table stage `stage` with its job config on the layers of `plan` (`stage_plan`):
    what the stage's `result` gives."""
    import importlib

    from pipelines.stages import ensure

    module = importlib.import_module(f"pipelines.stages.{stage}")
    return ensure(module.STAGE, work, job, plan, runtime)
