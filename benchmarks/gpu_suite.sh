#!/usr/bin/env bash
# Every GPU check and benchmark of the repo in one go, for one machine with one (or two, or three) CUDA GPUs.
#
#   OUT=/tmp/gpu_out bash benchmarks/gpu_suite.sh [tests|tests_omni|decode|orpheus|orpheus_http|orpheus_ab|orpheus_fp8|wan|wan_quick|wan_profile|wan_extra|wan_fp8|omni|omni_80gb|omni2|omni_quick|omni_fp8|profile_omni|code2wav|structured|pd|pd2|kernels|pi05|pi05_modes|vjepa2|vjepa2_profile|hops|hops2|fp8_decode|bagel|bagel_fp8|bagel_cfg3|cosmos3|cosmos3_policy|serve_fit|all]
#
# On a bare GPU machine run `source benchmarks/device_setup.sh` first (it says what to carry there).
#
# Writes logs and JSON results under $OUT (default ./gpu_out). Each step has its own time limit, and a
# failing step does not stop the others. Needs the repo importable (pip install -e . or PYTHONPATH) and,
# for the Orpheus server step, fastapi/uvicorn/pyzmq/msgspec; the Wan step needs diffusers for its
# baseline (benchmarks/wan_bench.py says how to carry it); the omni steps need the Qwen3-Omni tokenizer folder
# (mstar_tokenizers/qwen3-omni-v2, built by any qwen3_omni test here) under the temp dir. omni2, hops2 and pd2 need two GPUs,
# bagel_cfg3 three.
# ORPHEUS_CONFIG picks the Orpheus server's config (default mstar/configs/orpheus.yaml).
# serve_fit (not in all): MODELS picks the models (default every one), SERVE_FIT_ARGS adds flags of
# benchmarks/serve_fit.py (its docstring has the tokenizer folders each model needs and a plan of calls).
# With TAR=1 everything under $OUT is packed into $OUT/gpu_suite.tgz at the end (one file to fetch).
# Results are named <benchmark>_<gpu>[_<config>].json (GPU: h100, h200, ... from nvidia-smi, or set GPU=);
# the newest of each replaces its file in benchmarks/results/. The *.log files are not results.
set -u
OUT=${OUT:-gpu_out}
WHAT=${1:-all}
PORT=${PORT:-8123}
GPU=${GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -oiE 'h100|h200|b200|a100' | tr 'A-Z' 'a-z')}
GPU=${GPU:-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
run() {  # run <seconds> <log name> <command...>
  local limit=$1 name=$2; shift 2
  echo "== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; echo "rc=$rc"
  tail -n 12 "$OUT/$name.log"; return $rc
}
descendants() {  # from /proc in plain bash: no pgrep or awk needed
  local p key value
  for p in /proc/[0-9]*; do
    [[ -r $p/status ]] || continue
    while read -r key value; do
      [[ $key == PPid: ]] || continue
      [[ $value == "$1" ]] && echo "${p#/proc/}" && descendants "${p#/proc/}"
      break
    done < "$p/status"
  done
}
stacks() {  # stacks <server pid>: the server (it may be a launcher's child) writes every thread's stack to
  # its log and passes the signal on to its worker processes (mstar.runtime.process.stacks_on_sigusr1);
  # where cuda-gdb is installed, it also lists each worker's GPU kernels still running (a GPU that hangs)
  local p
  for p in "$1" $(descendants "$1"); do
    [[ $(readlink "/proc/$p/exe") == *python* ]] || continue  # USR1 ends a shell (a launcher shim)
    if grep -qa 'mstar.cli.main' "/proc/$p/cmdline" 2>/dev/null; then
      kill -USR1 "$p" 2>/dev/null
    elif grep -qa 'spawn_main' "/proc/$p/cmdline" 2>/dev/null && command -v cuda-gdb > /dev/null; then
      timeout 90 cuda-gdb -q -batch -p "$p" -ex 'info cuda kernels' -ex 'thread apply all bt 12' \
          > "$OUT/cuda_gdb_$p.txt" 2>&1
    fi
  done
  sleep 2
}
wait_ready() {
  python3 - "$PORT" <<'PY'
import sys, time, urllib.request
for _ in range(180):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/ready", timeout=2); sys.exit(0)
    except Exception:
        time.sleep(1)
sys.exit(1)
PY
}

FULL_OMNI="tests/gpu/test_qwen3_omni_full_dummy_gpu.py tests/gpu/test_profile_omni_gpu.py"  # 35B builds
test_file() {  # test_file <file>: one pytest with its own limit (FILE_LIMIT s), one summary line
  local f=$1 name; name=gpu_tests_$(basename "$f" .py)
  timeout "${FILE_LIMIT:-240}" python3 -m pytest -q -n 0 -m gpu "$f" -p no:cacheprovider -rfE --tb=short \
      --durations=5 -o faulthandler_timeout="${FAULT_S:-150}" --log-level=INFO > "$OUT/$name.log" 2>&1
  echo "$f rc=$? $(grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|errors?)' "$OUT/$name.log" | tr '\n' ' ')"
}
if [[ $WHAT == tests || $WHAT == all ]]; then
  # one pytest per file, so one slow or stuck file costs only itself; GPU_TESTS picks files (a device call
  # of 10 minutes does not hold them all). A file running past FAULT_S seconds dumps every thread's stack
  # into its log (where it is stuck or slow). JOBS=n runs n files at once on the one GPU (for pass/fail
  # only: files share the GPU and the host, so their timings mean nothing).
  files=${GPU_TESTS:-$(ls tests/gpu/test_*.py)}
  for f in $files; do
    case " $FULL_OMNI " in *" $f "*) continue ;; esac
    while (( $(jobs -rp | wc -l) >= ${JOBS:-1} )); do wait -n; done
    test_file "$f" &
  done > >(tee "$OUT/gpu_tests_summary.txt")
  wait
