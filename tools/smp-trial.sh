#!/bin/sh
# smp-trial.sh: boot Debian's kernel with two guest vCPUs N times on Kiln and
# N times on QEMU microvm, alternating, and record for each run whether it
# reached the userspace marker, triple-faulted, panicked or hung, and how
# long it took. It is TestKVMBootCommand's first subtest (same kernel, same
# /init, same command line, 512 MiB), repeated, with QEMU as the control.
#
# Run it where /dev/kvm works; on a machine without one, inside the TCG L1
# VM, from a folder under /tmp so that L1 sees the binaries there (the
# harness shares the working folder when it lies under /tmp):
#
#   git worktree add /tmp/kiln-smp HEAD && cd /tmp/kiln-smp &&
#   go build -o bin/kiln ./cmd/kiln && go build -o bin/kvmharness ./tools/kvmharness
#   bin/kvmharness -exec -mode=tcg -cpus 2 -keep -timeout 60m -l1-timeout 70m -- \
#       /work/main/tools/smp-trial.sh -n 10
#
# (add -qemu PATH to emulate L1 with another QEMU; the peer inside L1 is
# -q's, the system's qemu-system-x86_64 by default). docs/bench.md, "Two
# vCPUs under emulated nested SVM", has the results.
#
# Options (environment in brackets):
#   -n RUNS      runs per VMM (10)
#   -t SECONDS   limit of one boot (300, as the test's --timeout 5m)
#   -c CPUS      guest vCPUs (2)
#   -k KERNEL    kernel image (the cached Debian vmlinuz, as the test uses)
#   -b KILN      the kiln binary [KILN] (bin/kiln)
#   -q QEMU      the peer QEMU [QEMU] (qemu-system-x86_64)
#   -o DIR       where consoles and results go [SMP_TRIAL_OUT] (inside the
#                harness's job folder when there is one, which -keep keeps;
#                otherwise a new folder under /tmp)
#   -only kiln|qemu   boot one VMM only
#
# Output: one RESULT line per run, "RESULT <vmm> <run> <outcome> <seconds>
# <detail>", outcome one of ok, triple-fault, panic, hang, wrong-cpus,
# other; then a SUMMARY per VMM. Each run's console, stderr and L1's
# kernel log during it are in DIR/<vmm>-<run>.{console,stderr,dmesg}, and
# for a boot still running 20 s before its limit, what L1 saw of it then
# (threads, kernel stacks, KVM counters and exit tracepoints) in .diag.
# Exit status: 0 when every run reached the marker, 1 otherwise, 2 on a
# usage or setup error.
set -u

runs=10 limit=300 cpus=2 kernel="" only=""
kiln=${KILN:-bin/kiln} qemu=${QEMU:-qemu-system-x86_64} out=${SMP_TRIAL_OUT:-}
while [ $# -gt 0 ]; do
	case $1 in
	-n) runs=$2; shift 2 ;;
	-t) limit=$2; shift 2 ;;
	-c) cpus=$2; shift 2 ;;
	-k) kernel=$2; shift 2 ;;
	-b) kiln=$2; shift 2 ;;
	-q) qemu=$2; shift 2 ;;
	-o) out=$2; shift 2 ;;
	-only) only=$2; shift 2 ;;
	*) echo "usage: $0 [-n RUNS] [-t SECONDS] [-c CPUS] [-k KERNEL] [-b KILN] [-q QEMU] [-o DIR] [-only kiln|qemu]" >&2; exit 2 ;;
	esac
done
[ -n "$kernel" ] || kernel=${KILN_CACHE:-$HOME/.cache/kiln}/kernel/current/vmlinuz
[ -r "$kernel" ] || { echo "smp-trial: no kernel at $kernel (make kernel)" >&2; exit 2; }
[ -w /dev/kvm ] || { echo "smp-trial: /dev/kvm is not usable here: run it through bin/kvmharness -exec" >&2; exit 2; }
case $only in kiln) qemu="" ;; qemu) kiln="" ;; "") ;; *) echo "smp-trial: -only kiln or qemu" >&2; exit 2 ;; esac
[ -z "$kiln" ] || [ -x "$kiln" ] || { echo "smp-trial: no kiln binary at $kiln (make build)" >&2; exit 2; }
[ -z "$qemu" ] || command -v "$qemu" >/dev/null || { echo "smp-trial: no $qemu" >&2; exit 2; }
[ -x /bin/busybox ] && command -v cpio >/dev/null || { echo "smp-trial: needs busybox-static and cpio" >&2; exit 2; }

