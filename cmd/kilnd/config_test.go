package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/jail"
)

// TestConfigFile: a config file's keys are the flags' names; the command
// line overrides them; unknown keys, wrong types and bad values are errors
// naming the key and its line.
func TestConfigFile(t *testing.T) {
	dir := t.TempDir()
	tok := filepath.Join(dir, "token")
	full := `# every kind of key
listen = ["unix:/tmp/kf/a.sock", "tcp:127.0.0.1:7070"]
token-file = "` + tok + `"
state-dir = "/srv/kiln"
max-sandboxes = 12
max-memory = 4096
default-lifetime = "90m"
debug = true
log-format = "json"
metrics-listen = "127.0.0.1:9100"
net-pool = "10.200.0.0/16"
net-uplink = "eth0"
net-dns = "192.0.2.53, [2001:db8::53]:5353"
egress-default = "deny-all"
cgroup-root = "/sys/fs/cgroup/kiln.slice/"
memory-overcommit = 1.5
vmm-overhead = 96
pids-max = 2048
jail = true
jail-ids = "/srv/kiln-ids"
`
	tests := []struct {
		name    string
		file    string // "" for no --config
		args    []string
		check   func(t *testing.T, cfg config)
		wantErr string // a regexp
	}{
		{name: "every kind of key", file: full, check: func(t *testing.T, cfg config) {
			want := config{
				listens:          []listenSpec{{"unix", "/tmp/kf/a.sock"}, {"tcp", "127.0.0.1:7070"}},
				tokenFile:        tok,
				stateDir:         "/srv/kiln",
				maxSandboxes:     12,
				maxMemoryMiB:     4096,
				defaultLifetime:  90 * time.Minute,
				debug:            true,
				logFormat:        logJSON,
				metricsListen:    "127.0.0.1:9100",
				netPool:          netip.MustParsePrefix("10.200.0.0/16"),
				netUplink:        "eth0",
				netDNS:           []netip.AddrPort{netip.MustParseAddrPort("192.0.2.53:53"), netip.MustParseAddrPort("[2001:db8::53]:5353")},
				egressDefault:    egressDenyAll,
				cgroupRoot:       "/sys/fs/cgroup/kiln.slice",
				memoryOvercommit: 1.5,
				vmmOverheadMiB:   96,
				pidsMax:          2048,
				jail:             jail.ModeOn,
				jailIDs:          "/srv/kiln-ids",
				e2bTimeout:       15 * time.Second,
				e2bIdleTimeout:   defaultE2BIdleTimeout, e2bReadTimeout: defaultE2BReadTimeout, e2bWriteTimeout: defaultE2BWriteTimeout, e2bConnsPerAddr: defaultE2BConnsPerAddr,
			}
			want.configFile = cfg.configFile
			if !reflect.DeepEqual(cfg, want) {
				t.Errorf("config\n %+v\nwant\n %+v", cfg, want)
			}
		}},
		{name: "flags override the file, a repeatable one wholly", file: full,
			args: []string{"--state-dir", "/elsewhere", "--listen", "unix:/tmp/kf/b.sock", "--debug=false", "--pids-max", "7"},
			check: func(t *testing.T, cfg config) {
				if cfg.stateDir != "/elsewhere" || cfg.debug || cfg.pidsMax != 7 {
					t.Errorf("state dir %q, debug %v, pids-max %d; want the flags'", cfg.stateDir, cfg.debug, cfg.pidsMax)
				}
				if got := (*listenFlag)(&cfg.listens).String(); got != "unix:/tmp/kf/b.sock" {
					t.Errorf("listens %s; want the flag's alone", got)
				}
				if cfg.maxSandboxes != 12 || cfg.netUplink != "eth0" {
					t.Errorf("the file's other keys were lost: %+v", cfg)
				}
			}},
		{name: "a single listen string", file: `listen = "unix:/tmp/kf/c.sock"`, check: func(t *testing.T, cfg config) {
			if got := (*listenFlag)(&cfg.listens).String(); got != "unix:/tmp/kf/c.sock" || cfg.implicitSocket {
				t.Errorf("listens %s (implicit %v)", got, cfg.implicitSocket)
			}
		}},
		{name: "an integer ratio", file: "memory-overcommit = 2", check: func(t *testing.T, cfg config) {
			if cfg.memoryOvercommit != 2 {
				t.Errorf("memory-overcommit %v", cfg.memoryOvercommit)
			}
		}},
		{name: "an empty file", file: "# nothing\n", check: func(t *testing.T, cfg config) {
			if cfg.stateDir != "/var/lib/kiln" || cfg.logFormat != logText || cfg.pidsMax != defaultPidsMax {
				t.Errorf("defaults lost: %+v", cfg)
			}
		}},
		{name: "unknown key", file: "state-dir = \"/a\"\n\nstate_dir = \"/b\"\n", wantErr: `:3: key "state_dir": unknown key`},
		{name: "unknown key after a bad one", file: "nope = 1\nstate-dir = 2\n", wantErr: `:1: key "nope": unknown key`},
		{name: "a table", file: "debug = true\n[net]\npool = \"10.0.0.0/8\"\n", wantErr: `:2: key "net": unknown key`},
		{name: "config in a config", file: "config = \"/etc/other.toml\"", wantErr: `:1: key "config": .*another`},
		{name: "string for an integer", file: "max-sandboxes = \"12\"", wantErr: `:1: key "max-sandboxes": want an integer, not the string "12"`},
		{name: "integer for a string", file: "\nstate-dir = 5", wantErr: `:2: key "state-dir": want a string, not the integer 5`},
		{name: "string for a bool", file: `debug = "yes"`, wantErr: `:1: key "debug": want true or false`},
		{name: "integer for a duration", file: "default-lifetime = 60", wantErr: `:1: key "default-lifetime": want a duration string`},
		{name: "bad duration", file: `default-lifetime = "an hour"`, wantErr: `:1: key "default-lifetime": .*an hour`},
		{name: "array of integers for listen", file: "listen = [1]", wantErr: `:1: key "listen": element 0: want a string`},
		{name: "table for listen", file: "listen = {a = 1}", wantErr: `:1: key "listen": want an array of strings, not a table`},
		{name: "bad listen", file: `listen = ["udp:x"]`, wantErr: `:1: key "listen": .*unknown network`},
		{name: "bad pool", file: "\n\nnet-pool = \"10.200.0.1/16\"", wantErr: `:3: key "net-pool": .*host bits set; the network is 10.200.0.0/16`},
		{name: "bad ratio", file: "memory-overcommit = -1.0", wantErr: `:1: key "memory-overcommit": .*want a ratio > 0`},
		{name: "bad format", file: `log-format = "xml"`, wantErr: `:1: key "log-format": "xml" is not one of text, json`},
		{name: "negative integer", file: "pids-max = -4", wantErr: `:1: key "pids-max": .*not a whole number`},
		{name: "syntax error", file: "debug = true\nstate-dir = \"/a\n", wantErr: `:2: `},
		{name: "duplicate key", file: "debug = true\ndebug = false\n", wantErr: `:2: .*debug`},
		{name: "missing explicit config", args: []string{"--config", filepath.Join(dir, "missing.toml")}, wantErr: `config file: open .*missing.toml: no such file`},
		{name: "no config", args: []string{"--config="}, check: func(t *testing.T, cfg config) {
			if cfg.configFile != "" {
				t.Errorf("config file %q read with --config=", cfg.configFile)
			}
		}},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			args := tt.args
			if tt.file != "" {
				p := filepath.Join(dir, "kilnd"+strings.Repeat("x", i)+".toml")
				if err := os.WriteFile(p, []byte(tt.file), 0o644); err != nil {
					t.Fatal(err)
				}
				args = append([]string{"--config", p}, args...)
			}
			cfg, err := parseFlagsWith(args, io.Discard, "")
			if tt.wantErr != "" {
				if err == nil || !regexp.MustCompile(tt.wantErr).MatchString(err.Error()) {
					t.Fatalf("parse: %v; want an error matching %q", err, tt.wantErr)
				}
				var ce *ConfigError
				if tt.file != "" && !errors.As(err, &ce) {
					t.Errorf("%v is not a *ConfigError", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, cfg)
		})
	}
}

