"""The explorer of a run: build time, size on disk, and how fast its pages render in Chromium.

    python benchmarks/bench_explorer.py results/demo [--feature 2:61] [--shots DIR]

Builds `RUN/explorer/` (timed), sums its size, then opens it from the file system in
Debian's headless Chromium through Playwright and prints each page's render time (from the
document's start for a page opened by its address, from the link for a page reached by a link):
an output feature opened first in a fresh browser profile (nothing cached), then the index,
the output feature (`--feature LAYER:F`, default the last layer's best circuit candidate pair
from gate_verdicts), one of its input features and its layer. With `--shots` it saves
screenshots of each page there.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))  # results_file, beside this script
from results_file import add_output, run_recorded  # noqa: E402

OUTPUT = "bench_explorer.txt"  # under benchmarks/results/

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def pick_feature(run, wanted: str | None) -> tuple[int, int, int]:
    """(layer, output feature, one of its inputs) of the output feature page to open:
    `wanted` (LAYER:FEATURE), else the last layer's best circuit candidate pair (gate_verdicts;
    without the verdicts stage, the gates table's layer rank 1)."""
    from pipelines import schemas

    verdicts = schemas.select(schemas.read(run.tables, "gate_verdicts"))
    pairs = verdicts[verdicts["kind"] == "pair"] if verdicts is not None else None
    gates = schemas.select(schemas.read(run.tables, "gates"))
    if wanted:
        layer, feature = map(int, wanted.split(":"))
        for frame, rank in ((pairs, None), (gates, "data_rank")):
            if frame is None:
                continue
            mine = frame[(frame["layer"] == layer) & (frame["out_feature"] == feature)]
            if rank is not None:
                mine = mine[mine[rank].eq(1).fillna(False).astype(bool)]
            if len(mine):
                return layer, feature, int(mine["in_a"].iloc[0])
        return layer, feature, 0
    if pairs is not None and len(pairs):
        row = pairs[pairs["circuit_rank"] == 1].sort_values("layer").iloc[-1]
    elif gates is not None:
        row = gates[gates["layer_rank"].eq(1).fillna(False).astype(bool)].sort_values("layer").iloc[-1]
    else:
        raise SystemExit(f"{run.tables}: neither gate_verdicts nor gates: run the circuits and verdicts stages first")
    return int(row["layer"]), int(row["out_feature"]), int(row["in_a"])


def main() -> None:
    from pipelines.engine.paths import RunPaths
    from pipelines.explorer.site import write_explorer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--feature", default=None, help="LAYER:FEATURE of the output feature page to open")
    parser.add_argument("--shots", type=Path, default=None, help="folder for screenshots")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    add_output(parser, OUTPUT)
    args = parser.parse_args()
    run = RunPaths(args.run.resolve())  # file URIs need an absolute path
    start = time.perf_counter()
    index = write_explorer(run)
    build = time.perf_counter() - start
    size = sum(p.stat().st_size for p in run.explorer.rglob("*") if p.is_file())
    print(f"built {index} in {build:.1f} s; {size / 2**20:.1f} MB in "
          f"{sum(1 for p in run.explorer.rglob('*') if p.is_file())} files")

    layer, feature, a = pick_feature(run, args.feature)

    from playwright.sync_api import sync_playwright

    def open_context(p, profile: str):
        return p.chromium.launch_persistent_context(profile, executable_path=args.chromium, args=ARGS,
                                                    headless=True, viewport={"width": 1400, "height": 1000})

    def rendered(page, count: int) -> dict:
        page.wait_for_function(f"window.BCX_TIMINGS && window.BCX_TIMINGS.length >= {count} && "
                               "document.getElementById('main').dataset.ready === '1'", timeout=60000)
        return page.evaluate("window.BCX_TIMINGS[window.BCX_TIMINGS.length - 1]")

    def report(name: str, route: str, timing: dict, cold: bool) -> None:
        # a cold page counts from the document's start, a linked one from the click
        ms = timing["at"] if cold else timing["ms"]
        content = timing["content"] + (timing["at"] - timing["ms"] if cold else 0)
        print(f"{name:>22}: {ms:7.0f} ms to render, its text and tables in {content:5.0f} ms ({route or 'index'})")

    feature_route = f"#/out/{layer}/{feature}"
    profiles = [tempfile.mkdtemp(prefix="bench-explorer-") for _ in range(2)]
    with sync_playwright() as p:
        # first visit in a fresh browser profile: nothing compiled or cached yet
        context = open_context(p, profiles[0])
        page = context.new_page()
        page.goto(index.as_uri() + feature_route)
        report("feature, fresh browser", feature_route, rendered(page, 1), True)
        context.close()

        context = open_context(p, profiles[1])
        page = context.new_page()
        for name, route, cold in (("index", "", True), ("feature", feature_route, False),
                                  ("input", f"#/in/{layer}/{a}", False), ("layer", f"#/layer/{layer}", False),
                                  ("feature, reloaded", feature_route, True)):
            if cold:
                page.goto("about:blank")  # else a change of hash alone would not load the document again
                page.goto(index.as_uri() + route)
                timing = rendered(page, 1)
            else:
                n = page.evaluate("window.BCX_TIMINGS.length")
                page.evaluate(f"location.hash = '{route}'")
                timing = rendered(page, n + 1)
            report(name, route, timing, cold)
            if args.shots:
                args.shots.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.shots / f"{name.replace(', ', '_')}.png"), full_page=True)
        context.close()
    for profile in profiles:
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    run_recorded(main, OUTPUT)
