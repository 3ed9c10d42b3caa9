"""The `verdicts` stage: group gates, ablations and the `gate_verdicts` table of each layer
(`pipelines.analysis.judge`), one part per layer: the output SAE's features' tables."""

from __future__ import annotations

from collections.abc import Iterator

import pandas as pd

from circuits.sites import OUTPUT_SITE
from pipelines import schemas, summary
from pipelines.analysis.judge import CIRCUIT_READS
from pipelines.analysis.single import judge_tables
from pipelines.engine.files import digest
from pipelines.engine.paths import RunPaths
from pipelines.engine.stamps import Stamp
from pipelines.engine.tables import table_path
from pipelines.inputs import LayerPlan, LayerSAEs, StageInputs, check_tables_match
from pipelines.jobs import VerdictsJob
from pipelines.options import whole_number
from pipelines.stages.base import TABLE_FORMAT, Command, Part, Plan, TableStage, held_out_digest

TABLES = tuple(name for name, table in schemas.TABLES.items() if table.stage == "verdicts")


class Verdicts(TableStage):
    name = "verdicts"
    rows_flag = "--rows"

    def rows(self, job: VerdictsJob) -> int:
        return job.rules.rows

    def parts(self, work: StageInputs, job: VerdictsJob, plan: Plan) -> list[Part]:
        for mine in plan.values():
            check_tables_match(work.run, mine, features=True)
        return [Part(layer, mine.part, _stamp(work, job, mine, mine.saes(work.lm)), TABLES)
                for layer, mine in plan.items()]

    def work(self, work: StageInputs, job: VerdictsJob, unit: tuple[LayerPlan, list[Part]], threads: int
             ) -> Iterator[tuple[Part, dict[str, pd.DataFrame]]]:
        """Rank, group, ablate and judge one layer's gate candidates."""
        plan, (part,) = unit
        run, layer = work.run, plan.layer
        saes = plan.saes(work.lm)
        circuits = {name: schemas.select(schemas.read(run.tables, name, [layer]), saes.input_site)
                    for name in CIRCUIT_READS}
        features, labels = (schemas.read(run.tables, name, [layer]) for name in ("features", "feature_labels"))
        yield part, judge_tables(work.lm.model, saes, work.store.held_out, circuits, features, labels,
                                 work.lm.tokenizer, work.lm.untrained, job.rules, streams=work.streams)
        work.report(job.rules.rows * work.store.held_out.n_ctx)

    def result(self, work: StageInputs, job: VerdictsJob, plan: Plan, computed: list[Part]) -> pd.DataFrame:
        """The verdicts of every planned layer."""
        verdicts = schemas.read(work.run.tables, "gate_verdicts", list(plan))
        return schemas.select(verdicts, next(iter(plan.values())).input_site)


def _stamp(work: StageInputs, job: VerdictsJob, plan: LayerPlan, saes: LayerSAEs) -> Stamp:
    return Stamp("verdicts", {"model": work.lm.digest, "held_out": held_out_digest(work.store),
                              "sae_in": digest(saes.sae_in.path), "sae_out": digest(saes.sae_out.path),
                              **_read_digests(work.run, plan)},
                 {"format": TABLE_FORMAT, **job.recipe()})


def _read_digests(run: RunPaths, plan: LayerPlan) -> dict[str, str]:
    """Digests of the tables the verdicts of a layer read (their files for this layer)."""
    found = {}
    for name in CIRCUIT_READS:
        path = table_path(run.tables, name, plan.layer, plan.part)
        if not path.is_file():
            raise FileNotFoundError(f"layer {plan.layer}: no {name} table of the output SAE's features read by their "
                                    f"encoder rows, for input site {plan.input_site}, in {run.tables}: run `circuits` "
                                    "first (with --outputs sae and --output-basis encoder)")
        found[name] = digest(path)
    for site in (plan.input_site, OUTPUT_SITE):
        for name in ("features", "feature_labels"):
            found[f"{name}:{site}"] = digest(table_path(run.tables, name, plan.layer, site))  # checked present
    return found


def _show(args, run: RunPaths, plan: Plan, verdicts: pd.DataFrame) -> None:
    summary.verdicts(verdicts, args.show, min_cell=getattr(args, "VerdictConfig.min_cell"),
                     groups=schemas.read(run.tables, "group_gates", list(plan)))
    print(f"verdicts of layers {list(plan)} in {run.tables / 'gate_verdicts'}")


STAGE = Verdicts()
COMMAND = Command(
    "verdicts", VerdictsJob, help="rank circuits, find group gates, ablate and judge them",
    description="After `circuits` and `features`: form groups of inputs (what an eigenvector reads; label classes) "
                "and measure their gates on held-out tokens, test every pair and group gate by exact layer-local "
                "intervention, type and rank them (circuits.gates), confirm the best by ablation in the model on "
                "tokens the ranking never read, and write pair_gates, gate_ablation, group_gates, group_truth, "
                "group_ablation and gate_verdicts under OUT/tables/.",
    show=_show,
    options=lambda p: p.add_argument("--show", type=whole_number("--show", 0), default=8,
                                     help="candidates per layer and kind printed (default: %(default)s)"))
