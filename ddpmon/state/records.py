"""Typed records: a tiny reader and writer for dataclasses over JSON, driven by type hints.

A record class is a dataclass whose fields are ``int``, ``float``, ``str``, ``bool``, ``Any``,
``X | None``, ``list[X]``, ``dict[str, X]`` or another record. ``load`` checks a parsed JSON
value against the class and builds it (naming the first bad field and what was expected);
``dump`` turns a record back into plain JSON data; ``json_schema`` describes the class as
JSON Schema. Converters are built once per class, so loading a thousand files stays cheap.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_NONE = type(None)


class SchemaError(ValueError):
    """A value does not fit its record; ``path`` names the field (``in_flight[2].seq``)."""

    def __init__(self, path: str, expected: str, value: object, message: str | None = None) -> None:
        self.path = path
        self.expected = expected
        shown = repr(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        super().__init__(message or f"has an invalid {path or 'value'} {shown} (expected {expected})")


def load(cls: type[T], data: object, path: str = "") -> T:
    """Build a ``cls`` record from parsed JSON; SchemaError names the first bad field."""
    return _converter(cls)(data, path)


def dump(record: object) -> Any:
    """A record (or a list/dict of them) as plain JSON data; ``None`` fields are kept."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {f.name: dump(getattr(record, f.name)) for f in dataclasses.fields(record)}
    if isinstance(record, list):
        return [dump(v) for v in record]
    if isinstance(record, dict):
        return {k: dump(v) for k, v in record.items()}
    return record


def json_schema(cls: type) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a record class, every nested record under ``$defs``."""
    defs: dict[str, Any] = {}
    _schema_of(cls, defs)
    root = defs.pop(cls.__name__)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **root, "$defs": defs}


# -- converters ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _converter(tp: Any) -> Callable[[Any, str], Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda value, path: value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        nullable = _NONE in options
        inner = [o for o in options if o is not _NONE]
        if len(inner) != 1:
            raise TypeError(f"records support only X | None unions, not {tp}")
        convert = _converter(inner[0])
        return lambda value, path: None if value is None and nullable else convert(value, path)
    if tp is bool:
        def boolean(value: Any, path: str) -> bool:
            if not isinstance(value, bool):
                raise SchemaError(path, "true or false", value)
            return value
        return boolean
    if tp is int:
        def integer(value: Any, path: str) -> int:
            if not isinstance(value, int) or isinstance(value, bool):
                raise SchemaError(path, "an integer", value)
            return value
        return integer
    if tp is float:
        def number(value: Any, path: str) -> float:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise SchemaError(path, "a number", value)
            return float(value)
        return number
    if tp is str:
        def string(value: Any, path: str) -> str:
            if not isinstance(value, str):
                raise SchemaError(path, "a string", value)
            return value
        return string
    if origin is list:
        (item_type,) = typing.get_args(tp)
        item = _converter(item_type)

        def array(value: Any, path: str) -> list[Any]:
            if not isinstance(value, list):
                raise SchemaError(path, "a list", value)
            return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return array
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        if key_type is not str:
            raise TypeError(f"record dicts have string keys, not {key_type}")
        entry = _converter(value_type)

        def mapping(value: Any, path: str) -> dict[str, Any]:
            if not isinstance(value, dict):
                raise SchemaError(path, "an object", value)
            return {str(k): entry(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        return mapping
    if dataclasses.is_dataclass(tp):
        return _record_converter(tp)
    raise TypeError(f"records cannot hold {tp!r}")


def _record_converter(cls: type) -> Callable[[Any, str], Any]:
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        fields.append((f.name, required, hints[f.name]))
    converters: dict[str, Callable[[Any, str], Any]] = {}

    def record(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise SchemaError(path, f"an object ({cls.__name__})", value)
        if not converters:  # built on first use: record classes may refer to later ones
            converters.update({name: _converter(tp) for name, _, tp in fields})
        kwargs = {}
        for name, required, _ in fields:
            where = f"{path}.{name}" if path else name
            if name in value:
                kwargs[name] = converters[name](value[name], where)
            elif required:
                raise SchemaError(where, "a value", None, f"has no {where!r} (a required key)")
        return cls(**kwargs)
    return record


# -- JSON Schema -----------------------------------------------------------------------------


def _schema_of(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return {}
    if origin in (typing.Union, types.UnionType):
        inner = [o for o in typing.get_args(tp) if o is not _NONE]
        return {"anyOf": [_schema_of(inner[0], defs), {"type": "null"}]}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if tp in simple:
        return {"type": simple[tp]}
    if origin is list:
        return {"type": "array", "items": _schema_of(typing.get_args(tp)[0], defs)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _schema_of(typing.get_args(tp)[1], defs)}
    if dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}  # placeholder against recursion
            hints = typing.get_type_hints(tp)
            props, required = {}, []
            for f in dataclasses.fields(tp):
                prop = _schema_of(hints[f.name], defs)
                doc = _field_docs(tp).get(f.name)
                if doc:
                    prop = {"description": doc, **prop}
                props[f.name] = prop
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    required.append(f.name)
            defs[name] = {
                "title": name, "description": (tp.__doc__ or "").strip().split("\n\n")[0],
                "type": "object", "properties": props, "required": required,
            }
        return {"$ref": f"#/$defs/{name}"}
    raise TypeError(f"records cannot hold {tp!r}")


@functools.lru_cache(maxsize=None)
def _field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field (``x: int = 0`` then ``\"\"\"...\"\"\"``)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs
