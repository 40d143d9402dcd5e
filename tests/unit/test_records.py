"""state/records.py: ``load`` against a plain reading of the type hints, on whole state files
altered at random, and the error paths of nested records and lists."""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import json
import random
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import pytest

from ddpmon.state import records, schema

# -- the reference: what load means, written as plainly as possible ------------------------


class Wrong(Exception):
    def __init__(self, expected: str, value: object, missing: bool = False) -> None:
        self.expected, self.value, self.missing = expected, value, missing
        self.path: list[str | int] = []


def read(tp: Any, value: Any) -> Any:
    nullable = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(
        None
    ) in typing.get_args(tp)
    inner = next(t for t in typing.get_args(tp) if t is not type(None)) if nullable else tp
    if value is None and nullable:
        return None
    if inner is Any:
        return value
    if inner is bool:
        if value is True or value is False:
            return value
        raise Wrong("true or false", value)
    if inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise Wrong("an integer", value)
    if inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value if type(value) is float else float(value)
        raise Wrong("a number", value)
    if inner is str:
        if isinstance(value, str):
            return value
        raise Wrong("a string", value)
    if typing.get_origin(inner) is list:
        if not isinstance(value, list):
            raise Wrong("a list", value)
        out = []
        for i, v in enumerate(value):
            out.append(within(i, typing.get_args(inner)[0], v))
        return out
    if typing.get_origin(inner) is dict:
        if not isinstance(value, dict):
            raise Wrong("an object", value)
        if typing.get_args(inner)[1] is Any:
            return value
        return {str(k): within(str(k), typing.get_args(inner)[1], v) for k, v in value.items()}
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        if isinstance(value, str) and value in {m.value for m in inner}:
            return inner(value)
        raise Wrong(f"one of {', '.join(m.value for m in inner)}", value)
    assert dataclasses.is_dataclass(inner)
    if not isinstance(value, dict):
        raise Wrong(f"an object ({inner.__name__})", value)
    hints = typing.get_type_hints(inner)
    values = []
    for f in dataclasses.fields(inner):
        if f.name in value:
            values.append(within(f.name, hints[f.name], value[f.name]))
        elif f.default_factory is not dataclasses.MISSING:
            values.append(f.default_factory())
        elif f.default is not dataclasses.MISSING:
            values.append(f.default)
        else:
            wrong = Wrong("a value", None, missing=True)
            wrong.path.append(f.name)
            raise wrong
    return inner(*values)


def within(key: str | int, tp: Any, value: Any) -> Any:
    try:
        return read(tp, value)
    except Wrong as wrong:
        wrong.path.append(key)
        raise


def outcome(load: Any) -> tuple[str, str]:
    """("ok", the record as typed JSON text) or ("error", the message)."""
    try:
        record = load()
    except records.SchemaError as err:
        return "error", str(err)
    except Wrong as wrong:
        where = "".join(
            f"[{p}]" if isinstance(p, int) else f".{p}" for p in reversed(wrong.path)
        ).lstrip(".")
        if wrong.missing:
            return "error", f"has no {where!r} (a required key)"
        return "error", str(records.SchemaError(where, wrong.expected, wrong.value))
    return "ok", json.dumps(records.dump(record), sort_keys=True)  # 1 and 1.0 differ here


# -- state files to alter ---------------------------------------------------------------------


def full_state() -> dict[str, Any]:
    """A state file with every record in it, as the recorder writes it (every key)."""
    frames = [schema.Frame("/src/train.py", 10 + i, f"f{i}", "x = f(x)") for i in range(5)]
    collectives = [
        schema.Collective(
            seq=100 + i,
            op="all_reduce",
            group="0",
            group_size=4,
            bytes=1 << 20,
            call_site="DDP backward",
            issued_unix=1000.5 + i,
            bucket=i,
            step=7,
            callers=["train.py:3 in main"],
        )
        for i in range(4)
    ]
    summary = schema.Summary(0.1, 0.2, 0.3)
    state = schema.RankState(
        rank=1,
        local_rank=1,
        world_size=4,
        host="node-0",
        pid=42,
        state_interval=1.0,
        stage="allreduce",
        ddp={"bucket_cap": 25, "nested": {"a": [1, 2]}},
        step=7,
        micro_steps=7,
        started_unix=900.0,
        last_progress_unix=1000.0,
        now_unix=1010.0,
        collectives=schema.Counts(30, 26),
        in_flight=collectives,
        last_collective=collectives[0],
        collective_log=collectives[1:3],
        collective_seq={"0": 103},
        collective_sites={"all_reduce train.py:3": 30, "barrier train.py:9": 2},
        unused_parameters=["w"],
        buckets=[
            schema.Bucket(
                i,
                bytes=4096,
                dtype="float32",
                num_parameters=2,
                parameters=["a", "b"],
                count=7,
                last_seconds=0.01,
                mean_seconds=0.02,
                ready_seconds=0.05,
            )
            for i in range(3)
        ],
        timings=schema.Timings(
            7,
            step_seconds=summary,
            forward_seconds=summary,
            parts=schema.StepParts(steps=7, step_seconds=0.1, busy_seconds=0.09),
        ),
        notes={"advice": "x"},
        errors={},
        hang=schema.Hang(
            detected_unix=1005.0,
            last_progress_unix=1000.0,
            silent_seconds=5.0,
            timeout_seconds=60.0,
            timeout_source="learned",
            in_flight=collectives[:2],
            threads=[
                schema.Thread("MainThread", 1, True, frames=frames),
                schema.Thread("worker", 2, False, daemon=True, frames=frames[:2]),
            ],
            flight_recorder={"entries": [{"seq": 1}]},
        ),
        exit=schema.Exit(unix=1011.0, exception="RuntimeError: x", code=1, how="exception"),
        advice=[schema.Advice("no_sampler", evidence=["e1"], ranks=[0, 1])],
        fingerprints=schema.Fingerprints(
            batch=[[7, 123]],
            params=[schema.ParamPrint(7, 99, [1, 2])],
            names=["w"],
            nonfinite=schema.NonFinite(5, "w"),
        ),
        data=schema.DataInfo(sampler="DistributedSampler", shuffle=True, batch_size=8),
        activity=schema.Activity("stepping", sampled_unix=1009.0),
    )
    return json.loads(json.dumps(schema.to_json(state)))


