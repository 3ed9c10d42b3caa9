"""bilinear-circuits from Python: the same functions the `bilinear-circuits` command runs.

```python
import bilinear_circuits as bc

run = bc.open_run("results/demo")        # a finished run: model, tokenizer, SAEs, tables
feature = run.feature(layer=1, feature=10)
feature.top_interactions()                # what the MLP multiplies to build it
feature.eigenvalues, feature.correlation(2)
run.graph("She was not").top_path
```

- `open_run` / `Run`: a run folder, its tables as DataFrames, one feature (`Feature`), a
  layer's ranked circuits, a prompt's attribution graph (`Graph`);
- `Layer`: a `HookedTransformer` and two sae-lens SAEs in memory, with token ids or texts:
  the same per-feature and per-layer results without any run folder;
- `attribution_graph`: a prompt's graph from objects in memory;
- `make_corpus`, `train_lm`, `train_saes`, `run_stage` (circuits, features, verdicts), `report`,
  `explore`, `convert`, `run_demo`: each stage with its config dataclass, as the command line runs it.

Names load on first use (importing TransformerLens and sae-lens takes seconds).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_WHERE = {
    "open_run": "bilinear_circuits.run",
    "Run": "bilinear_circuits.run",
    "Feature": "bilinear_circuits.feature",
    "Layer": "bilinear_circuits.layer",
    "Graph": "bilinear_circuits.graph",
    "Viewer": "bilinear_circuits.graph",
    "attribution_graph": "bilinear_circuits.graph",
    "run_stage": "bilinear_circuits.stages",
    "make_corpus": "bilinear_circuits.stages",
    "train_lm": "bilinear_circuits.stages",
    "train_saes": "bilinear_circuits.stages",
    "run_demo": "bilinear_circuits.stages",
    "report": "bilinear_circuits.stages",
    "explore": "bilinear_circuits.stages",
    "convert": "bilinear_circuits.stages",
    "ReportConfig": "pipelines.report.config",
    "SiteChoice": "pipelines.jobs",
    "CircuitConfig": "circuits.layer",
    "FeatureConfig": "pipelines.analysis.features",
    "VerdictConfig": "pipelines.analysis.verdicts",
    "GraphConfig": "pipelines.graph.build",
    "CircuitsJob": "pipelines.jobs",
    "FeaturesJob": "pipelines.jobs",
    "VerdictsJob": "pipelines.jobs",
    "GraphJob": "pipelines.jobs",
    "SAEJob": "pipelines.jobs",
    "LMJob": "pipelines.jobs",
    "StoryConfig": "pipelines.data.stories",
    "DemoConfig": "pipelines.demo",
    "Runtime": "pipelines.runtime",
}

__all__ = sorted(_WHERE)

if TYPE_CHECKING:  # for type checkers and the API reference; at run time names load on first use
    from bilinear_circuits.feature import Feature
    from bilinear_circuits.graph import Graph, Viewer, attribution_graph
    from bilinear_circuits.layer import Layer
    from bilinear_circuits.run import Run, open_run
    from bilinear_circuits.stages import (convert, explore, make_corpus, report, run_demo, run_stage, train_lm,
                                          train_saes)
    from circuits.layer import CircuitConfig
    from pipelines.analysis.features import FeatureConfig
    from pipelines.analysis.verdicts import VerdictConfig
    from pipelines.data.stories import StoryConfig
    from pipelines.demo import DemoConfig
    from pipelines.graph.build import GraphConfig
    from pipelines.jobs import CircuitsJob, FeaturesJob, GraphJob, LMJob, SAEJob, SiteChoice, VerdictsJob
    from pipelines.report.config import ReportConfig
    from pipelines.runtime import Runtime


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'bilinear_circuits' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
