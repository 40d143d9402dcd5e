"""Chrome traces as torch.profiler writes them, built by hand: for the comparison's tests
(tests/unit/test_profiles.py) and a stand-in rank's answers (tests/unit/test_captures.py)."""

from __future__ import annotations

from typing import Any

TID = 7


def op(
    name: str, ts: float, dur: float, tid: int = TID, cat: str = "cpu_op", **args: Any
) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def frame(name: str, ts: float, dur: float, tid: int = TID) -> dict[str, Any]:
    return op(name, ts, dur, tid, cat="python_function")


def steps(n: int, start: float = 100.0, length: float = 1000.0) -> list[dict[str, Any]]:
    return [
        op(f"ProfilerStep#{i + 1}", start + i * length, length, cat="user_annotation")
        for i in range(n)
    ]


def trace(events: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"schemaVersion": 1, "traceEvents": events}
    if meta:
        data["ddpmon"] = meta  # add_metadata_json's value, parsed
    return data


def rank_trace(extra_mm_us: float) -> dict[str, Any]:
    """Two steps of a forward (model.py) calling linear and, with ``extra_mm_us``, a matrix
    product, then the loop's backward."""
    events = [*steps(2, 0, 10000), frame("train.py(12): main", -50, 30000)]
    for s in range(2):
        t = s * 10000
        events += [
            frame("torch/nn/modules/module.py(1751): _call_impl", t + 10, 5000),
            frame("model.py(40): forward", t + 12, 4990),
            frame("torch/nn/modules/linear.py(124): forward", t + 20, 100),
            frame("<built-in function linear>", t + 21, 98),
            op("aten::linear", t + 22, 96),
            op("aten::addmm", t + 30, 80),
        ]
        if extra_mm_us:
            events += [
                frame("<built-in method mm of type object at 0x1>", t + 130, extra_mm_us + 2),
                op("aten::mm", t + 131, extra_mm_us),
            ]
        events += [
            frame("torch/_tensor.py(626): backward", t + 6000, 300),
            op("aten::mm", t + 6010, 50),
        ]
    return trace(events, rank=1, steps=2, first_step=11, last_step=12)
