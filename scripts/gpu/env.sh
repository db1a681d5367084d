# Sourced by the runners scripts/gpu-tests and scripts/gpu-peer pack (run, bench, bench-e2e,
# bench-peer) on the GPU machine: the CUDA libraries on the loader's path, a scratch folder
# removed at exit, the GPU's name printed.
here="$(cd "$(dirname "$0")" && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
libs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda-13.0/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && libs="$libs:$d"
done
for d in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
  for l in "$d"/nvidia/*/lib "$d"/nvidia/cu13/lib; do [ -d "$l" ] && libs="$libs:$l"; done
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}$libs"
# A test that finds no GPU here fails instead of skipping; failures show where.
export PENSIEVE_REQUIRE_GPU=1 RUST_BACKTRACE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
