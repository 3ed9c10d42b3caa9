"""A stage's tasks on a Ray cluster (`--ray [ADDRESS]`): the one place that imports Ray.

Each task runs `work(inputs, unit)` in a Ray worker that reopens the run's inputs (model,
token store) from their folders, so every worker must see the run directory at the same
path: it must lie on storage every worker shares. The driver leaves a marker file in the
run directory before it submits anything, and a worker that cannot see it refuses the task
with a message saying so. The driver holds the run's lock for the whole command; its
workers write under the run without taking the lock (they are the lock holder's hands), and
every other command is refused as usual.

A task whose worker dies (killed, out of memory, a node lost) is retried by Ray up to
`RETRIES` times; a task that raises stops the command at once with the task's name, host and
error (an error of the inputs or settings would only repeat), and the tasks still running
are cancelled. Whatever finished before is kept: every task writes its outputs atomically
with their stamps, so running the command again does only what is left. The driver shows
one progress bar: tasks done and tokens per second, from the tokens the tasks report as
they go.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
import uuid
from pathlib import Path

from tqdm.auto import tqdm

LOCAL = "local"  # `--ray` without an address: a Ray runtime of this machine's own
RETRIES = 2  # times Ray reruns a task whose worker died
CONNECT_TIMEOUT_S = 10.0  # for a cluster's address to answer
MARKER = ".ray-driver-{}"  # in the run directory: a worker that cannot see it cannot see the run


class RayUnavailableError(ValueError):
    """`--ray` was given but Ray is not installed."""


class TaskFailed(RuntimeError):
    """A task failed on a worker: which task, on which host, and why."""

    def __init__(self, stage: str, task: str, host: str, error: str):
        super().__init__(stage, task, host, error)
        self.stage, self.task, self.host, self.error = stage, task, host, error

    def __str__(self) -> str:
        return f"{self.stage}: task '{self.task}' failed on worker {self.host}: {self.error}"


def import_ray():
    """Ray, or a RayUnavailableError that says how to install it."""
    try:
        import ray
    except ImportError:
        raise RayUnavailableError("--ray needs Ray, which is not installed: pip install 'bilinear-circuits[ray]' "
                                  "(or pip install 'ray>=2.9'), or leave out --ray to run here") from None
    return ray


def check_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A ValueError unless something answers at a `host:port` (or `ray://host:port`) Ray
    address within `timeout_s`: Ray itself would retry an address where nothing listens for
    ever. Other forms (`local`, `auto`) are left to Ray."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ValueError(f"--ray {address}: no Ray cluster answers there within {timeout_s:g} s "
                         f"({err.strerror or err}); start one with `ray start --head` or check the address") from None


def connect(runtime) -> object:
    """Ray, connected: to the cluster at `runtime.ray`, or a local runtime of `workers` tasks.
    A task asks for `threads` CPUs: refused here when no node of the cluster has that many."""
    ray = import_ray()
    if not ray.is_initialized():
        if runtime.ray != LOCAL:
            check_address(runtime.ray)
        env = {"env_vars": {"TQDM_DISABLE": "1"}}  # the driver's bar is the one display
        if runtime.ray == LOCAL:
            # "local": a runtime of its own, never a cluster that `ray start` left running here
            ray.init(address="local", num_cpus=runtime.workers * runtime.threads, include_dashboard=False,
                     log_to_driver=False, runtime_env=env, configure_logging=False)
        else:
            ray.init(address=runtime.ray, log_to_driver=False, runtime_env=env, configure_logging=False)
    largest = max((node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive")), default=0)
    if runtime.threads > largest:
        raise ValueError(f"--threads {runtime.threads}: no node of the Ray cluster has that many CPUs (at most "
                         f"{largest:g}); each task asks for --threads CPUs")
    return ray


def disconnect() -> None:
    """Leave the Ray cluster this process joined, if any (a local runtime stops with it), so
    that a command leaves nothing behind in a process that goes on, such as a test session
    or a notebook."""
    ray = sys.modules.get("ray")  # never imports Ray: a command without --ray did not load it
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def run_on_ray(runtime, work, inputs, tasks: list, stage: str) -> list:
    """`[work(inputs, task.unit) for task in tasks]` as Ray tasks, `runtime.workers` at a time."""
    ray = connect(runtime)
    folders = inputs.folders()
    for stale in Path(folders["run"]).glob(MARKER.format("*")):  # of a killed driver: this one holds the lock
        stale.unlink(missing_ok=True)
    marker = Path(folders["run"]) / MARKER.format(uuid.uuid4().hex[:12])
    started = time.perf_counter()
    bar = tqdm(total=len(tasks), desc=f"{stage} on Ray ({runtime.workers} workers)", unit="task")
    results: dict[int, object] = {}
    pending: dict = {}
    progress = None
    try:
        marker.write_text(f"{socket.gethostname()} {os.getpid()}\n", encoding="utf-8")
        progress = ray.remote(_Progress).options(num_cpus=0).remote()
        remote = ray.remote(_run_task)
        queue = list(enumerate(tasks))
        while queue or pending:
            while queue and len(pending) < runtime.workers:
                index, task = queue.pop(0)
                options = dict(num_cpus=runtime.threads, max_retries=RETRIES, retry_exceptions=False)
                if task.gpus:
                    options["num_gpus"] = task.gpus
                ref = remote.options(**options).remote(work, folders, str(marker), runtime.device, runtime.threads,
                                                       task, stage, progress)
                pending[ref] = index
            done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            tokens = ray.get(progress.total.remote())
            bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - started, 1e-9):,.0f}")
            for ref in done:
                index = pending.pop(ref)
                results[index] = _result(ray, ref, tasks[index], stage)
                bar.update(1)
    finally:
        bar.close()
        for ref in pending:  # a failure or Ctrl-C: nothing may go on writing once the lock is released
            ray.cancel(ref, force=True)
        if progress is not None:
            ray.kill(progress)
        marker.unlink(missing_ok=True)
    return [results[i] for i in range(len(tasks))]


def _result(ray, ref, task, stage: str):
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as error:
        cause = error.as_instanceof_cause()
        if isinstance(cause, TaskFailed):
            raise TaskFailed(cause.stage, cause.task, cause.host, cause.error) from None
        raise TaskFailed(stage, task.name, "?", str(error).splitlines()[-1]) from None
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as error:
        raise TaskFailed(stage, task.name, "?", f"its worker died {RETRIES + 1} times ({type(error).__name__})") from None


class _Progress:
    """Tokens processed by every task so far (a Ray actor the tasks report to)."""

    def __init__(self):
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def total(self) -> int:
        return self.tokens


def _run_task(work, folders: dict, marker: str, device: str, threads: int, task, stage: str, progress):
    """One task on a worker: check the run is visible here, reopen the inputs, do the work."""
    from pipelines.inputs import StageInputs
    from pipelines.runtime import Runtime

    host = f"{socket.gethostname()} (pid {os.getpid()})"
    try:
        if not Path(marker).is_file():
            raise FileNotFoundError(
                f"the run directory {folders['run']} is not visible here as it is to the driver: with --ray the run "
                "directory must be on storage every worker shares, at the same path")
        # a task with a GPU sees only that one, as cuda:0
        device = "cuda" if device.startswith("cuda") else device
        inputs = StageInputs.reopen(folders, device, report=lambda n: progress.add.remote(n))
        with Runtime(threads=threads, device=device).torch_threads():
            return work(inputs, task.unit)
    except Exception as error:  # noqa: BLE001 - every error goes back named with its task and host
        last = traceback.format_exception_only(type(error), error)[-1].strip()
        raise TaskFailed(stage, task.name, host, last) from error
