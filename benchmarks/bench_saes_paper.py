"""All 12 SAEs of a paper-preset model (6 layers x resid_mid and mlp_out, d_model 512, 2048
latents, k 30, batches of 4096): the streaming trainer against the old one-at-a-time path.

Each path runs in a fresh subprocess, so its peak RSS is its own:

- new: `sae.train.train_saes`, one model pass per buffer fill feeding every SAE's sparse
  TopK step; no activation on disk;
- new x4: the same with four times the tokens and the same buffer, to show memory stays flat;
- old: what the toolkit did before (commit 3b00986), at the disk budget the paper's scale
  forces: for each of the 12 points in turn, a model pass over the training tokens writing
  float32 activation shards to disk, then sae-lens's `SAETrainer` (TopK SAE, Adam, the
  sparse decoder the old code added) reading them back. With `--old-all-points` the old
  path caches all points in one model pass instead (12x the disk).

Then one SAE's optimiser step alone for ours, sae-lens's and sparsify's trainers
(`bench_sae_step.per_sae_step_rates`), and projections of a full paper-scale run (150M
tokens per SAE) on this machine and on one GPU. The model has random weights and the
tokens are random: speed and memory do not depend on what the model learned.

    python benchmarks/bench_saes_paper.py [--steps 16] [--buffer-tokens 32768] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from circuits.sites import DEFAULT_SAE_SITES  # noqa: E402
from pipelines.runtime import Runtime  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_saes_paper.txt"  # under benchmarks/results/

LAYERS, D_MODEL, N_CTX, VOCAB, BATCH, K = 6, 512, 256, 4096, 4096, 30
PAPER_TOKENS = 150_000_000
POINTS = [(layer, site) for layer in range(LAYERS) for site in DEFAULT_SAE_SITES]


class Rows:
    """Random token rows with BOS at each row's start, shaped like a token store's."""

    def __init__(self, n_rows: int, seed: int = 0):
        g = np.random.default_rng(seed)
        self.tokens = g.integers(4, VOCAB, size=(n_rows, N_CTX), dtype=np.int64)
        self.tokens[:, 0] = 1

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, rows) -> torch.Tensor:
        return torch.from_numpy(self.tokens[rows])

    def keep(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens != 1


def paper_model(device: str = "cpu"):
    from pipelines.lm.model import PRESETS, build_model

    torch.manual_seed(0)
    return build_model(PRESETS["paper"].replace(d_vocab=VOCAB), device).eval()


def run_new(steps: int, buffer_tokens: int, device: str = "cpu") -> dict:
    from sae.config import SAETrainConfig
    from sae.train import train_saes

    model = paper_model(device)
    cfg = SAETrainConfig(k=K, train_tokens=steps * BATCH, batch_size=BATCH, buffer_tokens=buffer_tokens,
                         lr=1e-4).resolve(D_MODEL)
    rows = Rows(4 * steps * BATCH // (N_CTX - 1) + 64)
    start = time.perf_counter()
    train_saes(model, rows, POINTS, cfg, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "activation_disk_bytes": 0}


def run_old(steps: int, all_points: bool) -> dict:
    """The old path: cache to disk, then sae-lens's trainer per SAE (see the module docstring)."""
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from sae_lens import LoggingConfig, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig
    from sae_lens.training.sae_trainer import SAETrainer

    from sae.activations import iter_activations

    class SparseDecode(TopKTrainingSAE):
        """The old code's decoder: sums the k active rows instead of a dense product."""

        def decode(self, feature_acts):
            flat = feature_acts.reshape(-1, self.cfg.d_sae)
            values, indices = flat.topk(self.cfg.k, dim=-1, sorted=False)
            out = F.embedding_bag(indices, self.W_dec, per_sample_weights=values, mode="sum") + self.b_dec
            return self.run_time_activation_norm_fn_out(self.hook_sae_recons(out.reshape(*feature_acts.shape[:-1], -1)))

    model = paper_model()
    n_tokens = steps * BATCH
    rows = Rows(n_tokens // (N_CTX - 1) + 8)
    tokens = rows.batch(slice(None))
    keep = rows.keep(tokens)
    folder = Path(tempfile.mkdtemp(prefix="old_cache_"))
    disk_peak = 0
    start = time.perf_counter()
    try:
        groups = [POINTS] if all_points else [[p] for p in POINTS]
        for group in groups:
            chunks = {p: [] for p in group}
            for found in iter_activations(model, tokens, group, keep, batch_seqs=32):
                for p in group:
                    chunks[p].append(found[p])
            for p in group:
                acts = torch.cat(chunks[p])[:n_tokens]
                for i, shard in enumerate(acts.split(65536)):
                    save_file({"acts": shard.contiguous()}, str(folder / f"{p[0]}_{p[1]}_{i}.safetensors"))
            disk_peak = max(disk_peak, sum(f.stat().st_size for f in folder.iterdir()))
            for p in group:
                shards = sorted(folder.glob(f"{p[0]}_{p[1]}_*.safetensors"))
                data = torch.cat([load_file(str(s))["acts"] for s in shards])
                data = data[torch.randperm(len(data))]
                torch.manual_seed(0)
                sae = SparseDecode(TopKTrainingSAEConfig(d_in=D_MODEL, d_sae=4 * D_MODEL, k=K))
                trainer_cfg = SAETrainerConfig(total_training_samples=n_tokens, train_batch_size_samples=BATCH, lr=1e-4,
                                               lr_end=0.0, lr_scheduler_name="cosineannealing", device="cpu",
                                               logger=LoggingConfig(log_to_wandb=False))
                SAETrainer(cfg=trainer_cfg, sae=sae, data_provider=iter(data.split(BATCH))).fit()
                for s in shards:
                    s.unlink()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"seconds": time.perf_counter() - start, "activation_disk_bytes": disk_peak}


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    if args.child == "new":
        result = run_new(args.steps, args.buffer_tokens, args.device)
    else:
        result = run_old(args.steps, args.child == "old-all")
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result))


