// Command testimage makes the image tests' OCI images from a root
// filesystem tarball (tools/build-test-rootfs.sh makes one with
// debootstrap): an OCI image layout whose layers are estargz, built
// deterministically (image.BuildOptions: kiln image convert's fixed
// compression level, chunk size and parallelism),
// so the same tarball gives the same digests on every machine. It runs on
// the host once per cache: compressing a Debian root under the test
// harness's emulated L1 VM would take minutes.
//
// Images in the layout (org.opencontainers.image.ref.name):
//
//	debian         the root as the base layer, and a small top layer with
//	               what the image tests look for: a whiteout of a base file,
//	               an opaque directory, a deep directory, a data file
//	debian-big     debian plus a layer of -big-mib MiB of random files that
//	               nobody reads (laziness: opening it must cost no more);
//	               its config runs commands as nobody:nogroup in /tmp
//	debian-read    debian plus a layer of one -read-mib MiB random file,
//	               ReadFile (kiln bench image reads it sequentially)
//	busybox        a small runnable root of one layer: the host's static
//	               busybox with a link per applet, and PadMiB MiB of random
//	               files (about 10 MiB in all)
//	busybox-big    busybox plus debian-big's layer of -big-mib MiB (the
//	               same blob)
//	go-repo        debian plus a layer holding a real repository, RepoDir:
//	               the Go toolchain's own src/ (-go-src, the running
//	               toolchain's by default: 11,478 files) committed as one
//	               git commit and packed, as a clone would be; its
//	               WorkingDir is RepoDir (kiln bench image runs git status,
//	               find and grep -r there)
//
// With -flat DIR it also writes, for the images kiln bench image compares
// with an ext4 disk (busybox, debian-read, go-repo), DIR/NAME.tar: the image's
// layers applied in order (whiteouts done), without estargz's own
// entries, for tools/build-test-rootfs.sh to make ext4 images of.
//
// Usage: testimage -rootfs ROOT.tar -out DIR [-big-mib 1024] [-read-mib 256] [-busybox /bin/busybox] [-go-src DIR] [-flat DIR]
package main

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/kilnvm/kiln/image"
)

// Fixtures of the top layer, which the image tests check.
const (
	DeletedFile = "etc/issue.net"     // in the base, whited out on top
	OpaqueDir   = "usr/share/doc/git" // emptied on top, but for one file
	OpaqueKeep  = "usr/share/doc/git/KILN"
	DeepDir     = "srv/deep/a/b/c/d/e/f/g/h"
	DataFile    = "srv/data.bin" // DataSize random bytes
	DataSize    = 8 << 20
	WorkDir     = "/srv/work"
	ReadFile    = "srv/read.bin" // debian-read's file of -read-mib MiB
	PadDir      = "usr/share/kiln/pad"
	PadMiB      = 8        // busybox's random files, 1 MiB each
	RepoDir     = "src/go" // go-repo's repository
)

// flatImages are the images -flat writes trees of.
var flatImages = []string{"busybox", "debian-read", "go-repo"}

func main() {
	rootfs := flag.String("rootfs", "", "root filesystem `TAR`")
	out := flag.String("out", "", "OCI image layout `DIR` to write (must not exist)")
	bigMiB := flag.Int("big-mib", 1024, "MiB of random files in debian-big's extra layer")
	readMiB := flag.Int("read-mib", 256, "MiB of debian-read's file")
	busybox := flag.String("busybox", "/bin/busybox", "static busybox `BINARY` for the busybox images")
	flat := flag.String("flat", "", "also write the flattened trees of busybox and debian-read as `DIR`/NAME.tar")
	fidelity := flag.Bool("fidelity", false, "write only the fidelity image (-rootfs is the fidelity root) into -out")
	goSrc := flag.String("go-src", filepath.Join(runtime.GOROOT(), "src"), "source `DIR` committed as go-repo's repository")
	flag.Parse()
	if *rootfs == "" || *out == "" || *bigMiB < 1 || *readMiB < 1 {
		flag.Usage()
		os.Exit(2)
	}
	if *fidelity {
		if err := runFidelity(*rootfs, *out); err != nil {
			fmt.Fprintf(os.Stderr, "testimage: %v\n", err)
			os.Exit(1)
		}
		return
	}
	if err := run(*rootfs, *out, *bigMiB, *readMiB, *busybox, *goSrc, *flat); err != nil {
		fmt.Fprintf(os.Stderr, "testimage: %v\n", err)
		os.Exit(1)
	}
}

