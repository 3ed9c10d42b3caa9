"""One frozen job config per stage: everything a stage's command decides, in one object.

The command line fills these from its flags (`pipelines.options.add_job`/`job_from`), the
demo holds one of each, and a stage's stamp is its job's `recipe()` (runtime fields, such as
which SAE folders were named, are left out: their content digests are stamp inputs instead).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from circuits.config import Config, option
from circuits.layer import CircuitConfig
from circuits.sae_basis import OUTPUT_BASES
from circuits.sites import DEFAULT_INPUT_SITE, DEFAULT_SAE_SITES, INPUT_SITES, OUTPUT_SITE, SITES
from pipelines.analysis.features import FeatureConfig
from pipelines.analysis.verdicts import VerdictConfig
from pipelines.data.corpus import CorpusConfig
from pipelines.data.tokenizer import TokenizerConfig
from pipelines.engine.paths import RunPaths
from pipelines.graph.build import GraphConfig
from pipelines.inputs import LayerPlan, ModelInputs, plan_layers
from pipelines.lm.model import ModelConfig
from pipelines.lm.training import LMTrainConfig
from sae.config import SAETrainConfig


@dataclass(frozen=True)
class LMJob(Config):
    """What `train-lm` trains: corpus reading, model shape, tokenizer and optimisation."""

    corpus: CorpusConfig = option(doc="reading and splitting the corpus", factory=CorpusConfig)
    model: ModelConfig = option(doc="the LM's shape", factory=ModelConfig)
    tokenizer: TokenizerConfig = option(doc="tokenizer training", factory=TokenizerConfig)
    train: LMTrainConfig = option(doc="LM training", factory=LMTrainConfig)


@dataclass(frozen=True)
class SAEJob(Config):
    """What `train-saes` trains: one SAE per chosen layer and site, all with one recipe."""

    sites: tuple[str, ...] = option(DEFAULT_SAE_SITES, f"sites to train SAEs on: {', '.join(SITES)}")
    sae: SAETrainConfig = option(doc="each SAE's recipe", factory=SAETrainConfig)
    dead_warning: float = option(0.1, "warn when an SAE's dead fraction (latents that never fire on the evaluation "
                                      "tokens) is above this", low=0.0, high=1.0, runtime=True)

    def check(self) -> None:
        _check_sites(self.sites, SITES)


@dataclass(frozen=True)
class SAEChoice(Config):
    """Which SAEs an analysis reads: the run's own, or folders named for a single layer."""

    sae_in: str | None = option(None, "input-side SAE folder (sae-lens's or the paper authors' format, on "
                                      f"{' or '.join(INPUT_SITES)}), with a single --layer", runtime=True)
    sae_out: str | None = option(None, f"output-side ({OUTPUT_SITE}) SAE folder, with a single --layer", runtime=True)
    allow_hookless_saes: bool = option(False, "accept SAEs that record no hook, taking them to read the given layer "
                                              "and site", runtime=True)

    def plan(self, run: RunPaths, inputs: ModelInputs, layers: list[int]) -> dict[int, LayerPlan]:
        """Each layer's plan (`pipelines.inputs.LayerPlan`): the named SAE folders of the
        single chosen layer, or the run's own read at `read_site()`."""
        explicit = None
        if self.sae_in or self.sae_out:
            if not self.sae_in or len(layers) != 1:
                raise ValueError("--sae-in (with --sae-out for SAE outputs) goes with a single --layer")
            explicit = (Path(self.sae_in), Path(self.sae_out) if self.sae_out else None)
        return plan_layers(run, inputs, layers, explicit, self.read_site(), self.allow_hookless_saes)

    def read_site(self) -> str:
        """Where the run's own input SAEs are read (and a named one that records no hook)."""
        return DEFAULT_INPUT_SITE


@dataclass(frozen=True)
class SiteChoice(SAEChoice):
    """Which SAEs an analysis reads, and at which input site the run's own are read."""

    input_site: str = option(DEFAULT_INPUT_SITE, "which of the run's input SAEs to read", choices=INPUT_SITES)

    def read_site(self) -> str:
        return self.input_site


@dataclass(frozen=True)
class CircuitsJob(SiteChoice):
    """What `circuits` computes for each layer."""

    outputs: tuple[str, ...] = option(("sae",), "output directions: sae (the output SAE's features), hosvd, "
                                                "logit:GOOD-BAD or logit:WORD (unembedding directions), file:PATH "
                                                "(.npy/.safetensors)")
    output_basis: str = option("encoder", "read SAE outputs by their encoder rows (exact pre-activations) or decoder "
                                          "rows", choices=OUTPUT_BASES)
    corr_rows: int = option(1024, "held-out rows for correlations, gate statistics and truth tables", low=1)
    analysis: CircuitConfig = option(doc="the per-layer analysis", factory=CircuitConfig)


@dataclass(frozen=True)
class FeaturesJob(SAEChoice):
    """What `features` describes."""

    sites: tuple[str, ...] = option(SITES, "the run's SAE sites to describe, where they exist")
    description: FeatureConfig = option(doc="feature descriptions", factory=FeatureConfig)

    def check(self) -> None:
        _check_sites(self.sites, SITES)


@dataclass(frozen=True)
class VerdictsJob(SiteChoice):
    """What `verdicts` checks for each layer."""

    rules: VerdictConfig = option(doc="ranking, groups, ablations and verdicts", factory=VerdictConfig)


@dataclass(frozen=True)
class GraphJob(SAEChoice):
    """What `graph` builds: attribution graphs from the run's SAEs or those of one --layer."""

    graph: GraphConfig = option(doc="attribution graphs", factory=GraphConfig)

    def read_site(self) -> str:
        return self.graph.input_site


def _check_sites(sites: tuple[str, ...], known: tuple[str, ...]) -> None:
    if len(set(sites)) != len(sites):
        raise ValueError(f"--sites names a site twice: {','.join(sites)}")
    unknown = [s for s in sites if s not in known]
    if unknown:
        raise ValueError(f"unknown site {unknown[0]!r}; choose from {', '.join(known)}")
