#!/usr/bin/env bash
# Run every fuzz target for SECONDS each (default 20); exits non-zero if any invariant breaks.
# Uses atheris when installed in the interpreter (coverage-guided), else a random mutation loop.
set -euo pipefail
seconds="${1:-20}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
python="${PYTHON:-$repo/.venv/bin/python}"
[ -x "$python" ] || python="$(command -v python3)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
status=0
for target in "$here"/fuzz_*.py; do
    name="$(basename "$target" .py)"
    echo "== $name (${seconds}s)"
    mkdir -p "$work/$name"
    # the crash artifacts land in $work; the corpus is seeded by the target itself
    if ! (cd "$work" && PYTHONPATH="$repo" "$python" "$target" -max_total_time="$seconds" \
            -artifact_prefix="$work/$name/" 2>&1 | tail -n 5); then
        status=1
    fi
    if compgen -G "$work/$name/crash-*" > /dev/null || compgen -G "$work/crash-*" > /dev/null; then
        echo "!! $name broke its invariant; inputs:" && ls "$work/$name" "$work" | grep crash- || true
        status=1
    fi
done
exit "$status"
