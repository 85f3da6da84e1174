# Every target creates .venv on first use, with the exact versions the suite was last run with
# (constraints/pinned.txt, pip -c; torch is the CPU build this machine has on disk), so `make test` passes
# whatever the registry serves that day.  `make test-latest` tests the newest releases in a venv of its own.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
PINS := constraints/pinned.txt

.PHONY: example lint test test-ci test-all test-latest bench bench-link bench-gen docs-figures clean

$(VENV_STAMP): pyproject.toml $(PINS)
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(PINS) torch
	$(PY) -m pip install -q -c $(PINS) -e '.[test,bnb]'
	touch $(VENV_STAMP)

example: $(VENV_STAMP)
	.venv/bin/accelerate launch --config_file accelerate_configs/cpu_2proc.yaml examples/train_causal_lm.py

# Line length (120) and pyflakes over the package (pyproject.toml [tool.ruff]); CI runs it first (.ci/run).
lint: $(VENV_STAMP)
	.venv/bin/ruff check accel_flatshard accel_flatshard_autoload.py

# The default suite: unit tests first, then spawned gloo ranks, then real launches (tests/conftest.py).
test: $(VENV_STAMP)
	$(PY) -m pytest -q -m "not slow and not ci"

# What CI runs beyond `make test` (.ci/run): the tests marked ci, the CUDA schedule's derived mutation table
# and the simulated public paths at W=2 (docs/testing.md).
test-ci: $(VENV_STAMP)
	$(PY) -m pytest -q -m "ci and not slow"
	$(PY) tests/sim_table.py
	$(PY) -m pytest -q -m slow tests/test_sim_w2.py

# The newest releases (torch from the registry, past this machine's pip cap) in .venv-latest: prints the versions,
# reports a library above the tested window (a report, not a failure), checks torch's API, runs the tests that
# touch other libraries' internals (.ci/latest.sh says which); on success records them in constraints/newest.txt.
test-latest:
	.ci/latest.sh

# Everything: every pytest case (default, ci and slow) and the mutation table.
test-all: $(VENV_STAMP)
	$(PY) -m pytest -q
	$(PY) tests/sim_table.py

bench: $(VENV_STAMP)
	$(PY) benchmarks/bench.py

# Two emulated machines (network namespaces) joined by a veth shaped with tc: every engine at 2 x 1 and 2 x 2 ranks,
# unshaped, 1 and 10 Gbit/s (benchmarks/link_bench.py --help: rates, accumulation, engines).  Needs root.
bench-link: $(VENV_STAMP)
	$(PY) benchmarks/link_bench.py --json bench_link.json

bench-gen: $(VENV_STAMP)
	$(PY) benchmarks/gen_bench.py

# docs/figures/*.png and figures.json (issue 47), from real runs here: the W=2 step timeline, the planner's plot
# with a measured run, the bench figure (bench.py at its small rows; tools/docs_figures.py --bench-json FILE draws
# a full `make bench`'s output instead).  matplotlib: the `docs` extra, in the test extra too.
docs-figures: $(VENV_STAMP)
	$(PY) tools/docs_figures.py

clean:
	rm -rf .venv .venv-oldest .venv-latest build *.egg-info
