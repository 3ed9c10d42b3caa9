"""The `circuits` stage: each layer's circuit tables, one part per output set."""

from __future__ import annotations

from collections.abc import Iterator

from pipelines.analysis.circuit_tables import analyse_layer
from circuits.weights import from_hooked_transformer
from pipelines import schemas, summary
from pipelines.analysis.outputs import parse_outputs
from pipelines.engine.files import digest, text_digest
from pipelines.engine.stamps import Stamp
from pipelines.engine.tables import table_path
from pipelines.inputs import SAE_OUTPUTS, LayerPlan, LayerSAEs, StageInputs, layer_batches, part_name
from pipelines.jobs import CircuitsJob
from pipelines.stages.base import TABLE_FORMAT, Command, Part, Plan, TableStage, tokens_digest


class Circuits(TableStage):
    name = "circuits"
    rows_flag = "--corr-rows"

    def rows(self, job: CircuitsJob) -> int:
        return job.corr_rows

    def parts(self, work: StageInputs, job: CircuitsJob, plan: Plan) -> list[Part]:
        found = []
        for layer, mine in plan.items():
            saes = mine.saes(work.lm, SAE_OUTPUTS in job.outputs)
            for spec in job.outputs:
                tables = tuple(t.name for t in schemas.TABLES.values() if t.stage == self.name and t.outputs in ("any", spec))
                found.append(Part(layer, part_name(mine.input_site, spec, job.output_basis),
                                  _stamp(work, job, saes, spec), tables, spec))
        return found

    def work(self, work: StageInputs, job: CircuitsJob, unit: tuple[LayerPlan, list[Part]], threads: int
             ) -> Iterator[tuple[Part, dict]]:
        """One layer's output sets, its weight analysis on `threads` threads."""
        plan, parts = unit
        saes = plan.saes(work.lm, SAE_OUTPUTS in job.outputs)
        model = work.lm.model
        mlp = from_hooked_transformer(model, plan.layer)
        for part in parts:
            out = parse_outputs([part.detail], job.output_basis, work.lm, mlp, saes, job.analysis)[0]
            batches = (layer_batches(model, work.store.held_out, job.corr_rows, saes, streams=work.streams)
                       if out.sae is not None else None)
            yield part, analyse_layer(mlp, saes.sae_in.weights, out, batches, job.analysis, layer=plan.layer,
                                      input_site=saes.input_site, progress=True, workers=threads)
        work.report(job.corr_rows * work.store.held_out.n_ctx)

    def result(self, work: StageInputs, job: CircuitsJob, plan: Plan, computed: list[Part]) -> list[str]:
        """The parts computed now, by name."""
        for part in computed:
            _drop_hashed_part(work.run, part, plan[part.layer].input_site)
        return [f"layer {part.layer} {part.name}" for part in computed]


def _drop_hashed_part(run, part: Part, input_site: str) -> None:
    """Remove the tables and stamp of `part`'s output set under the name earlier versions gave a
    `logit:`/`file:` set (`<site>-<kind>-<8 hex digits>`, see `part_name`), now that the readable
    part is written: every table reads all parts, so both would show the set twice."""
    if ":" not in part.detail:
        return
    hashed = f"{input_site}-{part.detail.split(':', 1)[0]}-{text_digest(part.detail)[:8]}"
    for table in (t.name for t in schemas.TABLES.values() if t.stage == "circuits"):
        table_path(run.tables, table, part.layer, hashed).unlink(missing_ok=True)
    run.table_stamp("circuits", part.layer, hashed).unlink(missing_ok=True)


def _stamp(work: StageInputs, job: CircuitsJob, saes: LayerSAEs, spec: str) -> Stamp:
    outputs = digest(saes.sae_out.path) if spec == SAE_OUTPUTS else text_digest(spec, _spec_file_digest(spec))
    return Stamp("circuits", {"model": work.lm.digest, "held_out_tokens": tokens_digest(work.store.held_out),
                              "sae_in": digest(saes.sae_in.path), "outputs": outputs},
                 {"format": TABLE_FORMAT, **job.recipe(), "outputs": spec})


def _spec_file_digest(spec: str) -> str:
    return digest(spec[5:]) if spec.startswith("file:") else ""


STAGE = Circuits()
COMMAND = Command(
    "circuits", CircuitsJob, help="interaction, gate, eigen and low-rank tables per layer",
    description="Project each layer's bilinear MLP into its SAEs' bases and write the interactions, gates, gate_truth, "
                "eigen, eigen_inputs, lowrank and lowrank_samples tables under OUT/tables/. Layers already done from "
                "the same inputs are kept.",
    show=lambda args, run, plan, done: summary.circuits(done, list(plan), run.tables,
                                                        next(iter(plan.values())).input_site))