def sparse_state() -> dict[str, Any]:
    """A state file written by hand, as in the benchmarks: most keys left out, ints for floats."""
    frames = [
        {"file": "/src/train.py", "line": 100 + i, "function": f"step_{i}", "code": "x"}
        for i in range(4)
    ]
    in_flight = [
        {
            "seq": 7000 + b,
            "op": "all_reduce",
            "group": "0",
            "group_size": 8,
            "bytes": 25 << 20,
            "call_site": "DDP backward",
            "issued_unix": 880,
            "bucket": b,
            "step": 300,
        }
        for b in range(5)
    ]
    return {
        "rank": 3,
        "world_size": 8,
        "step": 300,
        "phase": "allreduce",
        "now_unix": 1000,
        "in_flight": in_flight,
        "collective_seq": {"0": 7004},
        "timings": {"window_steps": 3, "step_seconds": {"median": 1, "last": 2, "max": 3}},
        "hang": {
            "detected_unix": 940,
            "last_progress_unix": 880.5,
            "silent_seconds": 60,
            "timeout_seconds": 60,
            "timeout_source": "learned",
            "in_flight": in_flight,
            "threads": [{"name": "MainThread", "main": True, "frames": frames}] * 3,
        },
    }


REPLACEMENTS: list[Any] = [
    None,
    0,
    1,
    -3,
    2.5,
    True,
    False,
    "x",
    "",
    [],
    {},
    [1],
    ["a"],
    {"a": 1},
    {"seq": 1},
    [{"seq": 1, "op": "x"}],
    10**30,
]


def alter(data: Any, rng: random.Random) -> None:
    """One change at a random place: a key left out, a value replaced, an unknown key added."""
    places: list[tuple[Any, Any]] = []

    def walk(node: Any) -> None:
        items = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, value in items:
            places.append((node, key))
            walk(value)

    walk(data)
    node, key = rng.choice(places)
    what = rng.random()
    if what < 0.25 and isinstance(node, dict):
        del node[key]
    elif what < 0.35 and isinstance(node, dict):
        node["unknown_" + str(key)] = rng.choice(REPLACEMENTS)
    elif what < 0.5 and type(node[key]) is float:
        node[key] = int(node[key])
    elif what < 0.6 and isinstance(node[key], (int, float)) and not isinstance(node[key], bool):
        node[key] = float(node[key])
    else:
        node[key] = copy.deepcopy(rng.choice(REPLACEMENTS))


@pytest.mark.parametrize("base", [full_state, sparse_state])
def test_load_reads_as_the_type_hints_say_on_altered_state_files(base: Any) -> None:
    rng = random.Random(20240611)
    assert outcome(lambda: records.load(schema.RankState, base())) == outcome(
        lambda: read(schema.RankState, base())
    )
    errors = 0
    for _ in range(600):
        data = base()
        for _ in range(rng.choice((1, 1, 2, 3))):
            alter(data, rng)
        # the other lists of records, copied from an altered one, go through the list paths
        if isinstance(data.get("hang"), dict) and isinstance(data["hang"].get("in_flight"), list):
            data["collective_log"] = data["hang"]["in_flight"]
        want = outcome(functools.partial(read, schema.RankState, copy.deepcopy(data)))
        got = outcome(functools.partial(records.load, schema.RankState, data))
        assert got == want, json.dumps(data)[:2000]
        again = outcome(functools.partial(records.load, schema.RankState, data))  # caches filled
        assert again == want
        errors += want[0] == "error"
    assert 100 < errors < 500  # both kinds of outcome were tried


# -- error paths and behaviour --------------------------------------------------------------


def error(cls: Any, data: Any) -> str:
    with pytest.raises(records.SchemaError) as err:
        records.load(cls, data)
    return str(err.value)


