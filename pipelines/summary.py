"""What the commands and the demo print: one function per kind of outcome."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pipelines.data.tags import present_tags, tagged
from pipelines.schemas import GATE_TAGS

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


def sae_metrics(metrics: pd.DataFrame) -> None:
    """One line per SAE: its size and quality."""
    print(metrics[METRIC_COLUMNS].to_string(index=False, float_format=lambda v: f"{v:.4f}"))


def circuits(done: list[str], layers: list[int], tables: Path) -> None:
    print(f"circuit tables for layers {layers} in {tables} "
          f"(computed now: {', '.join(done) if done else 'none, all up to date'})")


def features(described: pd.DataFrame, tables: Path) -> None:
    print(f"{len(described)} features described in {tables / 'features'}")


def verdicts(table: pd.DataFrame, n: int, seconds: float | None = None) -> None:
    """Each layer's best circuit candidates of each kind, then those of each gate tag the table has."""
    when = f" ({seconds:.0f} s so far)" if seconds is not None else ""
    for kind, title in (("pair", "input pairs"), ("group", "group gates")):
        print(f"\nBest circuit candidates per layer, {title}, by circuit_rank (interventions: bilinear ands first, then "
              f"sure threshold ands, then by causal_bound, the causal score less its sampling error; split ones last; confirmed by ablation on "
              f"tokens the ranking never read){when}:")
        for g in top(table, kind, n).itertuples(index=False):
            _print_candidate(g)
    for tag in present_tags(table, GATE_TAGS):
        best = tagged(table, tag).sort_values("circuit_rank").groupby(["layer", "kind"]).head(1)
        best = best.sort_values(["kind", "layer"])
        print(f"\n{tag.name.capitalize()}s ({tag.doc}), each layer's best of each kind:")
        for g in best.itertuples(index=False):
            _print_candidate(g)
        for kind in ("pair", "group"):
            mine = best[best["kind"] == kind]
            print(f"{tag.name}s ({kind}s): interventions say and in layers "
                  f"{sorted(mine.loc[mine['gate_type'] == 'and', 'layer'])}; confirmed by ablations in layers "
                  f"{sorted(mine.loc[mine['is_and'], 'layer'])}.")


def top(verdicts: pd.DataFrame, kind: str, n: int) -> pd.DataFrame:
    """Each layer's `n` best candidates of one kind by circuit_rank."""
    mine = verdicts[verdicts["kind"] == kind].sort_values(["layer", "circuit_rank"])
    return mine.groupby("layer").head(n)


def _print_candidate(g) -> None:
    label = lambda x: x if isinstance(x, str) else "unlabelled"  # noqa: E731
    sides = (f"({int(g.in_a)}, {int(g.in_b)})" if g.kind == "pair"
             else f"groups {[int(m) for m in g.necessary_a]} of {len(g.members_a)} ({label(g.label_a)}) x "
                  f"{[int(m) for m in g.necessary_b]} of {len(g.members_b)} ({label(g.label_b)}), pruned")
    split = ", a split pair" if g.split_pair else ""
    print(f"  layer {g.layer}, circuit rank {g.circuit_rank}: out {g.out_feature} <- {sides}: {g.gate_type}, "
          f"causal_score {g.causal_score:.3f}, bound {g.causal_bound:.3f}, cross term {g.cross_share:.0%} of the "
          f"pre-activation (removing a keeps {g.keep_a:.0%}, b {g.keep_b:.0%}, both "
          f"{g.keep_ab:.0%}; synergy {g.synergy:.2f}; gate_score {g.gate_score:.3f}{split})")
    drops = ", ".join(f"removing {k} keeps {1 - getattr(g, 'drop_' + k):.0%}" for k in ("a", "b", "both")
                      if pd.notna(getattr(g, "drop_" + k)))
    print(f"      verdict: {g.verdict}{'; ' + drops if drops else ''}")
    if pd.notna(g.share_a):
        print(f"      the output's quadratic form there: a {g.share_a:.0%}, b {g.share_b:.0%}, other inputs "
              f"{g.share_other:.0%}, b_dec {g.share_bias:.0%}, SAE error {g.share_error:.0%}")
    print(f"      out {g.out_feature}: {g.out_description}")
    print(f"      a: {g.a_description[:160]}")
    print(f"      b: {g.b_description[:160]}")