func run(rootfs, out string, bigMiB, readMiB int, busybox, goSrc, flat string) error {
	tmp, b, done, err := newLayoutBuild(out)
	if err != nil {
		return err
	}
	defer done()
	scratch := b.dir
	start := time.Now()
	base, err := b.layerFromFile(rootfs)
	if err != nil {
		return fmt.Errorf("base layer: %w", err)
	}
	topTar, err := topLayerTar()
	if err != nil {
		return err
	}
	top, err := b.layerFromBytes(topTar)
	if err != nil {
		return fmt.Errorf("top layer: %w", err)
	}
	bigTar, err := bigLayerTar(scratch, bigMiB)
	if err != nil {
		return err
	}
	bigLayer, err := b.layerFromFile(bigTar)
	os.Remove(bigTar)
	if err != nil {
		return fmt.Errorf("big layer: %w", err)
	}
	readTar, err := oneFileTar(scratch, ReadFile, readMiB)
	if err != nil {
		return err
	}
	readLayer, err := b.layerFromFile(readTar)
	os.Remove(readTar)
	if err != nil {
		return fmt.Errorf("read layer: %w", err)
	}
	bbTar, err := busyboxTar(busybox)
	if err != nil {
		return err
	}
	bbLayer, err := b.layerFromBytes(bbTar)
	if err != nil {
		return fmt.Errorf("busybox layer: %w", err)
	}
	repoTar, err := repoLayerTar(scratch, goSrc)
	if err != nil {
		return err
	}
	repoLayer, err := b.layerFromFile(repoTar)
	os.Remove(repoTar)
	if err != nil {
		return fmt.Errorf("repository layer: %w", err)
	}
	cfg := v1.Config{
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "KILN_TEST_IMAGE=debian"},
		WorkingDir: WorkDir,
		Cmd:        []string{"/bin/sh", "-c", "echo default command ran in $PWD"},
	}
	big := cfg
	big.User, big.WorkingDir = "nobody:nogroup", "/tmp"
	read := cfg
	read.Env = append(cfg.Env[:2:2], "KILN_TEST_IMAGE=debian-read")
	repo := cfg
	repo.Env = append(cfg.Env[:2:2], "KILN_TEST_IMAGE=go-repo")
	repo.WorkingDir = "/" + RepoDir
	bb := v1.Config{
		Env:        []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "KILN_TEST_IMAGE=busybox"},
		WorkingDir: "/",
		Cmd:        []string{"/bin/sh"},
	}
	p, err := layout.Write(tmp, empty.Index)
	if err != nil {
		return err
	}
	for _, im := range []struct {
		name   string
		cfg    v1.Config
		layers []v1.Layer
	}{
		{"debian", cfg, []v1.Layer{base, top}},
		{"debian-big", big, []v1.Layer{base, top, bigLayer}},
		{"debian-read", read, []v1.Layer{base, top, readLayer}},
		{"busybox", bb, []v1.Layer{bbLayer}},
		{"busybox-big", bb, []v1.Layer{bbLayer, bigLayer}},
		{"go-repo", repo, []v1.Layer{base, top, repoLayer}},
	} {
		img, err := newImage(im.cfg, im.layers)
		if err != nil {
			return fmt.Errorf("%s: %w", im.name, err)
		}
		if flat != "" && slices.Contains(flatImages, im.name) {
			if err := writeFlat(img, filepath.Join(flat, im.name+".tar")); err != nil {
				return fmt.Errorf("%s: flattened tree: %w", im.name, err)
			}
		}
		if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": im.name})); err != nil {
			return fmt.Errorf("%s: %w", im.name, err)
		}
		d, _ := img.Digest()
		fmt.Fprintf(os.Stderr, "testimage: %s %s\n", im.name, d)
	}
	if err := os.Rename(tmp, out); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "testimage: %s in %v\n", out, time.Since(start).Round(time.Second))
	return nil
}