def spawn(kind: str, steps: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", kind, "--steps", str(steps), "--threads", str(args.threads),
               "--buffer-tokens", str(args.buffer_tokens), "--device", args.device]
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} failed:\n{done.stderr[-3000:]}")
    result = json.loads(lines[-1][7:])
    result["tokens_per_sae"] = steps * BATCH
    result["tokens_per_s_per_sae"] = steps * BATCH / result["seconds"]
    return result


def measured_projection(results: dict, device: str) -> None:
    """The new path's rate on `device` and the full run at that rate (the x4 run's: its start-up,
    the first buffer's fill, weighs a quarter as much)."""
    for name, r in results.items():
        print(f"{name:>8} {r['tokens_per_sae']:>11} tokens/SAE {r['seconds']:>8.1f} s {r['tokens_per_s_per_sae']:>10.0f} "
              f"tok/s per SAE (all 12 at once)")
    rate = results["new x4"]["tokens_per_s_per_sae"]
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    print(f"\nfull run (150M tokens per SAE, all 12 SAEs) at that rate on one {name}: "
          f"{PAPER_TOKENS / rate / 60:.0f} minutes (measured rate, projected length)")


def forward_flops_per_token() -> float:
    """Multiply-adds x 2 of the blocks (attention projections, bilinear MLP, attention scores)."""
    per_layer = 4 * D_MODEL * D_MODEL + 3 * D_MODEL * 2048 + 2 * N_CTX * D_MODEL / 2
    return 2 * LAYERS * per_layer