fi
if [[ $WHAT == tests_omni || $WHAT == all ]]; then
  run 480 gpu_tests_omni python3 -m pytest -q -n 0 -m gpu $FULL_OMNI -p no:cacheprovider --durations=15
fi
if [[ $WHAT == decode || $WHAT == all ]]; then
  run 300 decode_step python3 benchmarks/decode_step.py --out "$OUT/decode_step_$GPU.json"
  run 200 profile_decode python3 benchmarks/profile_decode.py --batch-sizes 1 4 --speakable-span --max-model-len 700 \
      --steps 30 --frame-places 0 1 --out "$OUT/profile_decode_$GPU.json"
  run 200 profile_decode_pdl python3 benchmarks/profile_decode.py --batch-sizes 1 --pdl both \
      --out "$OUT/profile_decode_${GPU}_pdl.json"
fi
if [[ $WHAT == orpheus || $WHAT == all ]]; then
  run 120 profile_orpheus python3 benchmarks/profile_orpheus.py --concurrency 1 4 --tokens 300 \
      --out "$OUT/profile_orpheus_$GPU.json"
  run 120 profile_orpheus_no_vocoder python3 benchmarks/profile_orpheus.py --concurrency 1 4 --tokens 300 --no-vocoder \
      --out "$OUT/profile_orpheus_${GPU}_no_vocoder.json"
  run 120 profile_orpheus_timeline python3 benchmarks/profile_orpheus.py --concurrency 1 --tokens 300 --timeline \
      --out "$OUT/profile_orpheus_${GPU}_timeline.json"
