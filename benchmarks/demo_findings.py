"""What a finished demo run finds, as one Markdown table: the LM's quality, the SAEs', the
low-rank correlations, the circuits confirmed, the negation gates and the graph of the
negation prompt. The README's table and the docs' results page are this script's output.

    python benchmarks/demo_findings.py RUN [--command "how RUN was made"] [--output FILE]

It reads only the run's files (`lm/summary.json`, `tables/`), so it takes seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script

from results_file import add_output, recorded  # noqa: E402
from circuits.sites import RESID_MID  # noqa: E402
from pipelines.engine.paths import RunPaths  # noqa: E402
from pipelines.schemas import select  # noqa: E402


def _read(run: Path, name: str) -> pd.DataFrame | None:
    folder = run / "tables" / name
    return pd.read_parquet(folder) if folder.exists() else None


def _node(n) -> str:
    """A graph node as the report names it: a token, L<layer>.in#/out#<latent>, an error, a logit."""
    if n.kind == "token":
        return f'"{n.token}"'
    if n.kind == "logit":
        return f'logit "{n.token}"'
    if n.kind in ("input", "output"):
        return f"L{n.layer}.{'in' if n.kind == 'input' else 'out'}#{n.feature}"
    return f"L{n.layer}.{n.kind}"


def _tested(rows: pd.DataFrame) -> int:
    return int((rows["gate_type"].notna() & (rows["gate_type"] != "untested")).sum())


def findings(run: Path) -> list[tuple[str, str]]:
    """(what, figure) rows of a finished demo run."""
    rows = []
    lm = json.loads(RunPaths(run).model.summary.read_text())
    rows.append(("LM held-out loss (unigram entropy)",
                 f"{lm['held_out_loss']:.3f} nats ({lm['unigram_entropy']:.2f}); {lm['bits_per_byte']:.3f} bits per byte"))
    if "negated_accuracy" in lm:
        rows.append(("valence of the next sentiment word predicted right: plain / after a negation",
                     f"{lm['plain_accuracy']:.1%} / {lm['negated_accuracy']:.1%}"))
    metrics = _read(run, "sae_metrics")
    if metrics is not None:
        rows.append((f"SAEs ({len(metrics)}): NMSE, dead fraction, loss added",
                     f"{metrics['nmse'].min():.3f}-{metrics['nmse'].max():.3f}, "
                     f"{metrics['dead_fraction'].min():.2f}-{metrics['dead_fraction'].max():.2f}, "
                     f"{metrics['loss_added'].min():.2%} to {metrics['loss_added'].max():.2%}"))
    lowrank = _read(run, "lowrank")
    if lowrank is not None:
        two = select(lowrank, RESID_MID, "sae")
        two = two[two["n_eigs"] == 2]
        per_layer = two.groupby("layer")["corr_active"].median()
        rows.append(("median rank-2 active-only correlation, per layer",
                     ", ".join(f"L{layer} {v:.3f}" for layer, v in per_layer.items())
                     + f" ({two['corr_active'].isna().sum()} of {len(two)} outputs too rarely active)"))
    verdicts = _read(run, "gate_verdicts")
    if verdicts is not None:
        verdicts = select(verdicts, RESID_MID, "sae")
        for kind, name in (("pair", "input pairs"), ("group", "group gates")):
            mine = verdicts[verdicts["kind"] == kind]
            ablated = mine[mine["drop_a"].notna()]
            types = mine["gate_type"].value_counts()
            rows.append((f"{name}: tested; typed bilinear `and`, `threshold` or `and-unformed`, `square`; ablated; confirmed as AND gates",
                         f"{_tested(mine)}; {types.get('and', 0)}, {types.get('threshold', 0) + types.get('and-unformed', 0)}, "
                         f"{types.get('square', 0)}; {len(ablated)}; {int(mine['is_and'].fillna(False).astype(bool).sum())}"))
        if "negation_gate" in verdicts.columns:
            tagged = verdicts[verdicts["negation_gate"].fillna(False).astype(bool)]
            types = tagged["gate_type"].value_counts()
            rows.append(("negation gates (tagged candidates): formed, tested; typed bilinear `and`, `threshold`, "
                         "`square`; confirmed",
                         f"{len(tagged)}, {_tested(tagged)}; {types.get('and', 0)}, {types.get('threshold', 0)}, "
                         f"{types.get('square', 0)}; {int(tagged['is_and'].fillna(False).astype(bool).sum())}"))
    index = RunPaths(run).graph_index
    if index.is_file():
        nodes = _read(run, "graph_nodes")
        for entry in json.loads(index.read_text()).get("graphs", [])[:1]:
            slug = entry.get("slug")
            mine = nodes[nodes["prompt"] == slug] if nodes is not None else None
            path = "" if mine is None else " -> ".join(
                _node(n) for n in mine[mine["path_step"] >= 0].sort_values("path_step").itertuples())
            rows.append((f"graph of \"{entry.get('prompt', slug)}\": nodes, strongest path from any token",
                         f"{len(mine) if mine is not None else '?'}; {path or 'none'}"))
    return rows


def markdown(rows: list[tuple[str, str]]) -> str:
    lines = ["| what | found |", "|---|---|"]
    lines += [f"| {what} | {found.replace('|', '/')} |" for what, found in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished demo run directory")
    parser.add_argument("--command", default=None, help="the command that made the run, printed above the table")
    add_output(parser, "demo_findings.md")
    args = parser.parse_args()
    with recorded(args.output):
        if args.command:
            print(f"Run made by `{args.command}`; table by `python benchmarks/demo_findings.py {args.run}`.\n")
        print(markdown(findings(args.run)))


if __name__ == "__main__":
    main()
