"""The `corpus` stage: the built-in story corpus of the run (`pipelines.data.stories`)."""

from __future__ import annotations

from pathlib import Path

from pipelines.data.corpus import write_story_corpus
from pipelines.data.stories import StoryConfig
from pipelines.engine import stamps
from pipelines.engine.paths import RunPaths, stamp_of
from pipelines.engine.stamps import Stamp


def ensure_corpus(run: RunPaths, cfg: StoryConfig) -> Path:
    """The built-in story corpus of the run, generated unless it exists for `cfg`."""
    stamp = Stamp("corpus", {}, cfg.recipe())
    if stamps.is_current(stamp_of(run.corpus), stamp):
        return run.corpus
    write_story_corpus(cfg, run.corpus)
    stamps.finish(stamp_of(run.corpus), stamp)
    return run.corpus
