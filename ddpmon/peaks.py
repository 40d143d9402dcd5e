"""The dense peak FLOP/s of GPU models, by the name NVML gives them, for MFU.

Every figure is NVIDIA's datasheet figure for the *dense* tensor-core (or, for ``float32``,
CUDA-core) rate, in FLOP/s. Datasheets print the 2:4-sparse rate for tensor cores,
marked with an asterisk ("with sparsity"); dense is half of it, and an MFU against the
sparse figure would be half the truth. A model that is not listed has no peak, and so no
MFU: a guess would be worse than none.

Keys: ``float32``, ``tf32`` (float32 matmuls on tensor cores, where torch allows
them), ``bfloat16``, ``float16``, ``float8``. A model that lacks a key (``bfloat16`` on a V100)
has no tensor-core rate for that type; float64 has none here (no training runs in it).
"""

from __future__ import annotations

from dataclasses import dataclass

T = 1e12

_H100_SXM = {
    "float32": 67 * T,
    "tf32": 494.7 * T,
    "bfloat16": 989.4 * T,
    "float16": 989.4 * T,
    "float8": 1978.9 * T,
}
"""H100 SXM5 (datasheet: FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958* TFLOPS, * sparse; the
Hopper whitepaper's dense figures: TF32 494.7, BF16/FP16 989.4, FP8 1,978.9)."""
_H100_NVL = {
    "float32": 60 * T,
    "tf32": 417.5 * T,
    "bfloat16": 835.5 * T,
    "float16": 835.5 * T,
    "float8": 1670.5 * T,
}
"""H100 NVL and H200 NVL (datasheets: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341*)."""
_A100 = {"float32": 19.5 * T, "tf32": 156 * T, "bfloat16": 312 * T, "float16": 312 * T}
"""A100, SXM4 and PCIe, 40 and 80 GB (datasheet: FP32 19.5, TF32 312*, BF16/FP16 624*)."""
_V100_SXM2 = {"float32": 15.7 * T, "float16": 125 * T}
"""V100 SXM2 (datasheet: FP32 15.7, tensor FP16 125; no BF16 or TF32 tensor cores)."""
_V100_PCIE = {"float32": 14 * T, "float16": 112 * T}
"""V100 PCIe (datasheet: FP32 14, tensor FP16 112)."""

DENSE_PEAKS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": {
        "float32": 51.2 * T,
        "tf32": 378 * T,
        "bfloat16": 756 * T,
        "float16": 756 * T,
        "float8": 1513 * T,
    },
    # H100 PCIe (datasheet: FP32 51, TF32 756*, BF16/FP16 1,513*, FP8 3,026*)
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H200": _H100_SXM,  # H200 SXM: the H100 SXM's compute (datasheet: BF16 1,979*)
    "NVIDIA H200 NVL": _H100_NVL,
    "NVIDIA GH200 480GB": _H100_SXM,  # GH200's Hopper GPU (datasheet: BF16 1,979*)
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A30": {"float32": 10.3 * T, "tf32": 82 * T, "bfloat16": 165 * T, "float16": 165 * T},
    # A30 (datasheet: FP32 10.3, TF32 165*, BF16/FP16 330*)
    "NVIDIA A40": {
        "float32": 37.4 * T,
        "tf32": 74.8 * T,
        "bfloat16": 149.7 * T,
        "float16": 149.7 * T,
    },
    # A40 (datasheet: FP32 37.4, TF32 149.6*, BF16/FP16 299.4*)
    "NVIDIA A10": {"float32": 31.2 * T, "tf32": 62.5 * T, "bfloat16": 125 * T, "float16": 125 * T},
    # A10 (datasheet: FP32 31.2, TF32 125*, BF16/FP16 250*)
    "NVIDIA L4": {
        "float32": 30.3 * T,
        "tf32": 60 * T,
        "bfloat16": 121 * T,
        "float16": 121 * T,
        "float8": 242.5 * T,
    },
    # L4 (datasheet: FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485*)
    "NVIDIA L40": {
        "float32": 90.5 * T,
        "tf32": 90.5 * T,
        "bfloat16": 181 * T,
        "float16": 181 * T,
        "float8": 362 * T,
    },
    # L40 (datasheet: FP32 90.5, TF32 181*, BF16/FP16 362.1*, FP8 724*)
    "NVIDIA L40S": {
        "float32": 91.6 * T,
        "tf32": 183 * T,
        "bfloat16": 362.05 * T,
        "float16": 362.05 * T,
        "float8": 733 * T,
    },
    # L40S (datasheet: FP32 91.6, TF32 366*, BF16/FP16 733*, FP8 1,466*)
    "Tesla V100-SXM2-16GB": _V100_SXM2,
    "Tesla V100-SXM2-32GB": _V100_SXM2,
    "Tesla V100-PCIE-16GB": _V100_PCIE,
    "Tesla V100-PCIE-32GB": _V100_PCIE,
    "Tesla T4": {"float32": 8.1 * T, "float16": 65 * T},  # T4 (datasheet: FP32 8.1, mixed FP16 65)
}

_BY_KEY = {" ".join(name.lower().split()): peaks for name, peaks in DENSE_PEAKS.items()}


@dataclass(frozen=True)
class Peak:
    """A device's dense peak for one type: what MFU divides by."""

    flops_per_second: float
    device: str
    dtype: str

    @property
    def source(self) -> str:
        """Where the figure comes from, for a reader to check."""
        return f"NVIDIA datasheet, {self.device}, {self.dtype}, dense (ddpmon/peaks.py)"


def dtype_key(dtype: str, tf32: bool = False) -> str:
    """The table's key for a torch dtype's name (``torch.bfloat16`` or ``bfloat16``):
    float8's kinds are one key; ``tf32`` for float32 where torch lets matmuls use TF32."""
    name = dtype.removeprefix("torch.")
    if name.startswith("float8"):
        return "float8"
    if name == "float32" and tf32:
        return "tf32"
    return {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)


def peak(device_name: str | None, dtype: str | None) -> Peak | None:
    """The dense peak FLOP/s of the GPU NVML calls ``device_name`` for ``dtype`` (a key of
    the table), or None where it is not known: an unlisted model, a CPU, a type the model
    has no rate for."""
    if not device_name or not dtype:
        return None
    figure = _BY_KEY.get(" ".join(device_name.lower().split()), {}).get(dtype)
    return Peak(figure, device_name, dtype) if figure else None
