"""Attribution graphs of a 64-token prompt: time end to end (frozen forward pass, graph,
pruning, scores, JSON and Parquet files) and peak memory, on the demo and paper presets.

Weights and SAEs are random (seeded) with the shapes of a real run: TopK SAEs of 4 x d_model
latents, k 16 on the demo model (the demo's k) and 30 on the paper preset (the paper's). Every
token then has k active latents per SAE, the most a trained SAE has, so these are upper bounds.
Each preset runs in its own process, so its peak resident memory is its own.

    python benchmarks/bench_graph.py [--threads 2] [--tokens 64] [--presets demo,paper]
"""

from __future__ import annotations

from pathlib import Path

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_graph.txt"  # under benchmarks/results/

K = {"demo": 16, "paper": 30, "tiny": 4}


def one(preset: str, n_tokens: int, threads: int) -> dict:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from circuits.attribution import LayerSAETensors
    from circuits.sites import RESID_MID
    from circuits.weights import SAEWeights
    from pipelines.engine.paths import RunPaths
    from pipelines.graph.build import GraphConfig, build_graph
    from pipelines.graph.export import write_graph
    from pipelines.lm.model import PRESETS, build_model

    torch.set_num_threads(threads)
    cfg = PRESETS[preset]
    model = build_model(cfg, seed=0).to(torch.float64).eval()
    vocab = {f"t{i}": i for i in range(cfg.d_vocab)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    g = torch.Generator().manual_seed(0)
    prompt = " ".join(f"t{int(i)}" for i in torch.randint(0, cfg.d_vocab, (n_tokens,), generator=g))
    d, d_sae, k = cfg.d_model, 4 * cfg.d_model, K[preset]

    def sae():
        W_dec = torch.randn(d_sae, d, generator=g, dtype=torch.float64)
        W_dec /= W_dec.norm(dim=1, keepdim=True)
        return SAEWeights(W_enc=W_dec.T.contiguous(), b_enc=torch.zeros(d_sae, dtype=torch.float64), W_dec=W_dec,
                          b_dec=torch.zeros(d, dtype=torch.float64), k=k)

    saes = {layer: LayerSAETensors(sae(), RESID_MID, sae()) for layer in range(cfg.n_layers)}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        pg = build_graph(prompt, model, tokenizer, saes, GraphConfig())
        built = time.perf_counter()
        write_graph(pg, RunPaths(tmp), None)
        done = time.perf_counter()
    kinds = pg.graph.kind
    return {"preset": preset, "tokens": n_tokens, "threads": threads, "nodes": int(kinds.numel()),
            "features": int(((kinds == 1) | (kinds == 2)).sum()), "kept_nodes": int(pg.node_mask.sum()),
            "kept_edges": int(pg.edge_mask.sum()), "graph_s": built - start, "files_s": done - built,
            "total_s": done - start, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--presets", default="demo,paper")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    add_output(p, OUTPUT)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.tokens, args.threads)))
        return
    print(f"{'preset':>7} {'tokens':>6} {'thr':>3} {'nodes':>6} {'features':>8} {'kept':>5} {'edges':>6} "
          f"{'graph s':>8} {'files s':>8} {'total s':>8} {'peak GiB':>8}")
    for preset in args.presets.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", preset, "--tokens", str(args.tokens),
                              "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['preset']:>7} {r['tokens']:>6} {r['threads']:>3} {r['nodes']:>6} {r['features']:>8} "
              f"{r['kept_nodes']:>5} {r['kept_edges']:>6} {r['graph_s']:>8.2f} {r['files_s']:>8.2f} "
              f"{r['total_s']:>8.2f} {r['peak_rss_gib']:>8.2f}")


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
