package modprobe

import (
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNotFound is returned (wrapped) for a name that is no module, no
// alias of one and nothing built in.
var ErrNotFound = errors.New("kernel module not found")

// Kernel is the seam to the kernel's module loader: the system calls
// Modprobe makes to load a module. Linux returns the real ones.
type Kernel struct {
	// FinitModule loads the module open as f: finit_module(2).
	FinitModule func(f *os.File, params string, flags int) error
	// InitModule loads the module image: init_module(2).
	InitModule func(image []byte, params string) error
}

// Linux returns the running kernel's loader.
func Linux() Kernel {
	return Kernel{FinitModule: FinitModule, InitModule: InitModule}
}

// FinitModule loads the kernel module open as f with finit_module(2) and
// its MODULE_INIT_* flags.
func FinitModule(f *os.File, params string, flags int) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var ferr error
	if err := rc.Control(func(fd uintptr) { ferr = unix.FinitModule(int(fd), params, flags) }); err != nil {
		return err
	}
	if ferr != nil {
		return fmt.Errorf("finit_module: %w", ferr)
	}
	return nil
}

// InitModule loads the kernel module image with init_module(2).
func InitModule(image []byte, params string) error {
	if err := unix.InitModule(image, params); err != nil {
		return fmt.Errorf("init_module: %w", err)
	}
	return nil
}

// Modprobe loads modules from one modules tree. Its index of the tree is
// read as needed and kept: a Modprobe is for one run, not for a tree that
// changes under it. It is not safe for concurrent use.
type Modprobe struct {
	// Dir is the modules tree: /lib/modules/<release>, with depmod's
	// files.
	Dir string
	// SysModule is where the kernel lists its modules, /sys/module.
	SysModule string
	// Kernel loads modules.
	Kernel Kernel
	// DryRun resolves and reports but loads nothing.
	DryRun bool
	// Report, when set, gets each step as kmod's --show-depends spells
	// it: "insmod PATH [PARAMS]" for a module to load (or loaded, when
	// not DryRun), "builtin NAME" for one built in.
	Report func(line string)
	// Log gets what was loaded and skipped (Debug) and soft
	// dependencies that failed (Warn); nil discards.
	Log *slog.Logger

	ix     *index
	state  map[string]int
	failed map[string]error
}

// Load states of a module in one run.
const (
	visiting = 1
	done     = 2
	failed   = 3
)