// newImage is an amd64 Linux image of layers with config cfg and a fixed
// creation time.
func newImage(cfg v1.Config, layers []v1.Layer) (v1.Image, error) {
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	var adds []mutate.Addendum
	for _, l := range layers {
		tocDigest, err := l.(*estargzLayer).toc()
		if err != nil {
			return nil, err
		}
		adds = append(adds, mutate.Addendum{Layer: l, MediaType: types.OCILayer,
			Annotations: map[string]string{estargz.TOCJSONDigestAnnotation: tocDigest}})
	}
	img, err := mutate.Append(img, adds...)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config = cfg
	cf.Created = v1.Time{Time: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	return mutate.ConfigFile(img, cf)
}

// estargzLayer is a layer built once into a temporary file, with its TOC
// digest.
type estargzLayer struct {
	v1.Layer
	tocDigest string
}

func (l *estargzLayer) toc() (string, error) { return l.tocDigest, nil }

// builder builds layers into files under dir.
type builder struct{ dir string }

// layerFromFile builds an estargz layer from the tar at path.
func (b *builder) layerFromFile(path string) (v1.Layer, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	return b.build(io.NewSectionReader(f, 0, fi.Size()))
}

func (b *builder) layerFromBytes(data []byte) (v1.Layer, error) {
	return b.build(io.NewSectionReader(bytes.NewReader(data), 0, int64(len(data))))
}

func (b *builder) build(sr *io.SectionReader) (v1.Layer, error) {
	blob, err := estargz.Build(sr, image.BuildOptions(context.Background())...)
	if err != nil {
		return nil, err
	}
	defer blob.Close()
	f, err := os.CreateTemp(b.dir, "layer-*")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if _, err := io.Copy(f, blob); err != nil {
		os.Remove(f.Name())
		return nil, err
	}
	name := f.Name()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return os.Open(name) }, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	return &estargzLayer{Layer: l, tocDigest: blob.TOCDigest().String()}, nil
}

// topLayerTar is the top layer's tar.
func topLayerTar() ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mt := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: 0o755, ModTime: mt})
	}
	file := func(name string, data []byte, mode int64) error {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: mode, Size: int64(len(data)), ModTime: mt}); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	data := make([]byte, DataSize)
	rng := rand.NewChaCha8([32]byte{'k', 'i', 'l', 'n', 'd', 'a', 't', 'a'})
	rng.Read(data)
	var err error
	for _, step := range []func() error{
		func() error { return dir("etc") },
		func() error { return file("etc/"+".wh."+filepath.Base(DeletedFile), nil, 0o644) },
		func() error { return dir("usr/share/doc/git") },
		func() error { return file(OpaqueDir+"/.wh..wh..opq", nil, 0o644) },
		func() error { return file(OpaqueKeep, []byte("the only file left in an opaque directory\n"), 0o644) },
		func() error { return dir("srv") },
		func() error { return dir("srv/work") },
		func() error {
			p := ""
			for _, el := range []string{"srv", "deep", "a", "b", "c", "d", "e", "f", "g", "h"} {
				if p == "" {
					p = el
					continue
				}
				p += "/" + el
				if err := dir(p); err != nil {
					return err
				}
			}
			return file(DeepDir+"/marker", []byte("deep\n"), 0o644)
		},
		func() error { return file(DataFile, data, 0o644) },
	} {
		if err = step(); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// bigLayerTar writes a tar of mib MiB of random files (4 MiB each, under
// opt/big/) to a temporary file and returns its path.
func bigLayerTar(dir string, mib int) (string, error) {
	f, err := os.CreateTemp(dir, "big-*.tar")
	if err != nil {
		return "", err
	}
	defer f.Close()
	tw := tar.NewWriter(f)
	mt := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	rng := rand.NewChaCha8([32]byte{'k', 'i', 'l', 'n', 'b', 'i', 'g'})
	buf := make([]byte, 4<<20)
	fail := func(err error) (string, error) {
		os.Remove(f.Name())
		return "", err
	}
	for _, d := range []string{"opt/", "opt/big/"} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: mt}); err != nil {
			return fail(err)
		}
	}
	for i := 0; i < mib/4 || i == 0; i++ {
		n := len(buf)
		if mib < 4 {
			n = mib << 20
		}
		rng.Read(buf[:n])
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("opt/big/%04d.bin", i), Mode: 0o644, Size: int64(n), ModTime: mt}); err != nil {
			return fail(err)
		}
		if _, err := tw.Write(buf[:n]); err != nil {
			return fail(err)
		}
	}
	if err := tw.Close(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil && !errors.Is(err, os.ErrClosed) {
		return fail(err)
	}
	return f.Name(), nil
}

