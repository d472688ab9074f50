// Command checkunsafe keeps package unsafe where the house rule puts it:
// only files named *_unsafe.go (or *_unsafe_test.go) may import it, so a
// reader finds every unchecked pointer by name (as gVisor's checkunsafe
// does). Generated files ("Code generated ... DO NOT EDIT.") are exempt.
// It walks the module below its argument (default "."), skipping vendor,
// testdata, node_modules and dot folders, prints each offending file and
// exits 1 when there is one. make test runs it through its test.
package main

import (
	"bufio"
	"bytes"
	"fmt"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// generated is Go's marker of a generated file (go help generate).
var generated = regexp.MustCompile(`^// Code generated .* DO NOT EDIT\.$`)

// allowed reports whether a file of this name may import unsafe.
func allowed(name string) bool {
	return strings.HasSuffix(name, "_unsafe.go") || strings.HasSuffix(name, "_unsafe_test.go")
}

// isGenerated reports whether src carries the generated-code marker in
// a line before its package clause.
func isGenerated(src []byte) bool {
	sc := bufio.NewScanner(bytes.NewReader(src))
	for sc.Scan() {
		line := sc.Text()
		if generated.MatchString(line) {
			return true
		}
		if strings.HasPrefix(line, "package ") {
			return false
		}
	}
	return false
}

// check returns the files below root that import unsafe but may not.
func check(root string) ([]string, error) {
	var bad []string
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (strings.HasPrefix(name, ".") || name == "vendor" || name == "testdata" || name == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || allowed(name) {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		f, err := parser.ParseFile(fset, path, src, parser.ImportsOnly)
		if err != nil {
			return fmt.Errorf("checkunsafe: %w", err)
		}
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); p == "unsafe" && !isGenerated(src) {
				bad = append(bad, path)
			}
		}
		return nil
	})
	return bad, err
}

func main() {
	root := "."
	if len(os.Args) > 2 {
		fmt.Fprintln(os.Stderr, "usage: checkunsafe [DIR]")
		os.Exit(2)
	}
	if len(os.Args) == 2 {
		root = os.Args[1]
	}
	bad, err := check(root)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	for _, p := range bad {
		fmt.Printf("%s imports unsafe: move that code into a file named *_unsafe.go\n", p)
	}
	if len(bad) > 0 {
		os.Exit(1)
	}
}
