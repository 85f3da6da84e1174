#!/usr/bin/env bash
# CUDA check of accel_flatshard, one command, ~6 minutes of one GPU (more GPUs: adds NCCL parity at W>=2):
#   1. W=1 on real CUDA streams (NCCL): parity with a single-process run (GPT-2 / Llama, 4 engine settings,
#      fp32 + bf16 smoke) and a profiler trace showing all-gathers / reduce-scatters (emulated at W=1 by
#      device copies on the engine's side streams) overlapping compute kernels        -> gpu_check.py --part w1
#   2. emulated W=8 (torch's fake process group) on a ~1.1 B Llama: device peak while wrapping a host model
#      <= shards + one unit; training peak max_memory_allocated <= analytical bound; torch FSDP2's peak on the
#      same model printed next to it                                                  -> gpu_check.py --part fake-w8
#   3. CPU offload (fsdp_offload_params): W=1 on real streams: parity with the plain model (host AdamW step),
#      bf16 and accumulation vs no offload, nothing persistent on the device, device peak <= bound; host vs
#      device AdamW step time; emulated W=8 on the 1.1B Llama: device peak vs the bound, vs FSDP2 with
#      CPUOffloadPolicy                                      -> gpu_check_offload.py --part w1 / --part fake-w8
#   4. only with 2+ GPUs: NCCL parity at W = min(#GPUs, 4) vs the single-process run, models placed with
#      .to(cuda:LOCAL_RANK) and no torch.cuda.set_device, CPU inputs                  -> gpu_check.py --part nccl
# Usage: bash benchmarks/gpu_check.sh            (logs and the trace in $OUT, default ./gpu_check_out)
# Python: $PYTHON, else .venv/bin/python if its torch sees CUDA, else python3 (needs torch+CUDA, transformers).
# CPU smoke of the same code paths (no GPU): python benchmarks/gpu_check.py --device cpu --part w1|fake-w8
#   (and benchmarks/gpu_check_offload.py --device cpu --part w1|fake-w8)
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
"$PY" -c "import torch, transformers; print('python', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__)" || exit 2
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
status=0
echo "== [1/4] W=1, real CUDA streams: parity + overlap trace"
timeout 150 "$PY" benchmarks/gpu_check.py --part w1 --out "$OUT" 2>&1 | tee "$OUT/w1.log" || status=1
echo "== [2/4] emulated W=8 (fake process group), Llama ~1.1B: memory bound, vs FSDP2"
timeout 150 "$PY" benchmarks/gpu_check.py --part fake-w8 --out "$OUT" 2>&1 | tee "$OUT/fake_w8.log" || status=1
echo "== [3/4] CPU offload: W=1 real streams (parity, placement, peak), emulated W=8 1.1B (bound, vs FSDP2)"
timeout 100 "$PY" benchmarks/gpu_check_offload.py --part w1 --out "$OUT" 2>&1 | tee "$OUT/offload_w1.log" || status=1
timeout 150 "$PY" benchmarks/gpu_check_offload.py --part fake-w8 --out "$OUT" 2>&1 | tee "$OUT/offload_fake_w8.log" || status=1
if [ "$GPUS" -ge 2 ]; then
  W=$(( GPUS < 4 ? GPUS : 4 ))
  echo "== [4/4] NCCL parity at W=$W"
  timeout 120 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$W" benchmarks/gpu_check.py --part nccl \
      --out "$OUT" 2>&1 | tee "$OUT/nccl.log" || status=1
else
  echo "== [4/4] NCCL parity at W>=2: skipped (1 GPU)"
fi
echo "gpu_check.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $status