// oneFileTar writes a tar of one file name of mib MiB of random bytes to a
// temporary file under dir and returns its path.
func oneFileTar(dir, name string, mib int) (string, error) {
	f, err := os.CreateTemp(dir, "one-*.tar")
	if err != nil {
		return "", err
	}
	defer f.Close()
	fail := func(err error) (string, error) {
		os.Remove(f.Name())
		return "", fmt.Errorf("%s: %w", name, err)
	}
	tw := tar.NewWriter(f)
	mt := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: filepath.Dir(name) + "/", Mode: 0o755, ModTime: mt}); err != nil {
		return fail(err)
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(mib) << 20, ModTime: mt}); err != nil {
		return fail(err)
	}
	rng := rand.NewChaCha8([32]byte{'k', 'i', 'l', 'n', 'r', 'e', 'a', 'd'})
	buf := make([]byte, 1<<20)
	for range mib {
		rng.Read(buf)
		if _, err := tw.Write(buf); err != nil {
			return fail(err)
		}
	}
	if err := tw.Close(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		return fail(err)
	}
	return f.Name(), nil
}

// busyboxTar is the busybox image's only layer: the directories a root
// needs (the agent mounts /dev, /proc, /sys, /run and /tmp), bin/busybox
// and a symbolic link to it per applet it lists, passwd and group, and
// PadMiB files of random bytes.
func busyboxTar(busybox string) ([]byte, error) {
	bin, err := os.ReadFile(busybox)
	if err != nil {
		return nil, fmt.Errorf("busybox image: %w", err)
	}
	list, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		return nil, fmt.Errorf("busybox image: %s --list: %w", busybox, err)
	}
	applets := strings.Fields(string(list))
	slices.Sort(applets)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mt := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	hdr := func(h *tar.Header, data []byte) error {
		h.ModTime = mt
		h.Size = int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err := tw.Write(data)
		return err
	}
	for _, d := range []string{"bin", "dev", "etc", "proc", "root", "run", "sbin", "srv", "sys", "usr", "usr/bin", "usr/sbin", "usr/share", "usr/share/kiln", PadDir, "var"} {
		if err := hdr(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755}, nil); err != nil {
			return nil, err
		}
	}
	if err := hdr(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777}, nil); err != nil {
		return nil, err
	}
	if err := hdr(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755}, bin); err != nil {
		return nil, err
	}
	for _, a := range applets {
		if a == "busybox" || strings.ContainsAny(a, "/") {
			continue
		}
		if err := hdr(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + a, Linkname: "busybox", Mode: 0o777}, nil); err != nil {
			return nil, err
		}
	}
	for _, f := range []struct{ name, data string }{
		{"etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"},
		{"etc/group", "root:x:0:\nnogroup:x:65534:\n"},
		{"etc/os-release", "NAME=busybox\nID=busybox\n"},
	} {
		if err := hdr(&tar.Header{Typeflag: tar.TypeReg, Name: f.name, Mode: 0o644}, []byte(f.data)); err != nil {
			return nil, err
		}
	}
	rng := rand.NewChaCha8([32]byte{'k', 'i', 'l', 'n', 'p', 'a', 'd'})
	pad := make([]byte, 1<<20)
	for i := range PadMiB {
		rng.Read(pad)
		if err := hdr(&tar.Header{Typeflag: tar.TypeReg, Name: fmt.Sprintf("%s/%02d.bin", PadDir, i), Mode: 0o644}, pad); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// estargzEntries are the names estargz adds to a layer's tar.
var estargzEntries = map[string]bool{
	estargz.TOCTarName:         true,
	estargz.PrefetchLandmark:   true,
	estargz.NoPrefetchLandmark: true,
}

// writeFlat writes img's filesystem (mutate.Extract: layers in order,
// whiteouts applied) to path as a tar, without estargz's own entries.
func writeFlat(img v1.Image, path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path + ".tmp")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	tw := tar.NewWriter(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if estargzEntries[strings.TrimPrefix(h.Name, "./")] {
			continue
		}
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if _, err := io.Copy(tw, tr); err != nil {
			return err
		}
	}
	if err := tw.Close(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// FidelityImage is the one image of the fidelity layout (-fidelity): a
// Debian root with systemd as /sbin/init, docker.io, iptables, python3
// with pytest, and git, in one layer, for the tests of what a guest
// can run (Docker, systemd, a software-engineering task); and a second
// layer that disables Docker's units (fidelityDisabled).
const FidelityImage = "fidelity"

// fidelityDisabled are the symbolic links Debian's docker.io makes to
// enable its units at boot, which the fidelity image's top layer removes
// (whiteouts), as a Dockerfile's RUN systemctl disable docker.service
// docker.socket containerd.service would: the units stay installed, and
// systemd's boot to multi-user.target no longer waits for a dockerd that
// takes minutes to start on an emulated CPU (the Docker test starts
// containerd and dockerd itself; so can a user, with systemctl start).
var fidelityDisabled = []string{
	"etc/systemd/system/multi-user.target.wants/containerd.service",
	"etc/systemd/system/multi-user.target.wants/docker.service",
	"etc/systemd/system/sockets.target.wants/docker.socket",
}

// fidelityTopTar is the fidelity image's top layer: a whiteout of each
// of fidelityDisabled, under its folders.
func fidelityTopTar() ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mt := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	dirs := map[string]bool{}
	for _, p := range fidelityDisabled {
		d := filepath.Dir(p)
		var parts []string
		for _, el := range strings.Split(d, "/") {
			parts = append(parts, el)
			dir := strings.Join(parts, "/")
			if dirs[dir] {
				continue
			}
			dirs[dir] = true
			if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: dir + "/", Mode: 0o755, ModTime: mt}); err != nil {
				return nil, err
			}
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: d + "/.wh." + filepath.Base(p), Mode: 0o644, ModTime: mt}); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// newLayoutBuild checks that the layout out does not exist yet and returns
// the folder it is written in first (out + ".tmp", emptied), a builder on
// a scratch folder, and what removes that folder.
func newLayoutBuild(out string) (tmp string, b *builder, done func(), err error) {
	if _, err := os.Stat(out); err == nil {
		return "", nil, nil, fmt.Errorf("%s exists", out)
	}
	tmp = out + ".tmp"
	os.RemoveAll(tmp)
	scratch, err := os.MkdirTemp("", "testimage-")
	if err != nil {
		return "", nil, nil, err
	}
	return tmp, &builder{dir: scratch}, func() { os.RemoveAll(scratch) }, nil
}

