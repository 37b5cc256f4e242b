#!/usr/bin/env bash
# Run one command inside a throw-away QEMU guest that has soft-RoCE (rdma_rxe).
#
#   bash ci/rxe-vm.sh CMD [ARGS...]
#
# The guest runs Debian bookworm's stock kernel (which has CONFIG_RDMA_RXE) over the
# HOST's own root filesystem: the host's / is shared read-only over virtio-9p with a
# tmpfs overlay on top, and the current directory is shared read-write at the same
# path. So the guest sees exactly the host's Python, venvs, rdma-core and perftest;
# nothing is installed twice. Inside, rdma_rxe sits on a `dummy0` netdev
# (10.99.0.1/24) as device `rxe0`; the guest has no NIC, so no packet leaves it.
# CMD runs as root in the current directory with the caller's exported environment
# plus RXE_VM=1. Its stdout and stderr both arrive on this script's stdout; the
# script's own `[rxe-vm]` lines go to stderr.
#
# Exit code: CMD's exit code. 125 if no exit code came back (the guest did not
# start, crashed, or hit RXE_VM_TIMEOUT) — never 0. 2 for a usage error.
#
# Settings (environment):
#   RXE_VM_TIMEOUT  seconds for the whole guest, boot to power-off (default 900)
#   RXE_VM_CACHE    kernel + initramfs cache (default /var/cache/pdcore-rxe-vm;
#                   ci/cache in the checkout is gitignored too)
#   RXE_VM_MEM      guest RAM in MiB (default 4096)
#   RXE_VM_SMP      guest vCPUs (default: nproc)
#   RXE_VM_ACCEL    tcg (default) or kvm. KVM hangs after SeaBIOS on this machine type
#                   (PVM flavour of /dev/kvm), so it is opt-in.
#   RXE_VM_WORK_CACHE  9p cache mode of the shared current directory: loose (default; 4-10x
#                   faster imports than mmap, safe because the host does not touch the directory
#                   while the guest runs, and the guest syncs before power-off) or mmap
#   RXE_VM_KERNEL   a linux-image-*-amd64 ABI such as 6.1.0-57-amd64 (default: the
#                   cached one, else what linux-image-amd64 depends on now). Never a
#                   -cloud- kernel: it has no RDMA_RXE and no NET_9P.
#
# Costs under TCG on 2 cores: ~10 s per boot; first run also ~10 s of apt-get and
# ~5 s to fetch the kernel. Batch everything into one call.
set -euo pipefail
shopt -s nullglob

