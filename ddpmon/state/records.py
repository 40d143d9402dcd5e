"""Typed records: a tiny reader and writer for dataclasses over JSON, driven by type hints.

A record class is a dataclass whose fields are ``int``, ``float``, ``str``, ``bool``, a str-valued ``Enum``, ``Any``,
``X | None``, ``list[X]``, ``dict[str, X]`` or another record. ``load`` checks a parsed JSON
value against the class and builds it (naming the first bad field and what was expected);
``dump`` turns a record back into plain JSON data; ``json_schema`` describes the class as
JSON Schema.

How loading is written, and why. The doctor reads a state file per rank, a thousand of them,
each a few hundred records (a hang report's stack frames and collectives, the buckets), and
building the records is most of its time after the JSON parsing. So each record class gets,
once, its fields as data (name, the types a value is taken as it is, converter, default) and
a few closures over them. Nothing is generated as source and ``exec``'d: tracebacks, coverage
and a debugger see ordinary code, at the speed the generated converters had, by doing the
per-field work in C (``map``, ``operator.itemgetter``, set lookups) instead:

* ``careful`` is what loading means: field by field, in order, a value of a type taken as it
  is kept (an exact ``int`` for ``int``, ``None`` for ``X | None``), any other through the
  field's converter (which makes an ``int`` a ``float`` or says what was expected), a missing
  key from its default. It names the first bad field. It is the slow path.
* ``record`` reads one value: every field at once (a dict that leaves keys out is read merged
  over the defaults), lists, dicts and nested records through their converters, then the
  tuple of the values' types looked up among those seen to need nothing more, and the record
  built positionally. A plain field of another type is put through its converter alone
  (``mend``); anything odder goes to ``careful``.
* ``many`` reads a list of records (frames, collectives, buckets) a field at a time: a column
  of values checked with one ``issuperset`` of their types, the records built by ``map``.

The fast paths decide nothing that ``careful`` would not: they build the same record or hand
the value to it, so every error names the same field with the same words (path, expected type,
value). ``tests/unit/test_records.py`` holds ``load`` to a plain reading of the type hints on
a thousand altered state files; ``benchmarks/doctor_scale.py`` times it (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import types
import typing
from collections.abc import Callable, Container
from operator import contains
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
        super().__init__(
            message or f"has an invalid {path or 'value'} {shown} (expected {expected})"
        )


def load(cls: type[T], data: object, path: str = "") -> T:
    """Build a ``cls`` record from parsed JSON; SchemaError names the first bad field."""
    try:
        record: T = _converter(cls)(data)  # type: ignore[arg-type]
        return record
    except _Bad as bad:
        where = "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" for p in reversed(bad.path)
        ).lstrip(".")
        where = f"{path}.{where}".strip(".") if path else where
        if bad.missing:
            raise SchemaError(
                where, bad.expected, None, f"has no {where!r} (a required key)"
            ) from None
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
    # Plain values are taken as they are without a call each: a state file's per-step
    # columns hold thousands of numbers, dumped every second on the rank's own thread.
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        out = {}
        for name in _field_names(type(record)):
            v = getattr(record, name)
            out[name] = v if v is None or type(v) in _PLAIN else dump(v)
        return out
    if isinstance(record, list):
        return [v if v is None or type(v) in _PLAIN else dump(v) for v in record]
    if isinstance(record, dict):
        return {k: v if v is None or type(v) in _PLAIN else dump(v) for k, v in record.items()}
    if isinstance(record, enum.Enum):  # a str-valued enum (``activity.Status``) as its string
        return record.value
    return record


_PLAIN = frozenset((str, int, float, bool))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def json_schema(cls: type) -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of a record class, every nested record under ``$defs``."""
    defs: dict[str, Any] = {}
    _schema_of(cls, defs)
    root = defs.pop(cls.__name__)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **root, "$defs": defs}


# -- converters ------------------------------------------------------------------------------


@functools.cache
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
        many = _record_converters(item_type)[1] if dataclasses.is_dataclass(item_type) else None  # type: ignore[arg-type]
        as_is = _taken_as_is(item_type)

        def array(value: Any) -> list[Any]:
            if not isinstance(value, list):
                raise _Bad("a list", value)
            try:
                if many is not None:
                    return many(value)
                if as_is and as_is.issuperset(map(type, value)):
                    return list(value)
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
        as_is = _taken_as_is(value_type)

        def mapping(value: Any) -> dict[str, Any]:
            if not isinstance(value, dict):
                raise _Bad("an object", value)
            if (
                as_is
                and type(value) is dict
                and _STR.issuperset(map(type, value))
                and as_is.issuperset(map(type, value.values()))
            ):
                return dict(value)
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
        return _record_converters(tp)[0]  # type: ignore[arg-type]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        known = ", ".join(str(m.value) for m in tp)

        def member(value: Any) -> Any:
            try:
                return tp(value)
            except (ValueError, TypeError):
                raise _Bad(f"one of {known}", value) from None

        return member
    raise TypeError(f"records cannot hold {tp!r}")


