package sandbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/opencontainers/go-digest"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// The test images' fixtures (tools/testimage).
const (
	imgDeleted    = "/etc/issue.net"
	imgOpaque     = "/usr/share/doc/git"
	imgDeep       = "/srv/deep/a/b/c/d/e/f/g/h"
	imgData       = "/srv/data.bin"
	imgDataSize   = 8 << 20
	imgWorkDir    = "/srv/work"
	imgFetchLimit = 20 * time.Second
)

// modulesCheck prints the type and first mount option of the modules
// disk's mount at /lib/modules/$(uname -r) ("ext4 ro"), and "writable"
// when a file can be made there.
// (An image with a merged /usr shows the mount at /usr/lib/modules.)
const modulesCheck = `r=$(uname -r)
grep -E " (/usr)?/lib/modules/$r " /proc/mounts | cut -d' ' -f3,4 | cut -d, -f1
touch /lib/modules/$r/x 2>/dev/null && echo writable`

// imageEnv is a registry serving the test images and an images folder
// with them pulled.
type imageEnv struct {
	reg    *imagetest.Registry
	refs   map[string]string // image name in the layout -> ref in the registry
	dir    string            // images folder
	roots  *image.Roots
	images *image.Images
}

// fidelityEnv serves the fidelity images from a registry of the test's
// own, pulls kvmtest.FidelityImage into a fresh images folder and
// returns the environment.
func fidelityEnv(t testing.TB, ctx context.Context) *imageEnv {
	t.Helper()
	reg, refs := imagetest.ServeLayout(t, kvmtest.FidelityImages(t), "kiln/test")
	e := newImageEnv(t, reg, refs)
	e.pull(t, ctx, kvmtest.FidelityImage)
	return e
}

func newImageEnv(t testing.TB, reg *imagetest.Registry, refs map[string]string) *imageEnv {
	t.Helper()
	e := &imageEnv{reg: reg, refs: refs, dir: t.TempDir()}
	e.roots = image.NewRoots(image.Options{FetchTimeout: imgFetchLimit})
	im, err := e.roots.Images(e.dir)
	if err != nil {
		t.Fatal(err)
	}
	e.images = im
	return e
}

func (e *imageEnv) pull(t testing.TB, ctx context.Context, name string) *image.Image {
	t.Helper()
	img, err := e.images.Pull(ctx, e.refs[name], image.PullOptions{})
	if err != nil {
		t.Fatalf("pull %s: %v", name, err)
	}
	return img
}

func (e *imageEnv) start(t *testing.T, ctx context.Context, ref string, proc *ProcessOptions) *Sandbox {
	t.Helper()
	return e.startWith(t, ctx, Options{Image: ref, Process: proc})
}

// startWith starts a sandbox from o, with the env's images and defaults.
func (e *imageEnv) startWith(t testing.TB, ctx context.Context, o Options) *Sandbox {
	t.Helper()
	o.Runtime, o.Images, o.ImageRoots, o.Hostname, o.Console = testRuntime(t), e.dir, e.roots, "img", io.Discard
	if o.MemoryMiB == 0 {
		o.MemoryMiB = 512
	}
	ref := o.Image
	sb, err := Start(ctx, o)
	if err != nil {
		t.Fatalf("Start from image %s: %v", ref, err)
	}
	t.Cleanup(func() { sb.Close(context.Background()) })
	return sb
}

// sh runs script in sb and returns its stdout, failing on a non-zero exit.
func sh(t testing.TB, ctx context.Context, sb *Sandbox, script string) string {
	t.Helper()
	out, errOut, st, err := shTry(ctx, sb, script)
	if err != nil || !st.Success() {
		t.Fatalf("%q: %v %v; stdout %q stderr %q", script, st, err, out, errOut)
	}
	return out
}

func shTry(ctx context.Context, sb *Sandbox, script string) (string, string, client.ExitStatus, error) {
	var out, errOut bytes.Buffer
	st, err := sb.Client().Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errOut, Timeout: 5 * time.Minute})
	return strings.TrimSpace(out.String()), strings.TrimSpace(errOut.String()), st, err
}

// imageSize is the compressed size of img's layers.
func imageSize(img *image.Image) int64 {
	var n int64
	for _, l := range img.Layers {
		n += l.Size
	}
	return n
}

