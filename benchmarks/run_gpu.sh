#!/usr/bin/env bash
# Every GPU benchmark of the issues, one section at a time, logs and JSON under $OUT (default ./out).
# Usage (on a 2-GPU machine, peers' wheels in .peers/ built by ../shared/peers/build-peer-wheels.sh):
#   bash benchmarks/run_gpu.sh [comm] [stream] [train] [trainmem] [offload] [offload3] [kernels] [decode] [serve]
#                              [capacity]
#   (default: all but trainmem (allocation traces at the ZeRO-2 peak), capacity and offload3)
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
sections=${*:-comm stream train offload kernels decode serve}
run() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -i "warn" | tail -30
}
# -- serve (issue 6): (a) streaming vs raw H2D, (b) a model over a GPU memory cap beside DeepSpeed ZeRO-Inference,
# (c) the gRPC load test, (d) Llama-70B layers from disk over gRPC. One log and one JSON file for all of it;
# per-step limits sum to 480 s. Sizes: llama-8b (32 layers, 16.1 GB bf16) written once and shared by (a)-(c);
# under the 10 GiB cap both zspeed and DeepSpeed must stream it. (d) writes up to 8 llama-70b layers (1.7 GB
# each, checkpoint + layer store 3.4 GB a layer) after the 8b files are deleted; the 64 GiB disk sets the count.
serve_step() {  # name, seconds, command...   (SERVE_STEPS="synth c-load ...": only those steps)
  local name=$1 limit=$2 t0=$SECONDS; shift 2
  if [[ -n ${SERVE_STEPS:-} && " $SERVE_STEPS " != *" $name "* ]]; then return 0; fi
  echo "== serve/$name ($(date +%T), limit ${limit}s)" | tee -a "$OUT/serve.log"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$OUT/serve.log" \
    | grep -v -i -E "warn|^\[zserve\]|it/s\]|shard/s\]|layer/s\]" | tail -n 12
  echo "   serve/$name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s" | tee -a "$OUT/serve.log"
}
serve_section() {  # SERVE_DRY=1: the same steps on the CPU with the tiny preset, in seconds
  local W=/tmp/zspeed-serve J="$OUT/serve.json" B=benchmarks/bench_serve.py
  local small=llama-8b small_layers=32 large=llama-70b dev=auto engine=deepspeed max70=8
  local lens=(--prompt-len 128 --new-tokens 16) load_lens=(--prompt-len 128 --new-tokens 32)
  local nvme_lens=(--prompt-len 32)
  if [[ ${SERVE_DRY:-0} == 1 ]]; then
    small=tiny small_layers=2 large=tiny dev=cpu engine=hf max70=2 W=/tmp/zspeed-serve-dry
    lens=(--prompt-len 16 --new-tokens 8) load_lens=(--prompt-len 16 --new-tokens 8)
    nvme_lens=(--prompt-len 8 --window 1)
  fi
  local big=(--preset $small --weights-dir "$W" --device $dev --json "$J")
  local capped=(--batch 1 16 64 "${lens[@]}" --max-num-batched-tokens 8192 --gpu-mem-cap-gib 10)
  rm -f "$J"
  serve_step env 30 python3 $B env --weights-dir "$W" --json "$J"
  # The committed gRPC stubs need grpcio >= 1.85.1 and protobuf >= 7.35.1; where the image has older ones,
  # (c) and (d) use wheels from .peers/serve/ installed aside (the image's own packages stay untouched).
  local pyenv=()
  if ! python3 -c "import zspeed.serve.server" >/dev/null 2>&1 && ls .peers/serve/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/zspeed-serve-site .peers/serve/*.whl \
      && pyenv=(env "PYTHONPATH=/tmp/zspeed-serve-site${PYTHONPATH:+:$PYTHONPATH}") \
      && echo "   gRPC stubs: using grpcio/protobuf from .peers/serve" | tee -a "$OUT/serve.log"
  fi
  serve_step synth 100 python3 -m zspeed.serve.cli synth --arch $small --out "$W/$small-${small_layers}l-bf16"
  local window  # STREAM_WINDOWS="3 5": the streaming figure once per number of device slots
  for window in ${STREAM_WINDOWS:-3 5}; do
    serve_step a-stream 75 python3 $B stream "${big[@]}" "${capped[@]}" --window $window
  done
  serve_step b-zero-inference 130 python3 $B zero-inference "${big[@]}" "${capped[@]}" --engine $engine
  # the load test once per LOAD_MODES ("process inproc": zserve's engine in a process of its own, its default, or
  # in its gRPC process), LOAD_BUDGETS (step token budget), LOAD_CAPS (prompt tokens per step while decoding;
  # 0: no cap), LOAD_PACES (prefill pacing steps; 0: none) and LOAD_ATTNS ("auto sdpa triton": attention); each
  # zserve writes its step log to $OUT/steps-MODE-BUDGET-CAP-PACE-ATTN.jsonl
  local budget mode cap pace attn
  for mode in ${LOAD_MODES:-process}; do
    for budget in ${LOAD_BUDGETS:-2048}; do
      for cap in ${LOAD_CAPS:-96}; do
        for pace in ${LOAD_PACES:-2}; do
          for attn in ${LOAD_ATTNS:-auto}; do
            serve_step c-load 150 ${pyenv[@]+"${pyenv[@]}"} python3 $B load "${big[@]}" --offload none \
              --batch 1 32 "${load_lens[@]}" --requests 64 --rate-fractions 0.5 0.8 --max-seconds 12 \
              --max-num-batched-tokens $budget --max-prefill-tokens-per-step $cap --prefill-pacing-steps $pace \
              --attention-kernel $attn --step-log "$OUT/steps-$mode-$budget-$cap-$pace-$attn.jsonl" \
              $([[ $mode == inproc ]] && echo --no-engine-process)
          done
        done
      done
    done
  done
  rm -rf "$W/$small-${small_layers}l-bf16"
  local free_gb n70
  free_gb=$(df -P -BG "$W" | awk 'NR==2 {print $4 + 0}')
  n70=$(( (free_gb - 10) / 4 )); (( n70 > max70 )) && n70=$max70; (( n70 < 2 )) && n70=2
  echo "   disk: ${free_gb} GB free in $W -> $large with $n70 layers" | tee -a "$OUT/serve.log"
  serve_step d-nvme 115 ${pyenv[@]+"${pyenv[@]}"} python3 $B nvme --preset $large --num-layers $n70 \
    --weights-dir "$W" --device $dev --json "$J" --window 3 "${nvme_lens[@]}" --new-tokens 4 --max-seconds 90
  rm -rf "$W"
  serve_step summary 60 python3 $B summary --json "$J"
}
for s in $sections; do
  case $s in
    comm) run comm 120 python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_comm.py --json "$OUT/comm.json" ;;
    stream) run stream 240 python3 benchmarks/bench_stream.py --json "$OUT/stream.json" ;;
    train) run train 330 python3 benchmarks/bench_train.py --driver --nproc 2 --timeout 90 \
             --systems zspeed-z2,deepspeed-z2,zspeed-z3,fsdp2,deepspeed-z3,plain --json "$OUT/train.json" ;;
    trainmem) run trainmem 200 python3 benchmarks/bench_train.py --driver --nproc 2 --timeout 90 --warmup 1 --steps 2 \
                --systems zspeed-z2,deepspeed-z2 --memory-report "$OUT/memory" --json "$OUT/trainmem.json" ;;
    offload) run offload 420 python3 benchmarks/bench_offload.py --mode throughput --nproc 1 --timeout 150 \
               --json "$OUT/offload.json" ;;
    offload3) run offload3 540 python3 benchmarks/bench_offload.py --mode throughput --nproc 2 --timeout 200 \
                --json "$OUT/offload.json" ;;
    # one call may run 600 s: by default the 8 B pair of ZeRO-3 offload systems only (each in its own process,
    # 280 s at most); CAPACITY_SIZES / CAPACITY_SYSTEMS for others. 8 B needs ~130 GB of host memory: nvidia-h200-x2.
    capacity) run capacity 580 python3 benchmarks/bench_offload.py --mode capacity --sizes "${CAPACITY_SIZES:-8b}" \
                --systems "${CAPACITY_SYSTEMS:-zspeed-z3-offload,deepspeed-z3-offload}" --timeout 280 \
                --json "$OUT/capacity.json" ;;
    kernels) run kernels 400 python3 benchmarks/bench_kernels.py ;;
    decode) run decode 240 python3 benchmarks/bench_decode.py --json "$OUT/decode.json" ;;
    serve) serve_section ;;
    *) echo "unknown section $s" ;;
  esac
done
