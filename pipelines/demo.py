"""The demo: every stage on the built-in corpus, ending with the negation AND-gates found."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from circuits.layer import CircuitConfig
from circuits.tables import read_table
from pipelines.features import FeatureConfig
from pipelines.lm_training import LMTrainConfig
from pipelines.model import PRESETS, ModelConfig
from pipelines.negation import label_gates, top_gates, with_rank2_correlation
from pipelines.paths import RunPaths
from pipelines.report import ReportConfig, write_report
from pipelines.stages import ensure_circuits, ensure_corpus, ensure_features, ensure_lm, ensure_saes
from pipelines.stories import StoryConfig
from pipelines.tokenizer import TokenizerConfig, load_tokenizer
from sae.config import SAETrainConfig
from sae.sites import SAE_SITES


@dataclass
class DemoConfig:
    """Every setting of the demo, written to `<run>/demo_config.json`."""

    stories: StoryConfig = field(default_factory=lambda: StoryConfig(n_stories=40000))  # corpus
    model: ModelConfig = field(default_factory=lambda: PRESETS["demo"])  # LM shape
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # tokenizer training
    lm: LMTrainConfig = field(default_factory=lambda: LMTrainConfig(train_tokens=2_000_000))  # LM training
    # k 16 rather than the paper's share (8 of 512): with k 8 the input SAEs merge "not" with
    # the context's valence into conjunction features, hiding the AND the MLP computes.
    sae: SAETrainConfig = field(default_factory=lambda: SAETrainConfig(k=16, train_tokens=1_000_000))  # each SAE
    circuits: CircuitConfig = field(default_factory=CircuitConfig)  # circuit tables
    corr_rows: int = 1024  # held-out rows for the low-rank correlations
    features: FeatureConfig = field(default_factory=FeatureConfig)  # feature descriptions
    report: ReportConfig = field(default_factory=ReportConfig)  # the HTML report
    n_candidates: int = 8  # top gate candidates per layer printed and checked at the end

    @classmethod
    def small(cls) -> "DemoConfig":
        """A miniature for the test suite: same stages, minutes instead of a quarter hour."""
        return cls(
            stories=StoryConfig(n_stories=2000),
            model=PRESETS["tiny"],
            lm=LMTrainConfig(train_tokens=60_000, batch_size=16, eval_every=20, checkpoint_every=50),
            sae=SAETrainConfig(train_tokens=40_960, batch_size=1024, buffer_tokens=8192, eval_seqs=8),
            circuits=CircuitConfig(top_n=10, n_gates=5, max_rank=4, min_active=5),
            corr_rows=64,
            features=FeatureConfig(n_rows=64),
        )


def run_demo(run: RunPaths, cfg: DemoConfig) -> None:
    """Run every stage into `run`, skipping those already done, and print the gates found."""
    start = time.perf_counter()
    run.root.mkdir(parents=True, exist_ok=True)
    (run.root / "demo_config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    corpus = str(ensure_corpus(run, cfg.stories))
    model, model_cfg, summary = ensure_lm(run, corpus, cfg.model, cfg.tokenizer, cfg.lm)
    print(f"LM: held-out loss {summary['held_out_loss']:.3f} nats (unigram entropy "
          f"{summary['unigram_entropy']:.3f}); valence after negation right "
          f"{summary.get('negated_accuracy', float('nan')):.1%}, plain {summary.get('plain_accuracy', float('nan')):.1%}")
    tok = load_tokenizer(run.lm)
    layers = list(range(model_cfg.n_layers))
    metrics = ensure_saes(run, model, tok, corpus, layers, list(SAE_SITES), cfg.sae)
    print(metrics[["layer", "site", "nmse", "l0", "dead_fraction", "loss_added"]]
          .to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    ensure_circuits(run, model, tok, corpus, layers, cfg.circuits, cfg.corr_rows)
    features = ensure_features(run, model, tok, corpus, layers, list(SAE_SITES), cfg.features)
    report = write_report(run, cfg.report)

    gates = label_gates(top_gates(read_table(run.tables, "gates"), cfg.n_candidates), features)
    gates = with_rank2_correlation(gates, read_table(run.tables, "lowrank"))
    print(f"\nTop AND-gate candidates per layer, by and_score ({time.perf_counter() - start:.0f} s so far):")
    for g in gates.itertuples(index=False):
        flag = "  <- NEGATION GATE" if g.is_negation_gate else ""
        print(f"  layer {g.layer} out {g.out_feature} <- ({g.in_a}, {g.in_b}): and_score {g.and_score:.3f}, "
              f"cross {g.cross:.3f}, self {g.self_a:.3f}/{g.self_b:.3f}, rank-2 corr {g.corr_rank2:.2f} "
              f"({g.n_active} active tokens){flag}")
        print(f"      out {g.out_feature}: {g.out_description}")
        print(f"      in {g.in_a}: {g.in_a_description}")
        print(f"      in {g.in_b}: {g.in_b_description}")
    found = int(gates["is_negation_gate"].sum())
    print(f"\n{found} negation AND-gate(s) among the top {cfg.n_candidates} candidates of each layer "
          "(negation input x one-valence context input -> output predicting the other valence).")
    print(f"report: {report}")
