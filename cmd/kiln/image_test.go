package main

import (
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/kilnvm/kiln/image/imagetest"
)

// TestImageCommands pulls from a loopback registry, lists, inspects and
// removes, and checks the exit codes of bad input.
func TestImageCommands(t *testing.T) {
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	img, err := random.Image(1000, 2)
	if err != nil {
		t.Fatal(err)
	}
	ref := host + "/demo:v1"
	r, _ := name.ParseReference(ref)
	if err := remote.Write(r, img); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	garbage := filepath.Join(dir, "garbage.tar")
	os.WriteFile(garbage, []byte("not a tarball"), 0o644)

	for _, tc := range []struct {
		args []string
		code int
		out  string // in stdout, or stderr when the code is not 0
	}{
		{[]string{"pull", ref}, 0, ref},
		{[]string{"ls"}, 0, "demo:v1"},
		{[]string{"inspect", ref}, 0, `"manifest"`},
		{[]string{"pull", "Bad:Ref"}, 2, "image reference"},
		{[]string{"pull", host + "/absent:v1"}, 2, "not found"},
		{[]string{"pull", "127.0.0.1:1/closed:v1"}, 1, "pulling"},
		{[]string{"import", garbage}, 2, "not a tar archive"},
		{[]string{"inspect", "debian:bookworm"}, 2, `no image named "debian:bookworm"`},
		{[]string{"rm", "debian:bookworm"}, 2, "no image named"},
		{[]string{"gc"}, 0, "blobs, "},
		{[]string{"gc", "--max-size", "1KiB"}, 0, "left"},
		{[]string{"gc", "--max-size", "lots"}, 2, "want a positive size"},
		{[]string{"gc", "--max-size", "-5G"}, 2, "want a positive size"},
		{[]string{"inspect", ref}, 0, `"manifest"`}, // a cap evicts no image's own blobs
		{[]string{"rm", ref}, 0, "removed " + ref},
		{[]string{"inspect", ref}, 2, "no image named"},
		{[]string{"ls", "extra"}, 2, "want 0"},
		{[]string{"frob"}, 2, "unknown command"},
		{[]string{"convert"}, 2, "want 1"},
		{[]string{"convert", "Bad:Ref"}, 2, "image reference"},
	} {
		args := append([]string{"image", tc.args[0], "--dir", dir}, tc.args[1:]...)
		code, stdout, stderr := runKiln(t, args...)
		got := stdout
		if tc.code != 0 {
			got = stderr
		}
		if code != tc.code || !strings.Contains(got, tc.out) {
			t.Errorf("kiln image %v: code %d, stdout %q, stderr %q; want %d and %q", tc.args, code, stdout, stderr, tc.code, tc.out)
		}
	}
}

// TestImageConvert converts a plain image twice (the same digest both
// times), pushes it, and pulls the pushed image lazily.
func TestImageConvert(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	plain, err := imagetest.Gzip(imagetest.Tar(append(imagetest.BaseFiles(), imagetest.RandomFiles(1, "data", 5)...)...))
	if err != nil {
		t.Fatal(err)
	}
	img, err := imagetest.Image(plain)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "plain:v1", img)
	dest := reg.Host + "/esgz:v1"
	dir := t.TempDir()
	kiln := func(args ...string) (int, string, string) {
		return runKiln(t, append([]string{"image", args[0], "--dir", dir}, args[1:]...)...)
	}
	var digests []string
	for _, args := range [][]string{
		{"convert", ref},                               // pulls it first
		{"convert", "--name", "again:v1", ref},         // the same digest
		{"convert", "--push", dest, "--insecure", ref}, // and pushed
	} {
		code, stdout, stderr := kiln(args...)
		f := strings.Fields(stdout)
		if code != 0 || len(f) != 2 || !strings.Contains(stderr, "converting") {
			t.Fatalf("kiln image %v: code %d, stdout %q, stderr %q", args, code, stdout, stderr)
		}
		digests = append(digests, f[1])
	}
	if digests[0] != digests[1] || digests[1] != digests[2] {
		t.Errorf("converts gave %v", digests)
	}
	code, stdout, stderr := kiln("ls")
	for _, want := range []string{"plain:v1-esgz", "again:v1", "esgz:v1"} {
		if code != 0 || !strings.Contains(stdout, want) {
			t.Errorf("ls: %d %q %q, want %q", code, stdout, stderr, want)
		}
	}
	// The pushed image pulls lazily into another folder.
	code, stdout, stderr = runKiln(t, "image", "pull", "--dir", t.TempDir(), dest)
	if code != 0 || !strings.Contains(stdout, digests[0]) || !strings.Contains(stderr, "chunks on demand") {
		t.Errorf("pull of the converted image: %d %q %q", code, stdout, stderr)
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"1": 1, "512B": 512, "4KiB": 4 << 10, "500MiB": 500 << 20, "20GiB": 20 << 30, "2t": 2 << 40, "3 GB": 3 << 30} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "0", "-1", "GiB", "1PiB", "1.5G", "99999999999999999999"} {
		if _, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q): no error", in)
		}
	}
}
