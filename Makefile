# The two commands of the README, and what they need. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdcore-installed

.PHONY: demo test test-pure test-long mutants fuzz wheel rdma mooncake bench bench-quick clean

# torch 2.13.0 is the CPU wheel on this machine's disk; asked for first, so `torch>=2.13` installs nothing more.
# One line per step; pip's own chatter (-qq) stays out of the way, its errors do not.
$(STAMP): pyproject.toml setup.py $(wildcard pdcore/*/*.pyx transport/*.pyx) pdcore/core/_events_py.py pdcore/epd/_types_py.py
	@echo "setup: a virtual environment in $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --disable-pip-version-check --upgrade pip
	@echo "setup: torch 2.13.0 (CPU)"
	@$(PY) -m pip install -qq --disable-pip-version-check torch==2.13.0
	@echo "setup: pdcore and its extras; compiling the Cython state tables (~1 min)"
	@$(PY) -m pip install -qq --disable-pip-version-check -e '.[test,fuzz,cli,metrics]'
	@touch $@
	@echo "setup: done"

demo: $(STAMP)
	$(PY) -m pdcore demo
	$(PY) -m pdcore demo --epd  # encode -> prefill -> decode: every received row and every page checked

test: $(STAMP)
	$(PY) -m pytest -m "not rdma and not long"  # RDMA runs on a real device: make rdma; the long matrices: make test-long
	$(MAKE) --no-print-directory test-pure

# Every case of the matrices whose short variant `make test` runs (heterogeneous TP, the tiny model, ...).
test-long: $(STAMP)
	$(PY) -m pytest -m "long"

# The same behaviour with every compiled module swapped for its pure-Python twin.
test-pure: $(STAMP)
	PDCORE_PURE_PYTHON=1 $(PY) -m pytest -q -m "not rdma and not slow" tests/transport tests/test_peers.py tests/test_peers_dp.py \
		tests/test_fence_races.py tests/test_recovery.py tests/test_hostile_sizes.py tests/test_worker_never_waits.py \
		tests/test_agreement_shm.py tests/test_transport_standalone.py tests/test_peers_auth.py tests/test_pd_calls.py \
		tests/test_epd_types.py tests/test_epd_table.py tests/test_kv_plan.py tests/test_events.py
	PDCORE_PURE_PYTHON=1 $(PY) -m pdcore demo --requests 40
	PDCORE_PURE_PYTHON=1 $(PY) -m pdcore demo --epd --requests 40

# Each planted bug in tests/mutants/ must fail the tests its patch names (MUTANTS=all: the slow ones too).
mutants: $(STAMP)
	PY=$(PY) bash tests/mutants/run.sh

# The wheel a user installs: built from this tree, installed in a fresh venv, running the demo.
wheel: $(STAMP)
	bash ci/wheel-check.sh

fuzz: $(STAMP)
	bash fuzz/run.sh 10  # seconds per target (six targets); longer: bash fuzz/run.sh 300

# Real RDMA: soft-RoCE in a qemu guest (ci/rxe-vm.sh); see README "RDMA".
rdma: $(STAMP)
	bash ci/link-pyverbs.sh $(VENV)
	bash ci/rxe-vm.sh bash ci/rdma-tests.sh

# Mooncake's TCP transport runs beside ours in benchmarks/transport.py when it installs.
mooncake: $(STAMP)
	$(PY) -m pip install -q mooncake-transfer-engine-non-cuda || echo "mooncake did not install: its rows are left out"

bench-quick: $(STAMP) mooncake
	$(PY) benchmarks/agreement.py --quick
	$(PY) benchmarks/transport.py --quick
	$(PY) benchmarks/pd.py --quick
	$(PY) benchmarks/kv.py --quick
	$(PY) benchmarks/epd.py --quick

bench: $(STAMP) mooncake
	$(PY) benchmarks/agreement.py
	$(PY) benchmarks/transport.py
	$(PY) benchmarks/pd.py
	$(PY) benchmarks/kv.py
	$(PY) benchmarks/epd.py

clean:
	rm -rf build $(VENV) pdcore/*/*.c pdcore/*/*.so transport/*.c transport/*.so