// dataChunk finds the first data chunk of path in img's layers: its
// layer and TOC entry.
func dataChunk(t *testing.T, ctx context.Context, im *image.Images, img *image.Image, path string) (image.Layer, *estargz.TOCEntry) {
	t.Helper()
	layers, err := im.Layers(ctx, img)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.TrimPrefix(path, "/")
	for i := len(layers) - 1; i >= 0; i-- {
		for _, e := range layers[i].TOC.Entries {
			if e.Name == name && e.Type == "reg" {
				return layers[i].Layer, e
			}
		}
	}
	t.Fatalf("%s is in no layer of %s", path, img.Name)
	return image.Layer{}, nil
}

// hostRead reads path from the image's tree on the host.
func hostRead(t *testing.T, ctx context.Context, e *imageEnv, img *image.Image, path string, off, n int64) []byte {
	t.Helper()
	r, release, err := e.roots.Open(ctx, e.dir, img.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	ino, err := r.Tree.Resolve(path)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, n)
	if _, err := r.Tree.ReadAt(ctx, ino, buf, off); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	return buf
}

func sha(b []byte) string {
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// TestKVMImage runs sandboxes whose root is an OCI image served lazily as
// EROFS over virtio-blk (the default root) from an in-process registry,
// its guest devices listed; a Debian minbase image made with
// debootstrap (python3, git) runs both; opening it and running true costs
// at most 2% of its bytes; the image config applies; overlay semantics
// hold; a corrupt chunk is EIO for that file and nothing is stored; a
// snapshot with an open file and a deep working directory forks into 4
// children that each read the file on, run a binary not run before and see
// their cwd; a second sandbox of the image fetches nothing, and an
// in-memory checkpoint of it (Hold) restores with its root; restoring
// against another image is refused; once cached, restores need no registry;
// and an image with 1 GiB nobody reads opens as cheaply, as another user,
// with a stalled registry failing a read with a timeout, not a hung VM.
func TestKVMImage(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 25*time.Minute)
	defer cancel()
	reg, refs := imagetest.ServeLayout(t, kvmtest.TestImages(t), "kiln/test")
	e := newImageEnv(t, reg, refs)

	reg.Reset()
	img := e.pull(t, ctx, "debian")
	size := imageSize(img)
	pulled := reg.Stats().Bytes
	t.Logf("pulled %s (%d layers, %.1f MiB): %d bytes from the registry", img.Name, len(img.Layers), float64(size)/(1<<20), pulled)

	// Boot and run true: the laziness figure.
	reg.Reset()
	bootStart := time.Now()
	sb := e.start(t, ctx, e.refs["debian"], nil)
	sh(t, ctx, sb, "true")
	fetched := reg.Stats().Bytes
	t.Logf("boot + true: %v, %d bytes fetched (%.2f%% of %d)", time.Since(bootStart).Round(time.Millisecond), fetched, 100*float64(fetched)/float64(size), size)
	if fetched*50 > size {
		t.Errorf("boot + true fetched %d bytes, more than 2%% of the image's %d", fetched, size)
	}
	if got := sb.Image(); got != string(img.Manifest) {
		t.Errorf("Image() = %q, want %s", got, img.Manifest)
	}

	// The must-show, and the image config.
	if got := sh(t, ctx, sb, `python3 -c 'import json, sqlite3; print(1)'`); got != "1" {
		t.Errorf("python3 printed %q", got)
	}
	if got := sh(t, ctx, sb, "git --version"); !strings.HasPrefix(got, "git version ") {
		t.Errorf("git --version printed %q", got)
	}
	if got := sh(t, ctx, sb, `echo "$KILN_TEST_IMAGE $PWD $LANG $(id -u) $HOME"`); got != "debian "+imgWorkDir+" C.UTF-8 0 /root" {
		t.Errorf("image config: %q", got)
	}
	// Overlay: whiteouts and opaque directories of the upper layer; the
	// tree as read-only as its layers; writes and deletes in guest RAM.
	if got := sh(t, ctx, sb, "test ! -e "+imgDeleted+" && ls -A "+imgOpaque+" && cat "+imgDeep+"/marker"); got != "KILN\ndeep" {
		t.Errorf("whiteout, opaque dir, deep dir: %q", got)
	}
	if got := sh(t, ctx, sb, "mount | grep -E ' on / type overlay| /kiln/lower ' | wc -l; stat -c %i / >/dev/null"); got == "0" {
		t.Errorf("no overlay root in the guest's mounts")
	}
	// The lower layer is the image's EROFS disk, found by its serial.
	if got := sh(t, ctx, sb, `awk '$2 == "/run/kiln/image" {print $3, substr($4, 1, 2)}' /proc/mounts; grep -lx kilnroot /sys/block/vd*/serial >/dev/null && echo serial ok`); got != "erofs ro\nserial ok" {
		t.Errorf("image root's lower layer: %q, want an erofs mount of the disk with serial kilnroot", got)
	}
	t.Logf("devices of an image-rooted sandbox: %s", sh(t, ctx, sb, `for d in /sys/bus/virtio/devices/*; do echo -n "$(basename $d):$(cat $d/device) "; done; for b in /sys/block/vd*; do echo -n "$(basename $b):$(cat $b/serial):$(($(cat $b/size)/2048))MiB "; done`))
	sh(t, ctx, sb, "echo written > "+imgWorkDir+"/new && rm /etc/debian_version && test ! -e /etc/debian_version && cat "+imgWorkDir+"/new")

	// The kernel's modules disk in the image root: mounted read-only at
	// /lib/modules/$(uname -r) over the image's tree. The image has no
	// modprobe: the kernel's module autoloading goes through Kiln's
	// helper, /run/kiln/modprobe (TestKVMModuleAutoload's checks, in an
	// image root: overlay is loaded already, for the root), and run by
	// hand it loads from the disk too.
	t.Run("modules disk", func(t *testing.T) {
		const autoloaded = "veth bridge nf_tables nft_chain_nat"
		if got := sh(t, ctx, sb, modulesCheck+"\ncat /proc/sys/kernel/modprobe; test -e /sbin/modprobe && echo has modprobe\n"+loadedOf(autoloaded)); got != "ext4 ro\n/run/kiln/modprobe" {
			t.Fatalf("modules disk and modprobe helper in the image root: %q", got)
		}
		prog, err := os.Open(kvmtest.AutoloadBinary(t))
		if err != nil {
			t.Fatal(err)
		}
		defer prog.Close()
		if err := sb.Client().WriteFile(ctx, "/tmp/autoload", prog, 0o755); err != nil {
			t.Fatalf("copying the autoload program in: %v", err)
		}
		if out, errOut, st, err := shTry(ctx, sb, "/tmp/autoload /tmp/autoload-overlay"); err != nil || !st.Success() ||
			out != "ok veth\nok bridge\nok nftables\nok overlay" {
			t.Errorf("autoload in the image root: %v %v; stdout %q stderr %q", st, err, out, errOut)
		}
		if got, want := sh(t, ctx, sb, loadedOf(autoloaded)), strings.ReplaceAll(autoloaded, " ", "\n"); got != want {
			t.Errorf("autoloaded in the image root: %q, want %q", got, want)
		}
		if got := sh(t, ctx, sb, `/run/kiln/modprobe br_netfilter && grep -c '^br_netfilter ' /proc/modules`); got != "1" {
			t.Errorf("/run/kiln/modprobe br_netfilter: %q", got)
		}
	})

	// A chunk with one flipped byte: EIO for that file, nothing stored;
	// the same read succeeds once the registry serves the right bytes.
	layer, ce := dataChunk(t, ctx, e.images, img, imgData)
	undo := reg.FlipByte(layer.Digest, ce.Offset+64)
	out, errOut, st, err := shTry(ctx, sb, "cat "+imgData+" >/dev/null")
	undo()
	if err != nil || st.Success() || !strings.Contains(errOut, "Input/output error") {
		t.Errorf("reading a corrupt chunk: %v %v, stdout %q stderr %q; want EIO", st, err, out, errOut)
	}
	if e.images.Store().Has(digest.Digest(ce.ChunkDigest)) {
		t.Errorf("the corrupt chunk %s was stored", ce.ChunkDigest)
	}
	want := sha(hostRead(t, ctx, e, img, imgData, 0, imgDataSize))
	if got := sh(t, ctx, sb, "sha256sum "+imgData+" | cut -d' ' -f1"); got != want {
		t.Errorf("data file after the fault: sha256 %s, want %s", got, want)
	}

	// A process with an open file and a deep cwd, then snapshot and fork.
	sh(t, ctx, sb, `cat >/tmp/hold.py <<'EOF'
import hashlib, os, time
os.chdir('`+imgDeep+`')
f = open('`+imgData+`', 'rb')
f.read(1 << 20)
open('/tmp/ready', 'w').close()
while not os.path.exists('/tmp/go'):
    time.sleep(0.02)
d = f.read(1 << 20)
with open('/tmp/out', 'w') as o:
    o.write(hashlib.sha256(d).hexdigest() + ' ' + os.getcwd() + '\n')
EOF
setsid python3 /tmp/hold.py </dev/null >/tmp/hold.log 2>&1 &
for i in $(seq 600); do test -e /tmp/ready && exit 0; sleep 0.1; done; cat /tmp/hold.log; exit 1`)
	snap := filepath.Join(t.TempDir(), "snap")
	if err := sb.Save(ctx, snap); err != nil {
		t.Fatalf("Save: %v", err)
	}
	children, err := sb.Fork(ctx, 4, ForkOptions{})
	if err != nil {
		t.Fatalf("Fork: %v", err)
	}
	wantOut := sha(hostRead(t, ctx, e, img, imgData, 1<<20, 1<<20)) + " " + imgDeep
	for i, c := range children {
		got := sh(t, ctx, c, "touch /tmp/go; for i in $(seq 600); do test -s /tmp/out && break; sleep 0.1; done; cat /tmp/out")
		if got != wantOut {
			t.Errorf("child %d: the held file and cwd gave %q, want %q", i, got, wantOut)
		}
		// A binary the parent never ran, and the parent's writes.
		if got := sh(t, ctx, c, "base32 --version | head -1; cat "+imgWorkDir+"/new"); !strings.Contains(got, "base32") || !strings.HasSuffix(got, "written") {
			t.Errorf("child %d: %q", i, got)
		}
		if got := sh(t, ctx, c, modulesCheck+"; grep -c '^br_netfilter ' /proc/modules"); got != "ext4 ro\n1" {
			t.Errorf("child %d: modules disk: %q", i, got)
		}
		c.Close(ctx)
	}
	sb.Close(ctx)

	// A second sandbox of the image (in a VMM process of its own): the
	// same commands fetch nothing, and the first one's writes are gone.
	reg.Reset()
	sb2 := e.startWith(t, ctx, Options{Image: e.refs["debian"], Process: testProcess(), WritableMiB: 64})
	sh(t, ctx, sb2, `true; python3 -c 'import json, sqlite3; print(1)'; git --version`)
	if got := sh(t, ctx, sb2, "test -e /etc/debian_version && test ! -e "+imgWorkDir+"/new && echo clean"); got != "clean" {
		t.Errorf("second sandbox: %q", got)
	}
	if st := reg.Stats(); st.Bytes != 0 {
		t.Errorf("second sandbox of the image fetched %d bytes in %d requests, want 0", st.Bytes, st.Requests)
	}
	// Its writable layer is capped at 64 MiB: df of / is the overlay's
	// upper tmpfs, and a write past the cap fails with ENOSPC (after the
	// count: df and dd were not run before).
	if got := sh(t, ctx, sb2, "df -k / | tail -1 | awk '{print $2}'; dd if=/dev/zero of=/srv/work/fill bs=1M count=80 2>&1 | grep -c 'No space left'; rm -f /srv/work/fill"); got != "65536\n1" {
		t.Errorf("writable layer capped at 64 MiB: df and an 80 MiB write gave %q", got)
	}
	// An in-memory checkpoint of it (held by its VMM process): a sandbox
	// restored from it has the image root, and the root's writes of then.
	sh(t, ctx, sb2, "echo held >"+imgWorkDir+"/held")
	holdStart := time.Now()
	if err := sb2.Hold(ctx, "img"); err != nil {
		t.Fatalf("Hold: %v", err)
	}
	t.Logf("Hold of a booted image-rooted sandbox (no copy): %v", time.Since(holdStart).Round(time.Millisecond))
	sh(t, ctx, sb2, "rm "+imgWorkDir+"/held")
	fz, err := sb2.Frozen(ctx, "img")
	if err != nil {
		t.Fatalf("Frozen: %v", err)
	}
	if fz.Image() != string(img.Manifest) {
		t.Errorf("Frozen.Image() = %q, want %s", fz.Image(), img.Manifest)
	}
	holdStart = time.Now()
	rf, err := RestoreFrozen(ctx, fz, RestoreOptions{Process: testProcess()})
	fz.Close()
	if err != nil {
		t.Fatalf("RestoreFrozen: %v", err)
	}
	t.Logf("RestoreFrozen of it: %v", time.Since(holdStart).Round(time.Millisecond))
	if got := sh(t, ctx, rf, "cat "+imgWorkDir+"/held; cat "+imgDeep+"/marker; git --version | cut -c1-11"); got != "held\ndeep\ngit version" {
		t.Errorf("restored from the image-rooted hold: %q", got)
	}
	if rf.Image() != string(img.Manifest) {
		t.Errorf("restored from the hold: Image() = %q, want %s", rf.Image(), img.Manifest)
	}
	rf.Close(ctx)
	sb2.Close(ctx)

	// The image with 1 GiB nobody reads, in a store of its own (cold):
	// opening it and running true costs no more; its config runs as
	// nobody in /tmp.
	eb := newImageEnv(t, reg, refs)
	reg.Reset()
	big := eb.pull(t, ctx, "debian-big")
	bigSize := imageSize(big)
	sbBig := eb.start(t, ctx, eb.refs["debian-big"], nil)
	sh(t, ctx, sbBig, "true")
	fetchedBig := reg.Stats().Bytes
	t.Logf("debian-big (%.1f MiB): pull + boot + true fetched %d bytes (%.3f%%)", float64(bigSize)/(1<<20), fetchedBig, 100*float64(fetchedBig)/float64(bigSize))
	if fetchedBig*50 > bigSize {
		t.Errorf("debian-big: pull + boot + true fetched %d bytes, more than 2%% of %d", fetchedBig, bigSize)
	}
	if got := sh(t, ctx, sbBig, "echo $(id -un):$(id -gn) $PWD"); got != "nobody:nogroup /tmp" {
		t.Errorf("debian-big's user and working directory: %q", got)
	}
	// A registry that stops answering mid-read: that read fails in time,
	// the VM goes on.
	bigLayer, _ := dataChunk(t, ctx, eb.images, big, "/opt/big/0001.bin")
	release := reg.Stall(bigLayer.Digest, 1)
	stallStart := time.Now()
	_, errOut, st, err = shTry(ctx, sbBig, "cat /opt/big/0001.bin >/dev/null")
	took := time.Since(stallStart)
	release()
	if err != nil || st.Success() || !strings.Contains(errOut, "Input/output error") {
		t.Errorf("read from a stalled registry: %v %v, stderr %q; want EIO", st, err, errOut)
	}
	if took > 3*imgFetchLimit+time.Minute {
		t.Errorf("read from a stalled registry took %v (fetch limit %v)", took, imgFetchLimit)
	}
	t.Logf("stalled read failed after %v", took.Round(time.Millisecond))
	if got := sh(t, ctx, sbBig, "echo alive"); got != "alive" {
		t.Errorf("after the stall: %q", got)
	}
	sbBig.Close(ctx)

	// Restoring against another image is refused; against its own, with
	// the registry gone, it works from the cached chunks.
	e.pull(t, ctx, "debian-big")
	if _, err := Restore(ctx, snap, RestoreOptions{Images: e.dir, Image: refs["debian-big"], ImageRoots: e.roots}); err == nil || !strings.Contains(err.Error(), "restores only against its own image") {
		t.Errorf("restore against another image: %v", err)
	}
	reg.Close()
	r, err := Restore(ctx, snap, RestoreOptions{ImageRoots: e.roots})
	if err != nil {
		t.Fatalf("Restore with the registry gone: %v", err)
	}
	defer r.Close(ctx)
	if got := sh(t, ctx, r, `python3 -c 'import json, sqlite3; print(1)'; cat `+imgDeep+`/marker; cat `+imgWorkDir+`/new`); got != "1\ndeep\nwritten" {
		t.Errorf("restored with the registry gone: %q", got)
	}
	if got := sh(t, ctx, r, modulesCheck+"; grep -c '^br_netfilter ' /proc/modules"); got != "ext4 ro\n1" {
		t.Errorf("restored: modules disk: %q", got)
	}
}
