#!/usr/bin/env bash
# build-test-rootfs.sh: a Debian minbase root with python3 and git, made with
# debootstrap, as one tarball in Kiln's cache (once), and the image tests'
# OCI images made from it (tools/testimage: estargz layers, deterministic):
#   <cache>/test-rootfs/bookworm-minbase-python3-git.tar
#   <cache>/test-rootfs/images-v1/      (an OCI image layout)
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

# Bump when tools/testimage changes what it makes.
images=$cache/test-rootfs/images-v1
make_images() {
	[ -d "$images" ] && return 0
	say "making the test images (tools/testimage) in $images"
	go run ./tools/testimage -rootfs "$out" -out "$images"
}

if [ -s "$out" ]; then
	make_images
	echo "$out"
	exit 0
fi
sudo=
[ "$(id -u)" = 0 ] || sudo=sudo
command -v debootstrap >/dev/null || { say "no debootstrap: run make deps"; exit 1; }

mirror=$(awk '
	/^[[:space:]]*$/ { uri = ""; ok = 0 }
	/^URIs:/ { uri = $2 }
	/^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "'$suite'") ok = 1 }
	uri != "" && ok { print uri; exit }' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $3 == "'$suite'" { print $2; exit }' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
[ -n "$mirror" ] || { say "no $suite mirror in /etc/apt to debootstrap from"; exit 1; }

mkdir -p "$(dirname "$out")"
work=$(mktemp -d "$(dirname "$out")/.build.XXXXXX")
trap '$sudo rm -rf "$work"' EXIT
say "debootstrap --variant=minbase --include=$include $suite ($mirror)"
start=$(date +%s)
$sudo debootstrap --variant=minbase --include="$include" "$suite" "$work/root" "$mirror" >"$work/log" 2>&1 || {
	tail -30 "$work/log" >&2
	say "debootstrap failed"
	exit 1
}
# What a container image does not carry: apt's package lists and caches.
$sudo rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"* "$work/root/debootstrap"
$sudo tar --numeric-owner --xattrs --sort=name -C "$work/root" -cf "$work/root.tar" .
$sudo chown "$(id -u):$(id -g)" "$work/root.tar"
mv "$work/root.tar" "$out"
say "$(du -h "$out" | cut -f1) in $(($(date +%s) - start)) s: $out"
make_images
echo "$out"
