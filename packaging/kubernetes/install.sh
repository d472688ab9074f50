#!/bin/sh
# install.sh: put Kiln's containerd shim on a Kubernetes node, so that pods
# with runtimeClassName: kiln run in Kiln microVMs (docs/kubernetes.md).
#
#   install.sh [--root DIR] [--from DIR] [--no-restart]
#
# --from DIR (default: this script's folder) holds what is installed:
#   bin/containerd-shim-kiln-v2, bin/kiln-agent, bin/kiln and bin/kiln-vmm
#   (optional: the CLI and the VMM process it runs), and
#   kernel/<version>/{vmlinuz,modules/} with kernel/current -> <version>
#   (tools/fetch-kernel.sh's cache layout; Dockerfile.installer packs it).
# --root DIR (default /) is the node's root: the installer DaemonSet mounts
#   the host's / at /host and passes --root /host.
#
# It writes, under the root:
#   /usr/local/bin/{containerd-shim-kiln-v2,kiln-agent,kiln,kiln-vmm}
#   /var/lib/kiln/kernel/...              the guest kernel (the shim's cache)
#   /etc/kiln/shim.toml                   unless one is there
# and the CRI runtime "kiln" (containerd-kiln.toml) into
# /etc/containerd/config.toml, between markers (a missing config.toml is
# created with containerd's defaults and the runtime). Then it restarts
# containerd (systemctl, in the root's mount namespace when --root is not
# /) unless --no-restart. Running it again changes nothing that is already
# in place, but replaces the binaries and the kernel.
#
# It refuses a node without /dev/kvm or without cgroup v2 (the checks run
# against the node: under --root, DIR/dev/kvm and DIR/sys/fs/cgroup).
set -eu

root=/
from=$(cd "$(dirname "$0")" && pwd)
restart=1
while [ $# -gt 0 ]; do
	case "$1" in
	--root) root=$2; shift 2 ;;
	--from) from=$2; shift 2 ;;
	--no-restart) restart=0; shift ;;
	-h|--help) sed -n '2,27p' "$0"; exit 0 ;;
	*) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
	esac
done

say() { echo "install.sh: $*" >&2; }
die() { say "$*"; exit 1; }

r=${root%/}
[ -d "$root" ] || die "--root $root is not a directory"
for f in bin/containerd-shim-kiln-v2 bin/kiln-agent; do
	[ -x "$from/$f" ] || die "$from/$f is missing or not executable (build with make build, or use the installer image)"
