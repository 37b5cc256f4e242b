#!/usr/bin/env bash
# The RDMA step of CI, run INSIDE the soft-RoCE guest:
#
#   bash ci/rxe-vm.sh bash ci/rdma-tests.sh
#
# 1. exposes Debian's pyverbs to the venv if it is not yet (ci/link-pyverbs.sh);
# 2. runs `pytest -m rdma tests/rdma tests/transport tests/test_fence_blackbox.py tests/test_abort_blackbox.py` with
#    PDCORE_REQUIRE_RDMA=1, so a missing device or any skipped RDMA test fails the run;
# 3. runs a short seeded chaos run over verbs (`python -m pdcore chaos --transport faulty:verbs
#    --tp 1`: replicas of one rank, so no rank imports torch, which costs ~110 s under TCG);
# 4. runs the quick verbs benchmark next to its ib_write_bw floor on the same device and
#    message size (a benchmark, not a test: it prints, it does not fail the step).
# Exit code: pytest's, or the chaos run's if pytest passed. Outside the guest it runs on whatever verbs device the host has
# (PDCORE_RDMA_DEVICE picks one).
#
# Settings: PDCORE_PYTHON (default: the checkout's .venv/bin/python, the real
# interpreter, not a pyenv shim: a shim costs 5-9 s per start under emulation),
# PDCORE_RDMA_TEST_TIMEOUT (seconds for pytest, default 420), PDCORE_RDMA_BENCH=0 to
# skip the benchmark, =full to add benchmarks/transport.py.
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo" || exit 125
py=${PDCORE_PYTHON:-$repo/.venv/bin/python}
log() { printf '[rdma-tests] %s\n' "$*"; }

[[ -x $py ]] || { log "error: no interpreter at $py (make the venv first, or set PDCORE_PYTHON)"; exit 125; }
if [[ $(head -c 2 "$(readlink -f "$py")") == "#!" ]]; then
    log "error: $py is a script (a pyenv shim?); point PDCORE_PYTHON at the real interpreter"
    exit 125
fi
venv=$(cd "$(dirname "$py")/.." && pwd)
sites=("$venv"/lib/python3*/site-packages)
if [[ ! -L ${sites[0]}/pyverbs && ! -d ${sites[0]}/pyverbs ]]; then
    timeout -k 10 300 bash "$repo/ci/link-pyverbs.sh" "$venv" || exit 125
fi
if [[ ${RXE_VM:-0} == 1 ]]; then
    log "guest up $(cut -d' ' -f1 /proc/uptime)s; $(rdma link show 2>/dev/null | head -n1)"
fi

export PDCORE_REQUIRE_RDMA=1
# Importing torch under TCG takes ~110 s. Registering a tensor is buffer_span() (transport-independent,
# covered by the host run over tcp); tests/rdma registers numpy and raw (addr, length).
conformance=tests/transport/test_transport_conformance.py
deselect=(
    --deselect "$conformance::test_torch_and_raw_address_registrations[verbs]"
)
t0=$SECONDS
timeout -k 15 "${PDCORE_RDMA_TEST_TIMEOUT:-420}" \
    "$py" -m pytest -m rdma tests/rdma tests/transport tests/test_fence_blackbox.py tests/test_abort_blackbox.py -p no:cacheprovider -ra --durations=5 \
    "${deselect[@]}"
rc=$?
log "pytest exited $rc after $((SECONDS - t0))s"

# The watchdog sits above chaos's own bounds at --slow 4 (ranks ready within 240 s, the run, then each
# surviving rank reports within 355 s or is named as hung), so a slow start under TCG or a real hang
# ends in chaos's report, not in a kill that says nothing; a run takes 160-180 s here. Progress lines,
# not a bar: the guest's console is a terminal, and a bar leaves nothing in the CI log.
t0=$SECONDS
timeout -k 15 "${PDCORE_RDMA_CHAOS_TIMEOUT:-660}" \
    "$py" -m pdcore chaos --transport faulty:verbs --tp 1 --slow 4 --seconds "${PDCORE_RDMA_CHAOS_SECONDS:-30}" --seed 7 --quiet \
    --progress plain
chaos=$?
log "chaos over verbs exited $chaos after $((SECONDS - t0))s"
(( rc == 0 )) && rc=$chaos

# Benchmark (prints; never fails the step). Quick by default: ib_write_bw (the floor) and the verbs
# transport on the same device, 1000 x 64 KiB each, ~30 s under TCG. PDCORE_RDMA_BENCH=full runs
# benchmarks/transport.py --transport verbs --quick as well (~6 min under TCG: too long for every run).
bench=${PDCORE_RDMA_BENCH:-quick}
if [[ $bench != 0 ]]; then
    t0=$SECONDS
    timeout -k 10 150 "$py" benchmarks/_ib_write_bw.py --size 65536 --iters 1000 --vs-verbs \
        || log "quick benchmark exited $? (not a test failure)"
    if [[ $bench == full ]]; then
        timeout -k 10 900 "$py" benchmarks/transport.py --transport verbs --quick \
            || log "benchmarks/transport.py exited $? (not a test failure)"
    fi
    log "benchmark took $((SECONDS - t0))s"
fi
exit "$rc"
