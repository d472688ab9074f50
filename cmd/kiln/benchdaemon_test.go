package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/bench"
)

func TestParseBenchDaemon(t *testing.T) {
	tests := []struct {
		name  string
		args  []string
		check func(t *testing.T, a benchDaemonArgs)
		err   string
	}{
		{name: "defaults", check: func(t *testing.T, a benchDaemonArgs) {
			s := a.spec
			if a.image != "busybox" || a.images != "" || s.VMM != "" || s.Kilnd != "/opt/kiln/bin/kilnd" ||
				!slices.Equal(s.Concurrency, []int{1, 10, 50}) || !slices.Equal(s.Forks, []int{1, 8, 32}) ||
				s.RateFor != time.Minute || s.Pool != bench.DefaultDaemonPool || s.MemoryMiB != 128 || s.Samples != bench.DefaultDaemonSamples {
				t.Errorf("defaults: %+v, image %q", s, a.image)
			}
		}},
		{name: "emulated sizes", args: []string{"--concurrency", "1,10", "--rate-for", "30s", "--fork", "1,8", "--mem", "256",
			"--samples", "5", "--pool", "0", "--kilnd", "/x/kilnd", "--json", "out.json", "--kvm-mode", "emulated", "--images", "/img", "--image", "ref"},
			check: func(t *testing.T, a benchDaemonArgs) {
				s := a.spec
				if !slices.Equal(s.Concurrency, []int{1, 10}) || !slices.Equal(s.Forks, []int{1, 8}) || s.RateFor != 30*time.Second ||
					s.MemoryMiB != 256 || s.Samples != 5 || s.Pool != 0 || s.Kilnd != "/x/kilnd" || a.json != "out.json" ||
					s.KVMMode != bench.KVMEmulated || a.images != "/img" || a.image != "ref" {
					t.Errorf("parsed: %+v, %+v", s, a)
				}
			}},
		{name: "no forks", args: []string{"--no-fork"}, check: func(t *testing.T, a benchDaemonArgs) {
			if a.spec.Forks == nil || len(a.spec.Forks) != 0 {
				t.Errorf("forks %v, want none (not the default)", a.spec.Forks)
			}
		}},
		{name: "bad concurrency", args: []string{"--concurrency", "1,x"}, err: "comma-separated positive integers"},
		{name: "zero concurrency", args: []string{"--concurrency", "0"}, err: "positive integers"},
		{name: "fork too big", args: []string{"--fork", "300"}, err: "fork of 300"},
		{name: "bad kvm mode", args: []string{"--kvm-mode", "fast"}, err: `--kvm-mode "fast"`},
		{name: "empty image", args: []string{"--image", ""}, err: "--image is empty"},
		{name: "stray argument", args: []string{"now"}, err: "unexpected arguments"},
		{name: "negative rate", args: []string{"--rate-for", "-1s"}, err: "rate for -1s"},
		{name: "zero workers", args: []string{"--rate-workers", "0"}, err: "--rate-workers 0"},
		{name: "zero samples", args: []string{"--samples", "0"}, err: "--samples 0"},
		{name: "zero op timeout", args: []string{"--op-timeout", "0s"}, err: "--op-timeout"},
		{name: "negative timeout", args: []string{"--timeout", "-1m"}, err: "--timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, err := parseBenchDaemon(tt.args, "/opt/kiln/bin/kiln", io.Discard)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("parse %q: %v, want an error with %q", tt.args, err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("parse %q: %v", tt.args, err)
			}
			tt.check(t, a)
		})
	}
}

func TestParseBenchDaemonHelp(t *testing.T) {
	var b bytes.Buffer
	_, err := parseBenchDaemon([]string{"-h"}, "/k", &b)
	if !errors.Is(err, flag.ErrHelp) || !strings.Contains(b.String(), "usage: kiln bench daemon") || !strings.Contains(b.String(), "-rate-for") {
		t.Errorf("-h: %v\n%s", err, b.String())
	}
}

func TestCmdBenchDaemonUsage(t *testing.T) {
	var out, errw bytes.Buffer
	if code := cmdBench(t.Context(), []string{"daemon", "--concurrency", "0"}, &out, &errw); code != exitUsage {
		t.Errorf("exit %d, want %d; stderr %s", code, exitUsage, errw.String())
	}
	if !strings.Contains(errw.String(), "kiln bench daemon:") {
		t.Errorf("stderr %q does not name the command", errw.String())
	}
	errw.Reset()
	cmdBench(t.Context(), nil, &out, &errw)
	if !strings.Contains(errw.String(), "kiln bench daemon [flags]") {
		t.Errorf("kiln bench usage lacks daemon: %s", errw.String())
	}
}

func TestWriteReportJSON(t *testing.T) {
	write := func(w io.Writer) error { _, err := io.WriteString(w, "{}\n"); return err }
	var out bytes.Buffer
	if err := writeReportJSON("", &out, write); err != nil || out.Len() != 0 {
		t.Errorf("no path: %v, wrote %q", err, out.String())
	}
	if err := writeReportJSON("-", &out, write); err != nil || !strings.Contains(out.String(), "JSON:\n{}") {
		t.Errorf("-: %v, wrote %q", err, out.String())
	}
	p := filepath.Join(t.TempDir(), "r.json")
	if err := writeReportJSON(p, &out, write); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(p); err != nil || string(b) != "{}\n" {
		t.Errorf("file: %q, %v", b, err)
	}
	if err := writeReportJSON(filepath.Join(t.TempDir(), "no", "r.json"), &out, write); err == nil {
		t.Error("a file in a missing folder: no error")
	}
}