def test_a_bad_item_in_a_list_of_records_is_named_by_its_index() -> None:
    data = sparse_state()
    data["hang"]["in_flight"] = copy.deepcopy(data["in_flight"])
    data["hang"]["in_flight"][3]["seq"] = "7003"
    assert (
        error(schema.RankState, data)
        == "has an invalid hang.in_flight[3].seq '7003' (expected an integer)"
    )
    del data["hang"]["in_flight"][1]["op"]
    assert error(schema.RankState, data) == "has no 'hang.in_flight[1].op' (a required key)"


def test_the_first_bad_field_in_the_records_order_is_the_one_named() -> None:
    thread = {"name": 5, "frames": [{"line": "x"}]}  # name comes before frames
    assert error(schema.Thread, thread) == "has an invalid name 5 (expected a string)"
    assert (
        error(list[schema.Thread], [{"frames": []}, thread])
        == "has an invalid [1].name 5 (expected a string)"
    )
    thread["name"] = "t"
    assert error(schema.Thread, thread) == "has an invalid frames[0].line 'x' (expected an integer)"


def test_nested_records_dicts_and_wrong_containers_are_named() -> None:
    assert (
        error(schema.RankState, {"rank": 0, "timings": 7})
        == "has an invalid timings 7 (expected an object (Timings))"
    )
    assert (
        error(schema.RankState, {"rank": 0, "timings": {"step_seconds": {"median": 1, "last": 2}}})
        == "has no 'timings.step_seconds.max' (a required key)"
    )
    assert (
        error(schema.RankState, {"rank": 0, "collective_seq": {"0": 1, "1": "x"}})
        == "has an invalid collective_seq.1 'x' (expected an integer)"
    )
    assert (
        error(schema.RankState, {"rank": 0, "buckets": {"a": 1}})
        == "has an invalid buckets {'a': 1} (expected a list)"
    )
    assert (
        error(schema.RankState, {"rank": 0, "in_flight": None})
        == "has an invalid in_flight None (expected a list)"
    )
    assert (
        error(schema.RankState, {"rank": True}) == "has an invalid rank True (expected an integer)"
    )
    assert error(schema.Hang, {}) == "has no 'detected_unix' (a required key)"
    with pytest.raises(records.SchemaError) as err:
        records.load(schema.Frame, {"line": "x"}, path="hang.threads[0].frames[2]")
    assert err.value.path == "hang.threads[0].frames[2].line" and err.value.expected == "an integer"


def test_ints_for_floats_become_floats_alone_and_in_lists() -> None:
    one = records.load(schema.Summary, {"median": 1, "last": 2.5, "max": 3})
    assert (one.median, one.last, one.max) == (1.0, 2.5, 3.0) and type(one.median) is float
    many = records.load(
        list[schema.Summary],
        [{"median": 1.0, "last": 2.0, "max": 3.0}, {"median": 1, "last": 2, "max": 3}],
    )
    assert all(type(s.median) is float and type(s.max) is float for s in many)


def test_defaults_are_fresh_and_containers_are_copies() -> None:
    data = [{"seq": 1, "op": "a"}, {"seq": 2, "op": "b", "callers": ["x"]}]
    first, second = records.load(list[schema.Collective], data)
    assert (
        first.callers == []
        and first.callers is not records.load(schema.Collective, data[0]).callers
    )
    assert second.callers == ["x"] and second.callers is not data[1]["callers"]
    state = records.load(schema.RankState, {"rank": 0, "collective_sites": {"a": 1}})
    assert state.collective_sites == {"a": 1} and state.timings == schema.Timings()


def test_dict_keys_become_strings() -> None:
    state = records.load(schema.RankState, {"rank": 0, "collective_seq": {0: 1}, "notes": {1: "x"}})
    assert state.collective_seq == {"0": 1} and state.notes == {"1": "x"}


@dataclass(slots=True)
class Odd:
    ratio: float = 0  # not a float: a default is used as it is written
    size: int = field(default_factory=lambda: 5)
    label: str | None = None


def test_defaults_are_used_as_written() -> None:
    assert type(records.load(Odd, {}).ratio) is int
    assert [type(o.ratio) for o in records.load(list[Odd], [{}, {"ratio": 1}, {"label": "a"}])] == [
        int,
        float,
        int,
    ]
    assert [o.size for o in records.load(list[Odd], [{}, {"size": 2}])] == [5, 2]
    assert (
        error(list[Odd], [{}, {"size": 2.0}]) == "has an invalid [1].size 2.0 (expected an integer)"
    )


@dataclass(slots=True)
class Node:
    name: str
    children: list[Node] = field(default_factory=list)
    parent: Node | None = None
    extra: Any = None


def test_a_record_may_hold_its_own_class() -> None:
    tree = records.load(
        Node,
        {
            "name": "a",
            "children": [
                {"name": "b", "children": [{"name": "c"}]},
                {"name": "d", "parent": {"name": "a"}, "extra": [1]},
            ],
        },
    )
    assert tree.children[0].children[0] == Node("c") and tree.children[1].parent == Node("a")
    assert tree.children[1].extra == [1]
    assert (
        error(Node, {"name": "a", "children": [{"name": "b"}, {"name": "c", "children": [{}]}]})
        == "has no 'children[1].children[0].name' (a required key)"
    )