if [ -z "$out" ]; then
	for d in /tmp/kiln-kvmharness-*; do # the harness's job folder, shared read-write with the host
		[ -f "$d/run.sh" ] && [ -w "$d" ] && out=$d/smp-trial && break
	done
fi
[ -n "$out" ] || out=$(mktemp -d /tmp/smp-trial.XXXXXX)
mkdir -p "$out" || exit 2
echo "smp-trial: results in $out"

# The initramfs: what kvmtest.BusyboxInitrd builds (initramfs.BusyboxInit),
# /bin/busybox with its applets' symlinks, the empty folders, and
# TestKVMBootCommand's /init.
stage=$(mktemp -d /tmp/smp-trial-initrd.XXXXXX)
mkdir -p "$stage/bin" "$stage/dev" "$stage/proc" "$stage/sys" "$stage/tmp" "$stage/root" "$stage/etc" "$stage/mnt"
chmod 1777 "$stage/tmp"
cp /bin/busybox "$stage/bin/busybox"
for a in [ ash awk base64 cat chmod chroot cp cut date dd dmesg echo env false find grep halt head hostname \
	id insmod ip kill ln ls lsmod md5sum mkdir mknod mount mv nproc ping poweroff printf ps reboot rm sed seq sh \
	sha256sum sleep sort stat sync tail tee test timeout touch tr true umount uname uniq wc wget xargs; do
	ln -s busybox "$stage/bin/$a"
done
cat >"$stage/init" <<'EOF'
#!/bin/busybox sh
mount -t proc proc /proc
mount -t sysfs sys /sys
echo "KILN-MARKER cpus=$(grep -c ^processor /proc/cpuinfo) online=$(cat /sys/devices/system/cpu/online)"
poweroff -f
EOF
chmod 755 "$stage/init"
initrd=$out/initrd.cpio
(cd "$stage" && find . -mindepth 1 | sort | cpio -o -H newc -R 0:0 --quiet) >"$initrd" || exit 2
rm -rf "$stage"

online=$(seq -s, 0 $((cpus - 1)) | sed 's/,.*,/-/; s/,/-/')
[ "$cpus" -gt 1 ] || online=0
marker="KILN-MARKER cpus=$cpus online=$online"
cmdline="console=ttyS0 reboot=k panic=-1" # vmm.DefaultCmdline, what kiln boot gives by default

echo "smp-trial: $(uname -r) on $(grep -c ^processor /proc/cpuinfo) CPUs ($(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'))"
for p in nested npt avic vgif vls nrips; do
	[ -r /sys/module/kvm_amd/parameters/$p ] && printf 'smp-trial: kvm_amd.%s=%s\n' $p "$(cat /sys/module/kvm_amd/parameters/$p)"
done
echo "smp-trial: kernel $kernel, initrd $initrd, $cpus vCPUs, 512 MiB, limit ${limit}s, $runs runs each"
[ -z "$kiln" ] || echo "smp-trial: kiln $kiln"
[ -z "$qemu" ] || echo "smp-trial: peer $($qemu -version | head -1)"

now() { cut -d' ' -f1 /proc/uptime; }

# classify VMM RUN RC START: prints and records the RESULT line of a run.
classify() {
	vmm=$1 i=$2 rc=$3 t0=$4
	secs=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
	c=$out/$vmm-$i.console e=$out/$vmm-$i.stderr
	dmesg -c >"$out/$vmm-$i.dmesg" 2>/dev/null
	detail=""
	if grep -q "$marker" "$c"; then
		outcome=ok
		[ "$rc" = 0 ] || { outcome=other; detail="marker, then exit status $rc"; }
	elif grep -q 'KILN-MARKER' "$c"; then
		outcome=wrong-cpus detail=$(grep -m1 KILN-MARKER "$c" | tr -d '\r')
	elif grep -q 'Kernel panic' "$c" || grep -q 'guest stopped: panic' "$e"; then
		outcome=panic detail=$(grep -m1 'Kernel panic' "$c" | tr -d '\r')
	elif [ "$rc" = 124 ] || [ "$rc" = 137 ] || grep -q -e 'timeout .* reached' -e 'cancelled' "$e"; then
		outcome=hang
	elif grep -q 'triple' "$e"; then
		outcome=triple-fault detail=$(grep -m1 'triple' "$e")
	elif [ "$vmm" = qemu ] && [ "$rc" = 0 ] && ! grep -q 'reboot: ' "$c"; then
		# With -no-reboot QEMU exits 0 on a reset it was not asked for by
		# the kernel's reboot path (which prints "reboot: ..."): under KVM,
		# a triple fault (KVM_EXIT_SHUTDOWN).
		outcome=triple-fault detail="qemu exited on a reset the kernel did not announce"
	else
		outcome=other detail="exit status $rc: $(tail -n1 "$e" | tr -d '\r')"
	fi
	if [ "$outcome" != ok ]; then
		last=$(tr -d '\r' <"$c" | grep -v '^$' | tail -n1)
		detail="$detail; console's last line: $last"
	fi
	echo "RESULT $vmm $i $outcome $secs $detail" | tee -a "$out/results"
}

# diagnose PID FILE: what L1 sees of a boot that has not finished near its
# limit: the VMM's threads (state, CPU time, kernel stack: a vCPU halted in
# kvm_vcpu_block or running in the guest), KVM's counters two seconds apart,
# and two seconds of KVM's exit tracepoints, summed by vCPU, reason and RIP.
diagnose() {
	pid=$1 f=$2
	{
		echo "== $(now) s: VMM pid $pid"
		ps -L -o tid,stat,pcpu,time,wchan:32,comm -p "$pid"
		for t in /proc/"$pid"/task/*; do
			echo "-- thread ${t##*/} ($(cat "$t/comm" 2>/dev/null))"
			cat "$t/stack" 2>/dev/null | head -n 12
		done
		[ -d /sys/kernel/debug/kvm ] || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
		for d in /sys/kernel/debug/kvm/"$pid"-*; do
			[ -d "$d" ] || continue
			for pass in 1 2; do
				printf '%s:' "-- kvm stats $pass"
				for c in exits halt_exits halt_wakeup irq_injections nmi_injections irq_exits io_exits mmio_exits signal_exits req_event irq_window_exits; do
					[ -r "$d/$c" ] && printf ' %s=%s' "$c" "$(cat "$d/$c")"
				done
				echo
				[ "$pass" = 2 ] || sleep 2
			done
		done
		tr=/sys/kernel/tracing
		[ -w "$tr/tracing_on" ] || mount -t tracefs tracefs "$tr" 2>/dev/null
		if [ -w "$tr/tracing_on" ]; then
			echo 0 >"$tr/tracing_on"
			: >"$tr/trace"
			echo 4096 >"$tr/buffer_size_kb"
			for e in kvm_exit kvm_inj_virq kvm_apic_ipi kvm_apic_accept_irq kvm_pic_set_irq kvm_set_irq; do
				[ -w "$tr/events/kvm/$e/enable" ] && echo 1 >"$tr/events/kvm/$e/enable"
			done
			echo 1 >"$tr/tracing_on"
			sleep 2
			echo 0 >"$tr/tracing_on"
			echo "-- kvm_exit over 2 s, by vCPU, reason and RIP"
			grep ' kvm_exit: ' "$tr/trace" | sed 's/.* kvm_exit: //' |
				awk '{ for (i = 1; i < NF; i++) { if ($i == "vcpu") v = $(i+1); if ($i == "reason") r = $(i+1); if ($i == "rip") p = $(i+1) } n[v " " r " " p]++ }
				     END { for (k in n) print n[k], "vcpu", k }' | sort -rn | head -n 20
			echo "-- other kvm events over 2 s"
			grep -v -e ' kvm_exit: ' -e '^#' "$tr/trace" | sed 's/.*\(kvm_[a-z_]*\): /\1: /' | sort | uniq -c | sort -rn | head -n 20
			echo "-- the trace's last lines"
			grep -v '^#' "$tr/trace" | tail -n 30
			for e in "$tr"/events/kvm/*/enable; do echo 0 >"$e"; done
			: >"$tr/trace"
		fi
	} >"$f" 2>&1
}

# watchVMM VMM RUN PID START: waits for the VMM, diagnoses it 20 s before
# the limit, ends QEMU at the limit and kills either 30 s after; sets wrc to
# its exit status (124 when ended here).
watchVMM() {
	vmm=$1 i=$2 pid=$3 t0=$4 diagnosed="" rc=""
	while kill -0 "$pid" 2>/dev/null; do
		el=$(awk -v a="$t0" -v b="$(now)" 'BEGIN { printf "%d", b - a }')
		if [ -z "$diagnosed" ] && [ "$el" -ge $((limit - 20)) ]; then
			diagnose "$pid" "$out/$vmm-$i.diag"
			diagnosed=1
		fi
		if [ "$el" -ge $((limit + 30)) ]; then
			kill -KILL "$pid" 2>/dev/null
			rc=124
			break
		fi
		[ "$vmm" = qemu ] && [ "$el" -ge "$limit" ] && { kill -TERM "$pid" 2>/dev/null; rc=124; }
		sleep 1
	done
	wait "$pid"
	r=$?
	wrc=${rc:-$r}
}

bootKiln() {
	i=$1 t0=$(now)
	"$kiln" boot --kernel "$kernel" --initrd "$initrd" --cpus "$cpus" --mem 512 \
		--timeout "${limit}s" >"$out/kiln-$i.console" 2>"$out/kiln-$i.stderr" </dev/null &
	watchVMM kiln "$i" $! "$t0"
	classify kiln "$i" "$wrc" "$t0"
}

bootQEMU() {
	i=$1 t0=$(now)
	"$qemu" -M microvm,x-option-roms=off,isa-serial=on,rtc=off -bios qboot.rom -enable-kvm -cpu host \
		-m 512 -smp "$cpus" -nodefaults -no-user-config -nographic -no-reboot -serial stdio \
		-kernel "$kernel" -initrd "$initrd" -append "$cmdline" >"$out/qemu-$i.console" 2>"$out/qemu-$i.stderr" </dev/null &
	watchVMM qemu "$i" $! "$t0"
	classify qemu "$i" "$wrc" "$t0"
}

: >"$out/results"
dmesg -c >"$out/before.dmesg" 2>/dev/null
# Read kernel and initrd once so that the first boot does not pay for 9p.
cat "$kernel" "$initrd" >/dev/null
i=1
while [ "$i" -le "$runs" ]; do
	[ -z "$kiln" ] || bootKiln "$i"
	[ -z "$qemu" ] || bootQEMU "$i"
	i=$((i + 1))
done

status=0
for vmm in kiln qemu; do
	grep -q "^RESULT $vmm " "$out/results" || continue
	counts=$(awk -v v="$vmm" '$2 == v { n++; c[$4]++ } END { printf "%d runs:", n; for (o in c) printf " %s %d", o, c[o] }' "$out/results")
	med=$(awk -v v="$vmm" '$2 == v && $4 == "ok" { print $5 }' "$out/results" | sort -n |
		awk '{ s[NR] = $1 } END { if (NR) printf "; ok median %.1f s", (NR % 2) ? s[(NR+1)/2] : (s[NR/2] + s[NR/2+1]) / 2 }')
	summary="$counts$med"
	echo "SUMMARY $vmm $summary" | tee -a "$out/results"
done
grep -q '^RESULT [a-z]* [0-9]* [^o]' "$out/results" && status=1
exit $status