fi
orpheus_sweep() {  # orpheus_sweep <config> <json name> [more mstar serve flags]
  python3 -m mstar.cli.main serve orpheus --load-format dummy --config "$1" --port "$PORT" "${@:3}" \
      > "$OUT/$2_server.log" 2>&1 &
  local server=$!
  if wait_ready; then
    run 300 "$2" python3 -m mstar.cli.main bench --base-url "http://127.0.0.1:$PORT" --workload speech \
        --model orpheus --concurrency "${ORPHEUS_LEVELS:-1,4,8,16,32}" --duration "${ORPHEUS_DURATION:-10}" \
        --max-tokens 600 --ignore-eos \
        --output "$OUT/$2.json" || stacks "$server"
  else
    echo "orpheus server not ready"; tail -n 20 "$OUT/$2_server.log"
  fi
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
}
if [[ $WHAT == orpheus || $WHAT == orpheus_http || $WHAT == all ]]; then  # orpheus_http: the served sweep alone
  orpheus_sweep "${ORPHEUS_CONFIG:-mstar/configs/orpheus.yaml}" "orpheus_http_$GPU"
fi
if [[ $WHAT == orpheus_fp8 ]]; then  # the served sweep in bf16, then with FP8 weights, at 1 / 8 / 16 (~3 min)
  ORPHEUS_LEVELS=${ORPHEUS_LEVELS:-1,8,16} orpheus_sweep mstar/configs/orpheus.yaml "orpheus_http_${GPU}_bf16"
  ORPHEUS_LEVELS=${ORPHEUS_LEVELS:-1,8,16} orpheus_sweep mstar/configs/orpheus.yaml "orpheus_http_${GPU}_fp8" \
      --quantization fp8
fi
if [[ $WHAT == orpheus_ab ]]; then  # the sweep without, then with prefill graphs (cuda_graphs.prefill_tokens)
  orpheus_sweep mstar/configs/orpheus_eager_prefill.yaml "orpheus_http_${GPU}_eager_prefill"
  orpheus_sweep mstar/configs/orpheus.yaml "orpheus_http_$GPU"
fi
if [[ $WHAT == wan_quick ]]; then  # the Wan GPU tests of the served fast paths, then 50 steps at concurrency 1 (~2 min)
  run 180 gpu_tests_wan22_quick python3 -m pytest -q -n 0 -m gpu tests/gpu/test_wan22_scheduler_gpu.py \
      tests/gpu/test_wan22_vae_gpu.py -p no:cacheprovider
  run 120 wan_bench_quick python3 benchmarks/wan_bench.py --skip-diffusers --steps 50 --concurrency 1 \
      --out "$OUT/wan_bench_${GPU}_quick.json"
fi
if [[ $WHAT == wan_profile ]]; then  # one DiT forward (batch 2) per variant, then the VAE decode's variants (~3 min)
  run 200 profile_wan python3 benchmarks/profile_wan.py --batch 2 --out "$OUT/profile_wan_$GPU.json"
  run 200 profile_wan_vae python3 benchmarks/profile_wan_vae.py --accuracy \
      --variants float32_cl float32_cl_fp16conv bfloat16_cl --out "$OUT/profile_wan_vae_$GPU.json"
fi
if [[ $WHAT == kernels || $WHAT == all ]]; then  # the kernels behind tuned tables, each against its PyTorch/cuBLAS form
  run 120 sampler_micro python3 benchmarks/sampler_micro.py --vocab 28680 151936 --batch 1 4 16 --mix orpheus \
      --scale 3.0 --out "$OUT/sampler_micro_$GPU.json"
  run 150 gemv_micro python3 benchmarks/gemv_micro.py --ms 1 2 4 8 16 --out "$OUT/gemv_micro_$GPU.json"
  run 150 moe_micro python3 benchmarks/moe_micro.py --batches 1 4 8 12 16 24 32 48 64 96 128 \
      --out "$OUT/moe_micro_$GPU.json"
  run 120 snac_micro python3 benchmarks/snac_micro.py --form fused --emit both --batch 1 4 8 16 32 \
      --out "$OUT/snac_micro_$GPU.json"
fi
if [[ $WHAT == wan || $WHAT == all ]]; then
  run 90 profile_wan python3 benchmarks/profile_wan.py --batch 2 --out "$OUT/profile_wan_$GPU.json"
  run 420 wan_bench python3 benchmarks/wan_bench.py --out "$OUT/wan_bench_$GPU.json"
