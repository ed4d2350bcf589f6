"""Command-line flags generated from settings dataclasses: a setting is declared once, as a field.

A field of a frozen settings dataclass (EngineConfig, TransferConfig, ServerConfig) carries its
default, its type and, in its metadata, its help; `add_flags` turns the fields into argparse flags and
`from_flags` builds the dataclass back from the parsed namespace. A field whose type is itself a
dataclass (ServerConfig.engine) adds that class's flags, as a group titled by the field's help, under
the names of their own fields (no prefix: every flag name in the tree must be unique).

Metadata keys:
    help     what the setting does and its unit (required)
    flag     the flag's name when it is not the field's (is_deterministic: "deterministic")
    aliases  more names of the same flag ("hicache-size-gb"); one written with its dash is taken as it is
             (vLLM's "-tp")
    choices  the values it takes (the dataclass's __post_init__ checks them too)

Types: bool (--x / --no-x), int, float, str, X | None (None only as the default), tuple[X, ...]
(comma-separated on the command line).

`--config FILE.yaml` (add_config_flag, parse_args): a YAML map of flag names to values, as vLLM's:
`max-model-len: 2048` or `max_model_len: 2048` (a leading `--` allowed), `deterministic: true` for
--deterministic, `accept-transports: [tcp, ipc]` for a tuple, a map for a setting whose value is JSON text
(`speculative-config: {method: ngram, num_speculative_tokens: 3}` becomes that JSON). The file's values
become the parser's defaults, so flags on the command line win. A key that names no flag is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

T = TypeVar("T")
SCALARS = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One setting as a command-line flag."""

    dest: str  # the field's path from the top dataclass ("engine.max_model_len")
    names: tuple[str, ...]  # "--max-model-len", then the aliases
    kind: type  # bool, int, float or str; for tuple[X, ...] the item type X
    is_tuple: bool
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    group: str | None  # the help of the nested field it comes from; None: the top dataclass's own


def flags(cls: type) -> list[Flag]:
    """Every setting of the dataclass cls, those of its nested dataclasses included, in field order."""
    out: list[Flag] = []
    _collect(cls, "", None, out)
    names = [n for f in out for n in f.names]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TypeError(f"{cls.__name__}: flag names used twice: {twice}")
    return out


