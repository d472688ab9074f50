#!/usr/bin/env bash
# build-guest-kernel.sh builds Kiln's minimal guest kernel from Debian's
# linux-source-6.1 package and configs/guest-kernel.config.
#
# Usage:
#   tools/build-guest-kernel.sh          build and install (skips when up to date)
#   tools/build-guest-kernel.sh --force  rebuild even when up to date
#   tools/build-guest-kernel.sh --regen  regenerate configs/guest-kernel.config
#                                        from tinyconfig plus the options below
#   tools/build-guest-kernel.sh --boot-test
#                                        boot current/bzImage in QEMU microvm
#                                        with a busybox initramfs, check it runs
#                                        /init and powers off
#
# Output, under the kiln cache ($KILN_CACHE, else $XDG_CACHE_HOME/kiln, else
# $HOME/.cache/kiln):
#   guest-kernel/build/                  extracted source tree (reused)
#   guest-kernel/<kernelrelease>/        bzImage, vmlinux, config, stamp
#   guest-kernel/current -> <kernelrelease>
#
# Environment: KILN_CACHE, JOBS (default: nproc); QEMU_ACCEL, QEMU_CPU (--boot-test).
set -euo pipefail

die() { printf 'build-guest-kernel: %s\n' "$*" >&2; exit 1; }
log() { printf 'build-guest-kernel: %s\n' "$*" >&2; }

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
checked_in="$repo_root/configs/guest-kernel.config"
src_pkg=linux-source-6.1
src_tar=/usr/src/linux-source-6.1.tar.xz
build_deps=(build-essential bc bison flex libelf-dev libssl-dev cpio xz-utils)

cache=${KILN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln}
top="$cache/guest-kernel"
build="$top/build"
jobs=${JOBS:-$(nproc)}

