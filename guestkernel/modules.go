package guestkernel

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"debug/elf"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// ErrModuleNotFound is returned (wrapped) when a requested module is neither a
// loadable module nor built into the kernel.
var ErrModuleNotFound = errors.New("kernel module not found")

// Module is one loadable kernel module.
type Module struct {
	// Name is the module's name with '-' replaced by '_', as the kernel
	// names it (kvm_amd).
	Name string
	// Path is the absolute path of the module's .ko file.
	Path string
	// Depends names the modules that must be loaded before this one.
	Depends []string
}

// ModuleName normalises a module or file name to the kernel's spelling:
// without directory and .ko suffix, '-' replaced by '_'.
func ModuleName(s string) string {
	s = filepath.Base(s)
	if i := strings.Index(s, ".ko"); i >= 0 {
		s = s[:i]
	}
	return strings.ReplaceAll(s, "-", "_")
}

// ModuleLoadOrder returns the named modules and all their dependencies in an
// order in which insmod can load them: every module after its dependencies.
// Modules built into the kernel are satisfied and left out. A name that is
// neither loadable nor built in gives an error wrapping ErrModuleNotFound.
func (k *Kernel) ModuleLoadOrder(names ...string) ([]Module, error) {
	idx, err := k.moduleIndex()
	if err != nil {
		return nil, err
	}
	var order []Module
	state := map[string]int{} // 1: visiting, 2: done
	var visit func(name, neededBy string) error
	visit = func(name, neededBy string) error {
		switch state[name] {
		case 1:
			return fmt.Errorf("kernel %s: module dependency cycle through %s", k.Version, name)
		case 2:
			return nil
		}
		if idx.builtin[name] {
			state[name] = 2
			return nil
		}
		path, ok := idx.path[name]
		if !ok {
			if neededBy != "" {
				return fmt.Errorf("%w: %s (needed by %s) in kernel %s", ErrModuleNotFound, name, neededBy, k.Version)
			}
			return fmt.Errorf("%w: %s in kernel %s", ErrModuleNotFound, name, k.Version)
		}
		deps, ok := idx.deps[name]
		if !ok {
			deps, err = modinfoDepends(path)
			if err != nil {
				return err
			}
		}
		state[name] = 1
		for _, d := range deps {
			if err := visit(d, name); err != nil {
				return err
			}
		}
		state[name] = 2
		order = append(order, Module{Name: name, Path: path, Depends: deps})
		return nil
	}
	for _, n := range names {
		if err := visit(ModuleName(n), ""); err != nil {
			return nil, err
		}
	}
	return order, nil
}

type moduleIndex struct {
	path    map[string]string   // name -> absolute .ko path
	deps    map[string][]string // name -> dependencies, from modules.dep
	builtin map[string]bool
}

// moduleIndex reads modules.dep and modules.builtin when present; without
// modules.dep it walks the tree and dependencies come from each module's
// .modinfo section.
func (k *Kernel) moduleIndex() (*moduleIndex, error) {
	idx := &moduleIndex{path: map[string]string{}, deps: map[string][]string{}, builtin: map[string]bool{}}
	if f, err := os.Open(filepath.Join(k.ModulesDir, "modules.builtin")); err == nil {
		names, err := parseModuleList(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("kernel %s: modules.builtin: %w", k.Version, err)
		}
		for _, n := range names {
			idx.builtin[n] = true
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("kernel %s: %w", k.Version, err)
	}

	f, err := os.Open(filepath.Join(k.ModulesDir, "modules.dep"))
	if err == nil {
		defer f.Close()
		entries, err := ParseModulesDep(f)
		if err != nil {
			return nil, fmt.Errorf("kernel %s: modules.dep: %w", k.Version, err)
		}
		for _, e := range entries {
			idx.path[e.Name] = filepath.Join(k.ModulesDir, filepath.FromSlash(e.Path))
			idx.deps[e.Name] = e.Depends
		}
		return idx, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("kernel %s: %w", k.Version, err)
	}
	err = filepath.WalkDir(k.ModulesDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".ko") {
			idx.path[ModuleName(p)] = p
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("kernel %s: listing modules: %w", k.Version, err)
	}
	return idx, nil
}

// ParseModulesDep parses depmod's modules.dep: lines of
// "kernel/path/mod.ko: kernel/path/dep.ko ...". Paths stay relative to the
// modules directory; Depends holds module names. Entries come back sorted by
// name.
func ParseModulesDep(r io.Reader) ([]Module, error) {
	var mods []Module
	seen := map[string]bool{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	for line := 1; sc.Scan(); line++ {
		text := strings.TrimSpace(sc.Text())
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		mod, rest, ok := strings.Cut(text, ":")
		mod = strings.TrimSpace(mod)
		if !ok || !validModulePath(mod) {
			return nil, fmt.Errorf("line %d: want \"path.ko: deps\", got %q", line, text)
		}
		m := Module{Name: ModuleName(mod), Path: mod}
		for _, d := range strings.Fields(rest) {
			if !validModulePath(d) {
				return nil, fmt.Errorf("line %d: bad dependency %q", line, d)
			}
			m.Depends = append(m.Depends, ModuleName(d))
		}
		if seen[m.Name] {
			return nil, fmt.Errorf("line %d: module %s listed twice", line, m.Name)
		}
		seen[m.Name] = true
		mods = append(mods, m)
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.Slice(mods, func(i, j int) bool { return mods[i].Name < mods[j].Name })
	return mods, nil
}

// validModulePath accepts relative slash paths to a .ko file inside the
// modules tree.
func validModulePath(p string) bool {
	if p == "" || strings.HasPrefix(p, "/") || !strings.Contains(p, ".ko") || strings.ContainsRune(p, 0) {
		return false
	}
	for _, el := range strings.Split(p, "/") {
		if el == ".." || el == "" {
			return false
		}
	}
	n := ModuleName(p)
	return n != "" && n != "."
}

// parseModuleList reads module paths, one a line (modules.builtin,
// modules.order), as names.
func parseModuleList(r io.Reader) ([]string, error) {
	var names []string
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		if t := strings.TrimSpace(sc.Text()); t != "" {
			names = append(names, ModuleName(t))
		}
	}
	return names, sc.Err()
}

// modinfoDepends reads the depends= field of a module's .modinfo section.
func modinfoDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading module %s: %w", path, err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("module %s has no .modinfo section", path)
	}
	data, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("reading .modinfo of %s: %w", path, err)
	}
	return ParseModinfoDepends(data), nil
}

