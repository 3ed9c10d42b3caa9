"""One command at a time per run directory.

Two commands writing one run would race (one deleting what the other reads, the last
writer winning), so every command takes an exclusive `flock` on `<run>/.lock` for as long
as it runs, and writes its pid and stage there so that a second command can say who holds
it. The operating system drops the lock when the holder exits, however it exits, so a
killed command never leaves the run locked. Taking the lock again in the same process (the
demo runs every stage) is free. A run directory the lock had to create is removed again when
the command leaves nothing else in it (it failed on its inputs), so a mistyped --out leaves
no folder behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.engine.paths import RunPaths

_held: dict[Path, int] = {}


class RunBusyError(RuntimeError):
    """Another process holds the run directory's lock."""


@contextmanager
def run_lock(root: str | Path, stage: str, create: bool = True) -> Iterator[None]:
    """Hold the lock of run directory `root` while `stage` runs; RunBusyError if taken.
    A missing `root` is created, or with `create=False` (a stage that only reads a run)
    refused."""
    root = Path(root).resolve()
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"--out {root} is a file, not a run folder: name a folder (new or a run's)")
    if not create and not root.is_dir():
        raise FileNotFoundError(f"no run directory {root}: check --out")
    if root in _held:
        _held[root] += 1
        try:
            yield
        finally:
            _held[root] -= 1
        return
    created = None  # the outermost folder this lock creates, if any
    if not root.exists():
        created = root
        while not created.parent.exists():
            created = created.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        handle = open(RunPaths(root).lock, "a+")
    except PermissionError as err:
        raise PermissionError(f"cannot write to the run directory {root}: {err.strerror}") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _holder(handle.read())
            raise RunBusyError(
                f"run directory {root} is in use by {holder}; wait for it to finish or use another --out"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "stage": stage, "since": time.strftime("%H:%M:%S")}))
        handle.flush()
        _held[root] = 1
        try:
            yield
        finally:
            del _held[root]
            handle.truncate(0)  # no stale holder left to read
            if created is not None:
                _remove_bare(RunPaths(root).lock, created)
            fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        handle.close()


def _remove_bare(lock: Path, top: Path) -> None:
    """Remove the run directory of `lock`, and its parents up to `top`, if the lock file is
    all they hold."""
    if list(lock.parent.iterdir()) != [lock]:
        return
    lock.unlink()
    folder = lock.parent
    while True:
        try:
            folder.rmdir()
        except OSError:  # something else was written there meanwhile
            return
        if folder == top:
            return
        folder = folder.parent


def _holder(text: str) -> str:
    try:
        info = json.loads(text)
        return f"`{info['stage']}` (process {info['pid']}, since {info['since']})"
    except (json.JSONDecodeError, KeyError, TypeError):
        return "another process"
