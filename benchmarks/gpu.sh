#!/usr/bin/env bash
# The GPU checks and benchmarks of docs/performance.md ("On a GPU"), on one GPU, from the
# repository's root: `benchmarks/gpu.sh PART OUT_DIR`, PART one of `tests` (versions and
# tests/gpu), `sources` (benchmarks/bucket_sources.py) and `overhead` (benchmarks/overhead.py
# on a 0.37B-parameter bf16 transformer over NCCL for each attach option in $VARIANTS, and
# 2 gloo ranks with CUDA tensors unless GLOO=0). Each part is bounded in time; what each
# printed is in OUT_DIR.
set -u
part=$1 out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
load() { echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"; }

if [ "$part" = tests ]; then
  {
    date -u; nproc; load
    nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id,uuid --format=csv
    nvidia-smi | head -4
    $py - <<'PY'
import os, tempfile, torch, torch.distributed as dist
c10d = torch._C._distributed_c10d
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(),
      "device", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
dist.init_process_group("nccl", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
backend = dist.group.WORLD._get_backend(torch.device("cuda"))
print("NCCL backend class", type(backend).__module__, type(backend).__name__,
      "completion hook:", hasattr(dist.group.WORLD, "_register_on_completion_hook"))
print("flight recorder dumps:", [n for n in dir(c10d) if n.startswith("_dump_")])
print("TORCH_NCCL/TORCH_FR env:", {k: v for k, v in os.environ.items() if k.startswith(("TORCH_NCCL", "TORCH_FR", "NCCL"))})
try:
    import torchcomms
    print("torchcomms", getattr(torchcomms, "__version__", "?"))
except ImportError as e:
    print("torchcomms: not installed:", e)
dist.destroy_process_group()
PY
    $py -m pip list 2>/dev/null | grep -iE "^(torch|nvidia-ml-py|prometheus|psutil|h11|pyyaml|pytest|jsonschema)" 
  } > "$out/env.txt" 2>&1
  # against nvidia-smi first, on an idle GPU; then the rest side by side
  smi=(tests/gpu/test_gpu_metrics.py::test_every_gpu_matches_nvidia_smi tests/gpu/test_gpu_metrics.py::test_energy_counts_what_power_draws)
  timeout 90 $py -m pytest "${smi[@]}" -p no:cacheprovider -q -rA --timeout 80 > "$out/pytest-nvml.log" 2>&1
  DDPMON_GPU_FIGURES="$out/figures.jsonl" timeout 200 $py -m pytest tests/gpu -p no:cacheprovider -q -rA -n 6 \
    --timeout 150 "${smi[@]/#/--deselect=}" > "$out/pytest.log" 2>&1
  for log in "$out/pytest-nvml.log" "$out/pytest.log"; do tail -n 3 "$log"; done
  cat "$out/figures.jsonl" 2>/dev/null
elif [ "$part" = sources ]; then
  (load; timeout 100 $py benchmarks/bucket_sources.py) > "$out/sources.txt" 2>&1
  cat "$out/sources.txt"
elif [ "$part" = overhead ]; then
  lm="--ranks 1 --device cuda --backend nccl --model transformer --width 1024 --depth 24 --dtype bfloat16 --batch 8 --seq 512 --rounds 40"
  for variant in ${VARIANTS:-default hook a/a}; do
    case $variant in default) option= ;; a/a) option=--no-attach ;; *) option="--option bucket_timing=$variant" ;; esac
    (load; timeout 110 $py benchmarks/overhead.py $lm $option) 2>&1 | grep -v "^ddpmon\|^  report" >> "$out/overhead.txt"
  done
  [ "${GLOO:-1}" = 0 ] || for option in "" "--option bucket_timing=hook"; do
    (load; timeout 60 $py benchmarks/overhead.py --ranks 2 --device cuda --backend gloo --rounds 40 $option) 2>&1 \
      | grep -v "^ddpmon\|^  report" >> "$out/overhead.txt"
  done
  cat "$out/overhead.txt"
fi