fi
if [[ $WHAT == wan_fp8 ]]; then  # FP8 tests, the DiT's linears per W8A8 form, then bf16 and FP8 DiT in one run: e2e seconds and frame PSNR (~6 min)
  run 240 gpu_tests_fp8 python3 -m pytest -q -n 0 -m gpu tests/gpu/test_fp8_gpu.py tests/gpu/test_moe_fp8_gpu.py \
      -p no:cacheprovider
  run 120 fp8_gemm_micro python3 benchmarks/fp8_gemm_micro.py --out "$OUT/fp8_gemm_micro_$GPU.json"
  run 420 wan_bench_fp8 python3 benchmarks/wan_bench.py --skip-diffusers --steps 50 --concurrency 1 \
      --quantization none fp8 --out "$OUT/wan_bench_${GPU}_fp8.json"
fi
if [[ $WHAT == wan_extra || $WHAT == all ]]; then  # VAE 3 latent frames at once; bf16 VAE
  run 150 wan_bench_vae3 python3 benchmarks/wan_bench.py --skip-diffusers --steps 50 --concurrency 1 \
      --vae-chunk-frames 3 --out "$OUT/wan_bench_${GPU}_vae3.json"
  run 150 wan_bench_vae_bf16 python3 benchmarks/wan_bench.py --skip-diffusers --steps 50 --concurrency 1 \
      --vae-dtype bfloat16 --out "$OUT/wan_bench_${GPU}_vae_bf16.json"
fi
fold_metrics() {  # fold_metrics <json> <metrics txt>: the server's step metrics go into the results file
  python3 - "$1" "$2" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["server_metrics"] = {k: float(v) for k, v in (line.rsplit(" ", 1) for line in open(sys.argv[2]) if line.strip())}
json.dump(doc, open(sys.argv[1], "w"), indent=1)
PY
}
omni_bench() {  # omni_bench <config> <json name> [more mstar serve flags]
  # a worker step running past 30 s writes every thread's stack to the server log (MSTAR_STALL_DUMP_S)
  MSTAR_STALL_DUMP_S=30 python3 -m mstar.cli.main serve qwen3_omni --load-format dummy --config "$1" --port "$PORT" \
      "${@:3}" > "$OUT/$2_server.log" 2>&1 &
  local server=$!
  if wait_ready; then
    # one request first: if it takes over a minute the sweep would eat the call's time, so it is skipped
    local body='{"model":"qwen3_omni","input":"Hello there, how are you today?","max_tokens":256,"ignore_eos":true,'
    body+='"talker.max_tokens":257,"response_format":"pcm"}'
    local single
    if ! single=$(curl -sf -o /dev/null --max-time 60 -w "$2 single request: %{http_code} in %{time_total}s" \
        -H 'Content-Type: application/json' -d "$body" "http://127.0.0.1:$PORT/v1/audio/speech"); then
      echo "$2: one request failed or took over 60 s ($single); sweep skipped" | tee "$OUT/$2_single.txt"
      curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^mstar_component_(step_seconds|batch_size)_(sum|count)" \
          > "$OUT/$2_metrics.txt"
      kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
      return
    fi
    echo "$single" | tee "$OUT/$2_single.txt"
    # thinker greedy, 256 tokens (random weights never stop); the talker speaks at most 256 frames (20.5 s)
    # (OMNI_LIMIT s in all, OMNI_DURATION s a level, OMNI_LEVELS the concurrencies; the JSON keeps every level
    # finished if the limit cuts it)
    run "${OMNI_LIMIT:-400}" "$2" python3 -m mstar.cli.main bench --base-url "http://127.0.0.1:$PORT" --workload speech \
        --model qwen3_omni --concurrency "${OMNI_LEVELS:-1,4,8,16,32}" --duration "${OMNI_DURATION:-20}" --max-tokens 256 --ignore-eos \
        --extra-body '{"talker.max_tokens": 257}' --output "$OUT/$2.json" || stacks "$server"
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^mstar_component_(step_seconds|batch_size)_(sum|count)" \
        > "$OUT/$2_metrics.txt"
    [[ -s $OUT/$2.json ]] && fold_metrics "$OUT/$2.json" "$OUT/$2_metrics.txt"
  else
    echo "qwen3_omni server not ready"; tail -n 20 "$OUT/$2_server.log"
  fi
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
}
if [[ $WHAT == omni || $WHAT == all ]]; then
  omni_bench mstar/configs/qwen3_omni.yaml "qwen3_omni_http_$GPU"
