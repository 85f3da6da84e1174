#!/usr/bin/env bash
# CUDA check of accel_flatshard: one command, one GPU, at most GPU_CHECK_BUDGET_S (default 465 s) of parts plus
# about 35 s of start-up, archive and kill grace: under 9 minutes, inside a 600 s command limit (the summary prints the
# expected wall time, computed from the timeouts below).  Each part runs in its own process under its own timeout
# (a part gets at most what is left of the budget) and prints one verdict line; one failing, hanging or crashing
# part does not hide the others.  The summary ends the output.
#   nccl-1gpu  a 1-rank NCCL group with the W=1 shortcut off: the engine's all-gathers, reduce-scatters and hybrid
#              replica all-reduces are real NCCL calls (async_op=False inside its side streams; all_gather_into_tensor
#              / reduce_scatter_tensor on torch 2.11), counted, and the profiler's stream of each NCCL kernel
#              checked against the compute stream's (observed, not assumed); losses and parameters vs a
#              single-process run and vs the W=1 copy path (prefetch, no-prefetch, hybrid, bf16)
#   w1         W=1 on real CUDA streams: parity with a single-process run (GPT-2 / Llama; the default prefetch
#              schedule, no prefetch, no reshard, BACKWARD_POST + limit 1; fp32 and a bf16 smoke)
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
#              block, no graph compiled after step 1, no graph break, no unit run eagerly; compiled vs eager step
#              time.  Its timeout fits a cold inductor cache (two compiles + NCCL start-up) and says so when hit.
#   planner    the memory planner (accel-flatshard plan) vs max_memory_allocated, emulated W=8, 6 configurations
#   overlap    (own process: none of the parity parts' exact-math settings) emulated communication on the side
#              streams, profiled: the fraction of it that overlaps compute, against the ceiling the schedule allows
#   muon       torch.optim.Muon (owner computes, matrix_optim.py) on the "matrix_exchange" side stream: 10 steps of a
#              tiny Llama against the plain model (0 difference expected), as is and in slow-GPU mode
# The parity parts (nccl-1gpu, w1, compile, offload-w1, muon; nccl with 2+ GPUs) run twice: as is and in slow-GPU mode (sleeps queued on
# the compute stream before backward and the optimizer step, and on the side streams before each collective), so
# a missing wait shows as wrong values instead of hiding behind a GPU that never falls behind the host.
# What comes back: the parts write logs and traces to a work folder ($GPU_CHECK_WORK, default a new folder under
# /tmp); $OUT gets exactly two files: gpu_check_logs.tar.gz (every log and trace, <= 15 MiB: traces are left out
# when larger, and the summary says so) and summary.txt (self-contained: every part's verdict and figures, the
# expected wall time), printed last so that the output's tail is the summary (benchmarks/gpu_check_report.py).
# Adding a part: one "NAME TIMEOUT_S SCRIPT ARGS..." line in PARTS below; PASS is exit status 0; log: WORK/NAME.log.
# Usage: bash benchmarks/gpu_check.sh            ($OUT default ./gpu_check_out)
# Python: $PYTHON, else .venv/bin/python if its torch sees CUDA, else python3 (needs torch+CUDA, transformers).
# CPU smoke of this script and the same code paths, tiny sizes (tests/test_gpu_check_smoke.py):
#   GPU_CHECK_DEVICE=cpu PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh   (timeouts x5: GPU_CHECK_TIMEOUT_SCALE)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$OUT" "$WORK"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then PY=.venv/bin/python
else PY=python3; fi
REPORT_PY=$(command -v python3 || echo "$PY")  # the report needs only the standard library
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONWARNINGS=ignore::FutureWarning,ignore::UserWarning
# (CUBLAS_WORKSPACE_CONFIG and deterministic kernels: set by the parity parts themselves, not the timing part)
"$PY" -c "import torch, transformers, accelerate; print('python', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tee "$WORK/environment.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 2
GPUS=$(sed -n 's/.* gpus \([0-9]*\) .*/\1/p' "$WORK/environment.log" | tail -1)
GPUS=${GPUS:-0}
DEV=()
[ -n "${GPU_CHECK_DEVICE:-}" ] && DEV=(--device "$GPU_CHECK_DEVICE")
# the CPU smoke runs the same parts on a loaded CI machine: its timeouts and budget are scaled up
SCALE=${GPU_CHECK_TIMEOUT_SCALE:-$([ -n "${GPU_CHECK_DEVICE:-}" ] && echo 5 || echo 1)}
BUDGET=${GPU_CHECK_BUDGET_S:-465}
DEADLINE=$(( SECONDS + BUDGET * SCALE ))
status=0
: > "$WORK/verdicts.tsv"

