#!/usr/bin/env bash
# CUDA check of accel_flatshard: one command, one GPU, at most GPU_CHECK_BUDGET_S (default 460 s) of parts plus
# about 10 s of start-up: under 8 minutes, inside a 600 s command limit.  Each part runs in its own process under
# its own timeout (the 1-GPU timeouts add up to the budget; a part gets at most what is left of it) and prints one
# verdict line; one failing, hanging or crashing part does not hide the others.  A summary table ends the output.
#   nccl-1gpu  a 1-rank NCCL group with the W=1 shortcut off: the engine's all-gathers, reduce-scatters and hybrid
#              replica all-reduces are real NCCL calls (async_op=False inside its side streams; all_gather_into_tensor
#              / reduce_scatter_tensor on torch 2.11), counted and checked to run on their side streams; losses and
#              parameters vs a single-process run and vs the W=1 copy path (prefetch, no-prefetch, hybrid, bf16)
#   w1         W=1 on real CUDA streams: parity with a single-process run (GPT-2 / Llama; the default prefetch
#              schedule, no prefetch, no reshard, BACKWARD_POST + limit 1; fp32 and a bf16 smoke) and a profiler
#              trace of all-gathers / reduce-scatters (emulated by device copies on the side streams) overlapping
#              compute kernels
#   leak       wrapped models (trained, generating, state-dict'ed; with and without offload) deleted: device
#              memory_allocated back to its value before wrapping, wrapper and module collected
#   offload-w1 CPU offload W=1: parity with the plain model (host AdamW), bf16 and accumulation vs no offload,
#              nothing persistent on the device, device peak <= bound; host vs device AdamW step time
#   fake-w8    emulated W=8 (torch's fake process group) on a ~1.1 B Llama: device peak while wrapping a host model
#              <= shards + one unit; training peak <= analytical bound; torch FSDP2's peak printed next to it
#   offload-fake-w8  the same with offload: device peak vs the bound, vs FSDP2 with CPUOffloadPolicy
#   nccl       only with 2+ GPUs: NCCL parity at W = min(#GPUs, 4) vs the single-process run, models placed with
#              .to(cuda:LOCAL_RANK) and no torch.cuda.set_device, CPU inputs
#   compile    regional torch.compile at W=1 (1-rank NCCL group, inductor): losses vs the plain model compiled per
#              block, no graph compiled after step 1, no graph break, no unit run eagerly; compiled vs eager step time
#   planner    the memory planner (accel-flatshard plan) vs max_memory_allocated, emulated W=8, 6 configurations
# Adding a part: one `part NAME TIMEOUT_S COMMAND...` line below; PASS is exit status 0; output in $OUT/NAME.log.
# Usage: bash benchmarks/gpu_check.sh            (logs and the trace in $OUT, default ./gpu_check_out)
# Python: $PYTHON, else .venv/bin/python if its torch sees CUDA, else python3 (needs torch+CUDA, transformers).
# CPU smoke of this script and the same code paths, tiny sizes (tests/test_gpu_check_smoke.py):
#   GPU_CHECK_DEVICE=cpu PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh   (timeouts x3: GPU_CHECK_TIMEOUT_SCALE)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONWARNINGS=ignore::FutureWarning,ignore::UserWarning
"$PY" -c "import torch, transformers, accelerate; print('python', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" || exit 2
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
DEV=()
[ -n "${GPU_CHECK_DEVICE:-}" ] && DEV=(--device "$GPU_CHECK_DEVICE")
# the CPU smoke runs the same parts on a loaded CI machine: its timeouts and budget are scaled up
SCALE=${GPU_CHECK_TIMEOUT_SCALE:-$([ -n "${GPU_CHECK_DEVICE:-}" ] && echo 3 || echo 1)}
DEADLINE=$(( SECONDS + ${GPU_CHECK_BUDGET_S:-460} * SCALE ))
SUMMARY=()
status=0

part() {  # part NAME TIMEOUT_S COMMAND...: run it guarded, one verdict line
  local name=$1 limit=$(( $2 * SCALE )); shift 2
  local left=$(( DEADLINE - SECONDS ))
  if [ "$left" -lt "${GPU_CHECK_MIN_PART_S:-20}" ]; then
    SUMMARY+=("$(printf '%-16s SKIP (budget spent)' "$name")"); status=1; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (timeout ${limit} s)"
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  cat "$OUT/$name.log"
  local verdict=PASS
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then verdict="FAIL (timeout after ${limit} s)"
  elif [ $rc -ne 0 ]; then verdict="FAIL (exit $rc)"; fi
  [ "$verdict" = PASS ] || status=1
  SUMMARY+=("$(printf '%-16s %s (%d s)' "$name" "$verdict" $(( SECONDS - t0 )))")
  echo "-- $name: $verdict"
}

# ---- the parts (1 GPU: timeouts add up to 460 s); most informative first
part nccl-1gpu       50 "$PY" benchmarks/gpu_check.py --part nccl-1gpu ${DEV[@]+"${DEV[@]}"} --out "$OUT"
part w1              75 "$PY" benchmarks/gpu_check.py --part w1 ${DEV[@]+"${DEV[@]}"} --out "$OUT"
part compile         55 "$PY" benchmarks/gpu_check_compile.py ${DEV[@]+"${DEV[@]}"} --out "$OUT"
part leak            35 "$PY" benchmarks/gpu_check.py --part leak ${DEV[@]+"${DEV[@]}"} --out "$OUT"
part planner         60 "$PY" benchmarks/gpu_check_plan.py ${DEV[@]+"${DEV[@]}"} --out "$OUT"
part offload-w1      55 "$PY" benchmarks/gpu_check_offload.py --part w1 ${DEV[@]+"${DEV[@]}"} --out "$OUT"
part fake-w8         70 "$PY" benchmarks/gpu_check.py --part fake-w8 ${DEV[@]+"${DEV[@]}"} --out "$OUT"
part offload-fake-w8 60 "$PY" benchmarks/gpu_check_offload.py --part fake-w8 ${DEV[@]+"${DEV[@]}"} --out "$OUT"
if [ "$GPUS" -ge 2 ]; then
  W=$(( GPUS < 4 ? GPUS : 4 ))
  part nccl 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$W" benchmarks/gpu_check.py --part nccl \
      --out "$OUT"
else
  SUMMARY+=("$(printf '%-16s SKIP (1 GPU: NCCL parity at W>=2 needs 2+)' nccl)")
fi
echo "== summary ($SECONDS s)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
echo "gpu_check.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $status
