"""Cross-rank checks over state files: same data, diverged replicas, NaN origin, shared GPU.

No rank ever issues a collective for advice: each one writes its fingerprints into its state
file, and whoever reads several files compares them here (the doctor over a state
directory, and each rank over its peers' files when they share the state directory). No
torch: the doctor imports this.
"""

from __future__ import annotations

import time
from collections import defaultdict

from ..state.schema import Advice, RankState
from . import words

MIN_SAME_STEPS = 3
"""Steps whose batches must match on every rank before they count as the same data."""


def compare(states: list[RankState]) -> list[Advice]:
    """Every cross-rank finding over these ranks' states (one job)."""
    if len(states) < 2:
        return []
    states = sorted(states, key=lambda s: s.rank)
    found = [
        same_data(states),
        replicas_diverged(states),
        nonfinite_origin(states),
        shared_gpu(states),
    ]
    return [a for a in found if a is not None]


def same_data(states: list[RankState]) -> Advice | None:
    """same_data: ranks whose input batches were identical in every step both recorded (at
    least three, and not one fixed batch repeated: that is a benchmark, not a data pipeline)."""
    by_rank = {s.rank: {step: crc for step, crc in s.fingerprints.batch} for s in states}
    # ranks are "the same" when every step they both recorded matches; a fixed batch
    # repeated every step is left out
    same: list[list[int]] = []
    ranks = sorted(r for r, p in by_rank.items() if len(set(p.values())) > 1)
    seen: set[int] = set()
    for i, a in enumerate(ranks):
        if a in seen:
            continue
        group = [a]
        for b in ranks[i + 1 :]:
            common = set(by_rank[a]) & set(by_rank[b])
            if len(common) >= MIN_SAME_STEPS and all(
                by_rank[a][s] == by_rank[b][s] for s in common
            ):
                group.append(b)
        if len(group) > 1:
            seen.update(group)
            same.append(group)
    if not same:
        return None
    involved = sorted(r for g in same for r in g)
    first = min(min(set(by_rank[g[0]]) & set(by_rank[g[1]])) for g in same)
    samplers = sorted(
        {
            f"rank {s.rank}: {s.data.sampler}"
            for s in states
            if s.rank in involved and s.data.sampler
        }
    )
    evidence = [
        f"ranks {', '.join(map(str, g))} fed identical batches in all "
        f"{len(set(by_rank[g[0]]) & set(by_rank[g[1]]))} steps compared"
        for g in same
    ]
    if samplers:
        evidence.append("sampler seen: " + "; ".join(samplers))
    return Advice(
        "same_data",
        "warning",
        f"ranks {_ranks(involved)} train on the same batches: the job does the work of "
        f"{len(states) - len(involved) + len(same)} rank(s) at the cost of {len(states)}",
        evidence,
        words.FIX["same_data"],
        step=first,
        unix=time.time(),
        ranks=involved,
    )


def replicas_diverged(states: list[RankState]) -> Advice | None:
    """replicas_diverged: parameter-and-buffer fingerprints that differ between ranks at the
    same step. Names the first differing tensor and the earliest step compared that differs."""
    prints = {s.rank: {p.step: p for p in s.fingerprints.params} for s in states}
    steps = sorted(set.intersection(*(set(p) for p in prints.values())))
    for step in steps:
        digests: dict[int, list[int]] = defaultdict(list)
        for rank, by_step in prints.items():
            digests[by_step[step].digest].append(rank)
        if len(digests) < 2:
            continue
        # the reference: the largest group (the one holding the lowest rank on a tie)
        majority = max(digests.values(), key=lambda ranks: (len(ranks), -min(ranks)))
        odd = sorted(r for ranks in digests.values() if ranks is not majority for r in ranks)
        ref = prints[majority[0]][step]
        names = next((s.fingerprints.names for s in states if s.rank == majority[0]), [])
        first = next(
            (
                i
                for r in odd
                for i, (x, y) in enumerate(zip(ref.tensors, prints[r][step].tensors))
                if x != y
            ),
            None,
        )
        name = names[first] if first is not None and first < len(names) else "?"
        inner = [s.rank for s in states if any(a.kind == "inner_module_forward" for a in s.advice)]
        if inner:
            cause = f"a training forward on the inner module (ddp.module) on rank(s) {_ranks(inner)} bypassed DDP's all-reduce"
        elif name.startswith("buffer:"):
            cause = (
                "buffers differ per rank: DDP broadcasts them from rank 0 only with broadcast_buffers=True, "
                "or code changes them outside forward"
            )
        else:
            cause = (
                "parameters changed outside DDP on some rank: a rank-dependent initialisation after wrapping, "
                "a forward/backward on the inner module, or a rank-dependent optimizer update"
            )
        return Advice(
            "replicas_diverged",
            "warning",
            f"the model replicas differ: rank(s) {_ranks(odd)} differ from rank {majority[0]} "
            f"at step {step}, first in {name}",
            [
                f"fingerprints of step {step}: "
                + ", ".join(f"rank {r} {prints[r][step].digest:08x}" for r in sorted(prints)),
                f"first differing tensor: {name}",
                f"likely cause: {cause}",
            ],
            words.FIX["replicas_diverged"],
            step=step,
            unix=time.time(),
            ranks=sorted(set(odd) | {majority[0]}),
        )
    return None


def nonfinite_origin(states: list[RankState]) -> Advice | None:
    """nonfinite_gradients: the rank(s) whose own gradients were first non-finite, before the
    all-reduce spread them; the ranks that got them later are consequences."""
    bad = {s.rank: s.fingerprints.nonfinite for s in states if s.fingerprints.nonfinite is not None}
    if not bad:
        return None
    first = min(n.step for n in bad.values())
    origin = sorted(r for r, n in bad.items() if n.step == first)
    later = sorted(r for r in bad if r not in origin)
    clean = [
        s.rank
        for s in states
        if s.rank not in bad and s.fingerprints.nonfinite_checked_step >= first
    ]
    evidence = [
        f"rank {r}: first non-finite gradient in step {bad[r].step}, in {bad[r].parameter}"
        for r in sorted(bad)
    ]
    if later:
        evidence.append(
            f"rank(s) {_ranks(later)} received them through the all-reduce afterwards (consequences)"
        )
    if clean:
        evidence.append(
            f"rank(s) {_ranks(clean)} had finite gradients of their own in step {first}"
        )
    return Advice(
        "nonfinite_gradients",
        "warning",
        f"NaN/Inf gradients started on rank {_ranks(origin)} in step {first}, in {bad[origin[0]].parameter}, "
        "before the all-reduce",
        evidence,
        words.FIX["nonfinite_gradients"],
        step=first,
        unix=time.time(),
        ranks=origin,
    )


def shared_gpu(states: list[RankState]) -> Advice | None:
    """shared_gpu: several ranks on one GPU (same host, same NVML UUID)."""
    by_gpu: dict[tuple[str | None, str], list[int]] = defaultdict(list)
    for s in states:
        if s.data.gpu_uuid:
            by_gpu[(s.host, s.data.gpu_uuid)].append(s.rank)
    shared = {k: v for k, v in by_gpu.items() if len(v) > 1}
    if not shared:
        return None
    ranks = sorted(r for v in shared.values() for r in v)
    return Advice(
        "shared_gpu",
        "warning",
        f"ranks {_ranks(ranks)} share a GPU",
        [
            f"ranks {_ranks(v)} on {host}: {uuid}"
            for (host, uuid), v in sorted(shared.items(), key=lambda i: i[1])
        ],
        words.FIX["shared_gpu"],
        unix=time.time(),
        ranks=ranks,
    )


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