// runFidelity writes the layout of FidelityImage from rootfs into out.
func runFidelity(rootfs, out string) error {
	tmp, b, done, err := newLayoutBuild(out)
	if err != nil {
		return err
	}
	defer done()
	start := time.Now()
	base, err := b.layerFromFile(rootfs)
	if err != nil {
		return fmt.Errorf("fidelity layer: %w", err)
	}
	topTar, err := fidelityTopTar()
	if err != nil {
		return fmt.Errorf("fidelity top layer: %w", err)
	}
	top, err := b.layerFromBytes(topTar)
	if err != nil {
		return fmt.Errorf("fidelity top layer: %w", err)
	}
	cfg := v1.Config{
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "KILN_TEST_IMAGE=" + FidelityImage},
		WorkingDir: "/root",
		Cmd:        []string{"/bin/bash"},
	}
	img, err := newImage(cfg, []v1.Layer{base, top})
	if err != nil {
		return fmt.Errorf("%s: %w", FidelityImage, err)
	}
	p, err := layout.Write(tmp, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": FidelityImage})); err != nil {
		return fmt.Errorf("%s: %w", FidelityImage, err)
	}
	d, _ := img.Digest()
	fmt.Fprintf(os.Stderr, "testimage: %s %s\n", FidelityImage, d)
	if err := os.Rename(tmp, out); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "testimage: %s in %v\n", out, time.Since(start).Round(time.Second))
	return nil
}