# Options the guest kernel needs, applied on top of `make tinyconfig` by
# --regen. Each entry is NAME=VALUE (y, n, a number or a quoted string).
# Every =y entry is verified to survive olddefconfig, so a missing dependency
# is an error rather than a silently dropped feature.
config_options=(
	# Build shape: 64-bit, everything built in, LZ4 for fast decompression,
	# SLUB (SMP-friendly, supports memcg kmem accounting) instead of SLOB.
	64BIT=y MODULES=n KERNEL_XZ=n KERNEL_LZ4=y SLOB=n SLUB=y 'LOCALVERSION="-kiln"' LOCALVERSION_AUTO=n
	# Console and diagnostics.
	PRINTK=y PRINTK_TIME=y EARLY_PRINTK=y BUG=y PANIC_ON_OOPS=n
	TTY=y UNIX98_PTYS=y SERIAL_8250=y SERIAL_8250_CONSOLE=y
	# Initramfs: gzip and uncompressed only.
	BLK_DEV_INITRD=y RD_GZIP=y RD_BZIP2=n RD_LZMA=n RD_XZ=n RD_LZO=n RD_LZ4=n RD_ZSTD=n
	# Userspace ABI.
	BINFMT_ELF=y BINFMT_SCRIPT=y PROC_FS=y SYSFS=y DEVTMPFS=y DEVTMPFS_MOUNT=y
	TMPFS=y SHMEM=y FUTEX=y EPOLL=y SIGNALFD=y TIMERFD=y EVENTFD=y AIO=y
	FILE_LOCKING=y MULTIUSER=y POSIX_TIMERS=y SYSVIPC=y
	# Networking.
	NET=y UNIX=y INET=y PACKET=y NETDEVICES=y NET_CORE=y
	# Paravirtual x86 guest: kvm-clock, PVH entry, SMP, x2APIC, ACPI, MP table.
	HYPERVISOR_GUEST=y PARAVIRT=y KVM_GUEST=y PVH=y
	SMP=y NR_CPUS=64 X86_X2APIC=y X86_MPPARSE=y ACPI=y
	# PCI core stays on although guests use virtio-mmio: in 6.1 ACPICA cannot
	# install its default PCI_Config region handler without CONFIG_PCI, and
	# then fails to load the DSDT at all ("AE_BAD_PARAMETER, During Region
	# initialization"), losing power-off, VMGENID and ACPI-described devices.
	PCI=y PCIEPORTBUS=n PCIEASPM=n PCI_QUIRKS=n VGA_ARB=n
	SERIAL_8250_PCI=n SERIAL_8250_EXAR=n SERIAL_8250_LPSS=n SERIAL_8250_MID=n
	SERIAL_8250_PERICOM=n HW_RANDOM_INTEL=n HW_RANDOM_AMD=n
	PERF_EVENTS_INTEL_UNCORE=n PERF_EVENTS_INTEL_RAPL=n PERF_EVENTS_INTEL_CSTATE=n
	# virtio over MMIO (ACPI-described or virtio_mmio.device= on the cmdline).
	VIRTIO_MENU=y VIRTIO=y VIRTIO_MMIO=y VIRTIO_MMIO_CMDLINE_DEVICES=y
	BLOCK=y BLK_DEV=y VIRTIO_BLK=y VIRTIO_NET=y VIRTIO_CONSOLE=y
	HW_RANDOM=y HW_RANDOM_VIRTIO=y
	VSOCKETS=y VIRTIO_VSOCKETS=y
	NET_9P=y NET_9P_VIRTIO=y NETWORK_FILESYSTEMS=y 9P_FS=y
	# Filesystems.
	EXT4_FS=y OVERLAY_FS=y
	# EROFS, the image root's layout: a read-only virtio-blk disk with xattrs
	# (security.capability for file capabilities) and POSIX ACLs, written
	# uncompressed, so no decompressors. EROFS lives under MISC_FILESYSTEMS;
	# the other misc filesystems stay off.
	MISC_FILESYSTEMS=y EROFS_FS=y EROFS_FS_XATTR=y EROFS_FS_POSIX_ACL=y
	EROFS_FS_SECURITY=y EROFS_FS_ZIP=n
	# Containers: cgroup v2 basics, namespaces, seccomp.
	CGROUPS=y MEMCG=y CGROUP_PIDS=y CGROUP_SCHED=y
	NAMESPACES=y UTS_NS=y IPC_NS=y PID_NS=y NET_NS=y USER_NS=y
	SECCOMP=y SECCOMP_FILTER=y
	# Entropy and VM cloning.
	VIRT_DRIVERS=y VMGENID=y RANDOM_TRUST_CPU=y
	# Nothing physical: no VT/keyboard/mouse, no ACPI laptop or cpufreq
	# drivers, no IPv6, no sound/USB/graphics/wireless.
	VT=n VGA_CONSOLE=n INPUT=n SERIO=n HID=n LEGACY_PTYS=n IPV6=n
	ACPI_AC=n ACPI_BATTERY=n ACPI_BUTTON=n ACPI_FAN=n ACPI_THERMAL=n
	ACPI_PROCESSOR=n ACPI_TABLE_UPGRADE=n ACPI_CONTAINER=n PNP_DEBUG_MESSAGES=n
	CPU_FREQ=n X86_INTEL_PSTATE=n POWER_SUPPLY=n HW_RANDOM_VIA=n MQ_IOSCHED_KYBER=n
	SCHED_MC_PRIO=n CPU_IDLE=n
	SOUND=n USB_SUPPORT=n DRM=n FB=n WLAN=n WIRELESS=n
)

# Symbols that Kconfig derives from the toolchain, not from our choices; they
# are excluded from the drift check so a compiler update is not "drift".
toolchain_syms='^CONFIG_(CC_(IS|HAS|CAN|VERSION)|GCC_|CLANG_|AS_|LD_(IS|VERSION|CAN|ORPHAN)|TOOLCHAIN_|RUSTC_|PAHOLE_)'

