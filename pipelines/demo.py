"""The demo: every stage on the built-in corpus, ending with each layer's best circuit
candidates, pairs and group gates, checked on data, and the negation gates among them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd

from circuits.config import Config, option
from circuits.layer import CircuitConfig
from circuits.sites import DEFAULT_SAE_SITES
from pipelines.analysis.features import FeatureConfig
from pipelines.analysis.verdicts import VerdictConfig
from pipelines.data.stories import StoryConfig
from pipelines.engine.files import write_json
from pipelines.engine.paths import RunPaths
from pipelines.explorer.site import write_explorer
from pipelines.inputs import ModelInputs, StageInputs
from pipelines.jobs import CircuitsJob, FeaturesJob, LMJob, SAEJob, VerdictsJob
from pipelines.lm.model import PRESETS
from pipelines.lm.training import LMTrainConfig
from pipelines.report.page import ReportConfig, write_report
from pipelines.runtime import Runtime
from pipelines.stages import (ensure_circuits, ensure_corpus, ensure_features, ensure_lm, ensure_saes, ensure_tokens,
                              ensure_verdicts)
from sae.config import SAETrainConfig

@dataclass(frozen=True)
class DemoConfig(Config):
    """Every setting of the demo, written to `<run>/demo_config.json`."""

    stories: StoryConfig = option(doc="the built-in corpus", factory=lambda: StoryConfig(n_stories=40000))
    lm: LMJob = option(doc="the tokenizer and LM", factory=lambda: LMJob(
        model=PRESETS["demo"], train=LMTrainConfig(train_tokens=2_000_000)))
    # k 16 rather than the paper's share (8 of 512): with k 8 the input SAEs merge "not" with
    # the context's valence into conjunction features, hiding the AND the MLP computes.
    saes: SAEJob = option(doc="the SAEs", factory=lambda: SAEJob(
        sites=DEFAULT_SAE_SITES, sae=SAETrainConfig(k=16, train_tokens=1_000_000)))
    circuits: CircuitsJob = option(doc="circuit tables", factory=CircuitsJob)
    features: FeaturesJob = option(doc="feature descriptions", factory=lambda: FeaturesJob(sites=DEFAULT_SAE_SITES))
    verdicts: VerdictsJob = option(doc="group gates, ablations and verdicts", factory=VerdictsJob)
    report: ReportConfig = option(doc="the HTML report", factory=ReportConfig)
    n_candidates: int = option(8, "best circuit candidates per layer printed, pairs and groups each (at most the "
                                  "verdicts' n_ablate: every one printed is ablated)", low=1)
    explorer: bool = option(True, "write the interactive explorer too")

    def check(self) -> None:
        if self.n_candidates > self.verdicts.verdicts.n_ablate:
            raise ValueError(f"DemoConfig.n_candidates={self.n_candidates} exceeds verdicts.n_ablate="
                             f"{self.verdicts.verdicts.n_ablate}: the demo would print candidates never ablated")

    @classmethod
    def small(cls) -> "DemoConfig":
        """A miniature for the test suite: same stages, a minute or two."""
        return cls(
            stories=StoryConfig(n_stories=2000),
            lm=LMJob(model=PRESETS["tiny"],
                     train=LMTrainConfig(train_tokens=60_000, batch_size=16, eval_every=20, checkpoint_every=50)),
            saes=SAEJob(sites=DEFAULT_SAE_SITES, sae=SAETrainConfig(train_tokens=40_960, batch_size=1024, buffer_tokens=8192,
                                                        eval_rows=8)),
            circuits=CircuitsJob(corr_rows=64, circuits=CircuitConfig(top_n=10, n_gates=5, max_rank=4, min_active=5)),
            features=FeaturesJob(sites=DEFAULT_SAE_SITES, features=FeatureConfig(n_rows=64)),
            verdicts=VerdictsJob(verdicts=VerdictConfig(rows=64, n_ablate=2, min_cell=5)),
            n_candidates=2,
        )

    def with_seed(self, seed: int) -> "DemoConfig":
        """The same demo with one seed for every random choice of every stage."""
        return self.replace(
            stories=self.stories.replace(seed=seed),
            lm=self.lm.replace(corpus=self.lm.corpus.replace(split_seed=seed), model=self.lm.model.replace(seed=seed),
                               train=self.lm.train.replace(seed=seed)),
            saes=self.saes.replace(sae=self.saes.sae.replace(seed=seed)),
            circuits=self.circuits.replace(circuits=self.circuits.circuits.replace(seed=seed)),
            features=self.features.replace(features=self.features.features.replace(seed=seed)),
            verdicts=self.verdicts.replace(verdicts=self.verdicts.verdicts.replace(seed=seed)))


def run_demo(run: RunPaths, cfg: DemoConfig, runtime: Runtime) -> None:
    """Run every stage into `run`, keeping those already done, and print the circuits found."""
    start = time.perf_counter()
    run.root.mkdir(parents=True, exist_ok=True)
    write_json(run.demo_config, cfg.to_json())
    corpus = ensure_corpus(run, cfg.stories)
    lm_job = cfg.lm.replace(corpus=cfg.lm.corpus.replace(lexicon=str(run.lexicon)))
    summary = ensure_lm(run, source=str(corpus), job=lm_job, runtime=runtime)
    print(f"LM: held-out loss {summary['held_out_loss']:.3f} nats ({summary['bits_per_byte']:.3f} bits per byte; "
          f"unigram entropy {summary['unigram_entropy']:.3f}); valence after a negation right "
          f"{summary.get('negated_accuracy', float('nan')):.1%}, plain {summary.get('plain_accuracy', float('nan')):.1%}")
    lm = ModelInputs(run.lm, runtime.device)
    work = StageInputs(run, lm, ensure_tokens(run, str(corpus), lm.tokenizer, lm.config.n_ctx, lm_job.corpus))
    layers = list(range(lm.config.n_layers))
    metrics = ensure_saes(work, job=cfg.saes, layers=layers, runtime=runtime)
    print(metrics[["layer", "site", "nmse", "l0", "dead_fraction", "loss_added"]]
          .to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    ensure_circuits(work, job=cfg.circuits, layers=layers, runtime=runtime)
    ensure_features(work, job=cfg.features, layers=layers, runtime=runtime)
    verdicts = ensure_verdicts(work, job=cfg.verdicts, layers=layers, runtime=runtime)
    print_summary(verdicts, cfg.n_candidates, time.perf_counter() - start)
    if cfg.explorer:
        write_explorer(run)
    report = write_report(run, cfg.report, lm, layers, input_site=cfg.verdicts.input_site)
    print(f"report: {report}")


def print_summary(verdicts: pd.DataFrame, n: int, seconds: float | None = None) -> None:
    """Each layer's best circuit candidates of each kind, then the negation gates."""
    when = f" ({seconds:.0f} s so far)" if seconds is not None else ""
    for kind, title in (("pair", "input pairs"), ("group", "group gates")):
        print(f"\nBest circuit candidates per layer, {title}, by circuit_rank (interventions: every `and` first, "
              f"then by causal_score; split ones last; confirmed by ablation on tokens the ranking never read){when}:")
        for g in top(verdicts, kind, n).itertuples(index=False):
            _print_candidate(g)
    if verdicts["negation_gate"].isna().all():
        return
    negation = verdicts[verdicts["negation_gate"].fillna(False).astype(bool)]
    best = negation.sort_values("circuit_rank").groupby(["layer", "kind"]).head(1).sort_values(["kind", "layer"])
    print("\nNegation gates (a negation side, a one-context side, an output boosting the other context's words), "
          "each layer's best of each kind:")
    for g in best.itertuples(index=False):
        _print_candidate(g)
    for kind in ("pair", "group"):
        mine = best[best["kind"] == kind]
        print(f"negation gates ({kind}s): interventions say and in layers "
              f"{sorted(mine.loc[mine['gate_type'] == 'and', 'layer'])}; confirmed by ablations in layers "
              f"{sorted(mine.loc[mine['is_and'], 'layer'])}.")


