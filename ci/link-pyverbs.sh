#!/usr/bin/env bash
# Make a virtualenv see Debian's pyverbs, and nothing else from the system Python.
#
#   bash ci/link-pyverbs.sh [VENV]        (default: the checkout's .venv)
#
# Debian bookworm's python3-pyverbs (rdma-core 44) is the pyverbs that matches the
# system's libibverbs and providers; it is compiled for CPython 3.11. PyPI's pyverbs
# does not load against these libraries. This script
#   1. installs python3-pyverbs, rdma-core and ibverbs-providers with apt-get if any
#      is missing;
#   2. puts ONE symlink, <site-packages>/pyverbs -> /usr/lib/python3/dist-packages/pyverbs,
#      into the venv (no .pth: the rest of dist-packages stays invisible);
#   3. imports pyverbs with the venv's interpreter to prove it.
# Idempotent. Exit codes: 0 ok, 1 failure (the message says what).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$here/.venv}
src=/usr/lib/python3/dist-packages/pyverbs
log() { printf '[link-pyverbs] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ -x $venv/bin/python ]] || die "no interpreter at $venv/bin/python (pass the venv as the first argument)"

missing=()
for pkg in python3-pyverbs rdma-core ibverbs-providers; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install rdma-core's pyverbs for this system by hand"
    log "installing ${missing[*]}"
    timeout -k 10 300 apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive timeout -k 10 600 \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
fi
[[ -d $src ]] || die "$src is missing although python3-pyverbs is installed"

# The .so files are built for one CPython minor version; refuse a mismatch up front.
want=$(find "$src" -maxdepth 1 -name 'base.cpython-*.so' -printf '%f\n' | sed -n 's/^base\.cpython-\([0-9]*\)-.*/\1/p' | head -n1)
have=$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
[[ $want == "$have" ]] || die "Debian's pyverbs is built for CPython ${want:-?}, the venv runs ${have}: use a ${want:0:1}.${want:1} venv"

site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
dst=$site/pyverbs
if [[ -L $dst ]]; then
    [[ $(readlink "$dst") == "$src" ]] || ln -sfn "$src" "$dst"
elif [[ -e $dst ]]; then
    die "$dst exists and is not our symlink (a pip-installed pyverbs?): remove it first"
else
    ln -s "$src" "$dst"
fi

out=$("$venv/bin/python" -c 'import pyverbs.device, pyverbs.qp, pyverbs.mr, pyverbs.cq; print(pyverbs.__file__)' 2>&1) \
    || die "the venv cannot import pyverbs: $out"
# No device on this machine is fine here (ibv_get_device_list fails without /sys/class/infiniband).
devs=$("$venv/bin/python" -c 'import pyverbs.device as d; print(" ".join(x.name.decode() for x in d.get_device_list()) or "none")' 2>/dev/null) || devs=none
log "ok: $dst -> $src (verbs devices here: $devs)"
