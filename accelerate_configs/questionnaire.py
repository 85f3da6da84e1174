"""Write the yaml that ``accelerate config`` writes on a CPU-only machine for FSDP1 and FSDP2.

Runs accelerate's own questionnaire (``accelerate.commands.config.config.get_user_input``) with every
question answered by its default, except the answers a user has to give to get 2 processes under FSDP:

* "Which type of machine are you using?" -> multi-GPU (FSDP is only offered there; on a host without
  GPUs accel_flatshard runs the processes on CPU with gloo);
* "How many GPU(s) should be used ...?" -> 2;
* "Do you want to use FullyShardedDataParallel?" -> yes;
* "What should be your FSDP version?" -> 1 for ``cpu_2proc_fsdp1.yaml``; the default (2) for
  ``cpu_2proc_fsdp2.yaml``;
* "Do you want to use the model's `_no_split_modules` to wrap?" -> yes (the default, no, makes the
  user type layer class names; yes writes no class names, so the yaml fits any transformers model).

Then ``ClusterConfig.to_yaml_file`` writes it, as ``accelerate config`` does.  Usage::

    python accelerate_configs/questionnaire.py            # rewrites both files next to this script
    python accelerate_configs/questionnaire.py --check    # exit 1 if they differ from what accelerate writes
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict
from unittest import mock

HERE = Path(__file__).resolve().parent
FILES = {1: HERE / "cpu_2proc_fsdp1.yaml", 2: HERE / "cpu_2proc_fsdp2.yaml"}


def _answers(fsdp_version: int) -> Dict[str, Any]:
    """Prompt prefix -> option index (menus) or typed text (fields)."""
    return {
        "Which type of machine are you using?": 4,  # multi-GPU
        "How many GPU(s) should be used": "2",
        "Do you want to use FullyShardedDataParallel?": "yes",
        "What should be your FSDP version?": fsdp_version - 1,
        "Do you want to use the model's `_no_split_modules` to wrap": "yes",
    }


def questionnaire_config(fsdp_version: int) -> Any:
    """accelerate's ``ClusterConfig`` for the answers above (all other questions: their defaults)."""
    from accelerate.commands.config import cluster, config, config_utils

    answers = _answers(fsdp_version)
    asked = []

    def answer_for(prompt: str) -> Any:
        asked.append(prompt)
        for prefix, value in answers.items():
            if prompt.strip().startswith(prefix):
                return value
        return None

    def ask_field(input_text, convert_value=None, default=None, error_message=None):
        value = answer_for(input_text)
        if value is None:
            if default is None:
                raise RuntimeError(f"the questionnaire asked {input_text!r}, which has no default and no scripted answer")
            return default
        return convert_value(value) if convert_value is not None else value

    def ask_options(input_text, options=[], convert_value=None, default=0):
        value = answer_for(input_text)
        index = default if value is None else value
        return convert_value(index) if convert_value is not None else index

    with mock.patch.object(cluster, "_ask_field", ask_field), mock.patch.object(cluster, "_ask_options", ask_options), \
            mock.patch.object(config, "_ask_field", ask_field), mock.patch.object(config, "_ask_options", ask_options), \
            mock.patch.object(config_utils, "_ask_field", ask_field), mock.patch.object(config_utils, "_ask_options", ask_options):
        result = config.get_user_input()
    missing = [p for p in answers if not any(a.strip().startswith(p) for a in asked)]
    if missing:
        raise RuntimeError(f"accelerate's questionnaire no longer asks {missing}; update accelerate_configs/questionnaire.py")
    return result


def questionnaire_yaml(fsdp_version: int, path: Path) -> str:
    questionnaire_config(fsdp_version).to_yaml_file(str(path))
    return path.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    import tempfile

    stale = []
    for version, target in FILES.items():
        with tempfile.TemporaryDirectory() as tmp:
            text = questionnaire_yaml(version, Path(tmp) / target.name)
        if args.check:
            if not target.is_file() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
            print(f"wrote {target}")
    if stale:
        print(f"differ from what `accelerate config` writes: {stale}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
