"""What the stages share: the table-stage interface, its one generic `ensure`, and the
digests several stages stamp.

A table stage's outputs are parts: the tables of one layer under one part name
(`tables/<table>/layer<l>/<part>.parquet`), each part stamped under `tables/.stamps/`
(`pipelines.engine.paths`). A stage says three things:

- `parts`: per part, what it is computed from (`Part.stamp`: its inputs' digests and the
  job's recipe) and which tables it writes (`Part.tables`);
- `tasks`: how the parts still to compute are grouped into tasks (by default one per layer);
- `work`: the tables of a task's parts, part by part.

`ensure` keeps every part whose stamp matches and whose tables exist, runs the tasks of the
others here or on Ray (`pipelines.engine.tasks`), writes each part's tables with its stamp
as their provenance and only then the stamp, so a stamp that exists always describes
complete tables. A stage's `result` is what its command and the demo use afterwards.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from pipelines import schemas
from pipelines.data.tokens import TokenRows, TokenStore
from pipelines.engine import stamps
from pipelines.engine.files import digest, text_digest
from pipelines.engine.paths import RunPaths
from pipelines.engine.stamps import Stamp
from pipelines.engine.tables import has_table
from pipelines.engine.tasks import Task, run_tasks
from pipelines.inputs import LayerPlan, StageInputs
from pipelines.runtime import Runtime

# written into the stamps of the stages: outputs of an older format are recomputed (4: every
# SAE seeded by its point, not its place in the list; gate ablations by the verdicts stage)
TABLE_FORMAT = 4

Plan = dict[int, LayerPlan]  # the command's per-layer plans, by layer


@dataclass(frozen=True)
class Part:
    """One part of a table stage's outputs: the tables of one layer under one name."""

    layer: int
    name: str  # the tables' file name in the layer's folders: `resid_mid-sae`, `mlp_out`
    stamp: Stamp  # what the part is computed from
    tables: tuple[str, ...]  # the tables that must exist for the part to be reused
    detail: Any = None  # what the stage's work needs of it (picklable): an output spec, a site

    def marker(self, run: RunPaths, stage: str) -> Path:
        return run.table_stamp(stage, self.layer, self.name)

    def is_current(self, run: RunPaths, stage: str) -> bool:
        return (stamps.is_current(self.marker(run, stage), self.stamp)
                and all(has_table(run.tables, name, self.layer, self.name) for name in self.tables))


class TableStage:
    """A stage whose outputs are table parts (see the module docstring)."""

    name: str  # the stage's stamps and progress name it: "circuits"
    rows_flag: str | None = None  # the option of the held-out rows the stage reads (`rows`), if it reads some

    def rows(self, job) -> int:
        """The held-out rows `job` asks the stage to read (at most: the split may hold fewer)."""
        raise NotImplementedError

    def parts(self, work: StageInputs, job, plan: Plan) -> list[Part]:
        raise NotImplementedError

    def tasks(self, parts: list[Part], plan: Plan, runtime: Runtime) -> list[Task]:
        """One task per layer (its unit: the layer's plan and parts)."""
        layers = sorted({part.layer for part in parts})
        return [Task(f"layer {layer}", (plan[layer], [p for p in parts if p.layer == layer]), gpus(runtime))
                for layer in layers]

    def work(self, work: StageInputs, job, unit, threads: int) -> Iterator[tuple[Part, dict[str, pd.DataFrame]]]:
        """Each part of a task's `unit` with its tables, computed on `threads` threads."""
        raise NotImplementedError

    def result(self, work: StageInputs, job, plan: Plan, computed: list[Part]):
        """What `ensure` returns: by default the parts computed now."""
        return computed


def ensure(stage: TableStage, work: StageInputs, job, plan: Plan, runtime: Runtime):
    """The tables of `stage` for every planned layer, computing the parts not current."""
    stale = [part for part in stage.parts(work, job, plan) if not part.is_current(work.run, stage.name)]
    if stale and stage.rows_flag is not None:
        note = fewer_rows(stage.name, stage.rows_flag, stage.rows(job), len(work.store.held_out),
                          work.store.held_out.n_ctx)
        if note:
            print(note, file=sys.stderr)
    planned = stage.tasks(stale, plan, runtime)
    threads = runtime.threads // runtime.tasks_at_once(len(planned))  # each task's share
    tasks = [Task(task.name, (stage, job, task.unit, threads), task.gpus) for task in planned]
    try:
        run_tasks(runtime, _run_task, work, tasks, stage.name)
    finally:
        work.forget_streams()
    return stage.result(work, job, plan, stale)


def _run_task(work: StageInputs, unit: tuple) -> None:
    stage, job, task_unit, threads = unit
    for part, frames in stage.work(work, job, task_unit, threads):
        marker = part.marker(work.run, stage.name)
        stamps.begin(marker)
        for name, frame in frames.items():
            schemas.write(frame, work.run.tables, name, part.layer, part=part.name, provenance=part.stamp.to_json())
        stamps.finish(marker, part.stamp)


def fewer_rows(stage: str, flag: str, asked: int, held_out: int, n_ctx: int) -> str | None:
    """What to say when the held-out split has fewer rows than a stage is asked to read (it
    reads them all, and would otherwise say nothing), or None."""
    if asked <= held_out:
        return None
    return (f"{stage}: the held-out split has {held_out} rows of {n_ctx} tokens, fewer than the {asked} that {flag} "
            f"asks for; all {held_out} are read. For more, train the model with a larger --held-out (the share of "
            "documents it never trains on) or on a larger corpus")


def gpus(runtime: Runtime) -> float:
    """What a task asks a Ray cluster for: a GPU each when the work runs on CUDA."""
    return 1.0 if runtime.device.startswith("cuda") else 0.0


def tokens_digest(rows: TokenRows) -> str:
    """Digest of the token ids of a split (what an LM or SAE trained on)."""
    return digest(rows.tokens.filename)


def held_out_digest(store: TokenStore) -> str:
    """Digest of the held-out tokens and their labels (what descriptions are computed from)."""
    files = sorted(store.folder.glob("held_out.*.bin"))
    return text_digest([digest(f) for f in files], store.classes, store.lexicon_tokens)


@dataclass(frozen=True)
class Command:
    """How the command line offers a table stage (`pipelines.cli` adds one command per stage)."""

    name: str
    job: type  # the stage's job config (`pipelines.jobs`): its fields are the command's flags
    help: str  # one line in the command list
    description: str  # the command's --help
    show: Callable[[argparse.Namespace, RunPaths, Plan, Any], None]  # prints what the stage's `result` holds
    rename: dict[str, str] = field(default_factory=dict)  # fields whose flag is named otherwise
    options: Callable[[argparse.ArgumentParser], None] | None = None  # flags of the command's own
