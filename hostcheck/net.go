package hostcheck

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// capNetAdmin is CAP_NET_ADMIN's bit in CapEff.
const capNetAdmin = 12

// netResult is a network check's result: required when kilnd gives
// sandboxes networks, else a failure is only a warning.
func (h *Host) netResult() Result { return Result{Required: h.Network} }

func (h *Host) soften(r Result) Result {
	if !r.Required && r.Status == Fail {
		r.Status = Warn
		r.Detail += " (needed only with --net-pool)"
	}
	return r
}

// CheckNftables: nftables answers over netlink (it lists this network
// namespace's tables).
func CheckNftables(_ context.Context, h *Host) Result {
	r := h.netResult()
	list := h.ListTables
	if list == nil {
		list = listTables
	}
	n, err := list()
	if err != nil {
		r.Status, r.Detail = Fail, "listing nftables tables: "+err.Error()
		switch {
		case errors.Is(err, unix.EPERM), errors.Is(err, unix.EACCES):
			r.Hint = "kilnd needs CAP_NET_ADMIN: run it as root (kilnd.service does)"
		case errors.Is(err, unix.EPROTONOSUPPORT), errors.Is(err, unix.ENOENT), errors.Is(err, unix.EOPNOTSUPP):
			r.Hint = "load nf_tables (modprobe nf_tables; CONFIG_NF_TABLES)"
		default:
			r.Hint = "load nf_tables (modprobe nf_tables) and run as root"
		}
		return h.soften(r)
	}
	r.Detail = fmt.Sprintf("nf_tables answers: %d tables in this network namespace", n)
	return r
}

// CheckTun: /dev/net/tun opens read-write (each sandbox's NIC is a tap).
func CheckTun(_ context.Context, h *Host) Result {
	r := h.netResult()
	f, err := os.OpenFile(h.Tun, os.O_RDWR, 0)
	if err != nil {
		r.Status, r.Detail = Fail, err.Error()
		switch {
		case errors.Is(err, fs.ErrNotExist):
			r.Hint = "modprobe tun (and mknod " + h.Tun + " c 10 200 where no devtmpfs makes it)"
		case errors.Is(err, fs.ErrPermission):
			r.Hint = "run kilnd as root"
		}
		return h.soften(r)
	}
	f.Close()
	r.Detail = h.Tun + " opens"
	return r
}

// CheckNetns: network namespaces exist, this process has CAP_NET_ADMIN,
// and a new one can be made.
func CheckNetns(_ context.Context, h *Host) Result {
	r := h.netResult()
	if _, err := os.Stat(h.NetNS); err != nil {
		r.Status, r.Detail = Fail, err.Error()
		r.Hint = "the kernel needs CONFIG_NET_NS"
		return h.soften(r)
	}
	eff, err := capEff(h.ProcSelfStatus)
	if err != nil {
		r.Status, r.Detail = Fail, err.Error()
		r.Hint = "is /proc mounted? kilnd reads its capabilities there"
		return h.soften(r)
	}
	if eff&(1<<capNetAdmin) == 0 {
		r.Status, r.Detail = Fail, fmt.Sprintf("no CAP_NET_ADMIN (CapEff %016x)", eff)
		r.Hint = "run kilnd (and kiln doctor) as root"
		return h.soften(r)
	}
	unshare := h.UnshareNet
	if unshare == nil {
		unshare = unshareNet
	}
	if err := unshare(); err != nil {
		r.Status, r.Detail = Fail, err.Error()
		r.Hint = "network namespaces are refused here (a container without CAP_SYS_ADMIN, or user.max_net_namespaces = 0)"
		return h.soften(r)
	}
	r.Detail = "CAP_NET_ADMIN; a new network namespace was made"
	return r
}

// capEff reads CapEff from a /proc/PID/status file.
func capEff(path string) (uint64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		v, ok := strings.CutPrefix(sc.Text(), "CapEff:")
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: CapEff %q: %w", path, strings.TrimSpace(v), err)
		}
		return n, nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("%s has no CapEff line", path)
}

// CheckIPForward: IPv4 forwarding, which NAT of sandboxes' traffic needs.
// kilnd turns it on at start when it gives sandboxes networks, so off is
// a warning.
func CheckIPForward(_ context.Context, h *Host) Result {
	b, err := os.ReadFile(h.IPForward)
	if err != nil {
		return h.soften(Result{Required: h.Network, Status: Fail, Detail: err.Error(), Hint: "the kernel needs IPv4 networking (CONFIG_INET)"})
	}
	switch strings.TrimSpace(string(b)) {
	case "1":
		return Result{Detail: "on"}
	case "0":
		return Result{Status: Warn, Detail: "off: kilnd with --net-pool turns it on at start",
			Hint: "to keep it on: echo net.ipv4.ip_forward=1 > /etc/sysctl.d/90-kiln.conf"}
	}
	return Result{Status: Warn, Detail: fmt.Sprintf("%s holds %q", h.IPForward, strings.TrimSpace(string(b)))}
}
