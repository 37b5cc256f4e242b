#!/usr/bin/env bash
# The mutant set: each tests/mutants/*.patch plants one small bug; the tests named in its header
# must fail with it. See tests/mutants/README.md.
#
#   bash tests/mutants/run.sh                  every mutant not marked slow (CI: make mutants)
#   MUTANTS=all bash tests/mutants/run.sh      every mutant, the slow ones too
#   bash tests/mutants/run.sh NAME...          just these (file names, with or without .patch)
#
# Each mutant runs in its own copy of the working tree (tar, without .venv, .git and caches) in a
# scratch directory, with this checkout's interpreter ($PY, default .venv/bin/python) and
# PYTHONPATH pointing at the copy; a patch that touches a compiled source (a .pyx, or a .py that
# setup.py compiles as it is) rebuilds the copy's compiled modules
# first (only the changed ones are rebuilt, at -O0: PDCORE_QUICK_BUILD). Exit status 1 if a mutant survives, a patch no longer
# applies, or its test run breaks (collection error, nothing collected); the summary names each.
# MUTANTS_BASELINE=1 first runs every selected mutant's tests on the unpatched copy (they must pass).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
here="$root/tests/mutants"
py="${PY:-$root/.venv/bin/python}"
[[ "$py" = /* ]] || py="$root/$py"
[ -x "$py" ] || { echo "mutants: no interpreter at $py (run make first, or set PY)" >&2; exit 2; }
per_mutant_timeout="${MUTANT_TIMEOUT:-600}"
# MUTANT_TESTS="..." runs these tests instead of the ones a header names (to see which tests kill a mutant).

header() {  # header FIELD PATCH -> the value of '# FIELD: value' in the patch's header
    sed -n "/^---/q; s/^# $1: *//p" "$2" | head -n 1
}

needs_build() {  # needs_build PATCH -> true if it touches a compiled source: a .pyx or .pxi, or a .py setup.py compiles
    local target
    for target in $(sed -n 's|^+++ [^/]*/\([^[:space:]]*\).*|\1|p' "$1"); do
        case "$target" in
            *.pyx|*.pxi) return 0 ;;  # (a .pxi: a room a .pyx includes)
            *.py) grep -q "\"$target\"" "$root/setup.py" && return 0 ;;  # PURE_MODE in setup.py
        esac
    done
    return 1
}

patches=()
if [ $# -gt 0 ]; then
    for name in "$@"; do
        f="$here/${name%.patch}.patch"
        [ -f "$f" ] || { echo "mutants: no such mutant: $name" >&2; exit 2; }
        patches+=("$f")
    done
else
    for f in "$here"/*.patch; do
        if [ "$(header slow "$f")" = "yes" ] && [ "${MUTANTS:-}" != "all" ]; then
            echo "mutants: skipping slow $(basename "$f" .patch) (MUTANTS=all runs it)"
            continue
        fi
        patches+=("$f")
    done
fi
[ ${#patches[@]} -gt 0 ] || { echo "mutants: none selected" >&2; exit 2; }

scratch="$(mktemp -d "${TMPDIR:-/tmp}/pdcore-mutants.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/base"
tar -C "$root" -cf - --exclude=./.venv --exclude=./.git --exclude=./build --exclude=./ci/cache \
    --exclude='*.egg-info' --exclude=__pycache__ --exclude=.hypothesis --exclude=.pytest_cache . \
    | tar -C "$scratch/base" -xf - || { echo "mutants: cannot copy the tree to $scratch" >&2; exit 2; }

run_tests() {  # run_tests DIR TESTS... -> pytest's exit status in DIR
    local dir="$1"; shift
    (cd "$dir" && PYTHONPATH="$dir" HYPOTHESIS_PROFILE=mutants PYTHONDONTWRITEBYTECODE=1 \
        timeout --kill-after=30 "$per_mutant_timeout" \
        "$py" -m pytest -x -q -p no:cacheprovider "$@")
}

killed=(); survived=(); broken=()
start_all=$SECONDS
for f in "${patches[@]}"; do
    name="$(basename "$f" .patch)"
    read -r -a tests <<<"${MUTANT_TESTS:-$(header kill "$f")}"
    what="$(header mutant "$f")"
    if [ ${#tests[@]} -eq 0 ]; then
        echo "mutants: $name names no tests ('# kill: ...' in its header)"; broken+=("$name (no '# kill:' line)"); continue
    fi
    work="$scratch/$name"
    cp -a "$scratch/base" "$work"
    echo
    echo "=== $name: $what"
    echo "    tests: ${tests[*]}"
    if [ "${MUTANTS_BASELINE:-0}" = "1" ]; then
        run_tests "$work" "${tests[@]}" >"$scratch/$name.baseline.log" 2>&1
        rc=$?
        if [ $rc -ne 0 ]; then
            echo "    BASELINE FAILS (exit $rc) without the mutant:"; tail -n 15 "$scratch/$name.baseline.log" | sed 's/^/    | /'
            broken+=("$name (its tests fail without the mutant)"); rm -rf "$work"; continue
        fi
    fi
    if ! (cd "$work" && patch -p1 -F0 --batch --forward --no-backup-if-mismatch -s <"$f"); then
        echo "    DOES NOT APPLY: refresh the patch against the current code"
        broken+=("$name (does not apply)"); rm -rf "$work"; continue
    fi
    if needs_build "$f"; then
        echo "    building the compiled modules it touches (-O0; a minute or so)"
        if ! (cd "$work" && PYTHONPATH="$work" PDCORE_QUICK_BUILD=1 "$py" setup.py -q build_ext --inplace) >"$scratch/$name.build.log" 2>&1; then
            echo "    DOES NOT BUILD:"; tail -n 15 "$scratch/$name.build.log" | sed 's/^/    | /'
            broken+=("$name (does not build)"); rm -rf "$work"; continue
        fi
    fi
    t0=$SECONDS
    run_tests "$work" "${tests[@]}" >"$scratch/$name.log" 2>&1
    rc=$?
    secs=$((SECONDS - t0))
    case $rc in
        1) killed+=("$name"); echo "    killed in ${secs}s by:"
           grep -E '^(FAILED|ERROR) ' "$scratch/$name.log" | head -n 3 | sed 's/^/      /' ;;
        0) survived+=("$name"); echo "    SURVIVED (${secs}s): every named test passed with the bug in place"
           tail -n 3 "$scratch/$name.log" | sed 's/^/    | /' ;;
        124|137) killed+=("$name"); echo "    killed in ${secs}s: the tests hung past ${per_mutant_timeout}s (counted as killed)" ;;
        *) broken+=("$name (pytest exit $rc)"); echo "    BROKEN RUN (pytest exit $rc, ${secs}s):"
           tail -n 15 "$scratch/$name.log" | sed 's/^/    | /' ;;
    esac
    rm -rf "$work"
done

echo
echo "mutants: ${#killed[@]} killed, ${#survived[@]} survived, ${#broken[@]} broken, in $((SECONDS - start_all))s"
for n in "${survived[@]}"; do echo "  SURVIVED: $n"; done
for n in "${broken[@]}"; do echo "  BROKEN:   $n"; done
[ ${#survived[@]} -eq 0 ] && [ ${#broken[@]} -eq 0 ]
