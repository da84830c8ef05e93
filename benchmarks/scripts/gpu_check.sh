#!/usr/bin/env bash
# The GPU checks in one run, sized for a few minutes on one GPU: the kernels (parity on CUDA,
# decode attention bandwidth as a share of a device copy of the same bytes, Triton paged
# attention against contiguous SDPA on the same shapes), then the engine (bf16 and float32
# greedy parity against transformers, engine tokens/s). Reports land in OUT, or by default in a
# fresh bench-runs/gpu-TIMESTAMP (the folder `pagedserve bench` picks), never in docs/results/.
#
#   bash benchmarks/scripts/gpu_check.sh [OUT]       # on a machine with a CUDA GPU and this repo installed
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(python -c 'import sys; from pagedserve.benchmarks.report import results_dir
print(results_dir(sys.argv[1] or None, "gpu").resolve())' "${1:-}" | tail -n 1) || exit 2
echo "reports go to $out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
status=0
# Run from outside the repository (its folders shadow modules); scripts by absolute path.
here=$(pwd)
(cd /tmp && timeout 200 python "$here/benchmarks/scripts/kernels_gpu.py" --out "$out/kernels_gpu.md") || status=1
(cd /tmp && timeout 280 python "$here/benchmarks/scripts/gpu_engine.py" --budget-s 150 --out "$out/gpu_engine.md") || status=1
exit $status