// Load loads the module or alias name with what it needs first; params
// (module parameters, "key=value ...") go to the modules name stands for,
// not to their dependencies. Already loaded or built in is success; so is
// a module the kernel reports loaded meanwhile (EEXIST). Every module an
// alias matches is loaded; the error names each that failed.
func (m *Modprobe) Load(name, params string) error {
	if name == "" || len(name) > maxNameBytes || strings.ContainsRune(name, 0) {
		return fmt.Errorf("module name %.64q: want 1 to %d bytes, no NUL", name, maxNameBytes)
	}
	if m.Log == nil {
		m.Log = slog.New(slog.DiscardHandler)
	}
	if m.ix == nil {
		m.ix = newIndex(m.Dir)
		m.state, m.failed = map[string]int{}, map[string]error{}
	}
	if mod := moduleSpelling(name); m.loaded(mod) {
		m.Log.Debug("module already in the kernel", "module", mod)
		return nil
	}
	res, err := m.ix.resolve(name)
	if err != nil {
		return err
	}
	if res.builtin {
		m.report("builtin " + moduleSpelling(name))
		m.Log.Debug("module built into the kernel", "name", name)
		return nil
	}
	var errs []error
	for _, mod := range res.modules {
		if err := m.insert(mod, params, ""); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// insert loads mod after its soft and hard dependencies, once per run.
// neededBy names the module that needs it, for errors.
func (m *Modprobe) insert(mod, params, neededBy string) error {
	switch m.state[mod] {
	case visiting:
		return fmt.Errorf("module %s: dependency cycle through %s", neededBy, mod)
	case done:
		return nil
	case failed:
		return m.failed[mod]
	}
	if err := m.insertOnce(mod, params, neededBy); err != nil {
		m.state[mod], m.failed[mod] = failed, err
		return err
	}
	m.state[mod] = done
	return nil
}

func (m *Modprobe) insertOnce(mod, params, neededBy string) error {
	if m.loaded(mod) {
		m.Log.Debug("module already in the kernel", "module", mod)
		return nil
	}
	entry, ok := m.ix.deps[mod]
	if !ok {
		if m.ix.builtin[mod] {
			return nil
		}
		if neededBy == "" {
			return fmt.Errorf("%w: %s (named by an alias) in %s", ErrNotFound, mod, m.Dir)
		}
		return fmt.Errorf("%w: %s (needed by %s) in %s", ErrNotFound, mod, neededBy, m.Dir)
	}
	if len(m.state) >= MaxModules {
		return fmt.Errorf("module %s: more than %d modules in one run", mod, MaxModules)
	}
	m.state[mod] = visiting
	pre, err := m.ix.softdeps(mod)
	if err != nil {
		return err
	}
	for _, p := range pre {
		m.insertSoft(p, mod)
	}
	for _, d := range entry.Depends {
		if err := m.insert(d, "", mod); err != nil {
			return fmt.Errorf("module %s not loaded: %w", mod, err)
		}
	}
	path := filepath.Join(m.Dir, filepath.FromSlash(entry.Path))
	line := "insmod " + path
	if params != "" {
		line += " " + params
	}
	m.report(line)
	if m.DryRun {
		return nil
	}
	if err := m.loadFile(path, params); err != nil {
		return fmt.Errorf("loading module %s: %w", mod, err)
	}
	m.Log.Debug("loaded module", "module", mod, "path", path)
	return nil
}

// insertSoft loads the soft dependency name (a module or alias) of mod,
// best effort: a failure is logged, and one already being loaded in this
// run (a cycle of soft dependencies) is skipped.
func (m *Modprobe) insertSoft(name, mod string) {
	res, err := m.ix.resolve(name)
	if err == nil {
		for _, d := range res.modules {
			if m.state[d] == visiting {
				continue
			}
			if err = m.insert(d, "", mod); err != nil {
				break
			}
		}
	}
	if err != nil {
		m.Log.Warn("soft dependency not loaded", "module", mod, "softdep", name, "err", err)
	}
}

// loaded reports whether the kernel has mod, loaded or built in with a
// /sys/module entry.
func (m *Modprobe) loaded(mod string) bool {
	if !plainModuleName(mod) {
		return false
	}
	_, err := os.Lstat(filepath.Join(m.SysModule, mod))
	return err == nil
}

func (m *Modprobe) report(line string) {
	if m.Report != nil {
		m.Report(line)
	}
}

// loadFile loads the module file path: a plain .ko with finit_module, a
// compressed one with finit_module's MODULE_INIT_COMPRESSED_FILE, or
// where the kernel cannot decompress, a gzip one decompressed here with
// init_module. EEXIST is success.
func (m *Modprobe) loadFile(path, params string) error {
	comp, err := compression(path)
	if err != nil {
		return err
	}
	f, err := openRegular(path, MaxModuleBytes)
	if err != nil {
		return err
	}
	defer f.Close()
	if comp == "" {
		return ignoreExist(m.Kernel.FinitModule(f, params, 0))
	}
	err = m.Kernel.FinitModule(f, params, unix.MODULE_INIT_COMPRESSED_FILE)
	// Linux before 6.4 refuses the flag (EINVAL); one without
	// CONFIG_MODULE_DECOMPRESS, or without this format's decompressor,
	// EOPNOTSUPP or EINVAL.
	if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.EOPNOTSUPP) {
		return ignoreExist(err)
	}
	if comp != ".gz" {
		return fmt.Errorf("%s: the kernel cannot decompress it (%w: it needs Linux 6.4 with CONFIG_MODULE_DECOMPRESS), and this modprobe decompresses only gzip", path, err)
	}
	image, derr := gunzip(f)
	if derr != nil {
		return fmt.Errorf("%s: %w", path, derr)
	}
	return ignoreExist(m.Kernel.InitModule(image, params))
}

// compression returns a module file's compression suffix ("" for a plain
// .ko), refusing a file of any other name.
func compression(path string) (string, error) {
	for _, s := range []string{".ko", ".ko.gz", ".ko.xz", ".ko.zst"} {
		if strings.HasSuffix(path, s) {
			return strings.TrimPrefix(s, ".ko"), nil
		}
	}
	return "", fmt.Errorf("%s: not a module file (want .ko, .ko.gz, .ko.xz or .ko.zst)", path)
}

// gunzip decompresses a gzip module from its start, at most
// MaxModuleBytes.
func gunzip(f *os.File) ([]byte, error) {
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	zr, err := gzip.NewReader(f)
	if err != nil {
		return nil, fmt.Errorf("decompressing: %w", err)
	}
	b, err := io.ReadAll(io.LimitReader(zr, MaxModuleBytes+1))
	if err != nil {
		return nil, fmt.Errorf("decompressing: %w", err)
	}
	if len(b) > MaxModuleBytes {
		return nil, fmt.Errorf("decompressing: more than %d bytes", MaxModuleBytes)
	}
	return b, nil
}

func ignoreExist(err error) error {
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	return err
}

// ModulesRoot holds the running kernel's modules tree as
// ModulesRoot/<release>.
const ModulesRoot = "/lib/modules"

// RunModulesDir is where the guest agent mounts the kernel's modules
// disk when the root is read-only and has no ModulesRoot/<release> to
// mount it on (guest/pid1's MountModulesDisk): TreeDir looks there next.
const RunModulesDir = "/run/kiln/modules"

// SysModule is where the kernel lists its modules.
const SysModule = "/sys/module"

// Release returns the running kernel's release (uname -r).
func Release() (string, error) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return "", fmt.Errorf("uname: %w", err)
	}
	rel := unix.ByteSliceToString(u.Release[:])
	if rel == "" || strings.ContainsRune(rel, '/') || rel == "." || rel == ".." {
		return "", fmt.Errorf("uname: kernel release %q cannot name a modules tree", rel)
	}
	return rel, nil
}
