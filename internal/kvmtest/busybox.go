package kvmtest

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/kilnvm/kiln/initramfs"
)

// BusyboxArchive is a one-layer busybox image tagged tag, in docker save's
// form (docker load and ctr images import read it): the host's static
// busybox with a symbolic link per applet it lists, as tools/testimage's
// busybox image.
func BusyboxArchive(t testing.TB, tag string) []byte {
	t.Helper()
	bin, err := os.ReadFile(initramfs.HostBusybox)
	if err != nil {
		t.Fatalf("busybox for the container image: %v", err)
	}
	list, err := exec.Command(initramfs.HostBusybox, "--list").Output()
	if err != nil {
		t.Fatalf("%s --list: %v", initramfs.HostBusybox, err)
	}
	applets := strings.Fields(string(list))
	slices.Sort(applets)
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	mt := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	add := func(h *tar.Header, data []byte) {
		h.ModTime, h.Size = mt, int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{"bin", "dev", "etc", "proc", "root", "sys", "var", "www"} {
		add(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755}, nil)
	}
	add(&tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777}, nil)
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "bin/busybox", Mode: 0o755}, bin)
	for _, a := range applets {
		if a != "busybox" && !strings.ContainsAny(a, "/") {
			add(&tar.Header{Typeflag: tar.TypeSymlink, Name: "bin/" + a, Linkname: "busybox", Mode: 0o777}, nil)
		}
	}
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "etc/passwd", Mode: 0o644}, []byte("root:x:0:0:root:/root:/bin/sh\n"))
	add(&tar.Header{Typeflag: tar.TypeReg, Name: "etc/group", Mode: 0o644}, []byte("root:x:0:\n"))
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layer.Bytes())), nil })
	if err != nil {
		t.Fatal(err)
	}
	img, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Created = "linux", "amd64", v1.Time{Time: mt}
	cf.Config.Env = []string{"PATH=/bin"}
	cf.Config.Cmd = []string{"sh"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	ref, err := name.NewTag(tag)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := tarball.Write(ref, img, &out); err != nil {
		t.Fatalf("writing the busybox docker archive: %v", err)
	}
	return out.Bytes()
}
