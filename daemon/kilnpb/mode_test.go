package kilnpb

import (
	"io/fs"
	"testing"
)

func TestMode(t *testing.T) {
	for _, m := range []fs.FileMode{0o644, fs.ModeDir | 0o755, fs.ModeSymlink | 0o777, fs.ModeSocket | 0o600,
		fs.ModeNamedPipe | 0o600, fs.ModeDevice | fs.ModeCharDevice | 0o666, fs.ModeDevice | 0o660,
		fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky | 0o755} {
		if got := FileMode(StMode(m)); got != m {
			t.Errorf("%v: back as %v (st_mode %o)", m, got, StMode(m))
		}
	}
	if st := StMode(fs.ModeDir | 0o755); st != 0o40755 {
		t.Errorf("a directory's st_mode %o", st)
	}
}
