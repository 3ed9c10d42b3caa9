"""Our TopK trainer against sae-lens's on sae-lens's synthetic benchmark, where the features are known.

Synthetic models are built locally from `sae_lens.synthetic.SyntheticModelConfig` (nothing is
downloaded): ground-truth features in superposition with Zipfian firing probabilities,
magnitudes and, per configuration, low-rank correlations, a hierarchy of mutually exclusive
children and orthogonalised directions. `synthsaebench-192` is SynthSAEBench-16k's recipe
scaled down four times (16384 features in 768 dimensions become 4096 in 192, its 128 root
trees 32, its 4096-wide SAE 1024 wide).

Both trainers step on the same precomputed batches of hidden activations, one CPU thread each:

- ours: `sae.train.new_trainer` with a recipe (`SAETrainConfig`): the defaults, or an explicit
  learning rate, schedule, aux-k coefficient and dead-latent window, trained by the project's
  loop (`sae.train.run_training`). Our SAE then goes through
  the sae-lens format (`save_sae_lens`, `sae_lens.SAE.load_from_disk`) before it is scored;
- sae-lens: its `TopKTrainingSAE` stepped by its `SAETrainer` (`sae_lens_topk`) at constant learning rates
  `SAE_LENS_LRS` (its synthetic benchmark's schedule), everything else at sae-lens's
  defaults; the best of them is what ours must match.

Every SAE is scored by sae-lens's own `eval_sae_on_synthetic_data` on held-out samples: MCC,
feature uniqueness, F1, precision, recall, dead latents, shrinkage, L0, explained variance.
k is the true L0 of a configuration's d_sae most frequent features (as SynthSAEBench's k 25
for 4096 of its 16k features). CPU seconds per token are the training loop's process time
divided by its tokens (data generation, evaluation and numba's one-off compilation of our
kernels left out).

    python benchmarks/bench_synthetic.py [--configs ...] [--seeds 0 1] [--budgets 1048576 4194304]
        [--grid defaults|short|sweep|rule] [--processes 1] [--data-device cpu] [--output benchmarks/results/synthetic.md]

`--grid defaults` runs our defaults against sae-lens's constant rates; `--grid sweep` adds the
recipes the defaults were chosen from (docs/results/sae-defaults.md), and `--grid rule` the
defaults' neighbours, one setting changed at a time (`rule_variants`). Results go beside
`--output`: `.jsonl` (one line per SAE), `.json` and `.md` (tables averaged over seeds, headed
by the command, as every benchmark's results file).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

# TQDM_DISABLE: the training loop's progress bar, from every SAE of a pool, would fill the log
for _name, _value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"), ("WANDB_MODE", "disabled"),
                      ("TQDM_DISABLE", "1")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file and sae_lens_topk, beside this script

import torch  # noqa: E402

from results_file import add_output, command_line, recorded  # noqa: E402
from sae_lens_topk import sae_lens_topk  # noqa: E402

OUTPUT = "synthetic.md"  # under benchmarks/results/

BATCH = 4096
EVAL_SAMPLES = 16_384
SAE_LENS_LRS = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)


@dataclass(frozen=True)
class Synthetic:
    """One synthetic configuration and the SAE width trained on it."""

    num_features: int
    hidden_dim: int
    d_sae: int
    roots: int = 0  # hierarchy trees (branching 4, depth 3, mutually exclusive children); 0: none
    correlation_rank: int = 0  # 0: independent features
    orthogonalize: bool = False

    def model_config(self, seed: int):
        from sae_lens.synthetic import (FoldedNormalMagnitudeConfig, HierarchyConfig, LinearMagnitudeConfig,
                                        LowRankCorrelationConfig, OrthogonalizationConfig, SyntheticModelConfig,
                                        ZipfianFiringProbabilityConfig)

        return SyntheticModelConfig(
            num_features=self.num_features, hidden_dim=self.hidden_dim,
            firing_probability=ZipfianFiringProbabilityConfig(exponent=0.5, max_prob=0.4, min_prob=5e-4),
            hierarchy=HierarchyConfig(total_root_nodes=self.roots, branching_factor=4, max_depth=3,
                                      mutually_exclusive_portion=1.0) if self.roots else None,
            orthogonalization=OrthogonalizationConfig(num_steps=100, lr=3e-4) if self.orthogonalize else None,
            correlation=LowRankCorrelationConfig(rank=self.correlation_rank, correlation_scale=0.1)
            if self.correlation_rank else None,
            mean_firing_magnitudes=LinearMagnitudeConfig(start=5.0, end=4.0),
            std_firing_magnitudes=FoldedNormalMagnitudeConfig(mean=0.5, std=0.5),
            seed=seed,
        )


CONFIGS = {
    "zipf-64": Synthetic(1024, 64, 256),
    "corr-128": Synthetic(2048, 128, 512, correlation_rank=12),
    "synthsaebench-192": Synthetic(4096, 192, 1024, roots=32, correlation_rank=25, orthogonalize=True),
    "tiny": Synthetic(256, 16, 64, roots=4, correlation_rank=4),  # for tests of this script
}


# ---------------------------------------------------------------------------------------------
# data


def data_paths(folder: Path, config: str, seed: int) -> tuple[Path, Path]:
    return folder / f"{config}-s{seed}-train.pt", folder / f"{config}-s{seed}-eval.pt"


def generate(config: str, seed: int, tokens: int, folder: Path, device: str = "cpu") -> None:
    """Sample `tokens` training activations and `EVAL_SAMPLES` held-out (activations, features)
    of configuration `config` with model seed `seed`, on `device`, into `folder` (one CPU
    thread: `main` runs several at once)."""
    from sae_lens.synthetic import SyntheticModel

    torch.set_num_threads(1)
    train_path, eval_path = data_paths(folder, config, seed)
    if train_path.is_file() and eval_path.is_file() and torch.load(train_path, mmap=True).shape[0] >= tokens:
        return
    spec = CONFIGS[config]
    torch.manual_seed(seed)
    model = SyntheticModel(spec.model_config(seed), device=device)  # orthogonalising needs autograd
    with torch.no_grad():  # scoped: whoever calls this may train next, in the same process
        chunks, done = [], 0
        while done < tokens:
            n = min(65_536, tokens - done)
            chunks.append(model.sample(n).float().cpu())
            done += n
        torch.save(torch.cat(chunks), train_path)
        _, features = model.sample_with_features(EVAL_SAMPLES)
    features = features.float().cpu()
    head_l0 = (features[:, : spec.d_sae] > 0).sum(1).float().mean().item()
    torch.save({"features": features.to_sparse(), "feature_dict": model.feature_dict.cpu(),
                "k": max(2, round(head_l0)), "true_l0": (features > 0).sum(1).float().mean().item()}, eval_path)


class Replay:
    """Held-out feature activations handed out in order, as sae-lens's evaluation asks its
    generator for them (`sample(n)`)."""

    def __init__(self, features: torch.Tensor):
        self.features, self.at = features, 0

    def sample(self, n: int) -> torch.Tensor:
        rows = self.features.index_select(0, torch.arange(self.at, self.at + n)).to_dense()
        self.at += n
        return rows


_DATA: dict = {}


def load(folder: Path, config: str, seed: int) -> tuple[torch.Tensor, dict]:
    key = (str(folder), config, seed)
    if key not in _DATA:
        train_path, eval_path = data_paths(folder, config, seed)
        _DATA.clear()
        _DATA[key] = (torch.load(train_path, mmap=True), torch.load(eval_path, weights_only=False))
    return _DATA[key]


# ---------------------------------------------------------------------------------------------
# training


def compile_kernels() -> None:
    """Compile (or load from numba's cache) the CPU kernels of our step, once per process and
    before any timing: a start-up cost like an import, not a cost per token."""
    from circuits.weights import top_k_indices
    from sae.topk import _scatter_rows

    top_k_indices(torch.randn(2, 16), 1)
    _scatter_rows(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), torch.ones(2, 3), 2)


def _ours(train: torch.Tensor, d_sae: int, k: int, seed: int, tokens: int, recipe: dict):
    from sae_lens import SAE

    from sae.config import SAETrainConfig
    from sae.topk import save_sae_lens
    from sae.train import TensorBatches, new_trainer, run_training

    d_in = train.shape[1]
    cfg = SAETrainConfig(d_sae=d_sae, k=k, train_tokens=tokens, batch_size=BATCH, seed=seed,
                         **recipe).resolve(d_in)
    trainer = new_trainer(d_in, cfg)
    batches = TensorBatches(train.split(BATCH), BATCH)  # chunks of one batch: each batch is a view, not a copy
    compile_kernels()
    started = time.process_time()
    run_training({batches.key: trainer}, batches, cfg)
    seconds = time.process_time() - started
    with tempfile.TemporaryDirectory() as folder:
        save_sae_lens(trainer.sae, folder)
        sae = SAE.load_from_disk(folder)
    settings = {key: cfg.to_json()[key] for key in ("lr", "warmup_fraction", "decay_fraction", "lr_end_fraction",
                                                    "aux_k_coefficient", "dead_after_tokens")}
    return sae, seconds, cfg.used_tokens, settings


def _sae_lens(train: torch.Tensor, d_sae: int, k: int, seed: int, tokens: int, lr: float):
    steps = tokens // BATCH
    sae, trainer, step = sae_lens_topk(train.shape[1], d_sae, k, steps, BATCH, lr, lr, "constant", "cpu", seed)
    batches = train[: steps * BATCH].split(BATCH)
    started = time.process_time()
    for batch in batches:
        step(batch)
    seconds = time.process_time() - started
    return sae, seconds, steps * BATCH, {"lr": lr, "schedule": "constant",
                                         "dead_feature_window": trainer.cfg.dead_feature_window,
                                         "aux_loss_coefficient": sae.cfg.aux_loss_coefficient}


def run_job(job: dict) -> dict:
    """Train and score one SAE: `job` names config, seed, tokens, trainer, label, the data
    folder and the recipe (ours) or lr (sae-lens). A failure comes back as `{"error": ...}`
    so that one SAE does not stop the others."""
    try:
        return _run_job(job)
    except Exception as error:  # noqa: BLE001 - reported with the job, the sweep goes on
        return {**{key: job[key] for key in ("config", "seed", "tokens", "trainer", "label")},
                "error": f"{type(error).__name__}: {error}"}


def _run_job(job: dict) -> dict:
    from sae_lens.synthetic import eval_sae_on_synthetic_data

    torch.set_num_threads(1)
    train, held_out = load(Path(job["data"]), job["config"], job["seed"])
    spec = CONFIGS[job["config"]]
    if job["trainer"] == "ours":
        sae, seconds, used, settings = _ours(train, spec.d_sae, held_out["k"], job["seed"], job["tokens"], job["recipe"])
    else:
        sae, seconds, used, settings = _sae_lens(train, spec.d_sae, held_out["k"], job["seed"], job["tokens"], job["lr"])
    scores = eval_sae_on_synthetic_data(sae, held_out["feature_dict"], Replay(held_out["features"]),
                                        num_samples=held_out["features"].shape[0], batch_size=4096)
    out = scores.to_dict()
    out.update(out.pop("classification"))
    return {**{key: job[key] for key in ("config", "seed", "tokens", "trainer", "label")}, "k": held_out["k"],
            "d_sae": spec.d_sae, "d_in": spec.hidden_dim, "used_tokens": used, "cpu_s_per_token": seconds / used,
            "settings": settings, **out}


def rule_variants(config: str, tokens: int) -> list[tuple[str, dict]]:
    """The defaults' neighbours, one setting changed at a time: the rule's learning rate
    halved and doubled, a cosine over the whole run, an end fraction of 0.1, fixed dead-latent
    windows of 64k, 256k and 1M tokens (the default, a sixteenth of the run, is about the
    first at 1M tokens and the second at 4M), and sae-lens's aux-k coefficient 1; and the
    previous defaults (`1e-4 * sqrt(512 / d_in) * sqrt(PAPER_STEPS / steps)`, a cosine over
    the whole run, a 1M-token window)."""
    from sae.config import PAPER_STEPS, default_lr

    spec = CONFIGS[config]
    steps = tokens // BATCH
    rule = default_lr(spec.hidden_dim, spec.d_sae, steps)
    previous = 1e-4 * math.sqrt(512 / spec.hidden_dim * max(1.0, PAPER_STEPS / steps))
    return [("previous defaults", {"lr": previous, "decay_fraction": 1.0, "dead_after_tokens": 1_000_000}),
            ("rule x0.5", {"lr": rule / 2}), ("rule x2", {"lr": rule * 2}), ("cos", {"decay_fraction": 1.0}),
            ("end 0.1", {"lr_end_fraction": 0.1}), ("dead 64k", {"dead_after_tokens": 65_536}),
            ("dead 256k", {"dead_after_tokens": 262_144}), ("dead 1M", {"dead_after_tokens": 1_000_000}),
            ("aux 1", {"aux_k_coefficient": 1.0})]


def jobs(configs: list[str], seeds: list[int], budgets: list[int], grid: str, data: Path) -> list[dict]:
    """Every SAE to train. Ours: the defaults; for `grid == "short"` also four recipes of the
    sweep (rates m 8 and 16, "cos" and "wsd", aux-k 1); for `grid == "sweep"` learning rates
    `m * 1e-4 * sqrt(512 / d_in)` with cosine decay over the whole run or over its last fifth
    ("wsd"), and around the latter the aux-k coefficient, dead-latent window, warm-up and end
    fraction; for `grid == "rule"` the defaults' neighbours (`rule_variants`).
    sae-lens: its constant rates `SAE_LENS_LRS` (with `grid == "rule"`, beyond 1M tokens only
    the three highest: lower rates did worse at every size and budget measured)."""
    out = []
    for config in configs:
        d_in = CONFIGS[config].hidden_dim
        base = 1e-4 * math.sqrt(512 / d_in)
        for seed in seeds:
            for tokens in budgets:
                cell = {"config": config, "seed": seed, "tokens": tokens, "data": str(data)}
                out.append({**cell, "trainer": "ours", "label": "defaults", "recipe": {}})
                for lr in SAE_LENS_LRS if grid != "rule" or tokens <= 1_048_576 else SAE_LENS_LRS[-3:]:
                    out.append({**cell, "trainer": "sae-lens", "label": f"const {lr:g}", "lr": lr})
                if grid == "defaults":
                    continue
                if grid == "rule":
                    out.extend({**cell, "trainer": "ours", "label": label, "recipe": recipe}
                               for label, recipe in rule_variants(config, tokens))
                    continue
                if grid == "short":
                    for m, name, recipe in ((8, "cos", {}), (8, "wsd", {"decay_fraction": 0.2}),
                                            (16, "wsd", {"decay_fraction": 0.2}),
                                            (16, "wsd aux1", {"decay_fraction": 0.2, "aux_k_coefficient": 1.0})):
                        out.append({**cell, "trainer": "ours", "label": f"m{m} {name}", "recipe": {"lr": m * base, **recipe}})
                    continue
                for m in (4, 8, 16, 32, 64):
                    for decay, name in ((1.0, "cos"), (0.2, "wsd")):
                        out.append({**cell, "trainer": "ours", "label": f"m{m} {name}",
                                    "recipe": {"lr": m * base, "decay_fraction": decay}})
                variants = [(m, "aux1", {"aux_k_coefficient": 1.0}) for m in (16, 32, 64)]
                variants += [(32, "dead256k", {"dead_after_tokens": 262_144}), (32, "warm5", {"warmup_fraction": 0.05}),
                             (32, "end10", {"lr_end_fraction": 0.1})]
                for m, name, change in variants:
                    out.append({**cell, "trainer": "ours", "label": f"m{m} wsd {name}",
                                "recipe": {"lr": m * base, "decay_fraction": 0.2, **change}})
    return out


# ---------------------------------------------------------------------------------------------
# tables

METRICS = ("mcc", "uniqueness", "f1_score", "precision", "recall", "dead_latents", "shrinkage", "sae_l0",
           "explained_variance", "cpu_s_per_token")


def summarize(rows: list[dict]) -> dict:
    """Means over seeds per (config, tokens, trainer, label), and per (config, tokens) the
    acceptance checks: our defaults against sae-lens's best constant rate."""
    groups = defaultdict(list)
    for row in rows:
        groups[(row["config"], row["tokens"], row["trainer"], row["label"])].append(row)
    means = []
    for (config, tokens, trainer, label), members in sorted(groups.items()):
        entry = {"config": config, "tokens": tokens, "trainer": trainer, "label": label, "seeds": len(members),
                 "k": members[0]["k"], "d_sae": members[0]["d_sae"], "d_in": members[0]["d_in"]}
        for metric in METRICS:
            entry[metric] = sum(m[metric] for m in members) / len(members)
        entry["mcc_min"] = min(m["mcc"] for m in members)
        entry["f1_min"] = min(m["f1_score"] for m in members)
        means.append(entry)
    checks = []
    for config, tokens in sorted({(m["config"], m["tokens"]) for m in means}):
        cell = [m for m in means if m["config"] == config and m["tokens"] == tokens]
        ours = next((m for m in cell if m["trainer"] == "ours" and m["label"] == "defaults"), None)
        theirs = [m for m in cell if m["trainer"] == "sae-lens"]
        if ours is None or not theirs:
            continue
        best_mcc = max(theirs, key=lambda m: m["mcc"])
        best_f1 = max(theirs, key=lambda m: m["f1_score"])
        cheapest = sum(m["cpu_s_per_token"] for m in theirs) / len(theirs)
        checks.append({
            "config": config, "tokens": tokens,
            "ours_mcc": ours["mcc"], "sae_lens_best_mcc": best_mcc["mcc"], "at_lr_mcc": best_mcc["label"],
            "ours_f1": ours["f1_score"], "sae_lens_best_f1": best_f1["f1_score"], "at_lr_f1": best_f1["label"],
            "ours_dead": ours["dead_latents"], "sae_lens_dead_at_best_mcc": best_mcc["dead_latents"],
            "sae_lens_dead_min": min(m["dead_latents"] for m in theirs),
            "cpu_ratio": cheapest / ours["cpu_s_per_token"],
            "mcc_ok": ours["mcc"] >= best_mcc["mcc"], "f1_ok": ours["f1_score"] >= best_f1["f1_score"],
            "dead_ok": ours["dead_latents"] <= best_mcc["dead_latents"],
        })
    return {"means": means, "checks": checks}


def markdown(summary: dict) -> str:
    head = ("| config | tokens | trainer | recipe | seeds | k | MCC | uniq | F1 | prec | recall | dead | shrink | L0 | "
            "expl var | CPU us/token |")
    lines = [head, "|" + "---|" * 16]
    for m in summary["means"]:
        lines.append(
            f"| {m['config']} | {m['tokens']:,} | {m['trainer']} | {m['label']} | {m['seeds']} | {m['k']} | {m['mcc']:.3f} | "
            f"{m['uniqueness']:.3f} | {m['f1_score']:.3f} | {m['precision']:.3f} | {m['recall']:.3f} | "
            f"{m['dead_latents']:.1f} | {m['shrinkage']:.3f} | {m['sae_l0']:.1f} | {m['explained_variance']:.3f} | "
            f"{1e6 * m['cpu_s_per_token']:.2f} |")
    lines += ["", "Our defaults against sae-lens's best constant rate (means over seeds):", "",
              "| config | tokens | MCC ours | MCC sae-lens best (lr) | F1 ours | F1 sae-lens best (lr) | dead ours | "
              "dead sae-lens at best MCC | sae-lens CPU / ours | MCC ok | F1 ok | dead ok |", "|" + "---|" * 12]
    for c in summary["checks"]:
        lines.append(
            f"| {c['config']} | {c['tokens']:,} | {c['ours_mcc']:.3f} | {c['sae_lens_best_mcc']:.3f} ({c['at_lr_mcc']}) | "
            f"{c['ours_f1']:.3f} | {c['sae_lens_best_f1']:.3f} ({c['at_lr_f1']}) | {c['ours_dead']:.1f} | "
            f"{c['sae_lens_dead_at_best_mcc']:.1f} | {c['cpu_ratio']:.2f}x | {c['mcc_ok']} | {c['f1_ok']} | "
            f"{c['dead_ok']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["zipf-64", "corr-128", "synthsaebench-192"],
                        choices=sorted(CONFIGS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--budgets", nargs="+", type=int, default=[1_048_576, 4_194_304], help="training tokens")
    parser.add_argument("--grid", choices=("defaults", "short", "sweep", "rule"), default="defaults")
    parser.add_argument("--processes", type=int, default=1, help="SAEs trained at once, one thread each")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "bench_synthetic",
                        help="folder of the generated activations (reused when present)")
    parser.add_argument("--data-device", default="cpu", help="device that samples the synthetic models")
    add_output(parser, OUTPUT)
    parser.add_argument("--labels", nargs="+", help="train only the recipes of these labels (as the tables name "
                        "them, e.g. 'previous defaults' or 'const 0.008'), to add rows to an earlier run")
    parser.add_argument("--tables-from", type=Path, nargs="+",
                        help="only rebuild the tables from the .jsonl files of earlier runs")
    args = parser.parse_args()
    out = None if args.output == "-" else Path(args.output)
    if args.tables_from is not None:
        rows = [json.loads(line) for path in args.tables_from for line in path.read_text().splitlines() if line.strip()]
        rows = [row for row in rows if "error" not in row]
        write_tables(rows, out)
        return
    todo = jobs(args.configs, args.seeds, args.budgets, args.grid, args.data)
    if args.labels:
        unknown = sorted(set(args.labels) - {job["label"] for job in todo})
        if unknown:
            parser.error(f"--labels: no recipe of --grid {args.grid} is labelled {', '.join(map(repr, unknown))}; "
                         f"its labels are {', '.join(sorted({job['label'] for job in todo}))}")
        todo = [job for job in todo if job["label"] in args.labels]
    args.data.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    cells = [(config, seed, max(args.budgets), args.data, args.data_device)
             for config in args.configs for seed in args.seeds]
    with get_context("spawn").Pool(min(len(cells), args.processes)) as pool:
        pool.starmap(generate, cells)
    print(f"data: {time.perf_counter() - started:.1f} s", flush=True)
    # longest first, so the pool does not wait on one long SAE at the end
    todo.sort(key=lambda j: -j["tokens"] * CONFIGS[j["config"]].d_sae * (3 if j["trainer"] == "sae-lens" else 1))
    rows = []
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
    # one line per SAE as it ends, so a sweep cut short keeps what it trained
    lines = os.devnull if out is None else out.with_suffix(".jsonl")
    with open(lines, "w") as sink, get_context("spawn").Pool(args.processes, maxtasksperchild=None) as pool:
        for row in pool.imap_unordered(run_job, todo):
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            if "error" in row:
                print(f"FAILED {row}", flush=True)
                continue
            rows.append(row)
            print(f"[{len(rows)}/{len(todo)}] {row['config']} s{row['seed']} {row['tokens']:,} {row['trainer']} "
                  f"{row['label']}: MCC {row['mcc']:.3f} F1 {row['f1_score']:.3f} dead {row['dead_latents']} "
                  f"{1e6 * row['cpu_s_per_token']:.2f} us/token", flush=True)
    write_tables(rows, out)


def write_tables(rows: list[dict], out: Path | None) -> None:
    """Print the tables of `rows` and keep them as the other benchmarks keep their figures
    (`results_file.recorded`), in `out` with the suffix .md, and the summary in .json (`out`
    None: print only)."""
    from pipelines.engine.files import write_json

    summary = summarize(rows)
    if out is not None:
        write_json(out.with_suffix(".json"), {"command": command_line(), **summary})
    with recorded(None if out is None else str(out.with_suffix(".md"))):
        print(markdown(summary), end="")


if __name__ == "__main__":
    main()