// TestDefaultConfigFile: the default file is read when it exists, and its
// absence is no error.
func TestDefaultConfigFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "kilnd.toml")
	if cfg, err := parseFlagsWith(nil, io.Discard, p); err != nil || cfg.configFile != "" {
		t.Fatalf("no default file: %+v, %v", cfg, err)
	}
	os.WriteFile(p, []byte(`max-sandboxes = 3`), 0o644)
	cfg, err := parseFlagsWith(nil, io.Discard, p)
	if err != nil || cfg.configFile != p || cfg.maxSandboxes != 3 {
		t.Fatalf("default file: %+v, %v", cfg, err)
	}
	os.WriteFile(p, []byte(`max-sandboxes = "3"`), 0o644)
	if _, err := parseFlagsWith(nil, io.Discard, p); err == nil || !strings.Contains(err.Error(), "max-sandboxes") {
		t.Fatalf("a bad default file: %v; want its error", err)
	}
}

// TestShippedConfig: packaging/kilnd.toml names every flag (but config),
// commented out with its default, and, uncommented, parses to the
// defaults (but log-format, which it sets to json).
func TestShippedConfig(t *testing.T) {
	b, err := os.ReadFile("../../packaging/kilnd.toml")
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	var probe config
	var pl listenFlag
	newFlagSet(&probe, &pl).VisitAll(func(f *flag.Flag) {
		if f.Name == "config" {
			return
		}
		if !regexp.MustCompile(`(?m)^(# )?` + regexp.QuoteMeta(f.Name) + ` = `).MatchString(text) {
			t.Errorf("packaging/kilnd.toml has no %q key", f.Name)
		}
	})
	uncommented := regexp.MustCompile(`(?m)^# ([a-z-]+ = )`).ReplaceAllString(text, "$1")
	p := filepath.Join(t.TempDir(), "kilnd.toml")
	os.WriteFile(p, []byte(uncommented), 0o644)
	got, err := parseFlagsWith([]string{"--config", p}, io.Discard, "")
	if err != nil {
		t.Fatalf("packaging/kilnd.toml, uncommented: %v", err)
	}
	want, err := parseFlagsWith(nil, io.Discard, "")
	if err != nil {
		t.Fatal(err)
	}
	want.logFormat = logJSON
	want.configFile, want.implicitSocket = got.configFile, got.implicitSocket
	if !reflect.DeepEqual(got, want) {
		t.Errorf("packaging/kilnd.toml's keys are not the defaults:\n %+v\nwant\n %+v", got, want)
	}
	// As shipped (all but log-format commented out) it parses too.
	if _, err := parseFlagsWith([]string{"--config", "../../packaging/kilnd.toml"}, io.Discard, ""); err != nil {
		t.Errorf("packaging/kilnd.toml: %v", err)
	}
}

