#!/usr/bin/env bash
# fetch-kernel.sh: put Debian's current stock kernel into Kiln's cache.
#
# Resolves the kernel package behind Debian's linux-image-amd64 meta-package,
# downloads it with apt-get download (no install), extracts it with dpkg-deb
# and installs it, atomically, as
#   <cache>/kernel/<version>/vmlinuz
#   <cache>/kernel/<version>/vmlinux    (vmlinuz uncompressed: an ELF that boots
#                                        through the PVH entry, no decompression)
#   <cache>/kernel/<version>/config
#   <cache>/kernel/<version>/modules/   (lib/modules/<version>, with modules.dep)
#   <cache>/kernel/current -> <version>
# where <cache> is $KILN_CACHE, else $XDG_CACHE_HOME/kiln, else
# $HOME/.cache/kiln (the same rule as the guestkernel package).
# Does nothing when a complete current kernel is already there; --update
# re-resolves the meta-package and fetches a newer kernel if there is one.
# KILN_KERNEL_DEB=/path/to/linux-image-*.deb installs that file instead of
# downloading.
set -euo pipefail

update=0
case "${1:-}" in
  --update) update=1 ;;
  "") ;;
  *) echo "usage: $0 [--update]" >&2; exit 2 ;;
esac

say() { echo "fetch-kernel: $*" >&2; }
die() { say "$*"; exit 1; }

if [ -n "${KILN_CACHE:-}" ]; then
  root=$(realpath -m -- "$KILN_CACHE")
