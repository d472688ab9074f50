package fsverity

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseDigest(t *testing.T) {
	hexd := strings.Repeat("ab", 32)
	for _, c := range []struct {
		in string
		ok bool
	}{
		{hexd, true},
		{strings.ToUpper(hexd), true},
		{hexd[:62], false},
		{hexd + "00", false},
		{strings.Repeat("zz", 32), false},
		{"", false},
	} {
		d, err := ParseDigest(c.in)
		if (err == nil) != c.ok {
			t.Errorf("ParseDigest(%q): err %v, want ok %v", c.in, err, c.ok)
		}
		if c.ok && d.String() != strings.ToLower(c.in) {
			t.Errorf("ParseDigest(%q).String() = %q", c.in, d)
		}
	}
}

// TestEnableMeasure enables fs-verity on a file of the test's temporary
// folder where its file system has it (KILN_VERITY_DIR names one that
// must: the KVM tests' ext4 made with the verity feature), and checks
// that elsewhere both calls say ErrUnsupported.
func TestEnableMeasure(t *testing.T) {
	dir := os.Getenv("KILN_VERITY_DIR")
	must := dir != ""
	if dir == "" {
		dir = t.TempDir()
	}
	p := filepath.Join(dir, "f")
	if err := os.WriteFile(p, []byte("some bytes\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(p)
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := Measure(f); err != nil && !errors.Is(err, ErrNotEnabled) && !errors.Is(err, ErrUnsupported) {
		t.Fatalf("Measure before Enable: %v", err)
	}
	err = Enable(f)
	if errors.Is(err, ErrUnsupported) && !must {
		if _, merr := Measure(f); !errors.Is(merr, ErrUnsupported) && !errors.Is(merr, ErrNotEnabled) {
			t.Errorf("Measure where Enable is unsupported: %v", merr)
		}
		t.Logf("no fs-verity in %s: %v (checked that it says so)", dir, err)
		return
	}
	if err != nil {
		t.Fatalf("Enable: %v", err)
	}
	d1, err := Measure(f)
	if err != nil {
		t.Fatalf("Measure: %v", err)
	}
	if err := Enable(f); err != nil {
		t.Errorf("Enable again: %v", err)
	}
	if _, err := os.OpenFile(p, os.O_WRONLY, 0); err == nil {
		t.Error("a file with fs-verity opened for writing")
	}
	// The digest depends on the bytes only.
	q := filepath.Join(dir, "g")
	os.WriteFile(q, []byte("some bytes\n"), 0o600)
	defer os.Remove(q)
	g, err := os.Open(q)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	if err := Enable(g); err != nil {
		t.Fatal(err)
	}
	if d2, err := Measure(g); err != nil || d2 != d1 {
		t.Errorf("the same bytes measure %v (%v), want %v", d2, err, d1)
	}
}