fi
if [[ $WHAT == omni_80gb ]]; then  # bf16 on one 80 GB card (qwen3_omni_80gb.yaml: 1,024 KV pages, 16 in flight);
  # OMNI_CONFIG (an absolute path) and OMNI_NAME let another checkout's code serve the same config: run this
  # script from that checkout's root for a before/after pair on one machine
  OMNI_LEVELS=${OMNI_LEVELS:-1,8,16} omni_bench "${OMNI_CONFIG:-mstar/configs/qwen3_omni_80gb.yaml}" \
      "${OMNI_NAME:-qwen3_omni_http_${GPU}_80gb}"
fi
if [[ $WHAT == omni_fp8 ]]; then  # FP8 thinker and talker (experts too): qwen3_omni.yaml fits an 80 GB card
  OMNI_LEVELS=${OMNI_LEVELS:-1,16,32} omni_bench mstar/configs/qwen3_omni.yaml "qwen3_omni_fp8_http_$GPU" --quantization fp8
fi
if [[ $WHAT == profile_omni || $WHAT == all ]]; then  # the per-component profile (<= 240 s)
  run 300 profile_omni python3 benchmarks/profile_omni.py --out "$OUT/profile_omni_$GPU.json"
fi
if [[ $WHAT == omni_quick ]]; then  # the Omni kernels' GPU tests, then the talk loop's components at 1 and 16 rows (< 3 min)
  run 120 gpu_tests_omni_kernels python3 -m pytest -q -n 0 -m gpu tests/gpu/test_qwen3_omni_kernels_gpu.py -p no:cacheprovider
  run 200 profile_omni_talk python3 benchmarks/profile_omni.py --components talker talker_input code_predictor \
      --batches 1 16 --out "$OUT/profile_omni_${GPU}_talk.json"
fi
if [[ $WHAT == code2wav || $WHAT == all ]]; then  # Code2Wav alone, as served and eagerly (< 2 min)
  run 180 code2wav_bench python3 benchmarks/code2wav_bench.py --out "$OUT/code2wav_bench_$GPU.json"
fi
if [[ $WHAT == structured || $WHAT == all ]]; then  # json_schema decoding against free decoding, batch 1 and 16
  # needs the Llama-3 tokenizer folder (mstar_tokenizers/llama3-v1) under the temp dir, as device_setup.sh says
  run 420 structured_decode python3 benchmarks/structured_decode.py --batch 1 16 --out "$OUT/structured_decode_$GPU.json"
fi
if [[ $WHAT == pd || $WHAT == all ]]; then  # PD disaggregation (llama_pd.yaml, two processes) against one worker
  # needs the Llama-3 tokenizer folder (mstar_tokenizers/llama3-v1) under the temp dir, as device_setup.sh says
  run 560 pd_stream python3 benchmarks/pd_stream.py --out "$OUT/pd_stream_$GPU.json"
