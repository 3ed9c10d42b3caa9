"""What the commands and the demo print: one function per kind of outcome."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pipelines.analysis.negation import summarise
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
        print(f"\nBest circuit candidates per layer, {title}, by circuit_rank (interventions: every sure `and` first, "
              f"then by causal_bound, the causal score less its sampling error; split ones last; confirmed by ablation on "
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
          f"causal_score {g.causal_score:.3f}, bound {g.causal_bound:.3f} (removing a keeps {g.keep_a:.0%}, b {g.keep_b:.0%}, both "
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


def negation(found: dict | None) -> None:
    """Where the negation is computed (`pipelines.analysis.negation`)."""
    print("\n" + "\n".join(negation_lines(found)))


def negation_lines(found: dict | None, min_active: float = 0.1) -> list[str]:
    """The negation locus as lines of text, for the printed summary and the report."""
    if not found:
        return ["Negation locus: not scanned (the corpus has no negation and context labels)."]
    first, second = found["lexicon"]
    counts = found["counts"]
    parts = {c["component"]: c for c in found["components"]}
    total = parts.pop("total")
    lines = [f"Where the negation is computed. Direct effect on the logit difference of {first} minus {second} words, "
             f"signed toward the next word's class, mean on {counts['negated']} negated / {counts['plain']} plain "
             f"positions: " + ", ".join(f"{n} {c['negated']:+.2f}/{c['plain']:+.2f}" for n, c in parts.items())
             + f"; all {total['negated']:+.2f}/{total['plain']:+.2f} (right on {total['negated_right']:.0%} of the "
             "negated positions)."]
    mlps = {n: c["negated"] for n, c in parts.items() if n.startswith("mlp")}
    attns = {n: c["negated"] for n, c in parts.items() if n.startswith("attn")}
    if mlps and attns:
        m, a = max(mlps, key=mlps.get), max(attns, key=attns.get)
        lines.append(f"  toward the flipped class after a negation, most among the MLPs: {m} ({mlps[m]:+.2f}); among "
                     f"the attention layers: {a} ({attns[a]:+.2f})")
    if found.get("decodable"):
        lines.append("  the next word's class read linearly from the residual stream after each part (a ridge readout, "
                     "accuracy on held-out rows, negated/plain): " + ", ".join(
                         f"{d['after']} {d['negated']:.0%}/{d['plain']:.0%}" for d in found["decodable"]))
    intact = {d["after"]: d for d in found.get("decodable", [])}
    for layer in sorted({w["layer"] for w in found.get("without", [])}):
        kept = intact[f"mlp {layer}"]
        lines.append(f"  that readout after mlp {layer} ({kept['negated']:.0%}/{kept['plain']:.0%}) with a part of the "
                     "stream removed: " + ", ".join(f"{w['removed']} {w['negated']:.0%}/{w['plain']:.0%}"
                                                      for w in found["without"] if w["layer"] == layer))
    figures = summarise(found, min_active)
    if not figures["rows"]:
        lines.append("  no layer has both a negation and a context label group: no cross term to measure")
        return lines
    names = {"sae": "SAE out", "logit": "", "best-cross": "best cross direction", "hosvd": "HOSVD direction"}
    heading = None
    for r in figures["rows"]:
        if heading != (r["layer"], r["source"], r["context"]):
            heading = (r["layer"], r["source"], r["context"])
            sides = (f"negation ({r['n_a']} inputs) x {r['group_b']} ({r['n_b']} inputs)" if r["source"] == "labels"
                     else "the negation x context directions of the MLP input (difference of means, centred)")
            both = f" (both groups on at {r['both_on']:.0%})" if pd.notna(r["both_on"]) else ""
            p, q = r["n_a"], r["n_b"]
            lines.append(f"  layer {r['layer']}, {sides}, {r['n_tokens']} negated positions in {r['context']} "
                         f"contexts{both}; cross term as a share of the output's quadratic part there (weights: an "
                         f"unstructured form's cross share is {2 * p * q / (p + q) ** 2:.2f}):")
        active = f" (active on {r['active']:.0%})" if r["kind"] == "sae" else ""
        lines.append(f"    {(names[r['kind']] + ' ' + r['direction']).strip()}{active}: cross {r['share_cross']:+.1%} "
                     f"(the norm recomputed: {r['share_cross_renormed']:+.1%}; own terms: negation {r['share_own_a']:+.1%}, context {r['share_own_b']:+.1%}; rest "
                     f"{r['share_rest']:+.1%}); weights: cross share {r['w_cross_share']:.2f}, eigenvalues "
                     f"{r['lambda_pos']:+.3f}/{r['lambda_neg']:+.3f}"
                     + (f"; in logits toward the next word: cross {r['logit_cross']:+.2f} of the MLP's "
                        f"{r['logit_total']:+.2f}" if r["kind"] == "logit" else ""))
    largest = figures["largest"]
    if largest is not None:
        lines.append(f"  largest cross term of an SAE feature active on at least {min_active:.0%} of the negated "
                     f"positions: {largest['share_cross']:+.1%} of its output (layer {largest['layer']}, out "
                     f"{largest['direction']}, {largest['context']} contexts, {largest['source']} groups)")
    return lines
