"""What the commands and the demo print: one function per kind of outcome."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from pipelines.analysis.negation import describe_locus
from pipelines.analysis.verdicts import ranking_rule
from pipelines.data.tags import labelled, present_tags, tagged
from pipelines.schemas import GATE_TAGS, read, select

PRECISION_NAMES = {"none": "float32", "bf16": "bfloat16 autocast"}
METRIC_COLUMNS = ["layer", "site", "d_sae", "k", "nmse", "l0", "dead_fraction", "loss_added"]


def lm(summary: dict) -> None:
    """The model's held-out loss, its unigram baseline, speed and, with a lexicon, its behaviour."""
    print(f"held-out loss {summary['held_out_loss']:.3f} nats, {summary['bits_per_byte']:.3f} bits per byte; "
          f"unigram entropy {summary['unigram_entropy']:.3f} nats; {summary['tokens_per_s']:,.0f} tokens/s"
          + (f" (trained in {PRECISION_NAMES.get(summary['train_precision'], summary['train_precision'])})"
             if "train_precision" in summary else ""))
    if "negated_accuracy" in summary:
        print(f"class of the next lexicon word predicted right: plain {summary['plain_accuracy']:.1%}, "
              f"after a negation {summary['negated_accuracy']:.1%}")


def sae_metrics(metrics: pd.DataFrame, dead_warning: float | None = None) -> None:
    """One line per SAE: its size and quality; a warning for each whose dead fraction is above
    `dead_warning` (`SAEJob.dead_warning`)."""
    print(metrics[METRIC_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    if dead_warning is None:
        return
    for r in metrics[metrics["dead_fraction"] > dead_warning].itertuples(index=False):
        print(f"warning: the layer {r.layer} {r.site} SAE has {r.dead_fraction:.0%} dead latents (never active on the "
              f"evaluation tokens; above --dead-warning {dead_warning:g}): train on more tokens, or with a larger "
              "--aux-k-coefficient or a smaller --expansion", file=sys.stderr)


CORRELATION_RANK = 2  # the rank whose active-only correlations `circuits` quotes per layer (the report's default)


def circuits(done: list[str], layers: list[int], tables: Path, input_site: str) -> None:
    """Where the tables are, and per layer the median active-only correlation of the output
    SAE's features with their rank-`CORRELATION_RANK` approximation and how many have none."""
    print(f"circuit tables for layers {layers} in {tables} "
          f"(computed now: {', '.join(done) if done else 'none, all up to date'})")
    lowrank = select(read(tables, "lowrank", layers), input_site)
    if lowrank is None or lowrank.empty:
        return
    rank = min(CORRELATION_RANK, int(lowrank["n_eigs"].max()))
    for layer, mine in lowrank[lowrank["n_eigs"] == rank].groupby("layer"):
        corr, none = mine["corr_active"], int(mine["corr_active"].isna().sum())
        median = f"{corr.median():.3f}" if corr.notna().any() else "none"
        print(f"  layer {layer}: median rank-{rank} correlation {median} over {len(mine) - none} output features; "
              f"{none} of {len(mine)} have none (too few active tokens, see --min-active, or no variance)")


def features(described: pd.DataFrame, tables: Path) -> None:
    print(f"{len(described)} features described in {tables / 'features'}")


def verdicts(table: pd.DataFrame, n: int, seconds: float | None = None, min_cell: int | None = None,
             groups: pd.DataFrame | None = None) -> None:
    """Each layer's best circuit candidates of each kind, then those of each gate tag the table
    has, with how many it formed and tested (`min_cell`: the least tokens a test needs;
    `groups`: the `group_gates` table, every group gate formed, ranked or not)."""
    if groups is not None:  # the layers, input site and outputs of these verdicts
        keys = [c for c in ("layer", "input_site", "outputs") if c in groups and c in table]
        groups = groups.merge(table[keys].drop_duplicates(), on=keys)
    when = f" ({seconds:.0f} s so far)" if seconds is not None else ""
    print(f"\nThe circuit ranking (circuits.gates.ranking): {ranking_rule(first_sentence=True)}")
    for kind, title in (("pair", "input pairs"), ("group", "group gates")):
        print(f"\nBest circuit candidates per layer, {title}, by circuit_rank (the best confirmed by ablation on tokens "
              f"the ranking never read){when}:")
        for g in top(table, kind, n).itertuples(index=False):
            _print_candidate(g)
    for tag in present_tags(table, GATE_TAGS):
        best = tagged(table, tag).sort_values("circuit_rank").groupby(["layer", "kind"]).head(1)
        best = best.sort_values(["kind", "layer"])
        print(f"\n{tag.name.capitalize()}s ({tag.doc}), each layer's best of each kind:")
        for g in best.itertuples(index=False):
            _print_candidate(g)
        for kind in ("pair", "group"):
            print(tag_counts(table, tag, kind, min_cell, groups if kind == "group" else None))


def tag_counts(table: pd.DataFrame, tag, kind: str, min_cell: int | None = None,
               candidates: pd.DataFrame | None = None) -> str:
    """One line on a gate tag's candidates of one kind: how many were formed with sides that
    carry the tag's labels, how many of those were tested by intervention and why the others
    were not, how many the tag marks, how many of these the interventions call `and` and how
    many the model-run ablation confirms. `table` is `gate_verdicts`, which holds the ranked
    candidates only; `candidates`, where given, every one formed (`group_gates` for groups)."""
    ranked = labelled(table[table["kind"] == kind], tag)
    mine = ranked if candidates is None else labelled(candidates, tag)
    layers = lambda frame: sorted({int(x) for x in frame["layer"]})  # noqa: E731
    head = f"{tag.name}s ({kind}s): {len(mine)} formed with sides labelled {' and '.join(tag.channels)}"
    if mine.empty:
        return head + "."
    untested = mine[mine["gate_type"].isna() | (mine["gate_type"] == "untested")]
    parts = [f"{head} in layers {layers(mine)}", f"{len(mine) - len(untested)} tested by intervention"]
    if len(untested):
        need = f" (--min-cell {min_cell})" if min_cell is not None else ""
        # the ranking tokens a test found (group_gates), else the held-out tokens with both sides on
        column, what = (("iv_tokens", "such tokens") if "iv_tokens" in untested else
                        ("both_tokens", "held-out tokens had both sides on"))
        most = int(pd.to_numeric(untested[column], errors="coerce").fillna(0).max())
        parts.append(f"{len(untested)} untested: fewer ranking tokens with both sides on and the output active "
                     f"than a test needs{need}; at most {most} {what}")
    marked = tagged(ranked, tag)
    parts.append(f"{len(marked)} of them {tag.name}s by the tag's rule")
    if len(marked):
        ands = marked[marked["gate_type"] == "and"]
        ablated = marked[marked["drop_a"].notna() & marked["drop_b"].notna()]
        confirmed = marked[marked["is_and"].fillna(False).astype(bool)]
        parts.append(f"interventions say and for {len(ands)}" + (f" (layers {layers(ands)})" if len(ands) else ""))
        parts.append(f"{len(ablated)} ablated in the model, {len(confirmed)} confirmed as AND gates"
                     + (f" (layers {layers(confirmed)})" if len(confirmed) else ""))
    return "; ".join(parts) + "."


def top(verdicts: pd.DataFrame, kind: str, n: int) -> pd.DataFrame:
    """Each layer's `n` best candidates of one kind by circuit_rank."""
    mine = verdicts[verdicts["kind"] == kind].sort_values(["layer", "circuit_rank"])
    return mine.groupby("layer").head(n)


def _share(g, column: str) -> str:
    """`g`'s share in `column` as a percentage, or 'not measured' where it was not."""
    value = getattr(g, column, None)
    return "not measured" if value is None or pd.isna(value) else f"{value:.0%}"


def _print_candidate(g) -> None:
    label = lambda x: x if isinstance(x, str) else "unlabelled"  # noqa: E731
    sides = (f"({int(g.in_a)}, {int(g.in_b)})" if g.kind == "pair"
             else f"groups {[int(m) for m in g.necessary_a]} of {len(g.members_a)} ({label(g.label_a)}) x "
                  f"{[int(m) for m in g.necessary_b]} of {len(g.members_b)} ({label(g.label_b)}), pruned")
    split = ", a split pair" if g.split_pair else ""
    print(f"  layer {g.layer}, circuit rank {g.circuit_rank}: out {g.out_feature} <- {sides}: {g.gate_type}, "
          f"causal_score {g.causal_score:.3f}, bound {g.causal_bound:.3f}, cross term {_share(g, 'cross_share')} of the "
          f"pre-activation (removing a keeps {g.keep_a:.0%}, b {g.keep_b:.0%}, both {g.keep_ab:.0%}; synergy "
          f"{g.synergy:.2f}; gate_score {'not measured' if pd.isna(g.gate_score) else f'{g.gate_score:.3f}'}{split})")
    drops = ", ".join(f"removing {k} keeps {1 - getattr(g, 'drop_' + k):.0%}" for k in ("a", "b", "both")
                      if pd.notna(getattr(g, "drop_" + k)))
    print(f"      verdict: {g.verdict}{'; ' + drops if drops else ''}")
    if pd.notna(g.share_a):
        print(f"      the output's quadratic form there: a {g.share_a:.0%}, b {g.share_b:.0%}, other inputs "
              f"{g.share_other:.0%}, b_dec {g.share_bias:.0%}, SAE error {g.share_error:.0%}")
    print(f"      out {g.out_feature}: {g.out_description}")
    print(f"      a: {g.a_description[:160]}")
    print(f"      b: {g.b_description[:160]}")


def negation(found: dict) -> None:
    """Where the negation is computed (`pipelines.analysis.negation`)."""
    print("\n" + "\n".join(describe_locus(found)))
