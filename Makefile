# Every target creates .venv on first use: torch is pinned to the CPU build that this machine has on disk.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: example test test-all bench bench-gen clean

$(VENV_STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(VENV_STAMP)

example: $(VENV_STAMP)
	.venv/bin/accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/train_causal_lm.py

test: $(VENV_STAMP)
	$(PY) -m pytest -q -m "not slow"

test-all: $(VENV_STAMP)
	$(PY) -m pytest -q

bench: $(VENV_STAMP)
	$(PY) benchmarks/bench.py

bench-gen: $(VENV_STAMP)
	$(PY) benchmarks/gen_bench.py

clean:
	rm -rf .venv build *.egg-info