// TestHostFlags: each host-integration flag refuses bad values with an
// error naming it, and takes good ones.
func TestHostFlags(t *testing.T) {
	tests := []struct {
		args    []string
		wantErr string // "" for accepted
	}{
		{args: []string{"--log-format", "json"}},
		{args: []string{"--log-format", "JSON"}, wantErr: "-log-format"},
		{args: []string{"--metrics-listen", ":9100"}},
		{args: []string{"--metrics-listen", "[::1]:9100"}},
		{args: []string{"--metrics-listen", "localhost"}, wantErr: "-metrics-listen"},
		{args: []string{"--metrics-listen", "127.0.0.1:99999"}, wantErr: "-metrics-listen"},
		{args: []string{"--net-pool", "10.0.0.0/8"}},
		{args: []string{"--net-pool", "10.0.0.0/31"}, wantErr: "-net-pool"},
		{args: []string{"--net-pool", "fd00::/64"}, wantErr: "-net-pool"},
		{args: []string{"--net-pool", "10.0.0.0"}, wantErr: "-net-pool"},
		{args: []string{"--net-uplink", "enp3s0f1"}},
		{args: []string{"--net-uplink", "a-very-long-name-0"}, wantErr: "-net-uplink"},
		{args: []string{"--net-uplink", "../eth0"}, wantErr: "-net-uplink"},
		{args: []string{"--net-dns", "1.1.1.1,9.9.9.9:53"}},
		{args: []string{"--net-dns", "1.1.1.1,"}, wantErr: "-net-dns"},
		{args: []string{"--net-dns", "dns.example"}, wantErr: "-net-dns"},
		{args: []string{"--net-dns", "1.1.1.1:0"}, wantErr: "-net-dns"},
		{args: []string{"--net-refuse", "default"}},
		{args: []string{"--net-refuse", "none"}},
		{args: []string{"--net-refuse", "169.254.0.0/16, 10.0.0.0/8"}},
		{args: []string{"--net-refuse", ""}, wantErr: "-net-refuse"},
		{args: []string{"--net-refuse", "169.254.0.0/16,"}, wantErr: "-net-refuse"},
		{args: []string{"--net-refuse", "fd00::/8"}, wantErr: "-net-refuse"},
		{args: []string{"--net-refuse", "metadata"}, wantErr: "-net-refuse"},
		{args: []string{"--egress-default", "deny-all"}},
		{args: []string{"--egress-default", "deny"}, wantErr: "-egress-default"},
		{args: []string{"--cgroup-root", "none"}},
		{args: []string{"--cgroup-root", "kiln.slice"}, wantErr: "-cgroup-root"},
		{args: []string{"--memory-overcommit", "0.5"}},
		{args: []string{"--memory-overcommit", "0"}, wantErr: "-memory-overcommit"},
		{args: []string{"--memory-overcommit", "NaN"}, wantErr: "-memory-overcommit"},
		{args: []string{"--memory-overcommit", "Inf"}, wantErr: "-memory-overcommit"},
		{args: []string{"--memory-overcommit", "1e9"}, wantErr: "-memory-overcommit"},
		{args: []string{"--vmm-overhead", "0"}, wantErr: "-vmm-overhead"},
		{args: []string{"--vmm-overhead", "65537"}, wantErr: "-vmm-overhead"},
		{args: []string{"--vmm-overhead", "128"}},
		{args: []string{"--pids-max", "0"}, wantErr: "-pids-max"},
		{args: []string{"--pids-max", "99999999999999999999999"}, wantErr: "-pids-max"},
		{args: []string{"--pids-max", "64"}},
	}
	for _, tt := range tests {
		_, err := parseFlagsWith(tt.args, io.Discard, "")
		switch {
		case tt.wantErr == "" && err != nil:
			t.Errorf("%q: %v", tt.args, err)
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("%q: %v; want an error naming %s", tt.args, err, tt.wantErr)
		}
	}
	for arg, want := range map[string][]netip.Prefix{
		"default":                       nil,
		"none":                          {},
		"169.254.169.254/16,8.8.8.8/32": {netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("8.8.8.8/32")},
	} {
		cfg, err := parseFlagsWith([]string{"--net-refuse", arg}, io.Discard, "")
		if err != nil || (cfg.netRefused == nil) != (want == nil) || !slices.Equal(cfg.netRefused, want) {
			t.Errorf("--net-refuse %s: %#v, %v; want %#v", arg, cfg.netRefused, err, want)
		}
	}
	cfg, err := parseFlagsWith(nil, io.Discard, "")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.logFormat != logText || cfg.egressDefault != egressAllowAll || cfg.memoryOvercommit != 1 ||
		cfg.vmmOverheadMiB != defaultVMMOverheadMiB || defaultVMMOverheadMiB != 64 || cfg.pidsMax != 1024 || cfg.cgroupRoot != "" || cfg.netPool.IsValid() || cfg.netDNS != nil || cfg.netRefused != nil {
		t.Errorf("defaults: %+v", cfg)
	}
}

