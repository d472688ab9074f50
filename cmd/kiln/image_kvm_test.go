package main

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// TestKVMRunImage runs the image tests' Debian image through `kiln run
// --image`: an image that is not stored is pulled (from an in-process
// loopback registry); python3 and git run; -e merges over the image's Env;
// without a command the image's own runs, in its working directory, here
// in a VMM process of its own; --save and kiln fork work on an
// image-rooted sandbox; a name that does not exist says so.
func TestKVMRunImage(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	reg, refs := imagetest.ServeLayout(t, kvmtest.TestImages(t), "kiln/test")
	images := t.TempDir()
	agent := kvmtest.AgentBinary(t)

	code, stdout, stderr := runKiln(t, "run", "--agent", agent, "--boot-timeout", "8m", "--images", images, "--image", refs["debian"],
		"-e", "KILN_X=1", "--", "sh", "-c", `python3 -c 'import json, sqlite3; print(1)'; git --version; echo "$KILN_X $LANG $PWD"`)
	lines := strings.Split(strings.TrimSpace(stdout), "\n")
	if code != 0 || len(lines) != 3 || lines[0] != "1" || !strings.HasPrefix(lines[1], "git version ") || lines[2] != "1 C.UTF-8 /srv/work" {
		t.Fatalf("kiln run --image: exit code %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	if !strings.Contains(stderr, "pulling") && !strings.Contains(stderr, "pulled") {
		t.Logf("no pull progress on stderr: %q", stderr)
	}

	code, stdout, stderr = runKiln(t, "image", "ls", "--dir", images)
	if code != 0 || !strings.Contains(stdout, "kiln/test/debian") {
		t.Errorf("kiln image ls: exit code %d, stdout %q, stderr %q", code, stdout, stderr)
	}

	fetched := reg.Stats().Bytes
	code, stdout, stderr = runKiln(t, "run", "--agent", agent, "--boot-timeout", "8m", "--vmm-process", "--images", images, "--image", refs["debian"])
	if code != 0 || strings.TrimSpace(stdout) != "default command ran in /srv/work" {
		t.Fatalf("kiln run --image with the image's command: exit code %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	t.Logf("first run fetched %d bytes from the registry; the second %d", fetched, reg.Stats().Bytes-fetched)

	// --save of an image-rooted sandbox, then kiln fork of it: each
	// clone sees the parent's write in its overlay, and its own hostname.
	snap := filepath.Join(t.TempDir(), "snap")
	code, stdout, stderr = runKiln(t, "run", "--agent", agent, "--boot-timeout", "8m", "--images", images, "--image", refs["debian"],
		"--save", snap, "--", "sh", "-c", "echo saved > /srv/work/state")
	if code != 0 {
		t.Fatalf("kiln run --image --save: exit code %d, stdout %q, stderr %q", code, stdout, stderr)
	}
	code, stdout, stderr = runKiln(t, "fork", "--from", snap, "-n", "2", "--boot-timeout", "5m", "--", "sh", "-c", `echo "$(hostname) $(cat state) $PWD"`)
	lines = strings.Split(strings.TrimSpace(stdout), "\n")
	slices.Sort(lines)
	if want := []string{"[0] kiln-0 saved /srv/work", "[1] kiln-1 saved /srv/work"}; code != 0 || !slices.Equal(lines, want) {
		t.Errorf("kiln fork of an image-rooted snapshot: exit code %d, stdout %q (want %q), stderr %q", code, stdout, want, stderr)
	}

	code, _, stderr = runKiln(t, "run", "--agent", agent, "--images", images, "--image", reg.Host+"/kiln/test/nosuch:v1", "--", "true")
	if code != exitRunFailed || !strings.Contains(stderr, "not found") || strings.Count(strings.TrimSpace(stderr), "\n") != 0 {
		t.Errorf("a name that does not exist: exit code %d, stderr %q; want %d and one line saying not found", code, stderr, exitRunFailed)
	}
}
