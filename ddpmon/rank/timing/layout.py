"""What DDP's own logging data says (``_get_ddp_logging_data``): its facts, and its bucket
layout, which is the only view of the buckets when no comm hook reports them."""

from __future__ import annotations

from typing import Any

from .. import torch_api

DDP_FACTS = (
    "backend_name",
    "bucket_cap_bytes",
    "bucket_sizes",
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "broadcast_buffers",
    "has_sync_bn",
    "comm_hook",
    "gloo_num_threads",
    "torch_distributed_debug",
    "num_parameter_tensors",
    "total_parameter_size_bytes",
    "nccl_socket_ifname",
    "nccl_blocking_wait",
    "nccl_async_error_handling",
    "nccl_debug",
    "nccl_ib_timeout",
    "nccl_nthreads",
)


def ddp_facts(ddp: Any, recorder: Any = None) -> dict[str, Any]:
    """Facts from DDP's own logging data (``_get_ddp_logging_data``) where torch has it
    (else none, said once). Read once at attach, on the training thread: the call takes the
    reducer's lock."""
    try:
        data = torch_api.ddp_logging_data(ddp)
    except torch_api.Missing as missing:
        torch_api.off(missing, recorder)
        return {}
    except Exception:
        return {}
    return {k: data[k] for k in DDP_FACTS if k in data and data[k] not in ("", "N/A")}


class BucketLayout:
    """DDP's buckets as DDP's logging data describes them: with no comm hook, nothing else
    shows them. Read at step boundaries until DDP has rebuilt its buckets (iteration 1).
    ``sizes`` holds each bucket's bytes."""

    MAX_READS = 20

    def __init__(self, ddp: Any, parameters: list[Any], names: list[str]) -> None:
        self._ddp, self._parameters, self._names = ddp, parameters, names
        self._seen: Any = None
        self.generation = 0  # counts the layouts seen
        self._count = 0
        self._reads = 0
        self._final = False
        self.sizes: list[int] = []

    @property
    def final(self) -> bool:
        """DDP has rebuilt its buckets (or enough reads found it keeps them): no more reads."""
        return self._final

    def refresh(self, recorder: Any = None) -> int:
        """Read DDP's layout (and give the recorder its buckets, if one is given) if it
        may have changed; returns the bucket count."""
        if self._final:
            return self._count
        self._reads += 1
        data = torch_api.ddp_logging_data(self._ddp)
        rebuilt = data.get("rebuilt_bucket_sizes")
        sizes = _numbers(rebuilt or data.get("bucket_sizes"))
        indices_text = str(data.get("rebuilt_per_bucket_param_indices") or "") if rebuilt else ""
        groups = [_numbers(group) for group in indices_text.split(",")] if indices_text else []
        seen = (sizes, groups)
        if seen != self._seen:
            self._seen = seen
            self.generation += 1
            self.sizes = sizes
            self._count = len(sizes)
            if recorder is not None:
                self._publish(recorder, sizes, groups)
        self._final = bool(rebuilt) or self._reads >= self.MAX_READS
        return self._count

    def _publish(self, recorder: Any, sizes: list[int], groups: list[list[int]]) -> None:
        params, names = self._parameters, self._names
        for i, nbytes in enumerate(sizes):
            indices = [j for j in (groups[i] if i < len(groups) else []) if 0 <= j < len(params)]
            first = params[indices[0]] if indices else (params[0] if params else None)
            dtype = str(first.dtype).replace("torch.", "") if first is not None else ""
            recorder.set_bucket_layout(i, nbytes, dtype, [names[j] for j in indices])
        recorder.drop_buckets_from(len(sizes))


def _numbers(value: Any) -> list[int]:
    """DDP's logging data holds lists as text ("526336, 526336"); a list is taken as is."""
    if value is None or value == "":
        return []
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    return [int(v) for v in items]
