"""What the report shows: its config, apart from the page so that every command's parser can
offer the report's flags without importing the figures' plotting library."""

from __future__ import annotations

from dataclasses import dataclass

from circuits.config import Config, option


@dataclass(frozen=True)
class ReportConfig(Config):
    """What the report shows and how much it computes (about a minute on the demo)."""

    n_candidates: int = option(8, "circuit candidates per layer in each layer's tables (pairs, groups)", low=1)
    cards_per_layer: int = option(1, "best candidates per layer and kind shown in detail", low=0)
    n_inputs: int = option(8, "input features per interaction heatmap", low=2)
    n_eigen_bars: int = option(16, "largest eigenvalues drawn per spectrum", low=1)
    hist_rank: int = option(2, "rank whose correlations are histogrammed and quoted", low=1)
    dpi: int = option(100, "resolution of the PNG figures", low=20)