// ParseModinfoDepends extracts the module names of the "depends=" field from
// the NUL-separated key=value strings of a module's .modinfo section.
func ParseModinfoDepends(modinfo []byte) []string {
	var deps []string
	for _, field := range bytes.Split(modinfo, []byte{0}) {
		v, ok := bytes.CutPrefix(field, []byte("depends="))
		if !ok {
			continue
		}
		for _, d := range strings.Split(string(v), ",") {
			if name := ModuleName(strings.TrimSpace(d)); name != "" && name != "." {
				deps = append(deps, name)
			}
		}
	}
	return deps
}

// ReadModule returns the contents of the module file path, decompressed when
// its name says it is compressed: .ko.gz in Go, .ko.xz and .ko.zst with the
// xz and zstd tools (Debian's xz-utils and zstd packages). A plain .ko is
// returned as it is.
func ReadModule(path string) ([]byte, error) {
	var tool string
	switch {
	case strings.HasSuffix(path, ".ko"):
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("reading module: %w", err)
		}
		return b, nil
	case strings.HasSuffix(path, ".ko.gz"):
		f, err := os.Open(path)
		if err != nil {
			return nil, fmt.Errorf("reading module: %w", err)
		}
		defer f.Close()
		zr, err := gzip.NewReader(f)
		if err != nil {
			return nil, fmt.Errorf("decompressing module %s: %w", path, err)
		}
		b, err := io.ReadAll(zr)
		if err != nil {
			return nil, fmt.Errorf("decompressing module %s: %w", path, err)
		}
		return b, nil
	case strings.HasSuffix(path, ".ko.xz"):
		tool = "xz"
	case strings.HasSuffix(path, ".ko.zst"):
		tool = "zstd"
	default:
		return nil, fmt.Errorf("reading module %s: unknown file type (want .ko, .ko.gz, .ko.xz or .ko.zst)", path)
	}
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("reading module: %w", err)
	}
	var out, stderr bytes.Buffer
	cmd := exec.Command(tool, "-dc", "--", path)
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("decompressing module %s with %s (is it installed?): %w: %s", path, tool, err, strings.TrimSpace(stderr.String()))
	}
	return out.Bytes(), nil
}

// InitrdModulesDir is where an initramfs built around InsmodScript holds
// the modules it loads (as NAME.ko).
const InitrdModulesDir = "lib/modules"

// InsmodScript returns an initramfs /init body: proc, sysfs and devtmpfs
// mounted, one insmod per module of order from InitrdModulesDir (a failure
// names the module, tagged with who, and powers off), then script. A
// module name that is not a plain word is refused.
func InsmodScript(order []Module, script, who string) (string, error) {
	var s strings.Builder
	s.WriteString("mount -t proc proc /proc\n")
	s.WriteString("mount -t sysfs sysfs /sys\n")
	s.WriteString("mount -t devtmpfs devtmpfs /dev\n")
	for _, m := range order {
		if strings.ContainsAny(m.Name, " \t\n'\"$`\\;&|<>()*?[]{}~#") {
			return "", fmt.Errorf("module name %q is not a plain word", m.Name)
		}
		fmt.Fprintf(&s, "insmod /%s/%s.ko || { echo '%s: insmod %s failed'; poweroff -f; }\n", InitrdModulesDir, m.Name, who, m.Name)
	}
	s.WriteString(script)
	return s.String(), nil
}
