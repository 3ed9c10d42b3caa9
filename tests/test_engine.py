"""The run engine: atomic writes, content digests and their cache, stamps, the run lock, tables."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pipelines.engine.files as files
from pipelines.engine import stamps
from pipelines.engine.files import (atomic_dir, atomic_file, clean_temporaries, digest, read_json, remove,
                                    text_digest, write_json)
from pipelines.engine.lock import RunBusyError, run_lock
from pipelines.engine.paths import RunPaths
from pipelines.engine.stamps import Stamp
from pipelines.engine.tables import has_table, provenance, read_table, table_path, write_table
from tests.children import child_env

REPO = Path(__file__).resolve().parents[1]


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ------------------------------------------------------------------ atomic writes


def test_atomic_file_keeps_the_old_content_on_an_error(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_file(path) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".") and tmp.name.endswith(".tmp")
            tmp.write_text("half of the new")
            raise RuntimeError("killed")
    assert path.read_text() == "old" and names(tmp_path) == ["out.json"]
    with atomic_file(path) as tmp:
        tmp.write_text("new")
        assert path.read_text() == "old"  # replaced only at the end
    assert path.read_text() == "new" and names(tmp_path) == ["out.json"]
    with atomic_file(tmp_path / "sub" / "deep.txt") as tmp:  # parents are made
        tmp.write_text("x")
    assert (tmp_path / "sub" / "deep.txt").read_text() == "x"


def test_atomic_dir_keeps_the_old_folder_on_an_error(tmp_path):
    folder = tmp_path / "store"
    folder.mkdir()
    (folder / "a.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(folder) as tmp:
            assert list(tmp.iterdir()) == []
            (tmp / "b.txt").write_text("new")
            raise KeyboardInterrupt
    assert names(tmp_path) == ["store"] and names(folder) == ["a.txt"] and (folder / "a.txt").read_text() == "old"
    with atomic_dir(folder) as tmp:
        (tmp / "b.txt").write_text("new")
    assert names(tmp_path) == ["store"] and names(folder) == ["b.txt"]
    with atomic_dir(tmp_path / "fresh") as tmp:
        (tmp / "c.txt").write_text("c")
    assert names(tmp_path / "fresh") == ["c.txt"]


def test_clean_temporaries_removes_only_what_killed_writers_left(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".out.json.0123456789ab.tmp").write_text("half")
    (tmp_path / "sub" / ".table.parquet.abcdef012345.tmp").write_text("half")
    (tmp_path / ".store.abcdef012345.tmp").mkdir()
    (tmp_path / ".store.abcdef012345.tmp" / "rows.bin").write_bytes(b"x")
    keep = ["keep.tmp", ".lock", "out.json"]
    for name in keep:
        (tmp_path / name).write_text("keep")
    assert clean_temporaries(tmp_path) == 3
    assert names(tmp_path) == sorted(keep + ["sub"]) and names(tmp_path / "sub") == []


def test_remove_json_and_text_helpers(tmp_path):
    write_json(tmp_path / "a.json", {"b": [1, 2], "a": None})
    assert read_json(tmp_path / "a.json") == {"a": None, "b": [1, 2]}
    (tmp_path / "bad.json").write_text("{not json")
    assert read_json(tmp_path / "bad.json") is None and read_json(tmp_path / "none.json") is None
    (tmp_path / "d" / "e").mkdir(parents=True)
    remove(tmp_path / "d")
    remove(tmp_path / "a.json")
    remove(tmp_path / "never-was")
    assert names(tmp_path) == ["bad.json"]
    assert text_digest({"a": 1, "b": 2}) == text_digest({"b": 2, "a": 1}) != text_digest({"a": 1, "b": 3})


# ------------------------------------------------------------------ digests


@pytest.fixture
def hashing(monkeypatch, tmp_path):
    """A fresh digest cache under tmp_path, and a count of sha256 objects made by `files`."""
    monkeypatch.setenv("BILINEAR_CIRCUITS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(files, "_CACHE", files._DigestCache())  # as in a new process

    class Counting:
        calls = 0

        def sha256(self, *args):
            Counting.calls += 1
            return hashlib.sha256(*args)

    counting = Counting()
    monkeypatch.setattr(files, "hashlib", counting)
    return counting


def test_digest_is_content_based(tmp_path, hashing):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"same bytes")
    b.write_bytes(b"same bytes")
    assert digest(a) == digest(b) == hashlib.sha256(b"same bytes").hexdigest()
    b.write_bytes(b"same bytez")
    assert digest(a) != digest(b)
    with pytest.raises(FileNotFoundError, match="nothing"):
        digest(tmp_path / "nothing")


def test_folder_digest_ignores_hidden_files_and_depends_on_relative_names(tmp_path, hashing):
    def folder(name: str, files_: dict[str, bytes]) -> Path:
        root = tmp_path / name
        for rel, data in files_.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        return root

    base = {"x.bin": b"1", "sub/y.bin": b"2"}
    one = folder("one", base)
    two = folder("elsewhere/two", {**base, ".lock": b"pid", ".x.bin.abc.tmp": b"half", ".hidden/z.bin": b"3",
                                   "stamp.json": b"{}"})
    assert digest(one) == digest(two, ignore=("stamp.json",))
    assert digest(one) != digest(two)
    assert digest(one) != digest(folder("renamed", {"x.bin": b"1", "sub/w.bin": b"2"}))
    assert digest(one) != digest(folder("moved", {"x.bin": b"1", "y.bin": b"2"}))
    assert digest(one) != digest(folder("changed", {"x.bin": b"1", "sub/y.bin": b"3"}))
    (one / "empty").mkdir()
    assert digest(one) == digest(folder("again", base))  # empty folders hold no content


def test_digest_cache_is_hit_and_invalidated(tmp_path, hashing):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x" * 1000)
    first = digest(path)
    assert hashing.calls == 1
    assert digest(path) == first and hashing.calls == 1  # from the cache
    files._CACHE.entries = None  # a new process: the cache file answers
    assert digest(path) == first and hashing.calls == 1
    assert json.loads((tmp_path / "cache" / "bilinear-circuits" / "digests.json").read_text())
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # touched: hashed again
    assert digest(path) == first and hashing.calls == 2
    with open(path, "r+b") as handle:  # same size, other bytes, new mtime
        handle.write(b"y")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000))
    changed = digest(path)
    assert changed != first and hashing.calls == 3
    path.write_bytes(b"x" * 1001)  # other size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000))
    assert digest(path) not in (first, changed) and hashing.calls == 4


def test_a_burst_of_new_digests_writes_the_cache_file_once_and_loses_none(tmp_path, hashing, monkeypatch):
    # the file holds up to 20,000 digests (3.6 MB): rewritten per new digest, a stage reading a
    # fresh run's tables spent seconds writing it
    writes = []
    real_write = files.write_json
    monkeypatch.setattr(files, "write_json", lambda path, data: writes.append(path) or real_write(path, data))
    paths = []
    for i in range(40):
        paths.append(tmp_path / f"table{i}.parquet")
        paths[-1].write_bytes(bytes([i]) * 100)
    found = [digest(p) for p in paths]
    assert hashing.calls == 40 and len(writes) <= 2
    cache_file = tmp_path / "cache" / "bilinear-circuits" / "digests.json"
    other = {"/elsewhere|1|2|3": "written by another process meanwhile"}
    files.write_json(cache_file, {**(files.read_json(cache_file) or {}), **other})
    files._CACHE.flush()  # what the interpreter's exit runs
    on_disk = files.read_json(cache_file)
    assert set(found) <= set(on_disk.values()) and on_disk.items() >= other.items()
    files._CACHE.entries = None  # a new process: every digest answered by the file
    assert [digest(p) for p in paths] == found and hashing.calls == 40


# ------------------------------------------------------------------ stamps


def test_stamps(tmp_path):
    path = tmp_path / ".stamps" / "train-saes.json"
    stamp = Stamp("train-saes", {"model": "m1", "tokens": "t1"}, {"k": 8, "sites": ("resid_mid", "mlp_out")})
    assert not stamps.is_current(path, stamp) and stamps.changes(path, stamp) == []
    stamps.finish(path, stamp)
    assert stamps.is_current(path, stamp)
    # saved through JSON: a tuple and a list, 1 and 1.0 are the same recipe
    assert stamps.is_current(path, Stamp("train-saes", {"tokens": "t1", "model": "m1"},
                                         {"sites": ["resid_mid", "mlp_out"], "k": 8.0}))
    other = Stamp("train-saes", {"model": "m2", "tokens": "t1", "corpus": "c"}, {"k": 16, "sites": ("mlp_out",),
                                                                                  "lr": 1e-3})
    assert not stamps.is_current(path, other)
    assert stamps.changes(path, other) == ["corpus", "model", "config.k", "config.lr", "config.sites"]
    assert not stamps.is_current(path, Stamp("circuits", stamp.inputs, stamp.config))  # another stage
    stamps.begin(path)
    assert not path.exists() and not stamps.is_current(path, stamp)
    stamps.begin(path)  # nothing to remove is fine
    path.write_text('{"no": "stage"}')
    assert stamps.read(path) is None and not stamps.is_current(path, stamp)


# ------------------------------------------------------------------ the run lock


HOLDER = """
import sys
from pipelines.engine.lock import run_lock
with run_lock(sys.argv[1], sys.argv[2]):
    print("ready", flush=True)
    sys.stdin.readline()
