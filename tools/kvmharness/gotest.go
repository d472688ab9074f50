package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// goTool finds the go command: on PATH, else the usual /usr/local/go.
func goTool() (string, error) {
	if p, err := exec.LookPath("go"); err == nil {
		return p, nil
	}
	const usual = "/usr/local/go/bin/go"
	if _, err := os.Stat(usual); err == nil {
		return usual, nil
	}
	return "", errors.New("go command not found on PATH nor at /usr/local/go/bin/go")
}

// environ returns os.Environ with the given KEY=value pairs set.
func environ(set ...string) []string {
	env := os.Environ()
	for _, kv := range set {
		key, _, _ := strings.Cut(kv, "=")
		out := env[:0]
		for _, e := range env {
			if !strings.HasPrefix(e, key+"=") {
				out = append(out, e)
			}
		}
		env = append(out, kv)
	}
	return env
}

// goTestJSON runs `go test -json args...`, streams the tests' output to out
// as it comes and counts the events into t. It returns go test's error, if
// any, after counting everything.
func goTestJSON(ctx context.Context, goBin string, env []string, args []string, out io.Writer, t *tally, outside bool) error {
	cmd := exec.CommandContext(ctx, goBin, append([]string{"test", "-json"}, args...)...)
	cmd.Env = env
	cmd.Stderr = out
	cmd.WaitDelay = 10 * time.Second
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting go test: %w", err)
	}
	readErr := readEvents(stdout, func(ev event) {
		if ev.Action == "output" || ev.Action == "build-output" {
			io.WriteString(out, ev.Output)
		}
		t.add(ev, outside)
	})
	waitErr := cmd.Wait()
	if readErr != nil {
		return fmt.Errorf("reading go test output: %w", readErr)
	}
	if waitErr != nil {
		return fmt.Errorf("go test: %w", waitErr)
	}
	return nil
}

// testPackage is a package whose tests include TestKVM... functions.
type testPackage struct {
	ImportPath   string
	Dir          string
	TestGoFiles  []string
	XTestGoFiles []string
	// kvmTests names the TestKVM... functions its test files declare.
	kvmTests []string
}

// hasWarm reports whether p declares a warm KVM test (warmPrefix).
func (p testPackage) hasWarm() bool {
	for _, name := range p.kvmTests {
		if strings.HasPrefix(name, warmPrefix) {
			return true
		}
	}
	return false
}

// kvmPackages lists the packages matched by patterns that define at least
// one TestKVM... test for this build configuration.
func kvmPackages(ctx context.Context, goBin string, patterns []string) ([]testPackage, error) {
	args := append([]string{"list", "-json=ImportPath,Dir,TestGoFiles,XTestGoFiles"}, patterns...)
	cmd := exec.CommandContext(ctx, goBin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	var pkgs []testPackage
	dec := json.NewDecoder(bytes.NewReader(out))
	for dec.More() {
		var p testPackage
		if err := dec.Decode(&p); err != nil {
			return nil, fmt.Errorf("decoding go list output: %w", err)
		}
		files := append(append([]string(nil), p.TestGoFiles...), p.XTestGoFiles...)
		names, err := kvmTestNames(p.Dir, files)
		if err != nil {
			return nil, err
		}
		if len(names) > 0 {
			p.kvmTests = names
			pkgs = append(pkgs, p)
		}
	}
	return pkgs, nil
}

// kvmTestNames returns the top-level func TestKVM...(t *testing.T) the
// files declare.
func kvmTestNames(dir string, files []string) ([]string, error) {
	fset := token.NewFileSet()
	var names []string
	for _, f := range files {
		src, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			return nil, err
		}
		more, err := sourceKVMTests(fset, f, src)
		if err != nil {
			return nil, err
		}
		names = append(names, more...)
	}
	return names, nil
}

// sourceKVMTests returns the top-level TestKVM... funcs src declares.
func sourceKVMTests(fset *token.FileSet, name string, src []byte) ([]string, error) {
	file, err := parser.ParseFile(fset, name, src, parser.SkipObjectResolution)
	if err != nil {
		return nil, fmt.Errorf("parsing %s: %w", name, err)
	}
	var names []string
	for _, d := range file.Decls {
		fn, ok := d.(*ast.FuncDecl)
		if ok && fn.Recv == nil && kvmTest(fn.Name.Name) {
			names = append(names, fn.Name.Name)
		}
	}
	return names, nil
}

// buildTestBinary compiles pkg's test binary to out.
func buildTestBinary(ctx context.Context, goBin string, pkg, out string, stderr io.Writer) error {
	cmd := exec.CommandContext(ctx, goBin, "test", "-c", "-o", out, pkg)
	cmd.Stdout = stderr
	cmd.Stderr = stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go test -c %s: %w", pkg, err)
	}
	return nil
}

// test2json converts a test binary's -test.v=test2json output (the file at
// path) to events with `go tool test2json -t` (without -t it leaves out
// the tests' Elapsed times).
func test2json(ctx context.Context, goBin, pkg, path string, fn func(event)) error {
	in, err := os.Open(path)
	if err != nil {
		return err
	}
	defer in.Close()
	cmd := exec.CommandContext(ctx, goBin, "tool", "test2json", "-t", "-p", pkg)
	cmd.Stdin = in
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("go tool test2json: %w", err)
	}
	readErr := readEvents(stdout, fn)
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("go tool test2json: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	return readErr
}