def _collect(cls: type, prefix: str, group: str | None, out: list[Flag]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        meta = f.metadata
        if "help" not in meta:
            raise TypeError(f"{cls.__name__}.{f.name} has no help (field(..., metadata={{'help': ...}}))")
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            _collect(tp, f"{prefix}{f.name}.", meta["help"], out)
            continue
        kind, is_tuple = _flag_type(tp, f"{cls.__name__}.{f.name}")
        default = f.default
        if default is dataclasses.MISSING:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        name = meta.get("flag", f.name.replace("_", "-"))
        choices = meta.get("choices")
        out.append(
            Flag(
                dest=prefix + f.name,
                names=tuple(n if n.startswith("-") else f"--{n}" for n in (name, *meta.get("aliases", ()))),
                kind=kind,
                is_tuple=is_tuple,
                default=default,
                help=meta["help"],
                choices=tuple(choices) if choices is not None else None,
                group=group,
            )
        )


def _flag_type(tp: Any, where: str) -> tuple[type, bool]:
    """(the scalar type, whether the field is a tuple of it) of a field's type hint."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return _flag_type(rest[0], where)
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in SCALARS:
        return args[0], True
    elif tp in SCALARS:
        return tp, False
    raise TypeError(f"{where}: no flag for the type {tp!r}")


def _items(kind: type, choices: tuple[Any, ...] | None) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        values = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        wrong = [v for v in values if choices is not None and v not in choices]
        if wrong:
            raise argparse.ArgumentTypeError(f"{wrong} not among {list(choices or ())}")
        return values

    return parse


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds a flag per setting of cls (flags()); a nested dataclass's settings go in a group."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in flags(cls):
        where: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if f.group is not None:
            where = groups.get(f.group) or groups.setdefault(f.group, parser.add_argument_group(f.group))
        kw: dict[str, Any] = {"dest": f.dest, "default": f.default, "help": f.help}
        if f.kind is bool and not f.is_tuple:
            kw["action"] = argparse.BooleanOptionalAction
        elif f.is_tuple:
            kw["type"] = _items(f.kind, f.choices)
            kw["metavar"] = "A,B,..."
        else:
            kw["type"] = f.kind
            kw["choices"] = f.choices
            if f.choices is None:
                kw["metavar"] = f.names[0][2:].upper().replace("-", "_")
        where.add_argument(*f.names, **kw)


def from_flags(cls: type[T], ns: argparse.Namespace, prefix: str = "") -> T:
    """The cls that the parsed flags describe (its __post_init__ checks run: a ValueError for a bad value)."""
    values = vars(ns)
    hints = typing.get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            kw[f.name] = from_flags(tp, ns, f"{prefix}{f.name}.")
        else:
            kw[f.name] = values[prefix + f.name]
    return cls(**kw)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are two lines, under the command's name, not the whole usage
    (a server's runs to dozens of lines): the error, then where the flags are listed."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists the flags\n")


def parser_for(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with cls's flags that refuses abbreviated or unknown flags (Parser: two-line errors)."""
    p = Parser(
        prog=prog,
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add_flags(p, cls)
    return p


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """Adds --config FILE.yaml; parse_args reads it."""
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=None,
        help="a YAML map of flag names to values (max-model-len: 2048); flags on the command line win",
    )


def parse_args(parser: argparse.ArgumentParser, cls: type, argv: Sequence[str] | None) -> argparse.Namespace:
    """parser.parse_args(argv) with the values of its --config file (add_config_flag) as the defaults of
    cls's flags; a bad file exits as a bad flag does (parser.error)."""
    ns = parser.parse_args(argv)
    if ns.config is not None:
        try:
            parser.set_defaults(**config_defaults(cls, Path(ns.config)))
        except (OSError, yaml.YAMLError, ValueError) as e:
            parser.error(f"--config {ns.config}: {e}")
        ns = parser.parse_args(argv)  # NOTE: again, so the command line's values replace the file's
    return ns


def config_defaults(cls: type, path: Path) -> dict[str, Any]:
    """The settings a YAML config file gives, by dest ("engine.max_model_len"); a ValueError names a key
    that is no flag of cls, one given twice, or a value of the wrong type."""
    doc = yaml.safe_load(path.read_text())
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ValueError("expected a map of flag names to values")
    by_name = {name.lstrip("-"): f for f in flags(cls) for name in f.names}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = str(key).removeprefix("--").replace("_", "-")
        f = by_name.get(name)
        if f is None:
            near = difflib.get_close_matches(name, by_name, n=1)
            raise ValueError(f"unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        if f.dest in out:
            raise ValueError(f"{key!r} sets {f.names[0]} a second time")
        out[f.dest] = _config_value(f, key, value)
    return out


def _config_value(f: Flag, key: Any, value: Any) -> Any:
    """value (as YAML parsed it) as the flag's type, its choices checked."""
    if value is None:
        if f.default is None:
            return None
        raise ValueError(f"{key!r}: {f.names[0]} takes no null")
    try:
        if f.is_tuple:
            items = value if isinstance(value, list) else str(value).split(",")
            return _items(f.kind, f.choices)(",".join(str(_scalar(f.kind, v)) for v in items))
        out = _scalar(f.kind, value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"{key!r}: {e}") from None
    if f.choices is not None and out not in f.choices:
        raise ValueError(f"{key!r}: {out!r} not among {list(f.choices)}")
    return out


def _scalar(kind: type, value: Any) -> Any:
    """value as kind: YAML's bool for a bool only; a number for a number (from its text too) or a str."""
    if kind is bool or isinstance(value, bool):
        if kind is bool and isinstance(value, bool):
            return value
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    if isinstance(value, str) and kind is not str:
        return kind(value.strip())
    if kind is str and isinstance(value, (str, int, float)):
        return str(value)
    if kind is str and isinstance(value, dict):  # a JSON setting written as a YAML map
        return json.dumps(value)
    if kind is float and isinstance(value, (int, float)):
        return float(value)
    if kind is int and isinstance(value, int):
        return value
    raise TypeError(f"expected {kind.__name__}, got {value!r}")