"""

TRY = """
import sys
from pipelines.engine.lock import RunBusyError, run_lock
try:
    with run_lock(sys.argv[1], "try"):
        print("took it")
except RunBusyError as err:
    print("busy:", err)
"""


def python(code: str, *args: str, **kw) -> subprocess.Popen:
    env = child_env()
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, **kw)


def test_run_lock_refuses_a_second_process_and_names_it(tmp_path):
    holder = python(HOLDER, str(tmp_path), "train-saes")
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(RunBusyError, match=rf"{tmp_path}.*`train-saes` \(process {holder.pid}, since"):
            with run_lock(tmp_path, "circuits"):
                pass
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with run_lock(tmp_path, "circuits"):  # free once the holder is gone
        info = json.loads(RunPaths(tmp_path).lock.read_text())
        assert info["pid"] == os.getpid() and info["stage"] == "circuits"
        out, _ = python(TRY, str(tmp_path)).communicate(timeout=30)
        assert out.startswith("busy:") and f"process {os.getpid()}" in out
    out, _ = python(TRY, str(tmp_path)).communicate(timeout=30)
    assert out.strip() == "took it"


def test_run_lock_is_reentrant_in_process(tmp_path):
    with run_lock(tmp_path / "run", "demo"):
        with run_lock(tmp_path / "run", "train-lm"):
            with run_lock(Path(os.path.relpath(tmp_path / "run")), "circuits"):  # however it is spelled
                pass
        assert json.loads(RunPaths(tmp_path / "run").lock.read_text())["stage"] == "demo"
        out, _ = python(TRY, str(tmp_path / "run")).communicate(timeout=30)
        assert out.startswith("busy:")  # still held after the inner ones are left
    out, _ = python(TRY, str(tmp_path / "run")).communicate(timeout=30)
    assert out.strip() == "took it"


# ------------------------------------------------------------------ tables and paths


def test_tables_have_integer_layers_and_parts(tmp_path):
    for layer in (0, 2):
        write_table(pd.DataFrame({"feature": [1, 2], "score": [0.5, 0.25]}), tmp_path, "gates", layer=layer)
    write_table(pd.DataFrame({"feature": [9], "score": [1.0]}), tmp_path, "gates", layer=2, part="logits")
    assert table_path(tmp_path, "gates", 2, "logits") == tmp_path / "gates" / "layer2" / "logits.parquet"
    assert has_table(tmp_path, "gates", 2, "logits") and not has_table(tmp_path, "gates", 1)
    df = read_table(tmp_path, "gates")
    assert df["layer"].dtype == "int64" and sorted(df["layer"].tolist()) == [0, 0, 2, 2, 2]
    assert sorted(df.loc[df["layer"] == 2, "feature"]) == [1, 2, 9]
    whole = pd.read_parquet(tmp_path / "gates")  # the folder read as one table, layer still an integer
    assert whole["layer"].dtype == "int64" and len(whole) == 5
    assert read_table(tmp_path, "gates", layers=[0])["layer"].tolist() == [0, 0]
    (tmp_path / "gates" / "layer0" / ".part.parquet.abc.tmp").write_bytes(b"half")
    (tmp_path / "gates" / "layer0" / ".hidden.parquet").write_bytes(b"half")
    assert len(read_table(tmp_path, "gates")) == 5
    write_table(pd.DataFrame({"a": [1]}), tmp_path, "flat")
    assert (tmp_path / "flat" / "part.parquet").is_file() and "layer" not in read_table(tmp_path, "flat")
    with pytest.raises(FileNotFoundError, match="no table 'absent'"):
        read_table(tmp_path, "absent")


def test_table_provenance_round_trips(tmp_path):
    stamp = {"stage": "circuits", "inputs": {"model": "abc"}, "config": {"top_n": 50}}
    path = write_table(pd.DataFrame({"x": [1]}), tmp_path, "t", layer=1, provenance=stamp)
    assert provenance(path) == stamp
    assert provenance(write_table(pd.DataFrame({"x": [1]}), tmp_path, "u")) is None
    assert provenance(tmp_path / "missing.parquet") is None
    assert pq.read_table(path).column("x").to_pylist() == [1]


def test_table_schema_fixes_types_and_refuses_extra_columns(tmp_path):
    schema = pa.schema([("layer", pa.int64()), ("feature", pa.int32()), ("score", pa.float32())])
    path = write_table(pd.DataFrame({"score": [0.5], "feature": [3]}), tmp_path, "t", layer=4, schema=schema)
    written = pq.read_schema(path)
    assert written.names == ["layer", "feature", "score"]
    assert [written.field(n).type for n in written.names] == [pa.int64(), pa.int32(), pa.float32()]
    with pytest.raises(ValueError, match=r"table t has columns \['extra'\] that its schema lacks"):
        write_table(pd.DataFrame({"feature": [1], "score": [0.1], "extra": [1]}), tmp_path, "t", layer=4,
                    schema=schema)
    assert pq.read_table(path).column("feature").to_pylist() == [3]  # the refused write changed nothing


def test_run_paths_layout(tmp_path):
    run = RunPaths(str(tmp_path))
    assert run.root == tmp_path and run.lm == tmp_path / "lm" and run.tokens == tmp_path / "tokens"
    assert run.sae(2, "mlp_out") == tmp_path / "saes" / "layer2_mlp_out"
    assert run.table_stamp("circuits", 3, "eigen") == tmp_path / "tables" / ".stamps" / "circuits-layer3-eigen.json"
    assert run.table_stamp("report") == tmp_path / "tables" / ".stamps" / "report.json"


# ------------------------------------------------------------------ tasks


def test_tasks_run_here_in_order_on_the_runtimes_threads():
    import torch

    from pipelines.engine.tasks import Task, run_tasks
    from pipelines.runtime import Runtime

    seen = []

    def work(inputs, unit):
        seen.append((inputs, unit, torch.get_num_threads()))
        return unit * 10

    before = torch.get_num_threads()
    runtime = Runtime(threads=1, device="cpu")
    tasks = [Task("layer 2", 2), Task("layer 0", 0)]
    assert run_tasks(runtime, work, "inputs", tasks, "circuits") == [20, 0]
    assert seen == [("inputs", 2, 1), ("inputs", 0, 1)]
    assert torch.get_num_threads() == before  # restored
    assert run_tasks(runtime, work, "inputs", [], "circuits") == [] and len(seen) == 2


def test_tasks_run_side_by_side_on_a_thread_each_when_the_cpu_has_threads_to_spare():
    import threading

    import torch

    from pipelines.engine.tasks import Task, run_tasks
    from pipelines.runtime import Runtime

    both_started = threading.Barrier(2, timeout=10)  # breaks (and fails the test) if the tasks ran one by one
    seen = []

    def work(inputs, unit):
        if unit < 2:
            both_started.wait()
        seen.append((unit, threading.get_ident(), torch.get_num_threads()))
        return unit * 10

    before = torch.get_num_threads()
    runtime = Runtime(threads=2, device="cpu")
    assert runtime.tasks_at_once(3) == 2 and runtime.tasks_at_once(1) == 1
    assert Runtime(threads=1, device="cpu").tasks_at_once(3) == 1
    assert Runtime(threads=2, device="cuda").tasks_at_once(3) == 1
    tasks = [Task(f"layer {i}", i) for i in range(3)]
    assert run_tasks(runtime, work, "inputs", tasks, "verdicts") == [0, 10, 20]  # in the tasks' order
    assert sorted(unit for unit, _, _ in seen) == [0, 1, 2]
    assert len({ident for unit, ident, _ in seen if unit < 2}) == 2  # two threads
    assert {threads for _, _, threads in seen} == {1}  # each on its share of the two
    assert torch.get_num_threads() == before


def test_inputs_shared_by_tasks_side_by_side_are_made_once():
    """Tasks side by side share their inputs: the model (or the kept streams) is loaded once
    however many ask at once (Python 3.12's cached_property no longer locks)."""
    import threading
    import time

    from pipelines.inputs import _once

    made = []

    class Inputs:
        @_once
        def model(self):
            made.append(threading.get_ident())
            time.sleep(0.2)  # long enough for every thread to ask while it is made
            return object()

    inputs = Inputs()
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(inputs.model)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and len(seen) == 4 and all(m is seen[0] for m in seen)


def test_a_failing_task_side_by_side_stops_the_tasks_not_yet_started():
    import threading

    from pipelines.engine.tasks import Task, run_tasks
    from pipelines.runtime import Runtime

    started, release = [], threading.Event()

    def work(inputs, unit):
        started.append(unit)
        if unit == 0:
            raise ValueError("layer 0 failed")
        release.wait(10)  # layer 1, if it started, holds its thread until long after the failure
        return unit

    timer = threading.Timer(1.0, release.set)
    timer.start()
    tasks = [Task(f"layer {i}", i) for i in range(5)]
    with pytest.raises(ValueError, match="layer 0 failed"):
        run_tasks(Runtime(threads=2, device="cpu"), work, None, tasks, "verdicts")
    timer.cancel()
    # layer 1 may have started beside layer 0 before it failed; none of the queued ones did
    assert 0 in started and set(started) <= {0, 1}


def test_a_table_stage_frees_the_kept_streams_when_it_ends_even_on_an_error(tmp_path):
    from pipelines.runtime import Runtime
    from pipelines.stages.base import Part, TableStage, ensure

    class Work:
        run, freed = RunPaths(tmp_path), 0

        def forget_streams(self):
            self.freed += 1

    class Failing(TableStage):
        name = "failing"

        def parts(self, work, job, plan):
            return [Part(0, "part", Stamp("failing", {}, {}), ("none",))]

        def tasks(self, parts, plan, runtime):
            from pipelines.engine.tasks import Task
            return [Task("layer 0", None)]

        def work(self, work, job, unit, threads):
            raise ValueError("failed mid-stage")
            yield

    work = Work()
    with pytest.raises(ValueError, match="failed mid-stage"):
        ensure(Failing(), work, None, {}, Runtime(threads=1, device="cpu"))
    assert work.freed == 1


def test_glibc_keeps_freed_memory_for_the_next_allocations(monkeypatch):
    """The command line asks glibc's allocator for a fixed mapping threshold and no trimming
    (`reuse_freed_memory`); where the C library is glibc the request must be taken."""
    import platform

    from pipelines import cli, runtime

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc: the allocator is left as it is")
    assert runtime.reuse_freed_memory()
    asked = []
    monkeypatch.setattr(runtime, "reuse_freed_memory", lambda: asked.append(True) or True)
    monkeypatch.setattr(cli, "_run", lambda args: 0)
    assert cli.main(["report", "--out", "nowhere"]) == 0
    assert asked == [True]


def test_the_command_line_collects_cycles_rarely_and_not_at_exit(monkeypatch):
    """`main` raises the cycle collector's thresholds, and a process that called
    `collect_cycles_rarely` skips the interpreter's last collection: a cycle left for it is
    finalized at exit without the call and not with it."""
    import gc

    from pipelines import cli

    script = ("import gc, sys\nfrom pipelines.runtime import collect_cycles_rarely\ngc.disable()\n{call}"
              "class Cycle:\n    def __del__(self): sys.stdout.write('finalized')\n"
              "c = Cycle(); c.me = c; del c\n")
    root = str(Path(__file__).resolve().parents[1])
    for call, printed in (("", "finalized"), ("collect_cycles_rarely()\n", "")):
        done = subprocess.run([sys.executable, "-c", script.format(call=call)], cwd=root,
                              capture_output=True, text=True, check=True)
        assert done.stdout == printed
    before = gc.get_threshold()  # another test's call of `main` may have raised them already
    monkeypatch.setattr(cli, "_run", lambda args: 0)
    try:
        gc.set_threshold(700, 10, 10)  # Python's defaults
        assert cli.main(["report", "--out", "nowhere"]) == 0
        assert gc.get_threshold()[0] >= 50 * 700
    finally:
        gc.set_threshold(*before)


def test_one_thread_workers_run_on_one_thread_and_leave_the_callers_count():
    """Workers run on one intra-op thread; the caller keeps its count inside the pool and
    after it, and a thread started after the pool gets the caller's count, not the workers'."""
    import threading

    import torch

    from pipelines.runtime import intra_op_threads, one_thread_workers

    with intra_op_threads(2):
        with one_thread_workers(2) as pool:
            assert pool.submit(torch.get_num_threads).result() == 1
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 2
        later = []
        thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert later == [2]
    with one_thread_workers(1) as pool:
        assert pool is None


def test_the_automatic_thread_count_is_said_only_when_other_work_took_cores(monkeypatch, capsys):
    """Issue 51 item 17: every command printed "1 torch thread(s)..."; it says something only
    when the count is not every core's (others were busy: a rerun may differ in the last bits)."""
    import pipelines.runtime as runtime

    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 4)
    for free, said in ((4, False), (3, True), (1, True)):
        monkeypatch.setattr(runtime, "auto_threads", lambda: free)
        assert runtime.Runtime(device="cpu").resolved().threads == free
        err = capsys.readouterr().err
        assert ("torch thread" in err) == said, (free, err)
        assert not said or (f"{free} torch thread(s) of 4 cores" in err and "--threads N" in err)
    # with --ray each worker's share of every core is the default, said only when smaller
    monkeypatch.setattr(runtime, "auto_threads", lambda: 4)
    assert runtime.Runtime(device="cpu", ray="local", workers=2).resolved().threads == 2
    assert "torch thread" not in capsys.readouterr().err
