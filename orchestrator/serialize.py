"""Plain JSON values to and from the project's dataclasses, read off their fields.

`to_plain` writes a dataclass as a dict of its fields in declaration order (or in the order a
class states in `PLAIN_KEYS`), a str-Enum as its value, a tuple or list as a list, a dict with
its keys as strings. `from_plain` reads such a dict back by the fields' type hints: nested
dataclasses, Enums, `X | None`, tuples, lists and dicts (an int-keyed dict's keys back to ints),
numbers coerced to the declared type (JSON writes 25.0 as 25 nowhere, but a hand-written file
may).

Backward compatibility is stated per field: a key an older file lacks takes the field's
default, or the value its `OLDER_FILES` metadata names where files written before the field
existed meant something else than the default does now. A key without either that a file
lacks, and a key the class has no field for, are errors that name them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

OLDER_FILES = "older_files"
"""Field metadata key: the value a file written before the field existed means."""


def to_plain(value: Any) -> Any:
    """`value` as JSON-ready lists, dicts, strings, numbers, booleans and None."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: to_plain(getattr(value, name)) for name in _keys(type(value))}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key.value if isinstance(key, enum.Enum) else key): to_plain(item) for key, item in value.items()}
    return value


def from_plain(cls: type, data: dict[str, Any]) -> Any:
    """The `cls` dataclass `to_plain` wrote as `data`; TypeError on a key `cls` has no field
    for, ValueError on a missing one no default covers."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected an object of its fields, got {type(data).__name__}")
    hints, known = _hints(cls), _fields(cls)
    # A key `cls` has no field for goes to its constructor as written, which refuses it
    # (TypeError: "unexpected keyword argument"), as constructing it by hand would.
    values = {key: value for key, value in data.items() if key not in known}
    for name, spec in known.items():
        if name in data:
            values[name] = _read(hints[name], data[name], f"{cls.__name__}.{name}")
        elif OLDER_FILES in spec.metadata:
            values[name] = spec.metadata[OLDER_FILES]
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: key {name!r} is missing and has no default")
    return cls(**values)


def _keys(cls: type) -> tuple[str, ...]:
    """The field names `to_plain` writes, in order."""
    return getattr(cls, "PLAIN_KEYS", None) or tuple(_fields(cls))


@functools.cache
def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {spec.name: spec for spec in dataclasses.fields(cls) if spec.init}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _read(hint: Any, value: Any, where: str) -> Any:
    """`value` as the type `hint` names."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        kinds = [arg for arg in args if arg is not type(None)]
        if len(kinds) == 1:
            return _read(kinds[0], value, where)
        return value  # a union of several kinds is read as written
    if value is None:
        raise ValueError(f"{where}: expected {hint}, got null")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_read(args[0], item, where) for item in value)
        return tuple(_read(arg, item, where) for arg, item in zip(args, value)) if args else tuple(value)
    if origin is list:
        return [_read(args[0], item, where) for item in value] if args else list(value)
    if origin is dict:
        key_hint, value_hint = args if args else (Any, Any)
        return {_read(key_hint, key, where): _read(value_hint, item, where) for key, item in value.items()}
    if isinstance(hint, type):
        if dataclasses.is_dataclass(hint):
            return from_plain(hint, value)
        if issubclass(hint, enum.Enum):
            return hint(value)
        if hint is bool:
            return bool(value)
        if hint in (int, float, str):
            return hint(value)
    return value