# ---- the parts (1 GPU): name, timeout (s, on the GPU), command; most informative first.  The 1-GPU timeouts add
# up to the budget (465 s); with start-up, the archive and one killed part's grace the GPU run takes at most 500 s.
PARTS=(
  "nccl-1gpu       50 benchmarks/gpu_check.py --part nccl-1gpu"
  "w1              45 benchmarks/gpu_check.py --part w1"
  "compile        110 benchmarks/gpu_check_compile.py"
  "overlap         35 benchmarks/gpu_check.py --part overlap"
  "leak            25 benchmarks/gpu_check.py --part leak"
  "planner         45 benchmarks/gpu_check_plan.py"
  "offload-w1      45 benchmarks/gpu_check_offload.py --part w1"
  "fake-w8         55 benchmarks/gpu_check.py --part fake-w8"
  "offload-fake-w8 30 benchmarks/gpu_check_offload.py --part fake-w8"
  "muon            25 benchmarks/gpu_check_muon.py"
)
# what a timeout means, where it is not simply a hang
declare -A TIMEOUT_NOTE=(
  [compile]="a cold inductor cache: two compiles (the plain model per block, the wrapped one) plus NCCL start-up did not fit; the log's phase times say which; a rerun on the same machine finds the cache warm"
)
SUM_S=0
for spec in "${PARTS[@]}"; do set -- $spec; SUM_S=$(( SUM_S + $2 )); done
START_S=15 ARCHIVE_S=10 KILL_S=10  # start-up: one cold interpreter start; a part past its timeout is killed 10 s later
EXPECTED_S=$(( (SUM_S < BUDGET ? SUM_S : BUDGET) + START_S + ARCHIVE_S + KILL_S ))
EXPECTED="at most ${EXPECTED_S} s on the GPU (the 1-GPU parts' timeouts add up to ${SUM_S} s, capped by the budget ${BUDGET} s; + ${START_S} s start-up + ${ARCHIVE_S} s archive + ${KILL_S} s for a killed part)$([ "$SCALE" != 1 ] && echo "; this run: timeouts x${SCALE}")"
echo "expected wall time: $EXPECTED"

part() {  # part NAME TIMEOUT_S COMMAND...: run it guarded, one verdict line
  local name=$1 timeout_s=$2 limit=$(( $2 * SCALE )); shift 2
  local left=$(( DEADLINE - SECONDS ))
  if [ "$left" -lt "${GPU_CHECK_MIN_PART_S:-20}" ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" "SKIP (budget spent)" 0 "$timeout_s" >> "$WORK/verdicts.tsv"; status=1; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (timeout ${limit} s)"
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1; rc=$?
  cat "$WORK/$name.log"
  local verdict=PASS
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    verdict="FAIL (timeout after ${limit} s${TIMEOUT_NOTE[$name]:+: ${TIMEOUT_NOTE[$name]}})"
  elif [ $rc -ne 0 ]; then verdict="FAIL (exit $rc)"; fi
  [ "$verdict" = PASS ] || status=1
  printf '%s\t%s\t%s\t%s\n' "$name" "$verdict" $(( SECONDS - t0 )) "$limit" >> "$WORK/verdicts.tsv"
  echo "-- $name: $verdict"
}

for spec in "${PARTS[@]}"; do
  set -- $spec
  name=$1 timeout_s=$2; shift 2
  part "$name" "$timeout_s" "$PY" "$@" ${DEV[@]+"${DEV[@]}"} --out "$WORK"
done
if [ "$GPUS" -ge 2 ]; then
  W=$(( GPUS < 4 ? GPUS : 4 ))
  part nccl 60 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$W" benchmarks/gpu_check.py --part nccl \
      --out "$WORK"
else
  printf '%s\t%s\t\t\n' nccl "SKIP (1 GPU: NCCL parity at W>=2 needs 2+)" >> "$WORK/verdicts.tsv"
fi
echo "== summary ($SECONDS s; logs and traces in $WORK, archived in $OUT)"
# the report writes the archive and summary.txt into $OUT and prints the summary (the output's tail)
if ! "$REPORT_PY" benchmarks/gpu_check_report.py --work "$WORK" --out "$OUT" --expected "$EXPECTED"; then
  # (the report failed: the verdicts and the logs as they are)
  status=1
  tar czf "$OUT/gpu_check_logs.tar.gz" -C "$WORK" . 2>/dev/null
  { echo "gpu_check summary: report failed"; cat "$WORK/verdicts.tsv"; } > "$OUT/summary.txt"
  cat "$OUT/summary.txt"
fi
echo "gpu_check.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL) (wall $SECONDS s; $OUT: $(ls "$OUT" | tr '\n' ' '))"
exit $status
