package agent

import (
	"strings"
	"testing"
)

// FuzzProcParsers feeds the parsers of /proc/meminfo, /proc/uptime and
// memory.events arbitrary text: they must not panic, and must agree with
// themselves.
func FuzzProcParsers(f *testing.F) {
	f.Add("MemTotal:       16318780 kB\nMemAvailable: 1 kB\n")
	f.Add("350735.47 234388.90\n")
	f.Add("low 0\nhigh 3\noom_kill 2\n")
	f.Add("1.9999999999999 x")
	f.Add("18446744073709551615 kB")
	f.Fuzz(func(t *testing.T, s string) {
		m := parseMeminfo([]byte(s))
		for k := range m {
			if k == "" {
				t.Errorf("empty meminfo key from %q", s)
			}
		}
		if d, err := parseUptime([]byte(s)); err == nil && d < 0 {
			t.Errorf("negative uptime %v from %q", d, s)
		}
		for k := range parseKeyedCounters([]byte(s)) {
			if k == "" || strings.ContainsAny(k, " \t\n") {
				t.Errorf("bad counter name %q from %q", k, s)
			}
		}
	})
}

// FuzzTrampolineReport: the parser of the trampoline's failure report
// never panics and, when it finds an errno, returns the rest as message.
func FuzzTrampolineReport(f *testing.F) {
	f.Add("2 exec /x: no such file or directory")
	f.Add("garbage")
	f.Add("65536 x")
	f.Add(" x")
	f.Fuzz(func(t *testing.T, s string) {
		errno, msg := parseTrampolineReport([]byte(s))
		if errno == 0 && msg != s && !strings.HasPrefix(s, "0") {
			t.Errorf("parseTrampolineReport(%q) = 0, %q", s, msg)
		}
		if errno != 0 && !strings.HasSuffix(s, msg) {
			t.Errorf("parseTrampolineReport(%q) = %d, %q", s, errno, msg)
		}
	})
}

// FuzzValidateEnv: whatever validateEnv accepts, envValue can read back,
// and nothing it accepts holds a NUL byte or lacks a name.
func FuzzValidateEnv(f *testing.F) {
	f.Add("A=b", "PATH=/bin")
	f.Add("=x", "y")
	f.Add("A=\x00", "")
	f.Fuzz(func(t *testing.T, a, b string) {
		env := []string{a, b}
		if err := validateEnv(env); err != nil {
			return
		}
		for _, kv := range env {
			name, value, ok := strings.Cut(kv, "=")
			if !ok || name == "" || strings.IndexByte(kv, 0) >= 0 {
				t.Fatalf("validateEnv accepted %q", kv)
			}
			if got, ok := envValue(env, name); !ok || (got != value && env[0] == kv) {
				t.Fatalf("envValue(%q, %q) = %q, %v", env, name, got, ok)
			}
		}
	})
}
