"""Every stage of the demo against its floor: wall time, the least time its work needs here,
their ratio, and where the time goes.

    python benchmarks/bench_stages.py [--quick] [--out DIR] [--threads 1] [--seed 0]
                                      [--code DIR --code DIR ...] [--from RUN --stages circuits,...]

Runs the demo's stages (corpus, train-lm, train-saes, circuits, features, verdicts, report,
explorer) with the demo's settings (`--quick`: `DemoConfig.small()`) into a fresh run
directory (`--from RUN`: starting from the corpus, LM and SAEs of a finished run). Each stage runs in its own process, the stages before it reused from their stamps
and left out of its time. Before each stage the process measures this machine's matmul rate
(float32 products of square matrices, on `--threads` threads; bfloat16 ones before a stage
whose products run in bfloat16, the LM's training where the hardware has it) and its disk write rate
(a file written and synced), so that a floor and a time are taken under the same load.

A stage's floor is the floating-point work it cannot avoid divided by the matmul rate (model
passes, counted once per token even where several layers read them; the LM's forward and
backward; SAE encoders and the k active decoder rows; each output feature's interaction
matrix, its projection into the input SAE's basis and its eigendecomposition), plus the bytes
it writes divided by the disk rate. Stages without such work (the corpus generator, the
report's figures, the explorer's site) have a floor of their bytes alone.

The profile is sampled: every 20 ms a thread reads the Python stack of each of the stage's
busy threads (its layers may run on threads of their own) and charges each to the innermost
function of this project, marked with the library it was inside (`torch`, `pandas`, ...), if
any; the shares are of those thread-samples.

With several `--code` trees (e.g. the code before a change, then after it) each stage runs
once per tree, alternately, each tree in its own run directory, so that the trees meet the
same load; a table per tree and a comparison follow. The last line reads
`worst stage: NAME at R x its floor; total T s` for the last tree. Then the paper preset's
full run is projected from the floors, on this machine (at the measured rate, each stage at
the ratio measured here) and on one H100 (floors at a stated rate). On a GPU (`--device` is
the code's own `auto`: CUDA where torch sees one) the rates are the GPU's, measured on
4096-wide products, and the ratios those of wall time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_stages.txt"  # under benchmarks/results/

HERE = Path(__file__).resolve().parents[1]
STAGES = ("corpus", "train-lm", "train-saes", "circuits", "features", "verdicts", "report", "explorer")
COPIED = {"corpus": "corpus", "train-lm": "lm", "train-saes": "saes"}  # stage: its folder, copied from --from
H100_RATE = 300e12  # flop/s assumed for one H100: about 30% of its dense bf16 peak (989 TFLOP/s)
PAPER_LM_TOKENS = 500_000_000  # assumed: about one pass over TinyStories with a 4096-token vocabulary
PAPER_SAE_TOKENS = 150_000_000  # per SAE (the paper)
SAMPLE_S = 0.02


# ------------------------------------------------------------------ measuring the machine


def matmul_rate(threads: int, seconds: float = 1.0, n: int = 1024, dtype: str = "float32",
                device: str = "cpu") -> tuple[float, float]:
    """flop/s of `n x n` matrix products in `dtype` on `threads` threads, per second of wall
    time and per second of this process's CPU time (the best of a few tries each). On a GPU the
    products are 4096 wide (1024 is far from its peak) and both figures are per second of wall
    time: the host's CPU time measures only its waiting."""
    import torch

    torch.set_num_threads(threads)
    gpu = device.startswith("cuda")
    n = 4096 if gpu else n
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    a, b = (torch.randn(n, n, dtype=getattr(torch, dtype), device=device) for _ in range(2))
    a @ b
    sync()
    wall = cpu = 0.0
    for _ in range(3):
        start, cpu_start, count = time.perf_counter(), time.process_time(), 0
        while time.perf_counter() - start < seconds / 3:
            a @ b
            count += 1
            if gpu and count % 16 == 0:
                sync()
        sync()
        wall = max(wall, 2 * n**3 * count / (time.perf_counter() - start))
        cpu = wall if gpu else max(cpu, 2 * n**3 * count / max(time.process_time() - cpu_start, 1e-9))
    return wall, cpu