// repoLayerTar writes go-repo's repository layer to a tar file under dir:
// src copied to RepoDir, committed as one commit by a fixed author at a
// fixed time and packed (git gc), so that it looks like a fresh clone.
// Entries are owned by root with a fixed mtime.
func repoLayerTar(dir, src string) (string, error) {
	work, err := os.MkdirTemp(dir, "repo-*")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(work)
	repo := filepath.Join(work, RepoDir)
	if err := os.MkdirAll(filepath.Dir(repo), 0o755); err != nil {
		return "", err
	}
	if out, err := exec.Command("cp", "-a", src, repo).CombinedOutput(); err != nil {
		return "", fmt.Errorf("copy %s: %v: %s", src, err, out)
	}
	const when = "2026-01-01T00:00:00Z"
	env := append(os.Environ(), "GIT_AUTHOR_NAME=kiln", "GIT_AUTHOR_EMAIL=kiln@example.com", "GIT_AUTHOR_DATE="+when,
		"GIT_COMMITTER_NAME=kiln", "GIT_COMMITTER_EMAIL=kiln@example.com", "GIT_COMMITTER_DATE="+when, "GIT_CONFIG_NOSYSTEM=1", "HOME="+work)
	for _, args := range [][]string{
		{"init", "-q", "-b", "main"},
		{"add", "-A"},
		{"commit", "-q", "-m", "go src"},
		{"gc", "-q"},
	} {
		// No automatic gc in the background: the gc below packs.
		cmd := exec.Command("git", append([]string{"-c", "gc.auto=0", "-c", "gc.autoDetach=false"}, args...)...)
		cmd.Dir, cmd.Env = repo, env
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("git %s in %s: %v: %s", args[0], repo, err, out)
		}
	}
	f, err := os.CreateTemp(dir, "repo-*.tar")
	if err != nil {
		return "", err
	}
	defer f.Close()
	fail := func(err error) (string, error) {
		os.Remove(f.Name())
		return "", fmt.Errorf("repository layer: %w", err)
	}
	tw := tar.NewWriter(f)
	mt := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	err = filepath.WalkDir(work, func(path string, d os.DirEntry, err error) error {
		if err != nil || path == work {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&os.ModeSymlink != 0 {
			if link, err = os.Readlink(path); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(work, path)
		h.Name = filepath.ToSlash(rel)
		if d.IsDir() {
			h.Name += "/"
		}
		h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
		h.ModTime, h.AccessTime, h.ChangeTime = mt, time.Time{}, time.Time{}
		h.Format = tar.FormatPAX
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return nil
		}
		r, err := os.Open(path)
		if err != nil {
			return err
		}
		defer r.Close()
		_, err = io.Copy(tw, r)
		return err
	})
	if err != nil {
		return fail(err)
	}
	if err := tw.Close(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		return fail(err)
	}
	return f.Name(), nil
}
