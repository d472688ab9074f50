package virtio_test

import (
	"context"
	"crypto/md5"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// netTestLog sends the device's logs (debug included: every dropped frame)
// to the test log.
type netTestLog struct{ t *testing.T }

func (l netTestLog) Write(p []byte) (int, error) {
	l.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// netUpload is how much of the file the guest sends back, base64-encoded
// (busybox wget --post-file stops at the first NUL byte).
const netUpload = 256 << 10

// netGuestScript runs in the guest after virtio_net is loaded: it brings
// eth0 up as 10.0.2.2, pings the host end, downloads a file and uploads the
// first netUpload bytes of it back, printing its uptime at each step. ping,
// wget, md5sum, sha256sum and base64 are not among the initramfs's applet
// links, so they run as busybox APPLET.
const netGuestScript = `
t() { echo "KILN-NET-T $(cut -d' ' -f1 /proc/uptime) $1"; }
t start
i=0
while [ ! -e /sys/class/net/eth0 ] && [ $i -lt 20 ]; do i=$((i+1)); sleep 1; done
echo "KILN-NET-MAC $(cat /sys/class/net/eth0/address)"
ip link set lo up
ip addr add 10.0.2.2/24 dev eth0
ip link set eth0 up
echo "KILN-NET-CARRIER $(cat /sys/class/net/eth0/carrier)"
busybox ping -c 3 -W 10 10.0.2.1
echo "KILN-NET-PING=$?"
t ping
if busybox wget -q -O /tmp/file http://10.0.2.1:8080/file; then
	t download
	echo "KILN-NET-SHA256 $(busybox sha256sum /tmp/file)"
	echo "KILN-NET-MD5 $(busybox md5sum /tmp/file)"
	head -c 262144 /tmp/file | busybox base64 > /tmp/up
	busybox wget -q -O /tmp/resp --post-file /tmp/up http://10.0.2.1:8080/upload
	echo "KILN-NET-POST=$? $(cat /tmp/resp)"
	t upload
else
	echo KILN-NET-WGET=failed
fi
echo KILN-NET-DONE
poweroff -f
`

// TestKVMVirtioNet boots Debian's kernel with a virtio-net device on a tap
// inside a network namespace made for the test, where an HTTP server listens
// on 10.0.2.1:8080. The guest pings it, downloads a file of random bytes and
// prints its checksums, then uploads it back; the host checks both ways.
// Nothing leaves the namespace.
func TestKVMVirtioNet(t *testing.T) {
	kvmtest.Require(t)
	if os.Geteuid() != 0 {
		t.Fatal("needs root to create a network namespace and a tap")
	}
	k := kvmtest.Kernel(t)
	if k.Vmlinux == "" {
		t.Fatal("the kernel cache has no vmlinux (make kernel extracts it)")
	}
	ns := fmt.Sprintf("kiln-test-%d", os.Getpid())
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	ip("netns", "add", ns)
	defer func() {
		if out, err := exec.Command("ip", "netns", "delete", ns).CombinedOutput(); err != nil {
			t.Errorf("ip netns delete %s: %v: %s", ns, err, out)
		}
	}()
	nsPath := filepath.Join(virtio.NetnsDirForTest, ns)

	logger := slog.New(slog.NewTextHandler(netTestLog{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	// vmm.New opens the tap (creating it in the namespace); the guest
	// starts only with Run.
	nic := virtio.DeviceSpec{ID: "net0", Kind: virtio.KindNet, Net: &virtio.NetSpec{Tap: "kiln0", Netns: nsPath}}
	initrd := kvmtest.ModulesInitrd(t, []string{"virtio_mmio", "virtio_net"}, netGuestScript)
	var console kvmtest.Console
	vm, err := vmm.New(vmm.Config{
		Spec:    vmm.Spec{Kernel: k.Vmlinux, Initrd: initrd, Cmdline: vmm.DefaultCmdline + " quiet", CPUs: 1, MemoryMiB: 256, Devices: []virtio.DeviceSpec{nic}},
		Console: &console,
		Logger:  logger,
	})
	if err != nil {
		t.Fatalf("vmm.New: %v", err)
	}
	defer vm.Close()
	dev := vm.Device("net0").(*virtio.Net)
	ip("-n", ns, "addr", "add", "10.0.2.1/24", "dev", "kiln0")
	ip("-n", ns, "link", "set", "kiln0", "up")

	rng := rand.New(rand.NewPCG(3, 4))
	payload := make([]byte, 2<<20+321)
	for i := range payload {
		payload[i] = byte(rng.Uint32())
	}
	sha := sha256.Sum256(payload)
	md := md5.Sum(payload)
	var (
		uploadMu  sync.Mutex
		uploadSum string
	)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /file", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(payload)
	})
	mux.HandleFunc("POST /upload", func(w http.ResponseWriter, r *http.Request) {
		// The decoder skips the newlines busybox base64 puts in.
		h := sha256.New()
		n, err := io.Copy(h, base64.NewDecoder(base64.StdEncoding, io.LimitReader(r.Body, 16<<20)))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		uploadMu.Lock()
		uploadSum = hex.EncodeToString(h.Sum(nil))
		uploadMu.Unlock()
		fmt.Fprintf(w, "received %d bytes", n)
	})
	var ln net.Listener
	if err := virtio.InNetnsForTest(nsPath, func() error {
		var err error
		ln, err = net.Listen("tcp4", "10.0.2.1:8080")
		return err
	}); err != nil {
		t.Fatalf("listening in %s: %v", ns, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: time.Minute}
	go srv.Serve(ln)
	defer srv.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := time.Now()
	exit, err := vm.Run(ctx)
	t.Logf("guest ran %v; device stats %+v", time.Since(start).Round(time.Millisecond), dev.Stats())
	if err != nil {
		t.Fatalf("Run: %v; console:\n%s", err, console.String())
	}
	out := console.String()
	for _, m := range regexp.MustCompile(`KILN-NET-T (\S+) (\S+)`).FindAllStringSubmatch(out, -1) {
		t.Logf("guest uptime %ss at %s", m[1], m[2])
	}
	if exit.Reason != vmm.ReasonPowerOff || !strings.Contains(out, "KILN-NET-DONE") {
		t.Fatalf("guest stopped with %v before finishing; console:\n%s", exit, out)
	}
	want := map[string]string{
		`KILN-NET-MAC (\S+)`:             dev.MAC().String(),
		`KILN-NET-CARRIER (\S+)`:         "1",
		`KILN-NET-PING=(\d+)`:            "0",
		`KILN-NET-SHA256 ([0-9a-f]{64})`: hex.EncodeToString(sha[:]),
		`KILN-NET-MD5 ([0-9a-f]{32})`:    hex.EncodeToString(md[:]),
		`KILN-NET-POST=(.*)`:             fmt.Sprintf("0 received %d bytes", netUpload),
	}
	for re, w := range want {
		m := regexp.MustCompile(re).FindStringSubmatch(out)
		if m == nil {
			t.Errorf("the guest printed no %s; console:\n%s", re, out)
		} else if got := strings.TrimSpace(m[1]); got != w {
			t.Errorf("%s: guest printed %q, want %q", re, got, w)
		}
	}
	upSum := sha256.Sum256(payload[:netUpload])
	uploadMu.Lock()
	if uploadSum != hex.EncodeToString(upSum[:]) {
		t.Errorf("the guest uploaded data with sha256 %q, want %x", uploadSum, upSum)
	}
	uploadMu.Unlock()
	if st := dev.Stats(); st.TxDropped != 0 {
		t.Errorf("device dropped %d frames from the guest", st.TxDropped)
	}
}