def top(verdicts: pd.DataFrame, kind: str, n: int) -> pd.DataFrame:
    """Each layer's `n` best candidates of one kind by circuit_rank."""
    mine = verdicts[verdicts["kind"] == kind].sort_values(["layer", "circuit_rank"])
    return mine.groupby("layer").head(n)


def _print_candidate(g) -> None:
    label = lambda x: x if isinstance(x, str) else "unlabelled"  # noqa: E731
    sides = (f"({int(g.in_a)}, {int(g.in_b)})" if g.kind == "pair"
             else f"groups {[int(m) for m in g.members_a]} ({label(g.label_a)}) x {[int(m) for m in g.members_b]} "
                  f"({label(g.label_b)})")
    split = ", a split pair" if g.split_pair else ""
    print(f"  layer {g.layer}, circuit rank {g.circuit_rank}: out {g.out_feature} <- {sides}: {g.gate_type}, "
          f"causal_score {g.causal_score:.3f} (removing a keeps {g.keep_a:.0%}, b {g.keep_b:.0%}, both "
          f"{g.keep_ab:.0%}; synergy {g.synergy:.2f}; gate_score {g.gate_score:.3f}{split})")
    if g.kind == "group":
        print(f"      necessary members: {list(g.necessary_a)} x {list(g.necessary_b)}")
    drops = ", ".join(f"removing {k} keeps {1 - getattr(g, 'drop_' + k):.0%}" for k in ("a", "b", "both")
                      if pd.notna(getattr(g, "drop_" + k)))
    print(f"      verdict: {g.verdict}{'; ' + drops if drops else ''}")
    if pd.notna(g.share_a):
        print(f"      the output's quadratic form there: a {g.share_a:.0%}, b {g.share_b:.0%}, other inputs "
              f"{g.share_other:.0%}, b_dec {g.share_bias:.0%}, SAE error {g.share_error:.0%}")
    print(f"      out {g.out_feature}: {g.out_description}")
    print(f"      a: {g.a_description[:160]}")
    print(f"      b: {g.b_description[:160]}")