_STR = frozenset((str,))
_DICT = frozenset((dict,))


def _split(tp: Any) -> tuple[bool, Any]:
    """Whether ``tp`` is ``X | None``, and X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and _NONE in typing.get_args(tp):
        return True, next(o for o in typing.get_args(tp) if o is not _NONE)
    return False, tp


def _taken_as_is(tp: Any) -> frozenset[type]:
    """The types of a value that ``_converter(tp)`` returns as it is without a call: ``int``
    for ``int``, also ``None`` for ``int | None``; none of a list, dict or record."""
    nullable, inner = _split(tp)
    return frozenset(([_NONE] if nullable else []) + ([inner] if inner in _PLAIN else []))


@functools.cache
def _record_converters(cls: type) -> tuple[Callable[[Any], Any], Callable[[list[Any]], list[Any]]]:
    """The converter of one ``cls`` value and that of a list of them: ``record`` and ``many``,
    over the fields' data below (the module's docstring says how and why)."""
    hints = typing.get_type_hints(cls)
    names: list[str] = []
    fields: list[tuple[str, frozenset[type], int, Any, Callable[[], Any] | None]] = []
    convert_of: list[Callable[[Any], Any]] = []  # the converter of the field's type
    built_of: list[Callable[[Any], Any]] = []  # the same without ``| None``, for a value not None
    finish: list[Callable[[Any], Any]] = []  # ``many``'s step for a converted field
    accepts: list[Container[type]] = []  # the types of a finished value that need nothing more
    prefilled: list[Any] = []  # what a missing key reads as in the fast paths
    converted: list[tuple[int, Callable[[], Any] | None]] = []  # always converted: (field, factory)
    mendable: list[bool] = []  # a value of another type goes through the field's converter alone
    for i, f in enumerate(dataclasses.fields(cls)):
        if not f.init or f.kw_only:
            raise TypeError(
                f"record {cls.__name__}.{f.name}: records are built positionally "
                "(no init=False or kw_only fields)"
            )
        tp = hints[f.name]
        nullable, inner = _split(tp)
        as_is = _taken_as_is(tp)
        default = _MISSING if f.default is dataclasses.MISSING else f.default
        factory = None if f.default_factory is dataclasses.MISSING else f.default_factory
        built = inner is not Any and inner not in _PLAIN  # a list, dict or record
        names.append(f.name)
        fields.append((f.name, as_is, i, default, factory))
        convert_of.append(_resolve_at_first_use(convert_of, i, tp))
        built_of.append(_resolve_at_first_use(built_of, i, inner))
        finish.append(_finisher(built_of, i, factory))
        if inner is Any:
            accepts.append(_ANYTHING)
        elif built:
            accepts.append(
                frozenset(([_NONE] if nullable else []) + [typing.get_origin(inner) or inner])
            )
        else:
            accepts.append(as_is)
        if built or factory is not None:
            converted.append((i, factory))
        mendable.append(not built and factory is None)
        taken = (
            default is not _MISSING
            and type(default) in accepts[i]
            and (default is None or not built)
        )
        prefilled.append(default if taken else _MISSING)
    not_an_object = f"an object ({cls.__name__})"
    count = len(names)
    take = _taker(names)
    blank = dict(zip(names, prefilled))
    settled: set[tuple[type, ...]] = set()  # tuples of the values' types that need nothing more

    def careful(value: dict[str, Any]) -> Any:
        """The definition, and the only path that finds a value bad."""
        get = value.get
        values = []
        for name, as_is, i, default, factory in fields:
            v = get(name, _MISSING)
            if v is _MISSING:
                if factory is not None:
                    v = factory()
                elif default is not _MISSING:
                    v = default
                else:
                    bad = _Bad("a value", None, missing=True)
                    bad.path.append(name)
                    raise bad
            elif type(v) not in as_is:
                try:
                    v = convert_of[i](v)
                except _Bad as bad:
                    bad.path.append(name)
                    raise
            values.append(v)
        return cls(*values)

    def record(value: Any) -> Any:
        values: Any
        if type(value) is dict:
            if len(value) >= count:
                try:
                    values = take(value)
                except KeyError:
                    values = take({**blank, **value})
            else:
                values = take({**blank, **value})
        elif isinstance(value, dict):
            values = tuple(map(value.get, names, prefilled))
        else:
            raise _Bad(not_an_object, value)
        if converted:
            values = list(values)
            try:
                for i, factory in converted:
                    v = values[i]
                    if v is _MISSING:
                        if factory is not None:
                            values[i] = factory()
                    elif v is not None:
                        values[i] = built_of[i](v)
            except _Bad:
                return careful(value)  # names the first bad field, in the fields' order
        kinds = tuple(map(type, values))
        if kinds not in settled:
            if not all(map(contains, accepts, kinds)):
                return mend(value, values, kinds)
            if len(settled) < 64:
                settled.add(kinds)
        return cls(*values)

    def mend(value: Any, values: Any, kinds: tuple[type, ...]) -> Any:
        """``record``'s values with a plain field of another type (an int for a float) put
        through that field's converter; anything else to ``careful``."""
        values = list(values)
        try:
            for i, kind in enumerate(kinds):
                if kind not in accepts[i]:
                    if kind is _Missing or not mendable[i]:
                        return careful(value)
                    values[i] = convert_of[i](values[i])
        except _Bad:
            return careful(value)
        return cls(*values)

    def many(items: list[Any]) -> list[Any]:
        """``[record(v) for v in items]``, a column at a time for a list of plain dicts."""
        if not items or not count or not _DICT.issuperset(map(type, items)):
            return [record(v) for v in items]
        try:
            rows = list(map(take, items))
        except KeyError:
            rows = [take({**blank, **v}) for v in items]
        columns: list[Any] = list(zip(*rows))
        for i, _ in converted:  # a bad value raises: the list's converter names the first bad item
            columns[i] = list(map(finish[i], columns[i]))
        if all(map(_takes_all, accepts, columns)):
            return list(map(cls, *columns))
        return [record(v) for v in items]

    return record, many


