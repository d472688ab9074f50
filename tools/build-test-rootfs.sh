#!/usr/bin/env bash
# build-test-rootfs.sh: a Debian minbase root with python3 and git, made with
# debootstrap, as one tarball in Kiln's cache (once), and the image tests'
# OCI images made from it (tools/testimage: estargz layers, deterministic):
#   <cache>/test-rootfs/bookworm-minbase-python3-git.tar
#   <cache>/test-rootfs/images-v3/      (an OCI image layout)
#   <cache>/test-rootfs/ext4-v3/NAME.ext4  (ext4 images of the busybox,
#                                          debian-read and go-repo images'
#                                          trees, for kiln bench image)
#   <cache>/test-rootfs/tree-v3/debian-read/  (that tree, for kiln bench
#                                          image's QEMU virtio-9p peer)
#   <cache>/test-rootfs/bookworm-minbase-fidelity.tar and fidelity-v2/
#                                          (systemd, docker.io, pytest: the
#                                          fidelity image, its own layout)
# where <cache> is $KILN_CACHE, else $XDG_CACHE_HOME/kiln, else
# $HOME/.cache/kiln. The image tests package it as an OCI image (estargz
# layers), push it to an in-process registry and run python3 and git from it
# through kiln run --image. The mirror is the one apt already uses here.
# Run as root, or with sudo on PATH (debootstrap makes device nodes and
# chowns). Prints the tarball's path.
set -euo pipefail

suite=bookworm
include=python3,git
cache=${KILN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln}
out=$cache/test-rootfs/$suite-minbase-python3-git.tar
say() { echo "build-test-rootfs: $*" >&2; }
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo

# Bump both when tools/testimage changes what it makes.
images=$cache/test-rootfs/images-v3
ext4=$cache/test-rootfs/ext4-v3
trees=$cache/test-rootfs/tree-v3
make_images() {
	[ -d "$images" ] && [ -d "$ext4" ] && [ -d "$trees" ] && return 0
	local flat
	flat=$(mktemp -d "$cache/test-rootfs/.flat.XXXXXX")
	if [ ! -d "$images" ]; then
		say "making the test images (tools/testimage) in $images"
		go run ./tools/testimage -rootfs "$out" -out "$images" -flat "$flat"
	else
		# The layout exists: make the trees again, into a layout thrown away.
		go run ./tools/testimage -rootfs "$out" -out "$flat/layout" -flat "$flat"
	fi
	make_ext4 "$flat"
	$sudo rm -rf "$flat"
}

# make_ext4 FLAT makes ext4-v3/NAME.ext4 from each FLAT/NAME.tar (the
# image's tree, tools/testimage -flat): extracted as root, so that owners
# and modes stay the image's, then mkfs.ext4 -d, sized to the tree plus a
# third and 64 MiB.
make_ext4() {
	local flat=$1 tmp=$ext4.tmp t name dir kib
	command -v mkfs.ext4 >/dev/null || { say "no mkfs.ext4 (e2fsprogs)"; exit 1; }
	$sudo rm -rf "$tmp"
	mkdir -p "$tmp"
	for t in "$flat"/*.tar; do
		name=$(basename "$t" .tar)
		dir=$flat/$name.d
		mkdir -p "$dir"
		$sudo tar --numeric-owner --xattrs -xpf "$t" -C "$dir"
		kib=$($sudo du -sk "$dir" | cut -f1)
		kib=$((kib + kib / 3 + 65536))
		say "ext4 image of $name: ${kib} KiB"
		$sudo mkfs.ext4 -q -F -L root -d "$dir" "$tmp/$name.ext4" "${kib}k"
		$sudo chown "$(id -u):$(id -g)" "$tmp/$name.ext4"
		if [ "$name" = debian-read ]; then
			mkdir -p "$tmp/trees"
			mv "$dir" "$tmp/trees/$name"
		else
			$sudo rm -rf "$dir"
		fi
	done
	$sudo rm -rf "$ext4" "$trees"
	mv "$tmp/trees" "$trees"
	mv "$tmp" "$ext4"
}

# debootstrap_root OUT INCLUDE: a minbase root with INCLUDE's packages
# as the tarball OUT (once).
debootstrap_root() {
	local out=$1 include=$2 work start
	[ -s "$out" ] && return 0
	command -v debootstrap >/dev/null || { say "no debootstrap: run make deps"; exit 1; }
	mkdir -p "$(dirname "$out")"
	work=$(mktemp -d "$(dirname "$out")/.build.XXXXXX")
	say "debootstrap --variant=minbase --include=$include $suite ($mirror)"
	start=$(date +%s)
	$sudo debootstrap --variant=minbase --include="$include" "$suite" "$work/root" "$mirror" >"$work/log" 2>&1 || {
		tail -30 "$work/log" >&2
		$sudo rm -rf "$work"
		say "debootstrap failed"
		exit 1
	}
	# What a container image does not carry: apt's package lists and caches.
	$sudo rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"* "$work/root/debootstrap"
	$sudo tar --numeric-owner --xattrs --sort=name -C "$work/root" -cf "$work/root.tar" .
	$sudo chown "$(id -u):$(id -g)" "$work/root.tar"
	mv "$work/root.tar" "$out"
	$sudo rm -rf "$work"
	say "$(du -h "$out" | cut -f1) in $(($(date +%s) - start)) s: $out"
}

# The fidelity tests' root and its layout (tools/testimage -fidelity):
# systemd as /sbin/init, Docker (Debian's docker.io; its units disabled by
# a top layer of whiteouts), iptables, pytest. fidelity-v2: that layer.
fidelity_include=systemd-sysv,dbus,docker.io,iptables,kmod,procps,iproute2,ca-certificates,python3,python3-pytest,git
fidelity_out=$cache/test-rootfs/$suite-minbase-fidelity.tar
fidelity=$cache/test-rootfs/fidelity-v2
make_fidelity() {
	[ -d "$fidelity" ] && return 0
	[ -s "$fidelity_out" ] || [ -n "${mirror:-}" ] || find_mirror
	debootstrap_root "$fidelity_out" "$fidelity_include"
	say "making the fidelity image (tools/testimage -fidelity) in $fidelity"
	go run ./tools/testimage -fidelity -rootfs "$fidelity_out" -out "$fidelity"
}


find_mirror() {
mirror=$(awk '
	/^[[:space:]]*$/ { uri = ""; ok = 0 }
	/^URIs:/ { uri = $2 }
	/^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "'$suite'") ok = 1 }
	uri != "" && ok { print uri; exit }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $3 == "'$suite'" { print $2; exit }' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
[ -n "$mirror" ] || { say "no $suite mirror in /etc/apt to debootstrap from"; exit 1; }
}

if [ -s "$out" ]; then
	make_images
	make_fidelity
	echo "$out"
	exit 0
fi
find_mirror
debootstrap_root "$out" "$include"
make_images
make_fidelity
echo "$out"
