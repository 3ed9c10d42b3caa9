"""The `corpus` stage: the built-in story corpus of the run (`pipelines.data.stories`)."""

from __future__ import annotations

from pathlib import Path

from pipelines.data.story_corpus import write_story_corpus
from pipelines.data.stories import StoryConfig
from pipelines.engine import stamps
from pipelines.engine.paths import RunPaths, stamp_of
from pipelines.engine.stamps import Stamp
from pipelines.inputs import trained_corpus
from pipelines.stages.lm import ModelReplacementError


def ensure_corpus(run: RunPaths, cfg: StoryConfig, force: bool = False) -> Path:
    """The built-in story corpus of the run, generated unless it exists for `cfg`. A corpus
    the run's model was trained on is replaced only with `force`: every later stage reads it."""
    stamp = Stamp("corpus", {}, cfg.recipe())
    if stamps.is_current(stamp_of(run.corpus), stamp):
        return run.corpus
    trained = trained_corpus(run.lm) if run.model.stamp.is_file() else None
    if not force and trained is not None and Path(trained[0]).resolve() == run.corpus.resolve():
        changed = stamps.changes(stamp_of(run.corpus), stamp) or ["it was not written by this run"]
        raise ModelReplacementError(
            f"{run.corpus} is the corpus the model in {run.lm} was trained on ({', '.join(changed)} would change); "
            "every later stage depends on it, so it is not replaced silently: pass --force to replace it, or use "
            "another --out")
    write_story_corpus(cfg, run.corpus)
    stamps.finish(stamp_of(run.corpus), stamp)
    return run.corpus