// TestLogFormat: --log-format json logs one JSON object a line.
func TestLogFormat(t *testing.T) {
	var buf bytes.Buffer
	newLogger(&buf, config{logFormat: logJSON}).Info("kilnd: listening", "addr", "unix:/x")
	var m map[string]any
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil || m["msg"] != "kilnd: listening" || m["addr"] != "unix:/x" || m["level"] != "INFO" {
		t.Errorf("json log %q: %v, %v", buf.String(), m, err)
	}
	buf.Reset()
	newLogger(&buf, config{logFormat: logText}).Debug("hidden")
	newLogger(&buf, config{logFormat: logText, debug: true}).Debug("shown")
	if got := buf.String(); strings.Contains(got, "hidden") || !strings.Contains(got, "level=DEBUG msg=shown") {
		t.Errorf("text log %q", got)
	}
}

func FuzzConfigFile(f *testing.F) {
	for _, s := range []string{
		"debug = true", `listen = ["unix:/a", "tcp:127.0.0.1:1"]`, "[t]\nx = 1", "max-sandboxes = 1e3",
		`net-dns = "1.1.1.1"`, "pids-max = 18446744073709551615", "a.b = 1", `"state-dir" = "/x"`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, text string) {
		var cfg config
		var listens listenFlag
		fs := newFlagSet(&cfg, &listens)
		fs.SetOutput(io.Discard)
		err := applyConfig("f.toml", text, fs, nil)
		var ce *ConfigError
		if err != nil && !errors.As(err, &ce) {
			t.Fatalf("%q: %v is not a *ConfigError", text, err)
		}
	})
}
