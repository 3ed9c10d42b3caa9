"""How a command's work runs, as one explicit object the stages receive: torch threads, the
device, and whether and where work fans out over Ray. None of it changes what is computed
(beyond the last bits of float sums, see `threads`)."""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from circuits.config import Config, option


@dataclass(frozen=True)
class Runtime(Config):
    """Where and how the work of a command runs."""

    threads: int = option(0, "torch CPU threads (per worker with --ray); 0 = the cores not busy with other work when "
                             "the command starts (with --ray: shared among the workers)", low=0, runtime=True)
    device: str = option("auto", "auto (CUDA when present), cpu, cuda or cuda:N", runtime=True)
    ray: str | None = option(None, "run the stage's tasks on Ray: 'local' starts a Ray runtime here, an address "
                                   "(or RAY_ADDRESS) joins that cluster", runtime=True)
    workers: int = option(2, "with --ray: tasks run at once (SAE groups; layers of circuits, features, verdicts)",
                          low=1, runtime=True)

    def check(self) -> None:
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, not {self.device!r}")

    def resolved(self, announce: bool = True) -> "Runtime":
        """This runtime with its thread count and device decided (said on stderr when automatic)."""
        threads = self.threads
        if not threads:
            # on Ray each worker gets its share of the cores that are free here
            share = self.workers if self.ray else 1
            cores = os.cpu_count() or 1
            threads = max(1, auto_threads() // share)
            if announce and threads < max(1, cores // share):
                # the thread count changes torch's CPU sums in the last bits: a rerun on an idle machine may differ
                print(f"{threads} torch thread(s) of {cores} cores: the others are busy now (it changes float sums in "
                      "their last bits; --threads N to fix)", file=sys.stderr)
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is available here")
        return self.replace(threads=threads, device=device)

    @contextmanager
    def torch_threads(self, at_once: int = 1) -> Iterator[None]:
        """Run the block with torch's intra-op thread count set to `threads` (restored after),
        or to one while `at_once` > 1 tasks run at once (`tasks_at_once`)."""
        with intra_op_threads(1 if at_once > 1 else self.threads or None):
            yield

    def tasks_at_once(self, n_tasks: int) -> int:
        """How many of a stage's `n_tasks` tasks run at once in this process: on a CPU, one
        per thread, each on its share of the threads; on Ray or a GPU, one.

        A layer's analysis is many mid-sized operations (gathers, top-k, products of a few
        thousand rows), whose threads wait on each other at every one: two layers side by
        side, each on one thread, beat one layer on two (torch's operations release the GIL;
        `benchmarks/bench_threads.py` measures it). Two layers at once hold two layers'
        working memory.

        While tasks run at once torch has one intra-op thread (its count is global: a task
        that changed it would change it under the others, and with it their sums' last
        bits); a task gets `threads // at_once` threads of its own to run Python-level
        workers on (the circuits stage's output chunks), each on that one intra-op thread."""
        if self.ray is not None or not self.device.startswith("cpu") or self.threads < 2:
            return 1
        return max(1, min(self.threads, n_tasks))


def reuse_freed_memory() -> bool:
    """Have glibc's allocator keep freed memory for the process's next allocations rather than
    hand it back to the system; True where it applied (glibc; elsewhere nothing changes).

    By default glibc adapts the size above which it maps fresh pages (up to 32 MB) and returns
    free memory at the top of a heap beyond twice that size. The stages allocate and free
    tensors of a few to 30 MB at every step, so the same memory was faulted in again and
    again, a large share of SAE training's system time; a fixed 32 MB threshold and no
    trimming keep it mapped (the same as `MALLOC_MMAP_THRESHOLD_`/`MALLOC_TRIM_THRESHOLD_`, which must be set before Python
    starts). The peak memory stays the same; what a stage frees is kept for the next."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return bool(mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def collect_cycles_rarely() -> None:
    """Have Python's cycle collector run a seventieth as often, and not at all at exit.

    TransformerLens, sae-lens and pandas leave millions of long-lived objects, and every full
    collection walks all of them, although the stages' cyclic garbage is small: with Python's
    default thresholds (700, 10, 10) those walks are a noticeable part of importing sae-lens
    and of the verdicts stage. At exit the interpreter collects once more, walking everything
    to free memory the system reclaims anyway, which every command that loads an SAE would
    wait for; frozen objects are exempt (they are still freed by reference counting, and
    exit handlers run as before)."""
    gc.set_threshold(50_000, 20, 10)
    atexit.unregister(gc.freeze)  # once, however often a process calls it
    atexit.register(gc.freeze)


def auto_threads(sample_s: float = 0.3) -> int:
    """Cores not busy with other work now: the core count minus the cores the other
    processes kept busy over a short sample of /proc/stat (the load average lags by a
    minute: a finished job would still count). Elsewhere, the load average.

    Two threads beat one on an idle 2-core machine, but one beats two beside a busy
    process, since every thread waits on the slowest at each operation
    (`benchmarks/bench_threads.py`).
    """
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


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the block with torch's intra-op thread count set to `n` (None: leave it)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def one_thread_workers(n: int) -> Iterator[ThreadPoolExecutor | None]:
    """`n` threads that run torch work side by side, each operation on one intra-op thread
    (None when `n` < 2: the caller's thread does the work).

    Each worker sets its own count as it starts. A worker's `set_num_threads` also changes
    torch's default for threads that have not read theirs yet, so the caller's count is read
    before the pool starts (the caller keeps it: a model pass there can use every core while
    the workers wait) and torch's default restored after. Small operations on two intra-op
    threads wait on each other at every one; two threads with work of their own do not
    (`Runtime.tasks_at_once`)."""
    if n < 2:
        yield None
        return
    with intra_op_threads(torch.get_num_threads()), ThreadPoolExecutor(n, initializer=torch.set_num_threads,
                                                                       initargs=(1,)) as pool:
        yield pool
