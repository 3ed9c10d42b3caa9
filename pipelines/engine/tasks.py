"""Run a stage's tasks: here, one after another, or fanned out over a Ray cluster.

A stage splits its work into tasks (a layer, or a group of SAEs) that each read the run's
inputs and write their own outputs atomically, with their own stamps, under the run
directory. `run_tasks` calls `work(inputs, task)` for each: in this process with the inputs
already open (several at once on threads where the CPU has threads to spare), or, with
`Runtime.ray`, as Ray tasks that reopen the inputs from their folders (see
`pipelines.engine.cluster`). Either way a task that fails leaves nothing half-written,
so a rerun does exactly what is left.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm


@dataclass(frozen=True)
class Task:
    """One unit of a stage's work."""

    name: str  # how progress and errors name it: "layer 3", "SAEs layer0_resid_mid, layer1_resid_mid"
    unit: Any  # what `work` receives: a layer, a list of points (picklable)
    gpus: float = 0.0  # GPUs it asks a Ray cluster for


def run_tasks(runtime, work: Callable, inputs, tasks: list[Task], stage: str) -> list:
    """`[work(inputs, task.unit) for task in tasks]`, here or on Ray (`runtime.ray`). Here,
    `runtime.tasks_at_once` of them run at once on threads of this process, sharing `inputs`."""
    if not tasks:
        return []
    if runtime.ray is None:
        at_once = runtime.tasks_at_once(len(tasks))
        # one bar over the tasks, as on Ray: a stage whose work shows no bar of its own still shows progress
        with runtime.torch_threads(at_once), tqdm(total=len(tasks), desc=stage, unit="task") as bar:
            if at_once > 1:
                return _side_by_side(work, inputs, tasks, at_once, bar)
            results = []
            for task in tasks:
                bar.set_postfix_str(task.name)
                results.append(work(inputs, task.unit))
                bar.update(1)
            return results
    from pipelines.engine.cluster import run_on_ray

    return run_on_ray(runtime, work, inputs, tasks, stage)


def _side_by_side(work: Callable, inputs, tasks: list[Task], at_once: int, bar) -> list:
    """`run_tasks` here, `at_once` tasks at a time on threads. After a failure (or Ctrl-C) no
    task starts, and the running ones end, so their finished outputs are kept, before it is
    raised."""
    stop = threading.Event()

    def attempt(task: Task):
        if stop.is_set():  # a task before it failed: the stage ends with that error
            return None
        try:
            return work(inputs, task.unit)
        except BaseException:
            stop.set()
            raise

    with ThreadPoolExecutor(at_once) as pool:
        futures = {pool.submit(attempt, task): task for task in tasks}
        try:
            for future in as_completed(futures):
                future.result()
                bar.set_postfix_str(futures[future].name)
                bar.update(1)
        except BaseException as error:
            stop.set()
            if isinstance(error, KeyboardInterrupt):
                running = ", ".join(futures[f].name for f in futures if f.running())
                print(f"\nstopping once the running tasks end ({running}): their outputs are kept", file=sys.stderr)
            raise
        return [future.result() for future in futures]