fi
if [[ $WHAT == pd2 ]]; then  # two GPUs: prefill on GPU 0, decode on GPU 1 (KV pages moved) against one GPU at
  # 1/16/64 in flight, for the Orpheus-shaped Llama and the Qwen3-Omni thinker; then Orpheus served with the vocoder
  # on GPU 1 against one GPU at 1/8/16/32. PD2_PARTS picks parts (default "orpheus omni sweep"; a device call of 10
  # minutes holds about one). Needs the llama3-v1 and qwen3-omni-v2 tokenizer folders, as device_setup.sh says.
  if (( $(nvidia-smi -L 2>/dev/null | wc -l) < 2 )); then
    echo "pd2 needs two GPUs (llama_pd.yaml and qwen3_omni_pd.yaml put prefill on GPU 0, decode on GPU 1)"
    exit 1
  else
    parts=" ${PD2_PARTS:-orpheus omni sweep} "
    if [[ $parts == *" orpheus "* ]]; then  # 512-token prompts, 128 tokens each
      run 560 pd_stream_orpheus python3 benchmarks/pd_stream.py --model orpheus --concurrency 1 16 64 \
          --out "$OUT/pd_stream_${GPU}_2gpu_orpheus_concurrency.json"
    fi
    if [[ $parts == *" omni "* ]]; then  # 256-token prompts: the pool for 64 at 512 overfills an 80 GB card (planner)
      run 560 pd_stream_qwen3_omni python3 benchmarks/pd_stream.py --model qwen3_omni --concurrency 1 16 64 \
          --prompt-lens 256 --out "$OUT/pd_stream_${GPU}_2gpu_qwen3_omni_concurrency.json"
    fi
    if [[ $parts == *" sweep "* ]]; then
      for config in orpheus orpheus_disaggregated; do
        ORPHEUS_LEVELS=1,8,16,32 orpheus_sweep "mstar/configs/$config.yaml" "orpheus_http_${GPU}_$config"
      done
    fi
  fi
fi
if [[ $WHAT == pi05 ]]; then  # the Pi0.5 policy: stages with the kernel profile, the flow attention, served chunks (~6 min)
  run 150 pi05_stages python3 benchmarks/pi05_stages.py --profile --out "$OUT/pi05_stages_$GPU.json"
  run 120 pi05_attention python3 benchmarks/pi05_attention.py --out "$OUT/pi05_attention_$GPU.json"
  run 300 pi05_bench python3 benchmarks/pi05_bench.py --concurrency 8 32 128 --per-robot 5 --requests 200 \
      --out "$OUT/pi05_bench_$GPU.json"
fi
if [[ $WHAT == pi05_modes ]]; then  # a process per worker, then in process, one call: what serving across processes costs (~2 min)
  for mode in multiproc inproc; do
    run 150 "pi05_bench_$mode" python3 benchmarks/pi05_bench.py --mode "$mode" --concurrency 8 --per-robot 2 \
        --requests 200 --no-baseline --out "$OUT/pi05_bench_${GPU}_$mode.json"
  done
fi
if [[ $WHAT == vjepa2 ]]; then  # V-JEPA 2-AC rollouts against the recompute loop, encoder, a planned action (~4 min)
  run 400 vjepa2_bench python3 benchmarks/vjepa2_bench.py --horizons 4 15 30 --out "$OUT/vjepa2_bench_$GPU.json"
fi
if [[ $WHAT == vjepa2_profile ]]; then  # the top kernels of one graphed plan forward (~1.5 min)
  run 300 vjepa2_profile python3 benchmarks/vjepa2_bench.py --horizons 4 --profile --out "$OUT/vjepa2_bench_${GPU}_profile.json"
fi
if [[ $WHAT == hops ]]; then  # tensor hops between two processes: CUDA IPC against shared memory (< 1 min)
  run 120 transport_hops python3 benchmarks/transport_hops.py --cuda --out "$OUT/transport_hops_cuda_$GPU.json"
fi
if [[ $WHAT == hops2 ]]; then  # the receiver on GPU 1: CUDA IPC, NCCL point-to-point and shared memory (< 2 min)
  run 180 transport_hops_2gpu python3 benchmarks/transport_hops.py --cuda --devices 0 1 \
      --out "$OUT/transport_hops_cuda_${GPU}_2gpu.json"
fi
if [[ $WHAT == fp8_decode ]]; then  # the FP8 GEMV beside the bf16 one, then the decode step bf16 against FP8 (~1.5 min)
  run 200 gemv_micro_fp8 python3 benchmarks/gemv_micro.py --fp8 --out "$OUT/gemv_micro_fp8_$GPU.json"
  run 300 decode_step_fp8 python3 benchmarks/decode_step.py --skip-hf --batch-sizes 1 16 64 --quantization none fp8 \
      --out "$OUT/decode_step_${GPU}_fp8.json"