def sae_step_flops() -> float:
    """The dense encoder product of one step (the sparse parts are small next to it)."""
    return 2 * BATCH * D_MODEL * 4 * D_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16,
                        help="optimiser steps per SAE in the timed runs (16: three fills of the default buffer, so"
                             " the base run already holds the optimiser state and a full buffer at once)")
    parser.add_argument("--buffer-tokens", type=int, default=32768, help="shuffle buffer per point (new path)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--old-all-points", action="store_true", help="old path: all points in one cached pass")
    parser.add_argument("--device", default="cpu", help="where the new path runs: cpu, cuda or cuda:N (on a GPU it "
                                                        "alone is timed, and the full run projected from its rate "
                                                        "there), or auto")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    try:
        args.device = Runtime(threads=args.threads, device=args.device).resolved(announce=False).device
    except ValueError as err:
        parser.error(str(err))
    if args.child:
        child(args)
        return
    print(f"12 SAEs (6 layers x resid_mid, mlp_out), d_model {D_MODEL}, d_sae {4 * D_MODEL}, k {K}, batch {BATCH}; "
          f"{args.steps} steps per SAE; {args.threads} torch threads; buffer {args.buffer_tokens} tokens per point; "
          f"on {args.device}")
    results = {"new": spawn("new", args.steps, args), "new x4": spawn("new", 4 * args.steps, args)}
    if args.device != "cpu":
        measured_projection(results, args.device)
        return
    old = "old-all" if args.old_all_points else "old"
    results[old] = spawn(old, args.steps, args)
    gib = 2 ** 30
    print(f"\n{'path':>8} {'tokens/SAE':>11} {'seconds':>8} {'tok/s per SAE':>14} {'tok/s total':>12} "
          f"{'peak RSS GiB':>13} {'act. disk GiB':>14}")
    for name, r in results.items():
        print(f"{name:>8} {r['tokens_per_sae']:>11} {r['seconds']:>8.1f} {r['tokens_per_s_per_sae']:>14.0f} "
              f"{12 * r['tokens_per_s_per_sae']:>12.0f} {r['peak_rss_bytes'] / gib:>13.2f} "
              f"{r['activation_disk_bytes'] / gib:>14.3f}")
    new, flat, previous = results["new"], results["new x4"], results[old]
    print(f"\nend to end, new over old: {new['tokens_per_s_per_sae'] / previous['tokens_per_s_per_sae']:.2f}x")
    print(f"peak RSS with 4x the tokens: {flat['peak_rss_bytes'] / new['peak_rss_bytes']:.3f}x")

    from bench_sae_step import per_sae_step_rates

    rates = per_sae_step_rates(steps=10, threads=args.threads)
    print("\none SAE's optimiser step alone:")
    for name in ("ours", "sae_lens", "sparsify"):
        entry = rates[name]
        text = entry.get("error") or f"{entry['tokens_per_s']:.0f} tokens/s ({entry['ms_per_step']:.0f} ms/step)"
        print(f"  {name:>9}: {text}")
    for key in ("ours_over_sae_lens", "ours_over_sparsify"):
        if rates[key] is not None:
            print(f"  {key}: {rates[key]:.2f}x")

    steps_full = PAPER_TOKENS // BATCH
    cpu_hours = steps_full * BATCH / new["tokens_per_s_per_sae"] / 3600
    # GPU assumption: one H100 running the model forward in bf16 and the SAEs in fp32/TF32
    # at 35% of its dense peaks (990 TFLOP/s bf16, 495 TFLOP/s TF32), the sparse parts and
    # data movement doubling the SAE time; small SAEs on a GPU are bound by kernel launches
    # as much as by arithmetic, so the upper figure adds 1 ms per SAE step for launches and
    # the optimiser. Not measured: no GPU was available here.
    forward = PAPER_TOKENS * forward_flops_per_token() / (0.35 * 990e12)
    saes = 2 * 12 * steps_full * sae_step_flops() / (0.35 * 495e12)
    overhead = 12 * steps_full * 1e-3
    print(f"\nprojected full run (150M tokens per SAE, all 12 SAEs): this machine {cpu_hours:.0f} h "
          f"({cpu_hours / 24:.1f} days); one H100 {(forward + saes) / 60:.0f} to {(forward + saes + overhead) / 60:.0f} "
          "minutes (assumed, not measured: 35% of its dense bf16/TF32 peaks, SAE time doubled for sparse ops, "
          "and for the upper figure 1 ms of launch and optimiser overhead per SAE step)")

if __name__ == "__main__":
    run_recorded(main, OUTPUT)
