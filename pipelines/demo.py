"""The demo: every stage on the built-in corpus, ending with each layer's best gate
candidates, checked on data, and the negation AND-gates among them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd

from circuits.config import Config, option
from circuits.layer import CircuitConfig
from pipelines.analysis.features import FeatureConfig
from pipelines.analysis.verdicts import best_candidates, circuit_part, gate_verdicts, negation_candidates
from pipelines.data.corpus import LEXICON_FILE, CorpusConfig
from pipelines.data.stories import StoryConfig
from pipelines.data.tokenizer import TokenizerConfig
from pipelines.engine.files import write_json
from pipelines.engine.paths import RunPaths
from pipelines.engine.tables import read_table
from pipelines.explorer.site import write_explorer
from pipelines.lm.model import PRESETS, ModelConfig
from pipelines.lm.training import LMTrainConfig
from pipelines.report.page import ReportConfig, write_report
from pipelines.stages import (ModelInputs, ensure_ablations, ensure_circuits, ensure_corpus, ensure_features, ensure_lm,
                              ensure_saes, ensure_tokens)
from sae.config import SAETrainConfig

SITES = ["resid_mid", "mlp_out"]


@dataclass(frozen=True)
class DemoConfig(Config):
    """Every setting of the demo, written to `<run>/demo_config.json`."""

    stories: StoryConfig = option(doc="the built-in corpus", factory=lambda: StoryConfig(n_stories=40000))
    model: ModelConfig = option(doc="the LM's shape", factory=lambda: PRESETS["demo"])
    tokenizer: TokenizerConfig = option(doc="tokenizer training", factory=TokenizerConfig)
    lm: LMTrainConfig = option(doc="LM training", factory=lambda: LMTrainConfig(train_tokens=2_000_000))
    # k 16 rather than the paper's share (8 of 512): with k 8 the input SAEs merge "not" with
    # the context's valence into conjunction features, hiding the AND the MLP computes.
    sae: SAETrainConfig = option(doc="each SAE", factory=lambda: SAETrainConfig(k=16, train_tokens=1_000_000))
    circuits: CircuitConfig = option(doc="circuit tables", factory=CircuitConfig)
    corr_rows: int = option(1024, "held-out rows for correlations, gate statistics and truth tables", low=1)
    features: FeatureConfig = option(doc="feature descriptions", factory=FeatureConfig)
    report: ReportConfig = option(doc="the HTML report", factory=ReportConfig)
    n_candidates: int = option(8, "best data-ranked gate candidates per layer printed and checked", low=1)
    explorer: bool = option(True, "write the interactive explorer too")

    @classmethod
    def small(cls) -> "DemoConfig":
        """A miniature for the test suite: same stages, a minute or two."""
        return cls(
            stories=StoryConfig(n_stories=2000),
            model=PRESETS["tiny"],
            lm=LMTrainConfig(train_tokens=60_000, batch_size=16, eval_every=20, checkpoint_every=50),
            sae=SAETrainConfig(train_tokens=40_960, batch_size=1024, buffer_tokens=8192, eval_rows=8),
            circuits=CircuitConfig(top_n=10, n_gates=5, max_rank=4, min_active=5, n_ablate=2),
            corr_rows=64,
            features=FeatureConfig(n_rows=64),
            n_candidates=4,
        )

    def with_seed(self, seed: int) -> "DemoConfig":
        """The same demo with one seed for the corpus, the LM, the SAEs and the descriptions."""
        return self.replace(stories=self.stories.replace(seed=seed), lm=self.lm.replace(seed=seed),
                            sae=self.sae.replace(seed=seed))


def run_demo(run: RunPaths, cfg: DemoConfig, device: str = "cpu") -> None:
    """Run every stage into `run`, keeping those already done, and print the gates found."""
    start = time.perf_counter()
    run.root.mkdir(parents=True, exist_ok=True)
    write_json(run.root / "demo_config.json", cfg.to_json())
    corpus = ensure_corpus(run, cfg.stories)
    corpus_cfg = CorpusConfig(lexicon=str(corpus / LEXICON_FILE))
    summary = ensure_lm(run, str(corpus), corpus_cfg, cfg.model, cfg.tokenizer, cfg.lm, device)
    print(f"LM: held-out loss {summary['held_out_loss']:.3f} nats ({summary['bits_per_byte']:.3f} bits per byte; "
          f"unigram entropy {summary['unigram_entropy']:.3f}); valence after a negation right "
          f"{summary.get('negated_accuracy', float('nan')):.1%}, plain {summary.get('plain_accuracy', float('nan')):.1%}")
    inputs = ModelInputs(run.lm, device)
    store = ensure_tokens(run, str(corpus), inputs.tokenizer, inputs.config.n_ctx, corpus_cfg)
    layers_all = list(range(inputs.config.n_layers))
    metrics = ensure_saes(run, inputs, store, layers_all, SITES, cfg.sae, device)
    print(metrics[["layer", "site", "nmse", "l0", "dead_fraction", "loss_added"]]
          .to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    ensure_circuits(run, inputs, store, layers_all, cfg.circuits, cfg.corr_rows)
    ensure_features(run, inputs, store, layers_all, SITES, cfg.features, seed=cfg.stories.seed)

    read = lambda name: circuit_part(read_table(run.tables, name))  # noqa: E731
    gates, features, labels = read("gates"), read("features"), read("feature_labels")
    general = best_candidates(gates, cfg.n_candidates)
    negation = negation_candidates(gates, labels)
    ablation = ensure_ablations(run, inputs, store, pd.concat([general, negation]), cfg.corr_rows)
    print(f"\nBest gate candidates per layer, ranked by gate_score (contribution to the output's activation on "
          f"held-out tokens times and_data) ({time.perf_counter() - start:.0f} s so far):")
    for g in gate_verdicts(general, ablation, features, labels).itertuples(index=False):
        _print_candidate(g)
    found = gate_verdicts(negation, ablation, features, labels)
    print("\nNegation gates (a negation input, a one-context input, an output boosting the other context's words), "
          "each layer's best by gate_score:")
    for g in found.itertuples(index=False):
        _print_candidate(g)
    layers = sorted(found.loc[found["truth_and"], "layer"].tolist()) if len(found) else []
    confirmed = sorted(found.loc[found["is_and"], "layer"].tolist()) if len(found) else []
    print(f"\nnegation gates whose truth table says AND in layers {layers}; confirmed by ablations in layers "
          f"{confirmed}.")
    if cfg.explorer:
        write_explorer(run)
    report = write_report(run, cfg.report, inputs, layers_all, store)
    print(f"report: {report}")


def _print_candidate(g) -> None:
    print(f"  layer {g.layer}, data rank {g.layer_rank}: out {g.out_feature} <- ({g.in_a}, {g.in_b}): gate_score "
          f"{g.gate_score:.3f} (contribution {g.contribution_share:.1%}, both inputs on {g.coactivation:.0%} of its "
          f"tokens, and_data {g.and_data:.2f}), weights and_score {g.and_score:.3f}")
    drops = ", ".join(f"removing {k} keeps {1 - getattr(g, 'drop_' + k):.0%}" for k in ("a", "b", "both")
                      if pd.notna(getattr(g, "drop_" + k, float("nan"))))
    print(f"      verdict: {g.verdict}{'; ' + drops if drops else ''}")
    print(f"      out {g.out_feature}: {g.out_description}")
    print(f"      in {g.in_a}: {g.a_description}")
    print(f"      in {g.in_b}: {g.b_description}")