fi
if [[ $WHAT == bagel ]]; then  # BAGEL understanding at 1 and 16, text to image, editing, with profiles (~6 min)
  run 560 bagel_bench python3 benchmarks/bagel_bench.py --profile --out "$OUT/bagel_bench_$GPU.json"
fi
if [[ $WHAT == bagel_fp8 ]]; then  # tiny FP8 checks, then every BAGEL case (image questions: first token and tokens/s; text to image; editing), bf16 then FP8 LLM in one run: image PSNR and final latents against bf16's, decode and denoise profiles (~5 min)
  run 90 gpu_tests_bagel_fp8 python3 -m pytest -q -n 0 -m gpu tests/gpu/test_bagel_fp8_gpu.py -p no:cacheprovider
  run 480 bagel_bench_fp8 python3 benchmarks/bagel_bench.py --quantization none fp8 \
      --profile --out "$OUT/bagel_bench_${GPU}_fp8.json"
fi
if [[ $WHAT == bagel_cfg3 ]]; then  # needs three GPUs: text to image and editing (1024x1024, 50 steps) under bagel.yaml
  # (one GPU), then bagel_cfg_parallel.yaml (a guidance branch per GPU), in one run, a process per worker: seconds,
  # and the images and final latents against one GPU's of the same seed (~4 min)
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)
  if (( ${gpus:-0} < 3 )); then
    echo "bagel_cfg3 needs three GPUs (bagel_cfg_parallel.yaml puts its workers on GPUs 0, 1, 2); ${gpus:-0} visible"
    exit 1
  fi
  run 560 bagel_bench_cfg3 python3 benchmarks/bagel_bench.py --cases generation editing \
      --configs bagel bagel_cfg_parallel --out "$OUT/bagel_bench_${GPU}_cfg3.json"
fi
if [[ $WHAT == cosmos3 ]]; then  # Cosmos3-Nano text to image at three sizes, then 4 and 8 in flight, against diffusers (~8 min)
  run 560 cosmos3_t2i python3 benchmarks/cosmos3_bench.py --cases t2i throughput \
      --tokenizer "${TMPDIR:-/tmp}/mstar_tokenizers/qwen3-omni-v2" --out "$OUT/cosmos3_bench_${GPU}_t2i.json"
fi
if [[ $WHAT == cosmos3_policy ]]; then  # the DROID policy's chunk latency and chunks per second, against diffusers (~4 min)
  run 400 cosmos3_policy python3 benchmarks/cosmos3_bench.py --cases policy \
      --tokenizer "${TMPDIR:-/tmp}/mstar_tokenizers/qwen3-omni-v2" --out "$OUT/cosmos3_bench_${GPU}_policy.json"
fi
if [[ $WHAT == serve_fit ]]; then  # `mstar serve <model> --load-format dummy`: serves (config, memory, one request) or refuses
  # shellcheck disable=SC2086  # MODELS and SERVE_FIT_ARGS are word lists
  run "${SERVE_FIT_LIMIT:-560}" serve_fit python3 benchmarks/serve_fit.py ${MODELS:+--models $MODELS} ${SERVE_FIT_ARGS:-} \
      --log-dir "$OUT/serve_fit_logs" --out "$OUT/serve_fit_$GPU.json"
fi
if [[ $WHAT == omni2 ]]; then  # the original's split, then the thinker tensor-parallel over both GPUs
  omni_bench mstar/configs/qwen3_omni_2gpu.yaml "qwen3_omni_http_${GPU}_2gpu"
  omni_bench mstar/configs/qwen3_omni_2gpu_tp.yaml "qwen3_omni_http_${GPU}_2gpu_tp"
fi
if [[ ${TAR:-0} == 1 ]]; then
  tar czf /tmp/gpu_suite.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_suite.tgz "$OUT/"
fi
