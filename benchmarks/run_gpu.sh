#!/usr/bin/env bash
# Every GPU benchmark of the issues, one section at a time, logs and JSON under $OUT (default ./out).
# Usage (on a 2-GPU machine, peers' wheels in .peers/ built by ../shared/peers/build-peer-wheels.sh):
#   bash benchmarks/run_gpu.sh [comm] [stream] [train] [offload] [offload3] [kernels] [serve] [capacity]
#   (default: all but capacity and offload3, the 2-GPU ZeRO-3 offload set)
# Each section has its own time limit so one stuck peer cannot take the others' time.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
if ls .peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps .peers/*.whl >/dev/null 2>&1 || echo "peer wheels failed to install"
fi
sections=${*:-comm stream train offload kernels serve}
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -i "warn" | tail -30
}
for s in $sections; do
  case $s in
    comm) run comm 120 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_comm.py --json "$OUT/comm.json" ;;
    stream) run stream 240 python3 benchmarks/bench_stream.py --json "$OUT/stream.json" ;;
    train) run train 330 python3 benchmarks/bench_train.py --driver --nproc 2 --timeout 90 \
             --systems zspeed-z2,deepspeed-z2,zspeed-z3,fsdp2,deepspeed-z3,plain --json "$OUT/train.json" ;;
    offload) run offload 420 python3 benchmarks/bench_offload.py --mode throughput --nproc 1 --timeout 150 \
               --json "$OUT/offload.json" ;;
    offload3) run offload3 540 python3 benchmarks/bench_offload.py --mode throughput --nproc 2 --timeout 200 \
                --json "$OUT/offload.json" ;;
    capacity) run capacity 900 python3 benchmarks/bench_offload.py --mode capacity --json "$OUT/capacity.json" ;;
    kernels) run kernels 400 python3 benchmarks/bench_kernels.py ;;
    serve) run serve 240 python3 benchmarks/bench_serve.py stream --preset llama-8b --num-layers 12 --window 3 \
             --json "$OUT/serve_stream.json" ;;
    *) echo "unknown section $s" ;;
  esac
done