def _takes_all(accept: Container[type], column: list[Any]) -> bool:
    return bool(accept.issuperset(map(type, column)))  # type: ignore[attr-defined]


class _Missing:
    """The type of a key left out, in the fast paths (no field takes it as it is)."""

    __slots__ = ()


class _Anything:
    """What an ``Any`` field takes as it is: every type but ``_Missing``."""

    __slots__ = ()

    def __contains__(self, kind: object) -> bool:
        return kind is not _Missing

    def issuperset(self, kinds: Any) -> bool:
        return _Missing not in kinds


_MISSING = _Missing()
_ANYTHING = _Anything()


def _taker(names: list[str]) -> Callable[[dict[str, Any]], tuple[Any, ...]]:
    """The values of ``names`` in a dict as a tuple, in C (KeyError if one is missing)."""
    if len(names) > 1:
        return operator.itemgetter(*names)
    if names:
        name = names[0]
        return lambda value: (value[name],)
    return lambda value: ()


def _finisher(
    built_of: list[Callable[[Any], Any]], i: int, factory: Callable[[], Any] | None
) -> Callable[[Any], Any]:
    """``many``'s step for field ``i`` if it is always converted: a missing value from its
    factory, ``None`` as it is (the type check decides), any other through its converter."""

    def finish(value: Any) -> Any:
        if value is None:
            return value
        if value is _MISSING:
            return value if factory is None else factory()
        return built_of[i](value)

    return finish


def _resolve_at_first_use(
    converters: list[Callable[[Any], Any]], i: int, tp: Any
) -> Callable[[Any], Any]:
    """A stand-in for the converter of ``tp`` that, on first use, puts the real one in its
    place (record classes may refer to later ones, or to themselves)."""

    def convert(value: Any) -> Any:
        converters[i] = real = _converter(tp)
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
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [m.value for m in tp]}
    if dataclasses.is_dataclass(tp):
        name = tp.__name__  # type: ignore[union-attr]
        if name not in defs:
            defs[name] = {}  # placeholder against recursion
            hints = typing.get_type_hints(tp)
            props, required = {}, []
            for f in dataclasses.fields(tp):
                prop = _schema_of(hints[f.name], defs)
                doc = _field_docs(tp).get(f.name)  # type: ignore[arg-type]
                if doc:
                    prop = {"description": doc, **prop}
                props[f.name] = prop
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    required.append(f.name)
            defs[name] = {
                "title": name,
                "description": (tp.__doc__ or "").strip().split("\n\n")[0],
                "type": "object",
                "properties": props,
                "required": required,
            }
        return {"$ref": f"#/$defs/{name}"}
    raise TypeError(f"records cannot hold {tp!r}")


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field (``x: int = 0`` then ``\"\"\"...\"\"\"``)."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(
        [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]
    ):  # a base's fields too
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs
