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
    try:
        return _converter(cls)(data)
    except _Bad as bad:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in reversed(bad.path)).lstrip(".")
        where = f"{path}.{where}".strip(".") if path else where
        if bad.missing:
            raise SchemaError(where, bad.expected, None, f"has no {where!r} (a required key)") from None
        raise SchemaError(where, bad.expected, bad.value) from None


class _Bad(Exception):
    """Raised inside the converters; the path is built on the way out, only on failure."""

    def __init__(self, expected: str, value: object, missing: bool = False) -> None:
        self.expected, self.value, self.missing = expected, value, missing
        self.path: list[str | int] = []


def dump(record: object) -> Any:
    """A record (or a list/dict of them) as plain JSON data; ``None`` fields are kept."""
    if record is None or type(record) in _PLAIN:
        return record
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        return {name: dump(getattr(record, name)) for name in _field_names(type(record))}
    if isinstance(record, list):
        return [dump(v) for v in record]
    if isinstance(record, dict):
        return {k: dump(v) for k, v in record.items()}
    return record


_PLAIN = frozenset((str, int, float, bool))


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def json_schema(cls: type) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a record class, every nested record under ``$defs``."""
    defs: dict[str, Any] = {}
    _schema_of(cls, defs)
    root = defs.pop(cls.__name__)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **root, "$defs": defs}


# -- converters ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _converter(tp: Any) -> Callable[[Any], Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda value: value
    if origin in (typing.Union, types.UnionType):
        inner = [o for o in typing.get_args(tp) if o is not _NONE]
        if len(inner) != 1 or _NONE not in typing.get_args(tp):
            raise TypeError(f"records support only X | None unions, not {tp}")
        convert = _converter(inner[0])
        return lambda value: None if value is None else convert(value)
    if tp is bool:
        def boolean(value: Any) -> bool:
            if value is True or value is False:
                return value
            raise _Bad("true or false", value)
        return boolean
    if tp is int:
        def integer(value: Any) -> int:
            if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
                return value
            raise _Bad("an integer", value)
        return integer
    if tp is float:
        def number(value: Any) -> float:
            if type(value) is float:
                return value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise _Bad("a number", value)
        return number
    if tp is str:
        def string(value: Any) -> str:
            if type(value) is str or isinstance(value, str):
                return value
            raise _Bad("a string", value)
        return string
    if origin is list:
        (item_type,) = typing.get_args(tp)
        item = _converter(item_type)

        def array(value: Any) -> list[Any]:
            if not isinstance(value, list):
                raise _Bad("a list", value)
            try:
                return [item(v) for v in value]
            except _Bad:
                for i, v in enumerate(value):  # only on failure: which item
                    try:
                        item(v)
                    except _Bad as bad:
                        bad.path.append(i)
                        raise
                raise
        return array
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        if key_type is not str:
            raise TypeError(f"record dicts have string keys, not {key_type}")
        entry = _converter(value_type)
        if value_type is Any:
            def anything(value: Any) -> dict[str, Any]:
                if not isinstance(value, dict):
                    raise _Bad("an object", value)
                return value
            return anything

        def mapping(value: Any) -> dict[str, Any]:
            if not isinstance(value, dict):
                raise _Bad("an object", value)
            out = {}
            for k, v in value.items():
                try:
                    out[str(k)] = entry(v)
                except _Bad as bad:
                    bad.path.append(str(k))
                    raise
            return out
        return mapping
    if dataclasses.is_dataclass(tp):
        return _record_converter(tp)
    raise TypeError(f"records cannot hold {tp!r}")


_INLINE = {  # checks generated inline for the commonest field types (no call per field)
    int: "type({v}) is int",
    str: "type({v}) is str",
    float: "type({v}) is float",
    bool: "{v} is True or {v} is False",
}


def _record_converter(cls: type) -> Callable[[Any], Any]:
    """A converter for one record class, generated as Python source so that a field of a
    plain type costs one inline check rather than a call, and the record is built with
    positional arguments (a state file holds a few hundred records: a hang report's stack
    frames, its collectives; the doctor reads a thousand files)."""
    hints = typing.get_type_hints(cls)
    names: dict[str, Any] = {"cls": cls, "_Bad": _Bad, "_MISSING": _MISSING}
    lines = ["def record(value):",
             "    if not isinstance(value, dict):",
             f"        raise _Bad('an object ({cls.__name__})', value)",
             "    get = value.get"]
    args = []
    for i, f in enumerate(dataclasses.fields(cls)):
        if not f.init or f.kw_only:
            raise TypeError(f"record {cls.__name__}.{f.name}: records are built positionally "
                            "(no init=False or kw_only fields)")
        tp = hints[f.name]
        var = f"f{i}"
        args.append(var)
        nullable = typing.get_origin(tp) in (typing.Union, types.UnionType) and _NONE in typing.get_args(tp)
        inner = [o for o in typing.get_args(tp) if o is not _NONE][0] if nullable else tp
        names[f"conv{i}"] = _resolve_at_first_use(names, f"conv{i}", tp)
        lines.append(f"    {var} = get({f.name!r}, _MISSING)")
        lines.append(f"    if {var} is _MISSING:")
        if f.default is not dataclasses.MISSING:
            names[f"default{i}"] = f.default
            lines.append(f"        {var} = default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            names[f"factory{i}"] = f.default_factory
            lines.append(f"        {var} = factory{i}()")
        else:
            lines.append("        bad = _Bad('a value', None, missing=True)")
            lines.append(f"        bad.path.append({f.name!r})")
            lines.append("        raise bad")
        fast = (["{v} is None"] if nullable else []) + ([_INLINE[inner]] if inner in _INLINE else [])
        condition = " or ".join(f"({c.format(v=var)})" for c in fast)
        lines.append(f"    elif not ({condition}):" if condition else "    else:")
        lines.append("        try:")
        lines.append(f"            {var} = conv{i}({var})")
        lines.append("        except _Bad as bad:")
        lines.append(f"            bad.path.append({f.name!r})")
        lines.append("            raise")
    lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), names)  # noqa: S102 - source built above from the class's own fields
    return names["record"]


_MISSING = object()


def _resolve_at_first_use(names: dict[str, Any], name: str, tp: Any) -> Callable[[Any], Any]:
    """A stand-in for the converter of ``tp`` that, on first use, puts the real one in its
    place in the generated code's globals (record classes may refer to later ones)."""
    def convert(value: Any) -> Any:
        names[name] = real = _converter(tp)
        return real(value)
    return convert


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
