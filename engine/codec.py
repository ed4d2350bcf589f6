"""One strict codec between frozen dataclasses and plain values (what msgpack and JSON carry).

Every message between processes (server <-> rank, CE -> PE /prefill and its reply, the handoff's
control messages and header fields, settings sent to a rank) is a dataclass encoded by to_wire and
decoded by from_wire, so all of them share one strictness:

- a map must hold only the class's fields: an unknown or misspelled key is an error, never dropped;
  a missing field takes its default, and a field without one is an error;
- each value must have its field's type: `int` is an int and never a bool, `float` takes an int or a
  float, `str` a str, `bytes` bytes, `tuple[int, ...]` / `list[...]` a list (or tuple), `dict[str, X]`
  a map with string keys, `X | None` None or an X, a nested dataclass its map, `Any` anything;
- ranges and finiteness are the dataclass's own `__post_init__` checks, which run on decode as on
  construction (a ValueError there is reported as a WireError naming the class).

Decoders are built once per class from its type hints, so a decode is a loop over prebuilt
converters, not a walk over typing objects.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterable
from functools import cache
from typing import Any, TypeVar, Union

T = TypeVar("T")
Convert = Callable[[Any], Any]


class WireError(ValueError):
    """A value that is not an encoding of the expected type. `field` is the path of the offending
    field ("params.top_k"), or "" for the whole value."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.message = message
        self.field = field


def to_wire(obj: Any) -> Any:
    """A dataclass (recursively, with tuples as lists) as plain maps, lists and scalars."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _encoder(type(obj))(obj)
    return _encode_any(obj)


def _encode_any(obj: Any) -> Any:
    kind = type(obj)
    if kind in _PLAIN:  # the common values first, by exact type (a handoff offer's fields are these)
        return obj
    if kind is list or kind is tuple:
        if all(type(v) in _PLAIN for v in obj):  # e.g. block ids: no call per item
            return list(obj)
        return [_encode_any(v) for v in obj]
    if kind is dict:
        return {k: v if type(v) in _PLAIN else _encode_any(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _encoder(type(obj))(obj)
    if isinstance(obj, (list, tuple)):
        return [_encode_any(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _encode_any(v) for k, v in obj.items()}
    return obj


_SCALARS = (int, float, str, bytes, bool, type(None))
_PLAIN = frozenset(_SCALARS)


@cache
def _encoder(tp: Any) -> Callable[[Any], Any]:
    """An encoder built once per type: scalars pass as they are, lists of scalars are copied in C."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        parts = [(f.name, _encoder(hints[f.name])) for f in dataclasses.fields(tp)]
        plain = [name for name, enc in parts if enc is _identity]
        nested = [(name, enc) for name, enc in parts if enc is not _identity]

        def encode(obj: Any) -> Any:
            d = {name: getattr(obj, name) for name in plain}
            for name, enc in nested:
                d[name] = enc(getattr(obj, name))
            return d

        return encode
    if tp in _SCALARS:
        return _identity
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        encoders = {_encoder(a) for a in args}
        if encoders == {_identity}:
            return _identity
        if type(None) in args and len(args) == 2:  # X | None: X's encoder, no type tests per value
            only = next(_encoder(a) for a in args if a is not type(None))
            return lambda v: None if v is None else only(v)
        return _encode_any
    if origin in (tuple, list):
        items = [a for a in args if a is not Ellipsis]
        if all(_encoder(a) is _identity for a in items):
            return list
        if len(args) == 2 and args[1] is Ellipsis or origin is list and len(args) == 1:
            item = _encoder(args[0])
            return lambda v: [item(x) for x in v]
        return _encode_any
    if origin is dict and len(args) == 2 and _encoder(args[1]) is _identity:
        return dict
    if origin is typing.Literal:
        return _identity
    return _encode_any


def from_wire(cls: type[T], data: Any, field: str = "") -> T:
    """The cls that data encodes; raises WireError for anything else (see the module docstring).
    field: the path to report errors under (e.g. "params" for a nested value)."""
    try:
        return typing.cast(T, _decoder(typing.cast(Any, cls))(data))  # a class is hashable; mypy sees type[T]
    except WireError as e:
        if not field:
            raise
        raise WireError(e.message, _join(field, e.field)) from None


def _join(outer: str, inner: str) -> str:
    if not inner:
        return outer
    return f"{outer}{inner}" if inner.startswith("[") else f"{outer}.{inner}"


def _within(key: str, e: WireError) -> WireError:
    return WireError(e.message, _join(key, e.field))


@cache
def _decoder(tp: Any) -> Convert:
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_decoder(tp)
    if tp is Any or tp is object:
        return _identity
    if tp is type(None) or tp is None:
        return _exact(type(None), "null")
    if tp is bool:
        return _exact(bool, "a boolean")
    if tp is int:
        return _int
    if tp is float:
        return _float
    if tp is str:
        return _exact(str, "a string")
    if tp is bytes:
        return _exact(bytes, "bytes")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _union([_decoder(a) for a in args if a is not type(None)], type(None) in args, tp)
    if origin is typing.Literal:
        return _literal(args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return _sequence(args[0], tuple)
        return _fixed_tuple([_decoder(a) for a in args])
    if origin is list:
        return _sequence(args[0] if args else Any, list)
    if origin is dict:
        return _mapping(_decoder(args[1]) if args else _identity)
    raise TypeError(f"the codec has no rule for {tp!r}")


def _fail(message: str) -> Any:
    raise WireError(message)


def _identity(v: Any) -> Any:
    return v


def _exact(kind: type, name: str) -> Convert:
    def convert(v: Any) -> Any:
        return v if type(v) is kind else _fail(f"must be {name}, got {type(v).__name__}")

    return convert


def _int(v: Any) -> Any:
    if type(v) is not int:  # NOTE: not isinstance: a bool is an int there
        _fail(f"must be an integer, got {type(v).__name__}")
    return v


def _float(v: Any) -> Any:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    return _fail(f"must be a number, got {type(v).__name__}")


def _literal(allowed: tuple[Any, ...]) -> Convert:
    def convert(v: Any) -> Any:
        return (
            v
            if v in allowed and type(v) in {type(a) for a in allowed}
            else _fail(f"must be one of {list(allowed)!r}, got {v!r}")
        )

    return convert


def _union(options: list[Convert], allows_none: bool, tp: Any) -> Convert:
    if allows_none and len(options) == 1:  # X | None: the common case, no exception on None
        only = options[0]

        def optional(v: Any) -> Any:
            return None if v is None else only(v)

        return optional

    def convert(v: Any) -> Any:
        if v is None and allows_none:
            return None
        for option in options:
            try:
                return option(v)
            except WireError:
                continue
        return _fail(f"must be {_type_name(tp)}, got {type(v).__name__}")

    return convert


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "").replace("NoneType", "None")


def _sequence(item_type: Any, kind: type) -> Convert:
    if item_type is int:  # token ids: one type check in C for the whole list

        def ints(v: Any) -> Any:
            if not isinstance(v, (list, tuple)):
                _fail(f"must be a list, got {type(v).__name__}")
            if not set(map(type, v)) <= {int}:
                i = next(i for i, x in enumerate(v) if type(x) is not int)
                raise WireError(f"must be an integer, got {type(v[i]).__name__}", f"[{i}]")
            return v if type(v) is kind else kind(v)

        return ints
    item = _decoder(item_type)

    def convert(v: Any) -> Any:
        if not isinstance(v, (list, tuple)):
            _fail(f"must be a list, got {type(v).__name__}")
        return kind(_each((item, x) for x in v))

    return convert


def _fixed_tuple(items: list[Convert]) -> Convert:
    def convert(v: Any) -> Any:
        if not isinstance(v, (list, tuple)) or len(v) != len(items):
            _fail(f"must be a list of {len(items)} values")
        return tuple(_each(zip(items, v)))

    return convert


def _each(pairs: Iterable[tuple[Convert, Any]]) -> list[Any]:
    """Each value through its converter; an error names the value's index."""
    out = []
    for i, (convert, x) in enumerate(pairs):
        try:
            out.append(convert(x))
        except WireError as e:
            raise _within(f"[{i}]", e) from None
    return out


def _mapping(value: Convert) -> Convert:
    def convert(v: Any) -> Any:
        if not isinstance(v, dict):
            _fail(f"must be a map, got {type(v).__name__}")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                _fail(f"keys must be strings, got {type(k).__name__}")
            try:
                out[k] = value(x)
            except WireError as e:
                raise _within(k, e) from None
        return out

    return convert


def _misfit(what: str, names: list[str], cls: type) -> None:
    """An unknown or missing field: its own path when there is one (an error's `param`)."""
    if len(names) == 1:
        raise WireError(f"{what} field of {cls.__name__}", names[0])
    raise WireError(f"{what} fields {names} of {cls.__name__}")


def _passes(tp: Any) -> frozenset[type]:
    """The exact types of the values of tp that decode to themselves: scalars, and X | None of them
    (bool never passes for int: type(True) is bool)."""
    if tp in (int, float, str, bytes, bool):
        return frozenset({tp})
    if tp is type(None) or tp is None:
        return frozenset({type(None)})
    if typing.get_origin(tp) in (Union, types.UnionType):
        parts = [_passes(a) for a in typing.get_args(tp)]
        if all(parts):
            return frozenset().union(*parts)
    return frozenset()


def _dataclass_decoder(cls: type) -> Convert:
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    converters = {f.name: _decoder(hints[f.name]) for f in fields}
    required = frozenset(
        f.name
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    known = frozenset(converters)
    # NOTE: a value whose exact type needs no conversion (an int for int, None or a str for str | None)
    # is taken without a call: StepOutputs are decoded per engine step.
    passes = {f.name: _passes(hints[f.name]) for f in fields}

    def convert(v: Any) -> Any:
        if not isinstance(v, dict):
            _fail(f"must be a map ({cls.__name__}), got {type(v).__name__}")
        keys = v.keys()
        if not keys <= known:
            _misfit("unknown", sorted(str(k) for k in keys - known), cls)
        if not required <= keys:
            _misfit("missing", sorted(required - keys), cls)
        kw = {}
        for k, x in v.items():
            if type(x) in passes[k]:
                kw[k] = x
                continue
            try:
                kw[k] = converters[k](x)
            except WireError as e:
                raise _within(k, e) from None
        try:
            return cls(**kw)
        except WireError:
            raise
        except (TypeError, ValueError) as e:
            raise WireError(f"{cls.__name__}: {e}", getattr(e, "param", None) or "") from None

    return convert
