package procstat

import (
	"strings"
	"testing"
	"time"
)

// line is a /proc/PID/stat line as Linux 6.1 writes it (52 fields).
func line(comm, utime, stime, guest string) string {
	f := []string{"1234", comm, "S", "1", "1", "1", "0", "-1", "4194560", "100", "0", "0", "0", utime, stime,
		"0", "0", "20", "0", "3", "0", "100", "1000000", "200", "18446744073709551615", "1", "1", "0", "0", "0",
		"0", "0", "0", "0", "0", "0", "0", "17", "0", "0", "0", "0", guest, "0", "0", "0", "0", "0", "0", "0", "0", "0"}
	return strings.Join(f, " ") + "\n"
}

func TestParse(t *testing.T) {
	tests := []struct {
		name    string
		stat    string
		want    Times
		wantErr bool
	}{
		{"vmm", line("(kiln)", "250", "40", "200"), Times{UTime: 250, STime: 40, Guest: 200}, false},
		{"command with spaces and parens", line("(a) b (c))", "10", "5", "0"), Times{UTime: 10, STime: 5}, false},
		{"through stime only", "42 (kiln) S 1 2 3 4 5 6 7 8 9 10 300 45", Times{UTime: 300, STime: 45}, false},
		{"no command", "1234 kiln S 1", Times{}, true},
		{"short", "1234 (kiln) S 1 2 3", Times{}, true},
		{"utime not a number", line("(kiln)", "x", "40", "200"), Times{}, true},
		{"guest not a number", line("(kiln)", "1", "40", "-"), Times{}, true},
		{"empty", "", Times{}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := Parse([]byte(tt.stat))
			if (err != nil) != tt.wantErr || got != tt.want {
				t.Errorf("Parse = %+v, %v; want %+v, error %v", got, err, tt.want, tt.wantErr)
			}
		})
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(line("(kiln)", "250", "40", "200")))
	f.Add([]byte("42 (kiln) S 1 2 3 4 5 6 7 8 9 10 300 45"))
	f.Add([]byte(")))"))
	f.Fuzz(func(t *testing.T, b []byte) {
		Parse(b)
	})
}

func TestReadSelf(t *testing.T) {
	start := time.Now()
	for time.Since(start) < 50*time.Millisecond {
	}
	got, err := Read(0)
	if err != nil || got.UTime+got.STime == 0 {
		t.Errorf("Read(self) = %+v, %v; want some CPU time after spinning", got, err)
	}
	if _, err := Read(1 << 30); err == nil {
		t.Error("Read of a pid that cannot exist: no error")
	}
}
