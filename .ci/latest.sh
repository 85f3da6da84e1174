#!/usr/bin/env bash
# CI, third stage (`make test-latest`): the NEWEST releases of torch, accelerate, transformers, trl, peft and datasets,
# in a venv of their own (.venv-latest), while `make test` stays on its pins (constraints/pinned.txt).
#
# This machine's pip configuration caps torch at the builds on its disk (`pip config list`: a constraint file);
# PIP_CONFIG_FILE=/dev/null lifts it for this venv only, so pip takes the registry's newest torch (a CUDA build,
# which runs on a CPU-only host; ~2 min with its CUDA libraries).  The run:
#   1. prints the installed versions against the pins and the window (tools/pins.py report); a library above the
#      tested window is a REPORT line naming it, not a failure;
#   2. tools/torch_api_check.py against the installed torch: every torch name the package uses resolves in it;
#   3. the tests that touch other libraries' internals: the patch table and the version window, the _compat
#      adapter, the collectives and the engine, checkpoints, compile, the launches and the HF stacks (Trainer, TRL,
#      PEFT).  Any failure fails CI;
#   4. on success, constraints/newest.txt is rewritten with what was installed: `git diff` shows what moved, and
#      committing it (with SUPPORTED raised in accel_flatshard/integrations/versions.py) moves the window on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-latest
PY=$VENV/bin/python
export PIP_CONFIG_FILE=/dev/null
[ -x "$PY" ] || python3 -m venv "$VENV"
$PY -m pip install -q --upgrade pip
$PY -m pip install -q --upgrade torch accelerate transformers trl peft datasets huggingface_hub safetensors
$PY -m pip install -q -e '.[test]'
echo "== newest releases (.venv-latest) =="
$PY tools/pins.py report | tee "$VENV/versions.txt"
$PY tools/torch_api_check.py --installed
# The accelerate binary the launch tests spawn must be this venv's.
export PATH="$PWD/$VENV/bin:$PATH"
$PY -m pytest -q -m "not slow and not ci and not pinned_env" -p no:cacheprovider \
    tests/test_patches.py tests/test_versions.py tests/test_gpu_readiness.py tests/test_layout.py \
    tests/test_engine.py tests/test_parity.py tests/test_streams.py tests/test_sim_cuda.py \
    tests/test_checkpoint_units.py tests/test_checkpoint_dist.py tests/test_async_save.py tests/test_cli_checkpoint.py \
    tests/test_compile.py tests/test_plan.py tests/test_generation.py tests/test_offload.py \
    tests/test_accelerate_launch.py tests/test_accelerate_runnerless.py tests/test_accelerate_state.py \
    tests/test_parallelism_config.py tests/test_trainer.py tests/test_trainer_checkpoint.py tests/test_trl.py \
    tests/test_trl_peft_patches.py tests/test_peft.py tests/test_save_model.py tests/test_torch_state_dict_api.py \
    tests/test_registry.py tests/test_seed_api.py
$PY tools/pins.py record constraints/newest.txt
grep '^REPORT:' "$VENV/versions.txt" || echo "every newest release is inside the tested window"
