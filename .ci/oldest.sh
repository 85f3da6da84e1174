#!/usr/bin/env bash
# CI, second stage: the integration tests (Trainer, TRL SFT, PEFT, the save paths) on the OLDEST library set that
# pyproject.toml allows.  The lower bounds there are exactly these pins: change both together.
# Builds .venv-oldest (torch pinned to the CPU build that is on disk) once; reruns reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-oldest
PY=$VENV/bin/python
OLDEST=("accelerate==1.10.1" "transformers==4.57.6" "trl==0.24.0" "peft==0.17.1")
STAMP=$VENV/.installed-$(echo "${OLDEST[*]}" | tr ' =' '_-')
if [ ! -f "$STAMP" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    $PY -m pip install -q --upgrade pip
    $PY -m pip install -q torch==2.13.0
    $PY -m pip install -q "${OLDEST[@]}" -e '.[test]'
    touch "$STAMP"
fi
# Fail if pip resolved anything else than the pins (a bound in pyproject.toml that excludes them, say).
$PY - "${OLDEST[@]}" <<'PYEOF'
import sys
from importlib.metadata import version
wrong = [f"{spec} (installed {version(spec.split('==')[0])})" for spec in sys.argv[1:]
         if version(spec.split("==")[0]) != spec.split("==")[1]]
if wrong:
    sys.exit("oldest-set venv does not hold the pins: " + ", ".join(wrong))
print("oldest set:", ", ".join(f"{n}=={version(n)}" for n in ("torch", "accelerate", "transformers", "trl", "peft")))
PYEOF
# The accelerate binary the launch tests spawn must be this venv's.
export PATH="$PWD/$VENV/bin:$PATH"
$PY -m pytest -q -m "not slow" \
    tests/test_trainer.py \
    tests/test_trl.py::test_sft_trainer_on_untied_llama_follows_ddp \
    tests/test_trl.py::test_sft_trainer_model_is_sharded \
    tests/test_trl.py::test_sft_final_save_loads_with_from_pretrained_and_equals_ddps \
    tests/test_peft.py::test_lora_plain_loop_follows_ddp_and_is_sharded \
    tests/test_peft.py::test_lora_plain_loop_saved_adapter_loads_and_equals_ddps \
    tests/test_save_model.py::test_example_save_tail_writes_ddps_model \
    tests/test_save_model.py::test_other_save_paths_write_ddps_model \
    tests/test_trl_peft_patches.py \
    tests/test_patches.py