elif [[ "${XDG_CACHE_HOME:-}" == /* ]]; then
  root=$XDG_CACHE_HOME/kiln
elif [[ "${HOME:-}" == /* ]]; then
  root=$HOME/.cache/kiln
else
  die "cannot locate Kiln's cache: set KILN_CACHE, XDG_CACHE_HOME or HOME to an absolute path"
fi
kdir=$root/kernel
mkdir -p "$kdir"

# complete VERSION: the version's files are all there.
complete() { [ -n "$1" ] && [ -f "$kdir/$1/vmlinuz" ] && [ -f "$kdir/$1/modules/modules.order" ]; }
current() {
  if [ -L "$kdir/current" ]; then basename "$(readlink "$kdir/current")"
  elif [ -f "$kdir/current" ]; then tr -d '[:space:]' < "$kdir/current"
  fi
}

# extract_vmlinux DIR: write DIR/vmlinux, the ELF kernel inside DIR/vmlinuz,
# when the kernel can boot from it (CONFIG_PVH). The payload's place comes
# from the bzImage header (boot protocol 2.08+).
extract_vmlinux() {
  local dir=$1 img=$1/vmlinuz setup off len start magic
  grep -qx 'CONFIG_PVH=y' "$dir/config" 2>/dev/null || { say "no CONFIG_PVH: not extracting vmlinux"; return 0; }
  u() { od -An -t"u$2" -j "$1" -N "$2" "$img" | tr -d ' '; }
  setup=$(u $((0x1f1)) 1); [ "$setup" = 0 ] && setup=4
  off=$(u $((0x248)) 4); len=$(u $((0x24c)) 4)
  start=$(( (setup + 1) * 512 + off ))
  magic=$(od -An -tx1 -j "$start" -N 6 "$img" | tr -d ' \n')
  local dec
  case $magic in
    fd377a585a00) dec="xz -dc --single-stream" ;;
    1f8b*) dec="gzip -dc" ;;
    28b52ffd*) dec="zstd -dc" ;;
    5d0000*) dec="xz -dc --format=lzma" ;;
    *) say "vmlinuz payload of unknown compression ($magic): not extracting vmlinux"; return 0 ;;
  esac
  command -v "${dec%% *}" >/dev/null || { say "${dec%% *} not installed: not extracting vmlinux"; return 0; }
  tail -c +$((start + 1)) "$img" | head -c "$len" | $dec > "$dir/.vmlinux.tmp" 2>/dev/null || true
  if [ "$(od -An -tx1 -N4 "$dir/.vmlinux.tmp" | tr -d ' \n')" != 7f454c46 ]; then
    rm -f "$dir/.vmlinux.tmp"
    die "could not extract vmlinux from $img"
  fi
  mv "$dir/.vmlinux.tmp" "$dir/vmlinux"
}

# One fetch at a time per cache.
exec 9>"$kdir/.lock"
flock 9

if [ "$update" = 0 ] && complete "$(current)"; then
  v=$(current)
  if [ ! -f "$kdir/$v/vmlinux" ] && [ -f "$kdir/$v/config" ]; then
    say "extracting vmlinux of $v"
    extract_vmlinux "$kdir/$v"
  fi
  say "kernel $v already in $kdir"
  exit 0
fi

tmp=$(mktemp -d "$kdir/.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

if [ -n "${KILN_KERNEL_DEB:-}" ]; then
  [ -f "$KILN_KERNEL_DEB" ] || die "KILN_KERNEL_DEB=$KILN_KERNEL_DEB: no such file"
  deb=$KILN_KERNEL_DEB
else
  command -v apt-cache >/dev/null || die "apt-cache not found: this needs a Debian system"
  resolve() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
  pkg=$(resolve)
  if [ -z "$pkg" ] || [ "$update" = 1 ]; then
    say "apt-get update"
    apt-get update -qq >/dev/null || die "apt-get update failed"
    pkg=$(resolve)
  fi
  [ -n "$pkg" ] || die "apt-cache depends linux-image-amd64 names no linux-image-<version> package"
  version=${pkg#linux-image-}
  if [ "$update" = 1 ] && complete "$version"; then
    ln -sfn "$version" "$kdir/.current.tmp" && mv -T "$kdir/.current.tmp" "$kdir/current"
    say "kernel $version already in $kdir"
    exit 0
  fi
  say "downloading $pkg"
  sandbox=()
  # As root apt-get download drops privileges to _apt, which cannot write here.
  [ "$(id -u)" = 0 ] && sandbox=(-o APT::Sandbox::User=root)
  (cd "$tmp" && apt-get download -q "${sandbox[@]}" "$pkg" >&2) || die "apt-get download $pkg failed"
  deb=$(ls "$tmp"/*.deb)
fi

say "extracting $(basename "$deb")"
dpkg-deb -x "$deb" "$tmp/root" || die "dpkg-deb -x $deb failed"
rm -f "$tmp"/*.deb
mapfile -t versions < <(ls "$tmp/root/lib/modules")
[ "${#versions[@]}" = 1 ] || die "$(basename "$deb") holds ${#versions[@]} module trees, want 1"
version=${versions[0]}
mods=$tmp/root/lib/modules/$version
[ -f "$tmp/root/boot/vmlinuz-$version" ] || die "$(basename "$deb") has no boot/vmlinuz-$version"

# Kiln's initramfs loads modules with busybox insmod: store them uncompressed.
if find "$mods" -name '*.ko.xz' -print -quit | grep -q .; then
  command -v xz >/dev/null || die "modules are xz-compressed and xz is not installed (apt-get install xz-utils)"
  find "$mods" -name '*.ko.xz' -print0 | xargs -0 -r xz -d
fi
if find "$mods" -name '*.ko.zst' -print -quit | grep -q .; then
  command -v zstd >/dev/null || die "modules are zstd-compressed and zstd is not installed (apt-get install zstd)"
  find "$mods" -name '*.ko.zst' -print0 | xargs -0 -r zstd -q -d --rm
fi

if command -v depmod >/dev/null || [ -x /sbin/depmod ]; then
  PATH=$PATH:/sbin:/usr/sbin depmod -b "$tmp/root" "$version" || die "depmod failed"
else
  say "depmod not found (Debian package kmod): no modules.dep; Kiln reads dependencies from the modules"
fi

mkdir "$tmp/$version"
mv "$tmp/root/boot/vmlinuz-$version" "$tmp/$version/vmlinuz"
[ -f "$tmp/root/boot/config-$version" ] && mv "$tmp/root/boot/config-$version" "$tmp/$version/config"
mv "$mods" "$tmp/$version/modules"
extract_vmlinux "$tmp/$version"

if [ -e "$kdir/$version" ]; then
  old=$(mktemp -d "$kdir/.old.XXXXXX")
  mv "$kdir/$version" "$old/"
  mv "$tmp/$version" "$kdir/$version"
  rm -rf "$old"
else
  mv "$tmp/$version" "$kdir/$version"
fi
ln -sfn "$version" "$kdir/.current.tmp"
mv -T "$kdir/.current.tmp" "$kdir/current"
say "kernel $version ready in $kdir/$version"