done
[ -L "$from/kernel/current" ] || die "$from/kernel/current is missing (tools/fetch-kernel.sh's cache layout: kernel/<version>/vmlinuz, kernel/current -> <version>)"
version=$(readlink "$from/kernel/current")
case "$version" in */*|.*|"") die "$from/kernel/current points at $version: want a version folder beside it" ;; esac
[ -f "$from/kernel/$version/vmlinuz" ] && [ -d "$from/kernel/$version/modules" ] ||
	die "$from/kernel/$version needs vmlinuz and modules/"

if [ "${KILN_INSTALL_SKIP_NODE_CHECKS:-}" != 1 ]; then
	[ -c "$r/dev/kvm" ] || die "the node has no /dev/kvm: Kiln needs hardware virtualisation (load kvm_intel or kvm_amd; on a cloud VM, enable nested virtualisation or use bare metal)"
	[ -f "$r/sys/fs/cgroup/cgroup.controllers" ] || die "the node is not on cgroup v2 (no /sys/fs/cgroup/cgroup.controllers): boot with systemd.unified_cgroup_hierarchy=1"
fi

install -d -m 0755 "$r/usr/local/bin" "$r/var/lib/kiln/kernel" "$r/etc/kiln" "$r/etc/containerd"
for b in containerd-shim-kiln-v2 kiln-agent kiln kiln-vmm; do
	[ -x "$from/bin/$b" ] || continue
	install -m 0755 "$from/bin/$b" "$r/usr/local/bin/.$b.new"
	mv -f "$r/usr/local/bin/.$b.new" "$r/usr/local/bin/$b"
done

# The kernel: copied beside any older one, then current switched at once.
rm -rf "$r/var/lib/kiln/kernel/.$version.new"
cp -a "$from/kernel/$version" "$r/var/lib/kiln/kernel/.$version.new"
rm -rf "$r/var/lib/kiln/kernel/$version"
mv "$r/var/lib/kiln/kernel/.$version.new" "$r/var/lib/kiln/kernel/$version"
ln -sfn "$version" "$r/var/lib/kiln/kernel/.current.new"
mv -fT "$r/var/lib/kiln/kernel/.current.new" "$r/var/lib/kiln/kernel/current"

if [ -e "$r/etc/kiln/shim.toml" ]; then
	say "keeping $r/etc/kiln/shim.toml"
else
	cat >"$r/etc/kiln/shim.toml" <<'EOF'
# Kiln's containerd shim (docs/kubernetes.md). A pod's VM is sized by its
# io.kiln.vcpus / io.kiln.memory-mib annotations, else its container's
# limits, else these.
cache = "/var/lib/kiln"
cpus = 1
memory_mib = 512
boot_timeout = "30s"
EOF
fi

# The runtime goes into config.toml itself, between markers: containerd
# 1.x replaces a whole plugin section with an imported file's, so a
# drop-in under conf.d would wipe the node's own CRI settings
# (sandbox_image, cni, registry mirrors). A block from an earlier run is
# replaced; a runtime "kiln" the node's config defines itself is refused.
cfg="$r/etc/containerd/config.toml"
begin="# BEGIN kiln runtime (packaging/kubernetes/install.sh)"
end="# END kiln runtime"
[ -f "$from/containerd-kiln.toml" ] || die "$from/containerd-kiln.toml is missing"
if [ ! -e "$cfg" ]; then
	# A runtimes table of the node's own replaces containerd's default
	# one: runc, the default runtime, must be named again.
	cat >"$cfg" <<'EOF'
version = 2

[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
EOF
	say "wrote $cfg (containerd's defaults, runc and the kiln runtime)"
fi
tmp="$cfg.kiln.$$"
trap 'rm -f "$tmp"' EXIT
awk -v b="$begin" -v e="$end" '$0==b{skip=1} !skip{print} $0==e{skip=0}' "$cfg" >"$tmp"
if grep -q '^[[:space:]]*\[plugins\."io\.containerd\.[a-z0-9.]*cri[a-z0-9.]*"\.containerd\.runtimes\.kiln\]' "$tmp"; then
	die "$cfg defines the runtime kiln itself: remove it, or keep it and skip this installer"
fi
# containerd 2's own form (version 3) names the CRI runtime plugin anew.
plugin='io.containerd.grpc.v1.cri'
if grep -q '^[[:space:]]*version[[:space:]]*=[[:space:]]*3' "$tmp"; then
	plugin='io.containerd.cri.v1.runtime'
fi
{
	sed -e :a -e '/^\n*$/{$d;N;ba' -e '}' "$tmp"
	echo
	echo "$begin"
	sed -e '/^[[:space:]]*#/d' -e '/^version[[:space:]]*=/d' -e '/^[[:space:]]*$/d' \
		-e "s|plugins\.\"io\.containerd\.grpc\.v1\.cri\"|plugins.\"$plugin\"|" "$from/containerd-kiln.toml"
	echo "$end"
} >"$cfg.kiln.new"
mv -f "$cfg.kiln.new" "$cfg"
say "the kiln runtime is in $cfg"

if [ "$restart" = 1 ]; then
	if [ "$root" = / ]; then
		systemctl restart containerd
	else
		# From a privileged pod with hostPID: the node's systemd.
		nsenter -t 1 -m -- systemctl restart containerd
	fi
	say "restarted containerd"
fi
say "installed Kiln (kernel $version) under $root"