ensure_packages() {
	local missing=() p
	for p in "$src_pkg" "${build_deps[@]}"; do
		if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed'; then
			missing+=("$p")
		fi
	done
	((${#missing[@]} == 0)) && return 0
	log "installing missing packages: ${missing[*]}"
	local sudo=()
	if ((EUID != 0)); then
		command -v sudo >/dev/null || die "need root or sudo to install: ${missing[*]}"
		sudo=(sudo)
	fi
	"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" ||
		die "apt-get install ${missing[*]} failed"
}

src_version() {
	dpkg-query -W -f='${Version}' "$src_pkg"
}

# prepare_source extracts the source tarball into $build unless the tree there
# already came from the installed package version.
prepare_source() {
	[[ -r $src_tar ]] || die "$src_tar missing after installing $src_pkg"
	local want have=
	want=$(src_version)
	[[ -f $build/.kiln-source ]] && have=$(<"$build/.kiln-source")
	if [[ -f $build/Makefile && $have == "$want" ]]; then
		return 0
	fi
	log "extracting $src_tar ($src_pkg $want) into $build"
	rm -rf "$build" "$build.tmp"
	mkdir -p "$build.tmp"
	tar -xf "$src_tar" -C "$build.tmp" --strip-components=1 ||
		die "extracting $src_tar failed"
	printf '%s\n' "$want" >"$build.tmp/.kiln-source"
	mv "$build.tmp" "$build"
}

# check_drift fails when an option set to y in $1 is not y in $2.
check_drift() {
	local want=$1 got=$2 drift
	drift=$(grep -E '^CONFIG_[A-Za-z0-9_]+=y$' "$want" | grep -Ev "$toolchain_syms" |
		while IFS= read -r line; do
			sym=${line%%=*}
			grep -qxF "$line" "$got" ||
				printf '  %s: want y, got %s\n' "$sym" \
					"$(grep -E "^$sym=|^# $sym is not set" "$got" || echo 'absent')"
		done)
	if [[ -n $drift ]]; then
		printf 'build-guest-kernel: config drift: options set to y in %s changed after olddefconfig:\n%s\n' \
			"$want" "$drift" >&2
		return 1
	fi
}

# regen writes configs/guest-kernel.config from tinyconfig plus
# config_options. It works on the build tree's own .config (tinyconfig's
# fragment merge only knows that file); the build step overwrites it anyway.
regen() {
	local cfg="$build/.config" want="$build/.kiln-want"
	log "generating config from tinyconfig"
	rm -f "$cfg"
	make -C "$build" -s tinyconfig >/dev/null
	local opt sym val
	: >"$want"
	for opt in "${config_options[@]}"; do
		sym=${opt%%=*} val=${opt#*=}
		case $val in
		y) "$build/scripts/config" --file "$cfg" --enable "$sym" ;;
		n) "$build/scripts/config" --file "$cfg" --disable "$sym" ;;
		\"*)
			val=${val#\"} val=${val%\"}
			"$build/scripts/config" --file "$cfg" --set-str "$sym" "$val"
			;;
		*) "$build/scripts/config" --file "$cfg" --set-val "$sym" "$val" ;;
		esac
		[[ $val == y ]] && printf 'CONFIG_%s=y\n' "$sym" >>"$want"
	done
	make -C "$build" -s olddefconfig >/dev/null
	check_drift "$want" "$cfg" || die "a requested option lost a dependency; fix config_options"
	for opt in "${config_options[@]}"; do
		[[ $opt == *=n ]] || continue
		! grep -qE "^CONFIG_${opt%=n}=" "$cfg" ||
			die "CONFIG_${opt%=n} was asked off but something selects it: $(grep -E "^CONFIG_${opt%=n}=" "$cfg")"
	done
	mkdir -p "$(dirname "$checked_in")"
	cp "$cfg" "$checked_in"
	log "wrote $checked_in"
}

build_and_install() {
	local force=$1 stamp
	[[ -r $checked_in ]] || die "$checked_in missing (run with --regen)"
	stamp="config-sha256 $(sha256sum <"$checked_in" | cut -d' ' -f1)
source $src_pkg $(src_version)"
	if [[ $force == 0 && -f $top/current/stamp && -f $top/current/bzImage && -f $top/current/vmlinux ]] &&
		[[ $(<"$top/current/stamp") == "$stamp" ]]; then
		log "up to date: $(readlink -f "$top/current")"
		return 0
	fi

	cp "$checked_in" "$build/.config"
	make -C "$build" -s olddefconfig >/dev/null
	check_drift "$checked_in" "$build/.config" || die "refusing to build a drifted config"

	log "building bzImage and vmlinux with -j$jobs in $build"
	make -C "$build" -j"$jobs" bzImage vmlinux
	local release dest
	release=$(make -C "$build" -s kernelrelease)
	[[ -n $release && $release != */* ]] || die "bad kernelrelease ${release@Q}"
	dest="$top/$release"
	rm -rf "$dest.tmp"
	mkdir -p "$dest.tmp"
	cp "$build/arch/x86/boot/bzImage" "$build/vmlinux" "$dest.tmp/"
	cp "$build/.config" "$dest.tmp/config"
	printf '%s\n' "$stamp" >"$dest.tmp/stamp"
	rm -rf "$dest"
	mv "$dest.tmp" "$dest"
	ln -sfn "$release" "$top/current.tmp"
	mv -T "$top/current.tmp" "$top/current"
	log "installed $dest (bzImage $(stat -c %s "$dest/bzImage") bytes)"
}

# boot_test boots the installed kernel in QEMU's microvm machine with a
# busybox initramfs whose /init prints a marker (on its stdout and, with the
# kernel's timestamp, through /dev/kmsg) and powers off. QEMU_ACCEL and
# QEMU_CPU override the accelerator (kvm when /dev/kvm is usable, else tcg)
# and CPU model (host under kvm, max under tcg).
boot_test() {
	local kernel="$top/current/bzImage" busybox=/bin/busybox qemu=qemu-system-x86_64
	[[ -f $kernel ]] || die "$kernel missing (build first)"
	command -v "$qemu" >/dev/null || die "$qemu not found (apt-get install qemu-system-x86)"
	if ! [[ -x $busybox ]] || ! "$busybox" --list >/dev/null 2>&1; then
		die "$busybox missing (apt-get install busybox-static)"
	fi
	! readelf -l "$busybox" 2>/dev/null | grep -q INTERP ||
		die "$busybox is dynamically linked (apt-get install busybox-static)"

	local accel cpu
	accel=${QEMU_ACCEL:-$([[ -r /dev/kvm && -w /dev/kvm ]] && echo kvm || echo tcg)}
	cpu=${QEMU_CPU:-$([[ $accel == kvm ]] && echo host || echo max)}

	# Under TCG the guest TSC runs at the host's TSC rate, but the PIT-based
	# calibration is timing-sensitive and sometimes fails; microvm has no HPET
	# or PM timer to fall back on, so the guest then stalls. Tell it the rate.
	local append="console=ttyS0 panic=-1" mhz
	if [[ $accel == tcg ]]; then
		mhz=$(awk -F': *' '/^cpu MHz/ { print int($2); exit }' /proc/cpuinfo)
		[[ -n $mhz && $mhz -gt 0 ]] && append+=" tsc_early_khz=$((mhz * 1000))"
	fi

	local tmp
	tmp=$(mktemp -d)
	mkdir -p "$tmp/root/bin" "$tmp/root/dev" "$tmp/root/proc"
	cp "$busybox" "$tmp/root/bin/busybox"
	ln -s busybox "$tmp/root/bin/sh"
	cat >"$tmp/root/init" <<-'EOF'
		#!/bin/sh
		/bin/busybox mount -t proc proc /proc
		/bin/busybox mount -t devtmpfs devtmpfs /dev
		m="KILN-GUEST-OK uptime=$(/bin/busybox cut -d' ' -f1 /proc/uptime)"
		echo "$m"
		echo "$m" >/dev/kmsg
		/bin/busybox poweroff -f
	EOF
	chmod +x "$tmp/root/init"
	(cd "$tmp/root" && find . | cpio -o -H newc --quiet) >"$tmp/initramfs.cpio"

	local start end out rc=0
	start=$(date +%s%N)
	out=$(timeout 300 "$qemu" -M microvm -accel "$accel" -cpu "$cpu" \
		-m 256 -nodefaults -no-user-config -nographic -serial stdio \
		-kernel "$kernel" -initrd "$tmp/initramfs.cpio" \
		-append "$append" </dev/null 2>&1) || rc=$?
	end=$(date +%s%N)
	rm -rf "$tmp"
	printf '%s\n' "$out"
	((rc == 0)) || die "qemu ($accel, -cpu $cpu) exited with status $rc"
	grep -q 'KILN-GUEST-OK' <<<"$out" || die "guest never printed the marker"
	log "boot test passed ($accel, -cpu $cpu): qemu wall $(((end - start) / 1000000)) ms"
}

main() {
	local mode=build force=0
	case ${1:-} in
	'') ;;
	--force) force=1 ;;
	--regen) mode=regen ;;
	--boot-test) mode=boot-test ;;
	-h | --help) sed -n '2,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; return 0 ;;
	*) die "unknown argument ${1@Q} (want --force, --regen, --boot-test or --help)" ;;
	esac
	(($# <= 1)) || die "too many arguments"
	[[ $(uname -m) == x86_64 ]] || die "only x86_64 hosts are supported (got $(uname -m))"

	if [[ $mode == boot-test ]]; then
		boot_test
		return
	fi
	mkdir -p "$top"
	exec 9>"$top/.lock"
	flock -n 9 || { log "waiting for another build to finish"; flock 9; }

	ensure_packages
	prepare_source
	case $mode in
	regen) regen ;;
	build) build_and_install "$force" ;;
	esac
}

main "$@"
