"""mkdocs hooks: the reference pages generated from the code, and the docstring check.

- `reference/cli.md` from the command line's parser (`pipelines.cli.build_parser`), one
  section per command with every option, its default and its help;
- `reference/tables.md` from the table registry (`pipelines.schemas.markdown`);
- `reference/run-layout.md` from `results/README.md`;
- `results/benchmarks.md` from the files the benchmark scripts write (`benchmarks/results/`).

Generated at build time, they cannot go stale. `mkdocs build --strict` also fails when a
public name of `bilinear_circuits` or a stage's config lacks a docstring (or a config field its
one line of doc): each is logged as a warning, which `--strict` turns into an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.hooks.reference")


def on_config(config):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    for problem in missing_docs():
        log.warning(problem)
    return config


def on_files(files, config):
    for uri, text in (("reference/cli.md", cli_page()), ("reference/tables.md", tables_page()),
                      ("reference/run-layout.md", run_layout_page()), ("results/benchmarks.md", benchmarks_page())):
        files.append(File.generated(config, uri, content=text))
    return files


# ------------------------------------------------------------------ pages


def _options(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.choices:
            names += " " + "\\|".join(f"`{c}`" for c in action.choices)
        default = "" if action.default in (None, argparse.SUPPRESS, False) else f"`{action.default}`"
        text = (action.help or "") % {"default": action.default, "prog": parser.prog} if action.help else ""
        rows.append(f"| {names} | {default} | {text.replace('|', '/')} |")
    positionals = [a for a in parser._actions if not a.option_strings and not isinstance(a, argparse._SubParsersAction)]
    head = [f"- `{a.dest}`: {a.help or ''}" for a in positionals]
    return head + ([""] if head else []) + rows


def cli_page() -> str:
    from pipelines.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in subparsers._choices_actions}
    lines = ["# Command line", "",
             "Generated from the parser (`pipelines.cli.build_parser`) when the site is built. One entry point, "
             "`bilinear-circuits` (also `python -m pipelines`); every command has `--help` with the same text.", "",
             "| command | what it does |", "|---|---|"]
    lines += [f"| [`{name}`](#{name}) | {helps.get(name, '')} |" for name in subparsers.choices]
    for name, sub in subparsers.choices.items():
        lines += ["", f"## {name}", "", sub.description or helps.get(name, ""), "", *_options(sub)]
    return "\n".join(lines) + "\n"


def tables_page() -> str:
    from pipelines import schemas

    return ("# Tables\n\nGenerated from the table registry (`pipelines/schemas.py`) when the site is built: every "
            "table a run writes, the stage that writes it, its columns and their types. Parquet, one folder per "
            "table under `<run>/tables/`, one folder per layer (`gates/layer3/resid_mid-sae.parquet`); pandas, "
            "pyarrow and DuckDB read a folder as one table. Feature indices are 0-based, ranks 1-based; the "
            "constant coordinate is index `-1`. Every circuit table also has the columns `layer`, `outputs` "
            "(`sae`, `sae-decoder`, `hosvd`, `logit:...`, `file:...`), `input_site` and `out_feature`, left out "
            "below. A column marked *optional* is present only when the run's corpus supplies it (a gate tag, "
            "see [own corpus and labels](../howto/own-corpus.md)).\n\n" + schemas.markdown() + "\n")


def run_layout_page() -> str:
    text = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
    return "<!-- generated from results/README.md -->\n" + text.replace("# Run directories", "# Run layout", 1)


def benchmarks_page() -> str:
    folder = ROOT / "benchmarks" / "results"
    lines = ["# Benchmark results", "",
             "Each section is the file a benchmark script wrote under `benchmarks/results/` (its `--output`), "
             "headed by the command that produced it; rerun the command to refresh it. Figures depend on the "
             "machine: compare only figures measured on the same one.", ""]
    files = sorted(p for p in folder.glob("*") if p.suffix in (".md", ".txt")) if folder.is_dir() else []
    for path in files:
        lines += [f"## {path.stem.replace('_', ' ')}", "", result_section(path), ""]
    if not files:
        lines.append("No results are recorded yet: see [current results](index.md) for the commands.")
    return "\n".join(lines) + "\n"


def result_section(path: Path) -> str:
    """A results file as Markdown: its command (the file's first line), then its text."""
    first, _, rest = path.read_text(encoding="utf-8").partition("\n")
    command = first.removeprefix("<!-- ").removesuffix(" -->") if first.startswith("<!-- ") else ""
    body = rest.strip() if path.suffix == ".md" else f"```text\n{rest.strip()}\n```"
    return (f"`{command}`\n\n" if command else "") + body


INCLUDE = re.compile(r"<!-- results: ([\w.-]+) -->")


def on_page_markdown(markdown, page, config, files):
    """`<!-- results: NAME -->` in a page becomes the results file benchmarks/results/NAME."""
    def include(match):
        path = ROOT / "benchmarks" / "results" / match.group(1)
        if not path.is_file():
            log.warning(f"{page.file.src_uri}: no results file {path.relative_to(ROOT)} to include")
            return match.group(0)
        return result_section(path)

    return INCLUDE.sub(include, markdown)


# ------------------------------------------------------------------ docstrings


def missing_docs() -> list[str]:
    """Public names of `bilinear_circuits` without a docstring, and stage configs (and their
    fields) without documentation."""
    problems = []
    if importlib.util.find_spec("bilinear_circuits") is None:
        problems.append("bilinear_circuits is not importable: its public names cannot be checked")
    else:
        problems += _undocumented_api(importlib.import_module("bilinear_circuits"))
    problems += _undocumented_configs()
    return problems


def _public(module) -> list[str]:
    names = getattr(module, "__all__", None)
    return list(names) if names is not None else [n for n in vars(module) if not n.startswith("_")]


def _undocumented_api(module) -> list[str]:
    found = []
    if not inspect.getdoc(module):
        found.append(f"{module.__name__} has no module docstring")
    for name in _public(module):
        obj = getattr(module, name)
        if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
            continue
        if not inspect.getdoc(obj):
            found.append(f"{module.__name__}.{name} has no docstring")
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                target = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if (inspect.isfunction(target)) and not inspect.getdoc(target):
                    found.append(f"{module.__name__}.{name}.{attr} has no docstring")
    return found


def _undocumented_configs() -> list[str]:
    from circuits.config import Config
    from pipelines import jobs

    seen, found, todo = set(), [], [obj for obj in vars(jobs).values()
                                    if inspect.isclass(obj) and issubclass(obj, Config) and obj is not Config]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        if not (cls.__doc__ or "").strip() or cls.__doc__.startswith(f"{cls.__name__}("):
            found.append(f"config {cls.__module__}.{cls.__name__} has no docstring")
        hints = __import__("typing").get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if inspect.isclass(kind) and issubclass(kind, Config):
                todo.append(kind)
            elif not f.metadata.get("doc"):
                found.append(f"config field {cls.__name__}.{f.name} has no documentation line")
    return found