log() { printf '[rxe-vm] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 125; }

(($#)) || { log "usage: $0 CMD [ARGS...]"; exit 2; }
workdir=$(pwd -P)
[[ $workdir != / ]] || die "refusing to run from /: the current directory is shared read-write with the guest"

timeout_s=${RXE_VM_TIMEOUT:-900}
cache=${RXE_VM_CACHE:-/var/cache/pdcore-rxe-vm}
mem=${RXE_VM_MEM:-4096}
smp=${RXE_VM_SMP:-$(nproc)}
accel=${RXE_VM_ACCEL:-tcg}
workcache=${RXE_VM_WORK_CACHE:-loose}
[[ $timeout_s =~ ^[0-9]+$ && $mem =~ ^[0-9]+$ && $smp =~ ^[0-9]+$ ]] || die "RXE_VM_TIMEOUT, RXE_VM_MEM and RXE_VM_SMP must be integers"
t0=$SECONDS

# ---------------------------------------------------------------- host packages
# The guest uses the host's userspace, so everything the tests need is installed here.
host_pkgs=(qemu-system-x86 busybox-static cpio kmod iproute2 rdma-core ibverbs-providers
    ibverbs-utils perftest python3-pyverbs)
missing=()
for pkg in "${host_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
apt_updated=0
apt_update() {
    ((apt_updated)) && return 0
    timeout -k 10 300 apt-get update -qq >&2 || die "apt-get update failed"
    apt_updated=1
}
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing packages ${missing[*]} and no apt-get"
    log "installing ${missing[*]}"
    apt_update
    DEBIAN_FRONTEND=noninteractive timeout -k 10 900 \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
fi
for bin in qemu-system-x86_64 /bin/busybox cpio depmod modprobe; do
    command -v "$bin" >/dev/null || die "$bin not found after installing ${host_pkgs[*]}"
done
/bin/busybox --list | grep -qx poweroff || die "/bin/busybox is not busybox-static"

# ---------------------------------------------------------------- kernel (cached)
mkdir -p "$cache"
exec {lockfd}>"$cache/.lock"
flock -w 600 "$lockfd" || die "could not lock $cache within 600 s (another rxe-vm run?)"

kver=${RXE_VM_KERNEL:-}
if [[ -z $kver ]]; then
    # Prefer what is cached: Debian drops old ABI packages, and a warm run needs no network.
    for d in "$cache"/kernel-*/; do
        [[ -f $d/.complete ]] && kver=$(basename "$d") && kver=${kver#kernel-}
    done
fi
if [[ -z $kver ]]; then
    apt_update
    kver=$(apt-cache depends linux-image-amd64 2>/dev/null | sed -n 's/^ *Depends: linux-image-\(.*-amd64\)$/\1/p' | grep -v cloud | head -n1)
    [[ -n $kver ]] || die "cannot resolve the kernel ABI from 'apt-cache depends linux-image-amd64'"
fi
[[ $kver != *cloud* ]] || die "RXE_VM_KERNEL=$kver: the cloud flavour has no RDMA_RXE/NET_9P; use a plain -amd64 kernel"
kdir=$cache/kernel-$kver
if [[ ! -f $kdir/.complete ]]; then
    log "fetching kernel linux-image-$kver"
    rm -rf "$kdir" "$kdir.tmp"
    mkdir -p "$kdir.tmp"
    (cd "$kdir.tmp" && timeout -k 10 300 apt-get download -q -o APT::Sandbox::User=root "linux-image-$kver" >&2) || {
        apt_update
        (cd "$kdir.tmp" && timeout -k 10 300 apt-get download -q -o APT::Sandbox::User=root "linux-image-$kver" >&2)
    } || die "apt-get download linux-image-$kver failed"
    deb=("$kdir.tmp"/linux-image-*.deb)
    ((${#deb[@]} == 1)) || die "expected one kernel .deb in $kdir.tmp"
    # Only vmlinuz and the module trees the guest can need (about 190 MB instead of 400+).
    m=./lib/modules/$kver
    timeout -k 10 300 bash -c 'set -o pipefail; dpkg-deb --fsys-tarfile "$1" | tar -x -C "$2" --wildcards "${@:3}"' _ \
        "${deb[0]}" "$kdir.tmp" "./boot/vmlinuz-$kver" "$m/modules.*" \
        "$m/kernel/drivers/infiniband" "$m/kernel/drivers/net" "$m/kernel/drivers/virtio" \
        "$m/kernel/drivers/block" "$m/kernel/drivers/char" "$m/kernel/net" "$m/kernel/fs" \
        "$m/kernel/crypto" "$m/kernel/lib" "$m/kernel/arch" || die "unpacking ${deb[0]} failed"
    rm -f "${deb[0]}"
    # The .deb ships no modules.dep (postinst makes it).
    depmod -b "$kdir.tmp" "$kver" || die "depmod failed for $kver"
    touch "$kdir.tmp/.complete"
    mv "$kdir.tmp" "$kdir"
fi
vmlinuz=$kdir/boot/vmlinuz-$kver
moddir=$kdir/lib/modules/$kver
[[ -f $vmlinuz && -f $moddir/modules.dep ]] || die "kernel cache $kdir is incomplete: delete it"

# ---------------------------------------------------------------- initramfs (cached)
# rdma_rxe needs a crc32 shash, which request_module cannot load from a bare initramfs:
# load crc32_generic/crc32_pclmul explicitly. dummy creates dummy0 by itself.
want_mods=(virtio_pci 9pnet_virtio 9p overlay dummy crc32_generic crc32_pclmul rdma_rxe rdma_ucm ib_uverbs)
mapfile -t kos < <(modprobe -d "$kdir" -S "$kver" --show-depends -a "${want_mods[@]}" | awk '$1 == "insmod" {print $2}' | awk '!seen[$0]++')
((${#kos[@]})) || die "modprobe --show-depends found no modules in $kdir"

read -r -d '' init_script <<'INIT' || true
#!/bin/busybox sh
# PID 1 of the rxe guest: load modules, overlay the host root, start rxe0, run cmd.sh.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
stty -F /dev/console -onlcr 2>/dev/null
say() { echo "[rxe-vm guest] $*" > /dev/console; }
rc=125
finish() {
    echo "$rc" > /ctl/rc
    sync
    poweroff -f
    sleep 5
}
for ko in $(cat /modules.list); do
    insmod "/mods/${ko##*/}" || { say "insmod $ko failed"; poweroff -f; }
done
mkdir -p /ctl /host /ovl /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 ctl /ctl || { say "no ctl share"; poweroff -f; }
. /ctl/params
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /host || { say "cannot mount the host root"; finish; }
mount -t tmpfs -o size=50% tmpfs /ovl
mkdir -p /ovl/upper /ovl/work
mount -t overlay overlay -o lowerdir=/host,upperdir=/ovl/upper,workdir=/ovl/work /newroot || { say "overlay failed"; finish; }
for d in proc sys dev dev/pts dev/shm run tmp; do mkdir -p /newroot/$d; done
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
mount -t tmpfs tmpfs /newroot/run
mount -t tmpfs tmpfs /newroot/tmp
chmod 1777 /newroot/tmp /newroot/dev/shm
kver=$(uname -r)
mkdir -p /newroot/lib/modules/$kver
mount -o bind /newroot$moddir /newroot/lib/modules/$kver
mkdir -p /newroot$workdir
mount -t 9p -o trans=virtio,version=9p2000.L,cache=$workcache,msize=512000 work /newroot$workdir || { say "cannot mount the work dir"; finish; }
printf '#!/bin/sh\nexec /bin/chroot /newroot /sbin/modprobe "$@"\n' > /bin/modprobe-chroot
chmod +x /bin/modprobe-chroot
echo /bin/modprobe-chroot > /proc/sys/kernel/modprobe
ip link set lo up
ip link set dummy0 up
ip addr add 10.99.0.1/24 dev dummy0
chroot /newroot /usr/bin/rdma link add rxe0 type rxe netdev dummy0 || { say "rdma link add rxe0 failed"; finish; }
cp /ctl/cmd.sh /newroot/run/rxe-vm-cmd.sh
chroot /newroot /bin/bash /run/rxe-vm-cmd.sh < /dev/null > /dev/console 2>&1
rc=$?
finish
INIT

ikey=$( { printf '%s\n' "$init_script" "${kos[@]}"; sha256sum /bin/busybox; } | sha256sum | cut -c1-16)
initrd=$cache/initramfs-$kver-$ikey.cpio.gz
if [[ ! -f $initrd ]]; then
    log "building initramfs ($((${#kos[@]})) modules)"
    stage=$(mktemp -d)
    mkdir -p "$stage"/{bin,mods,proc,sys,dev}
    cp /bin/busybox "$stage/bin/busybox"
    printf '%s\n' "$init_script" >"$stage/init"
    chmod +x "$stage/init"
    for ko in "${kos[@]}"; do cp "$ko" "$stage/mods/"; done
    printf '%s\n' "${kos[@]}" >"$stage/modules.list"
    (cd "$stage" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) >"$initrd.tmp" || die "cpio failed"
    mv "$initrd.tmp" "$initrd"
    rm -rf "$stage"
    rm -f $(ls "$cache"/initramfs-*.cpio.gz | grep -vxF "$initrd") 2>/dev/null || true
fi
flock -u "$lockfd"

# ---------------------------------------------------------------- the command
ctl=$(mktemp -d /tmp/rxe-vm-ctl.XXXXXX)
qpid=
cleanup() {
    [[ -n $qpid ]] && kill "$qpid" 2>/dev/null || true
    rm -rf "$ctl"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 125' INT TERM
{
    echo 'set +e'
    # The caller's exported environment, minus what belongs to this shell or the host tty.
    while IFS= read -r -d '' kv; do
        name=${kv%%=*}
        [[ $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || continue
        case $name in PWD|OLDPWD|SHLVL|_|TERM|TMPDIR|BASH_FUNC_*) continue ;; esac
        printf 'export %s=%q\n' "$name" "${kv#*=}"
    done < <(env -0)
    echo 'export RXE_VM=1 TERM=dumb'
    printf 'cd %q || exit 125\n' "$workdir"
    printf 'exec'
    printf ' %q' "$@"
    printf '\n'
} >"$ctl/cmd.sh"
printf 'moddir=%q\nworkdir=%q\nworkcache=%q\n' "$moddir" "$workdir" "$workcache" >"$ctl/params"

case $accel in
    tcg) accel_args=(-accel tcg,thread=multi,tb-size=512 -cpu max) ;;
    kvm) accel_args=(-accel kvm -cpu host) ;;
    *) die "RXE_VM_ACCEL must be tcg or kvm, not $accel" ;;
esac
log "booting $kver ($accel, $smp vCPU, $mem MiB, timeout ${timeout_s}s; setup took $((SECONDS - t0))s)"
tboot=$SECONDS
set +e
timeout -k 10 "$timeout_s" qemu-system-x86_64 \
    "${accel_args[@]}" -smp "$smp" -m "$mem" -machine q35 \
    -nodefaults -no-user-config -display none -no-reboot -nic none \
    -chardev stdio,id=con,signal=off -serial chardev:con \
    -kernel "$vmlinuz" -initrd "$initrd" \
    -append "console=ttyS0 quiet loglevel=0 panic=-1" \
    -fsdev local,id=fs_root,path=/,security_model=none,readonly=on,multidevs=remap \
    -device virtio-9p-pci,fsdev=fs_root,mount_tag=hostroot \
    -fsdev local,id=fs_ctl,path="$ctl",security_model=none \
    -device virtio-9p-pci,fsdev=fs_ctl,mount_tag=ctl \
    -fsdev local,id=fs_work,path="$workdir",security_model=none,multidevs=remap \
    -device virtio-9p-pci,fsdev=fs_work,mount_tag=work \
    </dev/null &
qpid=$!
wait "$qpid"
qrc=$?
qpid=
set -e
if [[ ! -s $ctl/rc ]]; then
    if ((qrc == 124 || qrc == 137)); then
        log "FAILED: the guest hit RXE_VM_TIMEOUT=${timeout_s}s and was killed; no exit code came back"
    else
        log "FAILED: the guest ended (qemu exit $qrc) without reporting an exit code: it did not start, or crashed"
    fi
    exit 125
fi
rc=$(tr -dc '0-9' <"$ctl/rc")
[[ -n $rc ]] || { log "FAILED: unreadable exit code file"; exit 125; }
log "command exited $rc (guest $((SECONDS - tboot))s, total $((SECONDS - t0))s)"
exit "$rc"
