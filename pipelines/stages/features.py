"""The `features` stage: the `features` and `feature_labels` tables, one part per (layer, site).

Each (layer, site) is its own part (`features/layer2/mlp_out.parquet`), so describing one
site's SAEs leaves the others' descriptions as they are. Here every SAE still to do is
described in one pass over the held-out rows; on Ray, each layer is a task.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pandas as pd

from pipelines import schemas, summary
from pipelines.analysis.features import feature_tables
from pipelines.engine.files import digest
from pipelines.engine.stamps import Stamp
from pipelines.engine.tasks import Task
from pipelines.inputs import StageInputs
from pipelines.jobs import FeaturesJob
from pipelines.runtime import Runtime
from pipelines.stages.base import TABLE_FORMAT, Command, Part, Plan, TableStage, gpus, held_out_digest

class Features(TableStage):
    name = "features"
    rows_flag = "--rows"

    def rows(self, job: FeaturesJob) -> int:
        return job.description.n_rows

    def parts(self, work: StageInputs, job: FeaturesJob, plan: Plan) -> list[Part]:
        return [Part(layer, site, _stamp(work, job, sae.path), ("features",), site)
                for layer, mine in plan.items() for (_, site), sae in mine.described(work.lm, job.sites).items()]

    def tasks(self, parts: list[Part], plan: Plan, runtime: Runtime) -> list[Task]:
        """One task for every layer here (one pass over the rows), one per layer on Ray."""
        layers = sorted({part.layer for part in parts})
        if runtime.ray is None and parts:
            return [Task("layers " + ", ".join(map(str, layers)), (plan, parts))]
        return [Task(f"layer {layer}", ({layer: plan[layer]}, [p for p in parts if p.layer == layer]), gpus(runtime))
                for layer in layers]

    def work(self, work: StageInputs, job: FeaturesJob, unit: tuple[Plan, list[Part]], threads: int
             ) -> Iterator[tuple[Part, dict[str, pd.DataFrame]]]:
        plan, parts = unit
        saes = {}
        for part in parts:
            saes.update({point: sae for point, sae in plan[part.layer].described(work.lm, (part.detail,)).items()
                         if point[1] == part.detail})
        features, labels = feature_tables(work.lm.model, work.lm.tokenizer, work.store.held_out,
                                          {point: sae.weights for point, sae in saes.items()}, job.description,
                                          work.store.classes, work.store.lexicon_tokens, work.lm.token_counts)
        for part in parts:
            mine = lambda frame: frame[(frame["layer"] == part.layer) & (frame["site"] == part.detail)]  # noqa: E731
            yield part, {"features": mine(features), "feature_labels": mine(labels)}
        work.report(job.description.n_rows * work.store.held_out.n_ctx)

    def result(self, work: StageInputs, job: FeaturesJob, plan: Plan, computed: list[Part]) -> pd.DataFrame:
        """The `features` rows of every planned layer."""
        return schemas.read(work.run.tables, "features", list(plan))


def _stamp(work: StageInputs, job: FeaturesJob, sae_path: Path) -> Stamp:
    return Stamp("features", {"model": work.lm.digest, "held_out": held_out_digest(work.store), "sae": digest(sae_path)},
                 {"format": TABLE_FORMAT, "features": job.description.recipe()})


STAGE = Features()
COMMAND = Command(
    "features", FeaturesJob, help="describe SAE features (contexts, tokens, logits, labels)",
    description="Write OUT/tables/features/ and feature_labels/: frequency, contexts from distinct documents and "
                "several quantiles, token-feature flags, boosted tokens and, with labels, the share of activation per "
                "label class.",
    show=lambda args, run, plan, described: summary.features(described, run.tables), rename={"n_rows": "rows"})
