#!/usr/bin/env bash
# CUDA check of accel_flatshard on ONE GPU (NCCL), ~5 minutes:
#   1. parity at W=1 (GPT-2 / Llama, 4 engine settings, fp32 exact-ish + bf16 smoke) and the overlap of
#      (emulated) communication on the engine's side streams with compute kernels   -> gpu_check.py
#   2. the benchmark table at W=1 (real NCCL) and at an emulated W=8 (fake process group: memory and
#      engine overhead only, no communication) vs torch FSDP1 / FSDP2 / DDP          -> bench.py
# Usage: bash benchmarks/gpu_check.sh            (results and traces in $OUT, default ./gpu_check_out)
# Python: $PYTHON, else .venv/bin/python if its torch sees CUDA, else python3 (needs torch+CUDA, transformers).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then PY=.venv/bin/python
else PY=python3; fi
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONWARNINGS=ignore::FutureWarning
"$PY" -c "import torch, transformers; print('python', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'transformers', transformers.__version__)" || exit 2
status=0
echo "== gpu_check.py (parity + overlap)"
timeout 300 "$PY" benchmarks/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log" || status=1
echo "== bench.py W=1 (NCCL)"
timeout 200 "$PY" benchmarks/bench.py --device cuda --world-size 1 --rows llama-40M,gpt2-5M --batch 8 --seq 512 \
    --steps 10 --warmup 3 --ours ours,ours+proposed,ours+noreshard --json "$OUT/bench_cuda_w1.json" 2>&1 | tee "$OUT/bench_cuda_w1.log" || status=1
echo "== bench.py emulated W=8 (fake process group)"
timeout 200 "$PY" benchmarks/bench.py --device cuda --fake-pg --world-size 8 --rows llama-150M --batch 8 --seq 512 \
    --steps 10 --warmup 3 --json "$OUT/bench_cuda_fake_w8.json" 2>&1 | tee "$OUT/bench_cuda_fake_w8.log" || status=1
echo "gpu_check.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL) (logs in $OUT)"
exit $status
