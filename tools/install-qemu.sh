#!/usr/bin/env bash
# install-qemu.sh: make qemu-system-x86_64 QEMU 10.0 or newer, from Debian's
# own packages: on Debian 12 (bookworm) from its bookworm-backports suite,
# added beside the distribution's own suites (same mirror) when missing.
#
# Why: QEMU is the emulator of the test harness's L1 VMs (TCG, -cpu max:
# emulated nested SVM) and the microvm peer of the benchmarks. Under
# bookworm's QEMU 7.2, two-vCPU Linux boots in L1 hung in 2 of 10 Kiln runs
# and L1 itself crashed once; under QEMU 10.0 none of 10 Kiln or 10 QEMU
# microvm boots failed (docs/bench.md, "Two vCPUs under emulated nested
# SVM"). Run as root, or with sudo on PATH.
set -euo pipefail

want_major=10
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo

major() {
	qemu-system-x86_64 --version 2>/dev/null | sed -n 's/^QEMU emulator version \([0-9]*\)\..*/\1/p'
}

have=$(major || true)
if [ -n "$have" ] && [ "$have" -ge "$want_major" ]; then
	exit 0
fi

. /etc/os-release
case "${VERSION_CODENAME:-}" in
bookworm) suite=bookworm-backports ;;
*)
	echo "install-qemu: QEMU ${have:-none} on ${PRETTY_NAME:-this system}; want $want_major or newer (install it, or run on Debian 12 with bookworm-backports)" >&2
	exit 1
	;;
esac

# The distribution's mirror, as apt is set up here (deb822 or one-line).
mirror=$(awk '
	/^[[:space:]]*$/ { uri = ""; ok = 0 }
	/^URIs:/ { uri = $2 }
	/^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "bookworm") ok = 1 }
	uri != "" && ok { print uri; exit }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $3 ~ /^bookworm$/ { print $2; exit }' /etc/apt/sources.list 2>/dev/null || true)
if ! grep -rqsE "^[^#]*[[:space:]]$suite([[:space:]]|$)|^Suites:.*[[:space:]]$suite([[:space:]]|$)" /etc/apt/sources.list /etc/apt/sources.list.d/; then
	if [ -z "$mirror" ]; then
		echo "install-qemu: no Debian mirror found in /etc/apt to add $suite from" >&2
		exit 1
	fi
	echo "install-qemu: adding $suite ($mirror) to apt's sources"
	echo "deb $mirror $suite main" | $sudo tee "/etc/apt/sources.list.d/$suite.list" >/dev/null
fi
echo "install-qemu: installing qemu-system-x86 from $suite (QEMU ${have:-none} is older than $want_major)"
$sudo apt-get update -qq
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -t "$suite" qemu-system-x86
have=$(major || true)
if [ -z "$have" ] || [ "$have" -lt "$want_major" ]; then
	echo "install-qemu: still QEMU ${have:-none} after installing from $suite" >&2
	exit 1
fi
echo "install-qemu: $(qemu-system-x86_64 --version | head -1)"
