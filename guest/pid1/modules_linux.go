package pid1

import (
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/kilnvm/kiln/guestkernel"
	"golang.org/x/sys/unix"
)

// ModulesDir is where the agent's initramfs carries its kernel modules, as
// uncompressed <name>.ko files.
const ModulesDir = "/lib/modules"

// LoadModules loads every kernel module under dir (files named *.ko, in any
// subdirectory) with finit_module(2), each after the modules it depends on.
// The dependencies come from each module's own .modinfo section (depends=);
// one not under dir is taken to be built into the kernel. A module the
// kernel has already (EEXIST) counts as loaded. A module that fails to load
// does not stop the others, except those that depend on it; the error names
// every module not loaded. A dependency cycle, a module that cannot be read
// or two files of one module are errors before anything is loaded. A
// missing dir holds no modules. A nil log discards.
func (s *Sys) LoadModules(dir string, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	mods, err := scanModules(dir)
	if err != nil {
		return err
	}
	order, err := moduleOrder(mods, log)
	if err != nil {
		return err
	}
	failed := map[string]bool{}
	var errs []error
	loaded := 0
	for _, m := range order {
		if dep := firstFailed(m.Depends, failed); dep != "" {
			failed[m.Name] = true
			errs = append(errs, fmt.Errorf("module %s not loaded: its dependency %s failed", m.Name, dep))
			continue
		}
		if err := s.loadModule(m); err != nil {
			failed[m.Name] = true
			errs = append(errs, err)
			log.Error("loading kernel module", "module", m.Name, "err", err)
			continue
		}
		loaded++
		log.Debug("loaded kernel module", "module", m.Name)
	}
	if len(order) > 0 {
		log.Info("loaded kernel modules", "loaded", loaded, "of", len(order))
	}
	return errors.Join(errs...)
}

func firstFailed(deps []string, failed map[string]bool) string {
	for _, d := range deps {
		if failed[d] {
			return d
		}
	}
	return ""
}

func (s *Sys) loadModule(m guestkernel.Module) error {
	f, err := os.Open(m.Path)
	if err != nil {
		return fmt.Errorf("loading module %s: %w", m.Name, err)
	}
	defer f.Close()
	if err := s.FinitModule(f, ""); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("loading module %s (%s): %w", m.Name, m.Path, err)
	}
	return nil
}

// scanModules reads the name and dependencies of every *.ko under dir,
// keyed by name.
func scanModules(dir string) (map[string]guestkernel.Module, error) {
	mods := map[string]guestkernel.Module{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == dir && errors.Is(err, fs.ErrNotExist) {
				return fs.SkipAll
			}
			return err
		}
		if d.IsDir() || !strings.HasSuffix(p, ".ko") {
			return nil
		}
		m, err := readModinfo(p)
		if err != nil {
			return err
		}
		if other, ok := mods[m.Name]; ok {
			return fmt.Errorf("module %s is both %s and %s", m.Name, other.Path, p)
		}
		mods[m.Name] = m
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("listing kernel modules in %s: %w", dir, err)
	}
	return mods, nil
}

// readModinfo returns the module in the ELF file path: its name (the
// .modinfo name= field, else the file's name) and its dependencies.
func readModinfo(path string) (guestkernel.Module, error) {
	f, err := elf.Open(path)
	if err != nil {
		return guestkernel.Module{}, fmt.Errorf("reading module %s: %w", path, err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return guestkernel.Module{}, fmt.Errorf("module %s has no .modinfo section", path)
	}
	info, err := sec.Data()
	if err != nil {
		return guestkernel.Module{}, fmt.Errorf("reading .modinfo of %s: %w", path, err)
	}
	m := guestkernel.Module{Name: modinfoName(info), Path: path, Depends: guestkernel.ParseModinfoDepends(info)}
	if m.Name == "" {
		m.Name = guestkernel.ModuleName(path)
	}
	return m, nil
}

// modinfoName returns the module name of a .modinfo section's name= field,
// or "".
func modinfoName(info []byte) string {
	for field := range bytes.SplitSeq(info, []byte{0}) {
		if v, ok := bytes.CutPrefix(field, []byte("name=")); ok {
			if n := guestkernel.ModuleName(string(v)); n != "." {
				return n
			}
		}
	}
	return ""
}

// moduleOrder returns mods in an order in which each module comes after the
// modules it depends on, deterministically: modules by name, each preceded
// by its dependencies in the order the module lists them. Dependencies not
// in mods are dropped from Depends (built into the kernel).
func moduleOrder(mods map[string]guestkernel.Module, log *slog.Logger) ([]guestkernel.Module, error) {
	names := make([]string, 0, len(mods))
	for n := range mods {
		names = append(names, n)
	}
	sort.Strings(names)
	const visiting, done = 1, 2
	state := map[string]int{}
	var order []guestkernel.Module
	var visit func(name string, path []string) error
	visit = func(name string, path []string) error {
		switch state[name] {
		case visiting:
			return fmt.Errorf("kernel module dependency cycle: %s -> %s", strings.Join(path, " -> "), name)
		case done:
			return nil
		}
		state[name] = visiting
		m := mods[name]
		next := append(path[:len(path):len(path)], name)
		var deps []string
		for _, d := range m.Depends {
			if _, ok := mods[d]; !ok {
				log.Debug("kernel module dependency not in the image, taken as built in", "module", name, "dependency", d)
				continue
			}
			deps = append(deps, d)
			if err := visit(d, next); err != nil {
				return err
			}
		}
		m.Depends = deps
		state[name] = done
		order = append(order, m)
		return nil
	}
	for _, n := range names {
		if err := visit(n, nil); err != nil {
			return nil, err
		}
	}
	return order, nil
}
