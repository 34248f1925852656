#!/usr/bin/env bash
# The prepared GPU check: on a machine with CUDA, run the gpu-marked tests, every row of
# attention on CUDA at decode and prefill sizes (bench_rows.py), and the facade budget on
# CUDA tensors (bench_facade.py), in under 8 minutes, each step bounded, all written to one
# file. Without a CUDA device it writes "no CUDA device: skipped" and exits 0.
#
# Usage: benchmarks/gpu_check.sh [RESULTS_FILE]   (default: gpu_check.txt in the cwd)
# Run from the repository root, in an environment where astrai is installed.
set -u
out="${1:-gpu_check.txt}"
python="${PYTHON:-python}"
here="$(cd "$(dirname "$0")" && pwd)"
: >"$out"

if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
        >/dev/null 2>&1; then
    echo "no CUDA device: skipped" | tee -a "$out"
    exit 0
fi

status=0
step() {  # step NAME SECONDS COMMAND...: run it bounded, its output and exit code to $out
    local name="$1" limit="$2"
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$out"
    timeout "$limit" "$@" >>"$out" 2>&1
    local rc=$?
    echo "== $name: exit $rc" | tee -a "$out"
    [ "$rc" -eq 0 ] || status=1
}

"$python" -c "import torch; print('device:', torch.cuda.get_device_name(0), \
'capability', torch.cuda.get_device_capability(0), 'torch', torch.__version__)" >>"$out" 2>&1
step "gpu tests" 240 "$python" -m pytest -q -m gpu -p no:cacheprovider
step "rows on CUDA: attention" 150 "$python" "$here/bench_rows.py" --device cuda --quick \
    --family attention --rounds 5 --no-training
step "facade budget on CUDA" 60 "$python" "$here/bench_facade.py" --device cuda
echo "results: $out (exit $status)"
exit "$status"