def disk_rate(folder: Path, n_bytes: int = 64 << 20) -> float:
    """Bytes/s of writing and syncing a file of `n_bytes` in `folder`."""
    block = os.urandom(1 << 20)
    with tempfile.NamedTemporaryFile(dir=folder) as f:
        start = time.perf_counter()
        for _ in range(n_bytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
        return n_bytes / (time.perf_counter() - start)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


class Sampler:
    """Samples the Python stack of every busy thread every `SAMPLE_S` seconds while active (a
    stage's layers may run on threads of their own, `Runtime.tasks_at_once`); a thread
    waiting on a lock or a future (the stage's driver, tqdm's monitor) is idle, not sampled."""

    def __init__(self, roots: list[Path]):
        self.roots = [str(r) + os.sep for r in roots]
        self.counts: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self.stop.wait(SAMPLE_S):
            for ident, frame in sys._current_frames().items():
                if ident != me and not _waiting(frame):
                    self.counts[self._where(frame)] += 1

    def _where(self, frame) -> str:
        library = None
        while frame is not None:
            path = frame.f_code.co_filename
            if any(path.startswith(r) for r in self.roots) and "benchmarks" not in path:
                module = Path(path).with_suffix("").as_posix().split("/")[-2:]
                name = f"{'.'.join(module)}.{frame.f_code.co_name}"
                return f"{name} ({library})" if library else name
            if library is None:
                library = _library(path)
            frame = frame.f_back
        return f"other ({library})" if library else "other"

    def top(self, n: int) -> list[tuple[str, float]]:
        total = sum(self.counts.values()) or 1
        return [(name, count / total) for name, count in self.counts.most_common(n)]


def _waiting(frame) -> bool:
    """Whether a thread's innermost frame is a wait in `threading` or `concurrent.futures`."""
    path = Path(frame.f_code.co_filename).as_posix()
    return path.endswith("/threading.py") or "/concurrent/futures/" in path


def _library(path: str) -> str:
    parts = Path(path).parts
    if "site-packages" in parts or "dist-packages" in parts:
        i = max(i for i, p in enumerate(parts) if p in ("site-packages", "dist-packages"))
        return parts[i + 1].split(".")[0] if i + 1 < len(parts) else "python"
    return "python"


# ------------------------------------------------------------------ the stages


class Chain:
    """The demo's stages on one run directory; each call runs what it needs before it."""

    def __init__(self, root: Path, quick: bool, seed: int, threads: int):
        from pipelines.demo import DemoConfig
        from pipelines.engine.paths import RunPaths
        from pipelines.runtime import Runtime

        self.cfg = (DemoConfig.small() if quick else DemoConfig()).with_seed(seed)
        self.run = RunPaths(root)
        self.runtime = Runtime(threads=threads).resolved(announce=False)
        self.layers: list[int] = []

    def upto(self, stage: str):
        """Run every stage before `stage` (reused from their stamps); returns `stage`'s callable."""
        calls = {"corpus": self.corpus, "train-lm": self.train_lm, "train-saes": self.train_saes,
                 "circuits": self.circuits, "features": self.features, "verdicts": self.verdicts,
                 "report": self.report, "explorer": self.explorer}
        for name in STAGES[: STAGES.index(stage)]:
            if name not in ("report", "explorer"):
                calls[name]()
        return calls[stage]

    def corpus(self):
        from pipelines.demo import ensure_corpus

        self.run.root.mkdir(parents=True, exist_ok=True)
        self.source = ensure_corpus(self.run, self.cfg.stories)

    def train_lm(self):
        from pipelines.data.story_corpus import story_lexicon
        from pipelines.demo import ensure_lm, ensure_tokens
        from pipelines.inputs import ModelInputs, StageInputs

        cfg = self.cfg
        self.lm_job = cfg.lm.replace(corpus=story_lexicon(self.source, cfg.lm.corpus))
        self.summary = ensure_lm(self.run, source=str(self.source), job=self.lm_job, runtime=self.runtime)
        self.lm = ModelInputs(self.run.lm, self.runtime.device)
        self.work = StageInputs(self.run, self.lm, ensure_tokens(self.run, str(self.source), self.lm.tokenizer,
                                                                 self.lm.config.n_ctx, self.lm_job.corpus))
        self.layers = list(range(self.lm.config.n_layers))

    def train_saes(self):
        from pipelines.demo import ensure_saes

        self.sae_metrics = ensure_saes(self.work, job=self.cfg.saes, layers=self.layers, runtime=self.runtime)

    def circuits(self):
        from pipelines.stages import CIRCUITS, ensure

        ensure(CIRCUITS, self.work, self.cfg.circuits, self.cfg.circuits.plan(self.run, self.lm, self.layers),
               self.runtime)

    def features(self):
        from pipelines.stages import FEATURES, ensure

        ensure(FEATURES, self.work, self.cfg.features, self.cfg.features.plan(self.run, self.lm, self.layers),
               self.runtime)

    def verdicts(self):
        from pipelines.stages import VERDICTS, ensure

        ensure(VERDICTS, self.work, self.cfg.verdicts, self.cfg.verdicts.plan(self.run, self.lm, self.layers),
               self.runtime)

    def report(self):
        from pipelines.report.page import write_report

        # trees from before the report drew its figures in worker processes take no `processes`
        fan_out = {"processes": self.runtime.threads} if "processes" in inspect.signature(write_report).parameters else {}
        write_report(self.run, self.cfg.report, self.lm, self.cfg.verdicts.plan(self.run, self.lm, self.layers),
                     **fan_out)

    def explorer(self):
        from pipelines.explorer.site import write_explorer

        write_explorer(self.run)

    def quality(self) -> dict:
        """The demo's quality figures: held-out loss, SAE NMSE, median rank-2 correlation."""
        import pandas as pd

        from circuits.sites import DEFAULT_INPUT_SITE
        from pipelines import schemas

        out = {"held_out_loss": self.summary["held_out_loss"]}
        if hasattr(self, "sae_metrics"):
            out["nmse"] = {f"{r.layer}/{r.site}": float(r.nmse) for r in self.sae_metrics.itertuples()}
        if (self.run.tables / "lowrank").is_dir():
            low = pd.concat([schemas.read(self.run.tables, "lowrank", [layer]) for layer in self.layers])
            low = low[(low["n_eigs"] == 2) & (low["input_site"] == DEFAULT_INPUT_SITE)]
            out["rank2_median"] = {str(k): float(v) for k, v in low.groupby("layer")["corr_active"].median().items()}
        return out


# ------------------------------------------------------------------ floors


def forward_flops(m, layers: int | None = None, unembed: bool = True) -> float:
    """Flops of one token's forward pass through `layers` blocks (all by default), causal attention."""
    layers = m.n_layers if layers is None else layers
    block = 2 * (4 * m.d_model**2 + 3 * m.d_model * m.d_mlp) + 2 * m.d_model * m.n_ctx
    return layers * block + (2 * m.d_model * m.d_vocab if unembed else 0)


def sae_step_flops(d: int, d_sae: int, k: int) -> float:
    """One token's training flops in one TopK SAE: the dense encoder, then k rows each way."""
    return 2 * d * d_sae + 6 * k * d


def circuit_layer_flops(d: int, d_mlp: int, n_in: int, n_out: int) -> float:
    """Interaction matrices, their symmetric projection into the input basis, and eigh, per layer."""
    q = 2 * d * d_mlp * d
    projection = 2 * (n_in + 1) * d * d + (n_in + 1) ** 2 * d
    eigh = 9 * d**3
    return n_out * (q + projection + eigh)


def stream_flops(cfg, m) -> float:
    """The SAE stream's model passes: one to the last SAE's layer per training token."""
    return cfg.saes.sae.resolve(m.d_model).used_tokens * forward_flops(m, unembed=False)


def stage_flops(stage: str, cfg, m) -> float:
    """The floating-point work `stage` cannot avoid, for demo config `cfg` and model config `m`."""
    if stage in ("corpus", "report", "explorer"):
        return 0.0
    n_ctx = m.n_ctx
    if stage == "train-lm":
        train = cfg.lm.train
        steps = train.n_steps(n_ctx)
        evals = steps // train.eval_every + (steps % train.eval_every != 0)
        tokens = steps * train.batch_size * n_ctx
        return 3 * tokens * forward_flops(m) + (evals * train.eval_rows + 256) * n_ctx * forward_flops(m)
    d = m.d_model
    sae = cfg.saes.sae.resolve(d)
    d_sae = sae.d_sae
    n_saes = m.n_layers * len(cfg.saes.sites)
    if stage == "train-saes":
        model = stream_flops(cfg, m)
        evaluation = n_saes * sae.eval_rows * n_ctx * forward_flops(m)
        return model + n_saes * sae.used_tokens * sae_step_flops(d, d_sae, sae.k) + evaluation
    if stage == "circuits":
        rows = cfg.circuits.corr_rows * n_ctx
        encode = rows * 2 * d * 2 * d_sae * m.n_layers
        return (m.n_layers * circuit_layer_flops(d, m.d_mlp, d_sae, d_sae) + rows * forward_flops(m, unembed=False)
                + encode)
    if stage == "features":
        rows = cfg.features.description.n_rows * n_ctx
        logit = n_saes * 2 * d_sae * d * m.d_vocab
        return rows * (forward_flops(m, unembed=False) + n_saes * 2 * d * d_sae) + logit
    if stage == "verdicts":
        v = cfg.verdicts.rules
        rows = v.rows * n_ctx
        candidates = 2 * v.n_ablate + 2
        # an ablated token needs the layers after it at its own position (earlier ones are cached) and the unembedding
        ablations = m.n_layers * candidates * 3 * v.ablate_tokens * forward_flops(m)
        # every pair is tested on at most iv_tokens tokens: at least removing side A and side B are evaluations
        # of their own (the clean output and removing both can be shared or derived), each the MLP's product
        # through W_out and the output SAE's encoder
        pairs = d_sae * (cfg.circuits.analysis.n_gates + v.n_interactions + v.n_self * (v.n_self - 1) // 2)
        interventions = m.n_layers * pairs * v.iv_tokens * 2 * (2 * m.d_mlp * d + 2 * d * d_sae)
        return rows * (forward_flops(m, unembed=False) + m.n_layers * 2 * d * 2 * d_sae) + ablations + interventions
    raise ValueError(stage)


# ------------------------------------------------------------------ one stage, in a child process


def child(args) -> None:
    """Run one stage on this process's code and print its figures as one JSON line."""
    import torch

    from pipelines import runtime

    # the allocator and the cycle collector as the code's own command line sets them (trees
    # before 2026-11-25 have neither call, before 2026-11-26 not the collector's)
    for setting in ("reuse_freed_memory", "collect_cycles_rarely"):
        getattr(runtime, setting, lambda: None)()
    torch.set_num_threads(args.threads)
    chain = Chain(Path(args.out), args.quick, args.seed, args.threads)
    call = chain.upto(args.child)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # a stage whose products run in bfloat16 (the LM's training, where the hardware has it) is
    # held to the bfloat16 rate: the float32 one would put its floor above what it can reach
    device = chain.runtime.device
    dtype = "bfloat16" if args.child == "train-lm" and precision(chain.cfg.lm.train.autocast, device) == "bf16" \
        else "float32"
    (rate, cpu_rate), disk = matmul_rate(args.threads, dtype=dtype, device=device), disk_rate(Path(args.out))
    # the SAE stream's model passes may run in bfloat16 while the SAEs train in float32: that part
    # of the stage's floor is held to the bfloat16 rate
    stream_low = args.child == "train-saes" and precision(chain.cfg.saes.sae.autocast, device) == "bf16"
    low_rate, low_cpu_rate = matmul_rate(args.threads, dtype="bfloat16", device=device) if stream_low \
        else (rate, cpu_rate)
    before = folder_bytes(Path(args.out))
    # the libraries' imports are no stage's work, wherever a code tree happens to import them
    import sae_lens  # noqa: F401
    import transformer_lens  # noqa: F401

    import pipelines

    sampler = Sampler([Path(pipelines.__file__).resolve().parents[1]])
    start, cpu = time.perf_counter(), time.process_time()
    with sampler:
        call()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    written = max(0, folder_bytes(Path(args.out)) - before)
    m = chain.lm.config if chain.layers else None
    flops = stage_flops(args.child, chain.cfg, m) if m is not None else 0.0
    low = stream_flops(chain.cfg, m) if stream_low else 0.0
    result = {"stage": args.child, "seconds": seconds, "cpu": cpu, "flops": flops, "bytes": written, "rate": rate, "disk": disk,
              "floor": low / low_rate + (flops - low) / rate + written / disk, "cpu_rate": cpu_rate,
              "cpu_floor": low / low_cpu_rate + (flops - low) / cpu_rate + written / disk,
              "profile": sampler.top(args.profile_lines), "load": os.getloadavg()[0], "dtype": dtype,
              "bfloat16_flops": low, "bfloat16_cpu_rate": low_cpu_rate, "device": device,
              "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"}
    if args.child == "explorer":
        result["quality"] = chain.quality()
    if m is not None:
        result["model"] = m.to_json()
        result["paper"], result["paper_stream"] = paper_flops(chain.cfg, m) if args.child == "explorer" else (None, 0.0)
    with open(Path(args.out) / "bench-stages.jsonl", "a") as log:  # kept if the parent is stopped
        log.write(json.dumps(result) + "\n")
    print("BENCH " + json.dumps(result), flush=True)


def precision(kind: str, device: str) -> str:
    """What a code tree's precision setting `kind` means on `device`: "none" (float32) or "bf16"."""
    try:
        from sae.activations import resolve_precision
    except ImportError:  # a tree from before `--autocast auto`
        return kind
    return resolve_precision(kind, device)


def paper_flops(cfg, demo_model) -> tuple[dict, float]:
    """Each stage's flops in the paper preset's full run (6 layers, d_model 512, 12 SAEs), and
    those of its SAE stream's model passes among the SAE stage's."""
    from pipelines.lm.model import PRESETS

    m = PRESETS["paper"].replace(d_vocab=demo_model.d_vocab)
    lm = cfg.lm.replace(train=cfg.lm.train.replace(train_tokens=PAPER_LM_TOKENS))
    saes = cfg.saes.replace(sae=cfg.saes.sae.replace(k=30, train_tokens=PAPER_SAE_TOKENS))
    paper = cfg.replace(lm=lm, saes=saes)
    return {stage: stage_flops(stage, paper, m) for stage in STAGES}, stream_flops(paper, m)


# ------------------------------------------------------------------ the parent


def code_env(code: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process running the code tree `code`: the tree first on
    PYTHONPATH and what it held after (packages installed there), offline, wandb off, `extra`."""
    held = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(code)] + ([held] if held else [])),
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", **extra}


def run_child(code: Path, stage: str, out: Path, args) -> dict:
    env = code_env(code, TQDM_DISABLE="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", stage, "--out", str(out),
           "--threads", str(args.threads), "--seed", str(args.seed), "--profile-lines", str(args.profile_lines)]
    if args.quick:
        cmd.append("--quick")
    done = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
    if done.returncode or not lines:
        sys.exit(f"{stage} failed with the code of {code}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH "):])


def table(results: list[dict]) -> str:
    lines = [f"{'stage':<11} {'seconds':>8} {'floor s':>8} {'x floor':>8} {'CPU s':>7} {'CPU x':>6} {'GFLOP':>8} "
             f"{'MB out':>7} {'GFLOP/s':>8} {'load':>5}  where the time goes (sampled)"]
    for r in results:
        where = "; ".join(f"{name} {share:.0%}" for name, share in r["profile"])
        lines.append(f"{r['stage']:<11} {r['seconds']:8.1f} {r['floor']:8.2f} {r['seconds'] / r['floor']:8.1f} "
                     f"{r['cpu']:7.1f} {r['cpu'] / r['cpu_floor']:6.1f} {r['flops'] / 1e9:8.1f} "
                     f"{r['bytes'] / 1e6:7.1f} {r['rate'] / 1e9:8.1f} {r['load']:5.2f}  {where}")
    total, floor = sum(r["seconds"] for r in results), sum(r["floor"] for r in results)
    cpu, cpu_floor = sum(r["cpu"] for r in results), sum(r["cpu_floor"] for r in results)
    lines.append(f"{'total':<11} {total:8.1f} {floor:8.2f} {total / floor:8.1f} {cpu:7.1f} {cpu / cpu_floor:6.1f}")
    low = [r["stage"] for r in results if r.get("dtype", "float32") != "float32"]
    if low:
        lines.append(f"({', '.join(low)}: products in bfloat16, floor and GFLOP/s at the bfloat16 matmul rate)")
    streams = [r for r in results if r.get("bfloat16_flops")]
    for r in streams:
        lines.append(f"({r['stage']}: {r['bfloat16_flops'] / 1e9:.0f} GFLOP of model passes in bfloat16, their part of "
                     "the floor at the bfloat16 rate)")
    return "\n".join(lines)


def projection(results: list[dict]) -> str:
    """The paper preset's full run on this machine, each stage timed here at its ratio to its
    floor (the others at their floor): on a CPU the ratio of CPU seconds, the rate that of all
    cores; on a GPU the ratio of wall seconds at the GPU's measured rate, an upper bound there
    (a GPU runs the demo's small products far from its rate, the paper's nearer it). On a CPU,
    also one H100 at its floor at an assumed rate."""
    paper = results[-1]["paper"]
    gpu = results[-1].get("device", "cpu").startswith("cuda")
    cores = 1 if gpu else os.cpu_count() or 1
    rate = max(r["cpu_rate"] for r in results if r.get("dtype", "float32") == "float32") * cores
    # each stage at the rate of the precision it ran in (the LM's training may be bfloat16)
    rates = {stage: rate for stage in paper} | {r["stage"]: r["cpu_rate"] * cores for r in results
                                                if r.get("dtype", "float32") != "float32"}
    # a stage whose floor held part of its work to the bfloat16 rate (the SAE stream's model
    # passes) is projected the same way, or its ratio, taken against that lower floor, would be
    # applied to a float32 one
    low = {r["stage"]: r["bfloat16_cpu_rate"] * cores for r in results if r.get("bfloat16_flops")}
    stream = results[-1].get("paper_stream", 0.0)

    def least(stage: str, flops: float) -> float:
        """The stage's floor in seconds at the paper's size."""
        part = stream if stage in low else 0.0
        return (flops - part) / rates[stage] + (part / low[stage] if part else 0.0)

    ratio = {r["stage"]: max(1.0, r["seconds"] / r["floor"] if gpu else r["cpu"] / r["cpu_floor"])
             for r in results if r["flops"]}
    floor = sum(least(stage, flops) for stage, flops in paper.items())
    here = sum(least(stage, flops) * ratio.get(stage, 1.0) for stage, flops in paper.items())
    without_lm = here - least("train-lm", paper["train-lm"]) * ratio.get("train-lm", 1.0)
    by_stage = ", ".join(f"{s} {paper[s] / 1e15:.2f}" for s in STAGES if paper[s])
    at = ", ".join(f"{s} {r:.1f}x" for s, r in ratio.items())
    head = (f"projection, paper preset full run (6 layers, d_model 512, 12 SAEs of 2048 latents, k 30, "
            f"{PAPER_SAE_TOKENS / 1e6:.0f}M tokens per SAE, LM on {PAPER_LM_TOKENS / 1e6:.0f}M tokens; PFLOP by stage: "
            f"{by_stage}):\n")
    precisions = (f"{', the LM at its bfloat16 rate' if rates['train-lm'] != rate else ''}"
                  f"{', the SAE stream at its bfloat16 rate' if low else ''}")
    if gpu:
        return (head + f"  this GPU ({results[-1]['device_name']}) at {rate / 1e12:.0f} TFLOP/s (float32 products "
                f"measured in this run{precisions}): floor {floor / 60:.1f} min; at this run's wall-time ratios ({at}; "
                f"other stages at their floor) at most {here / 3600:.1f} h, {without_lm / 3600:.1f} h without training the "
                "LM: an upper bound, since the demo's products are too small to fill a GPU and the paper's run nearer "
                "their floor (a projection from measured rates and ratios; docs/howto/gpu.md)")
    return (head + f"  this machine, {cores} quiet cores at {rate / 1e9:.0f} GFLOP/s (this run's best float32 rate per "
            f"CPU second{precisions}): floor {floor / 3600:.0f} h; at this run's CPU ratios ({at}; other stages at "
            f"their floor) {here / 3600:.0f} h ({here / 86400:.1f} days), {without_lm / 3600:.0f} h without training "
            f"the LM\n  one H100 at an assumed {H100_RATE / 1e12:.0f} TFLOP/s: floor "
            f"{sum(paper.values()) / H100_RATE / 60:.1f} min (a projection, not measured)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small copy of the demo (DemoConfig.small())")
    parser.add_argument("--out", default=None, help="a new folder for the runs (default: a temporary one)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every stage and of the matmul rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--code", action="append", type=Path, help="a code tree to run (repeat to compare; default: "
                                                                   "this one)")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma list: run up to the last, time these")
    parser.add_argument("--from", dest="source", type=Path, default=None,
                        help="a finished demo run whose corpus, LM and SAEs each run starts from (with --stages "
                             "circuits,...: the analysis stages alone, every code tree on the same inputs)")
    parser.add_argument("--profile-lines", type=int, default=3, help="places listed per stage")
    parser.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    codes = [c.resolve() for c in (args.code or [HERE])]
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-stages-"))
    runs = [out / f"{i}-{c.name}" for i, c in enumerate(codes)]
    if any(r.exists() for r in runs):
        sys.exit(f"--out {out} already holds runs: give a new folder")
    stages = [s for s in STAGES if s in args.stages.split(",")]
    copied = [s for s in stages if s in COPIED and args.source and (args.source / COPIED[s]).is_dir()]
    if copied:
        sys.exit(f"--from {args.source} holds the output of {', '.join(copied)}, which each run copies and so "
                 f"does not time: give --stages of later stages only")
    for run in runs if args.source else []:
        for name in (*COPIED.values(), "tokens"):  # a run without SAEs times train-saes too
            if (args.source / name).is_dir():
                shutil.copytree(args.source / name, run / name)
    print(f"demo{' (quick)' if args.quick else ''}, seed {args.seed}, {args.threads} torch thread(s); "
          f"load average at start {os.getloadavg()[0]:.2f}; runs in {out}", flush=True)
    results: list[list[dict]] = [[] for _ in codes]
    for stage in STAGES[: STAGES.index(stages[-1]) + 1]:
        for i, code in enumerate(codes):
            r = run_child(code, stage, runs[i], args)
            if stage in stages:
                results[i].append(r)
                print(f"  {stage} ({code.name}): {r['seconds']:.1f} s, floor {r['floor']:.2f} s", flush=True)
    for code, res in zip(codes, results):
        print(f"\ncode {code}:\n{table(res)}")
        if "quality" in res[-1]:
            print(f"quality: {json.dumps(res[-1]['quality'])}")
    if len(codes) > 1:
        print("\nseconds (CPU seconds) by stage, " + " -> ".join(c.name for c in codes) + ":")
        for j, stage in enumerate(stages):
            print(f"  {stage:<11} " + " -> ".join(f"{res[j]['seconds']:.1f} ({res[j]['cpu']:.1f})" for res in results))
    (out / "results.json").write_text(json.dumps({str(c): r for c, r in zip(codes, results)}, indent=1))
    last = results[-1]
    if last[-1].get("paper"):
        print("\n" + projection(last))
    worst = max((r for r in last if r["floor"] > 0), key=lambda r: r["seconds"] / r["floor"])
    print(f"worst stage: {worst['stage']} at {worst['seconds'] / worst['floor']:.1f} x its floor; "
          f"total {sum(r['seconds'] for r in last):.0f} s")
    if not args.out:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
