"""Command-line options made from config dataclasses, so each default and its help exist once.

`add_config(parser, Cls)` adds `--field-name` for every field of `Cls` (or the ones named),
typed from the annotation (a tuple field takes a comma list), with the field's documentation
and default as help. The parsed value stays None unless given, so `config_from(args, Cls,
base)` applies only what the user typed on top of `base` (the dataclass defaults, a preset,
or a saved config). A stage's job config nests the configs of its parts: `add_job` and
`job_from` do the same for it and every config it holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from circuits.config import Config


def flag(name: str, rename: dict[str, str] | None = None) -> str:
    return "--" + (rename or {}).get(name, name).replace("_", "-")


def add_config(parser: argparse.ArgumentParser, cls: type[Config], only: tuple[str, ...] | None = None,
               skip: tuple[str, ...] = (), rename: dict[str, str] | None = None,
               default_text: str | None = None, title: str | None = None) -> None:
    """Add one option per field of `cls`; `default_text` replaces the shown defaults (for
    fields whose default comes from elsewhere, such as a preset); `title` heads the options
    in --help (default: the first line of the class's docstring)."""
    hints = typing.get_type_hints(cls)
    base = cls()
    title = title or (cls.__doc__.splitlines()[0].rstrip(".").lower() if cls.__doc__ else cls.__name__)
    group = parser.add_argument_group(title)
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only) or _nested(hints[f.name]):
            continue
        kind = _scalar(hints[f.name])
        default = getattr(base, f.name)
        doc = f.metadata.get("doc", "")
        if default_text is not None:
            help_text = f"{doc} (default: {default_text})"
        elif default is None and "default" in doc:
            help_text = doc  # the documentation says what None means
        else:
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            help_text = f"{doc} (default: {'none' if default is None else shown})"
        help_text = help_text.replace("%", "%%")
        name = flag(f.name, rename)
        dest = f"{cls.__name__}.{f.name}"
        if kind is bool:
            group.add_argument(name, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            choices = f.metadata.get("choices")
            metavar = "A,B,..." if typing.get_origin(kind) is tuple else kind.__name__.upper()
            group.add_argument(name, dest=dest, type=_parser(kind, name), default=None, help=help_text,
                               choices=choices, metavar=None if choices else metavar)


def config_from(args: argparse.Namespace, cls: type[Config], base: Config | None = None) -> Config:
    """`base` (default: the dataclass defaults) with every option of `cls` the user gave."""
    base = base or cls()
    given = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f"{cls.__name__}.{f.name}", None)
        if value is not None:
            given[f.name] = value
    return base.replace(**given) if given else base


def add_job(parser: argparse.ArgumentParser, cls: type[Config], **kwargs) -> None:
    """`add_config` for a job config and for each config it nests (`kwargs` go to every call)."""
    add_config(parser, cls, **kwargs)
    for kind in _nested_configs(cls):
        add_config(parser, kind, **kwargs)


def job_from(args: argparse.Namespace, cls: type[Config], base: Config | None = None) -> Config:
    """`config_from` for a job config and each config it nests."""
    job = config_from(args, cls, base)
    hints = typing.get_type_hints(cls)
    nested = {f.name: config_from(args, hints[f.name], getattr(job, f.name))
              for f in dataclasses.fields(cls) if _nested(hints[f.name])}
    return job.replace(**nested) if nested else job


def _nested(kind) -> bool:
    return isinstance(kind, type) and issubclass(kind, Config)


def _nested_configs(cls: type[Config]) -> list[type[Config]]:
    hints = typing.get_type_hints(cls)
    return [hints[f.name] for f in dataclasses.fields(cls) if _nested(hints[f.name])]


def _scalar(kind):
    """int from `int | None`, and so on."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        return options[0]
    return kind


def _parser(kind, name: str):
    item = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else None

    def parse(text: str):
        if item is not None:  # a tuple field: a comma list
            values = [v.strip() for v in text.split(",") if v.strip()]
            if not values:
                raise argparse.ArgumentTypeError(f"{name} takes a comma list, not {text!r}")
            return tuple(_parser(item, name)(v) for v in values)
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes {kind.__name__} values, not {text!r}") from None

    parse.__name__ = getattr(item or kind, "__name__", "value")
    return parse


def whole_number(flag: str, low: int, high: int | None = None):
    """An argparse type: a whole number from `low` to `high` (inclusive), said with `flag`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number, not {text!r}") from None
        if value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{flag} must be {bounds}, not {value}")
        return value

    parse.__name__ = "int"
    return parse
