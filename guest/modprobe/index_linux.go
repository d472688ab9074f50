package modprobe

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guestkernel"
)

// Limits on what one run reads.
const (
	// MaxIndexBytes bounds each modules.* file read (Debian 6.1's largest,
	// modules.alias, is 1.3 MB).
	MaxIndexBytes = 32 << 20
	// MaxModuleBytes bounds a module file, and a compressed one's
	// decompressed image (Debian 6.1's largest, amdgpu.ko, is 19 MB).
	MaxModuleBytes = 256 << 20
	// MaxModules bounds the modules one run loads or finds loaded,
	// dependencies and soft dependencies included.
	MaxModules = 256
	// maxNameBytes bounds a name or alias asked for.
	maxNameBytes = 4096
)

// The depmod files read.
const (
	depFile            = "modules.dep"
	builtinFile        = "modules.builtin"
	builtinModinfoFile = "modules.builtin.modinfo"
	aliasFile          = "modules.alias"
	symbolsFile        = "modules.symbols"
	softdepFile        = "modules.softdep"
)

// alias is one line of modules.alias (or modules.symbols, or a builtin
// module's alias): a pattern, normalised, and the module it names.
type alias struct {
	pattern, module string
}

// index is what one run knows of a modules tree, each file read at most
// once and only when needed.
type index struct {
	dir string

	depRead bool
	depErr  error                         // reading modules.dep, when it failed
	deps    map[string]guestkernel.Module // by name; Path relative to dir
	builtin map[string]bool

	aliases        *[]alias
	symbols        *[]alias
	builtinAliases *[]alias
	softPre        map[string][]string // nil until read
}

func newIndex(dir string) *index { return &index{dir: dir} }

// readDep reads modules.dep and modules.builtin once. A missing file is
// an empty one (depErr says modules.dep was missing, for the not-found
// message); another error is returned.
func (ix *index) readDep() error {
	if ix.depRead {
		return nil
	}
	ix.depRead = true
	ix.deps, ix.builtin = map[string]guestkernel.Module{}, map[string]bool{}
	data, err := readIndexFile(filepath.Join(ix.dir, depFile))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		ix.depErr = err
	case err != nil:
		return err
	default:
		mods, err := guestkernel.ParseModulesDep(bytes.NewReader(data))
		if err != nil {
			return fmt.Errorf("%s: %w", filepath.Join(ix.dir, depFile), err)
		}
		for _, m := range mods {
			ix.deps[m.Name] = m
		}
	}
	data, err = readIndexFile(filepath.Join(ix.dir, builtinFile))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for line := range strings.SplitSeq(string(data), "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			ix.builtin[guestkernel.ModuleName(line)] = true
		}
	}
	return nil
}

// aliasList reads the alias file name once into *list: lines of "alias
// PATTERN MODULE"; comments, blank and malformed lines are skipped.
func (ix *index) aliasList(list **[]alias, name string) ([]alias, error) {
	if *list != nil {
		return **list, nil
	}
	data, err := readIndexFile(filepath.Join(ix.dir, name))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	var out []alias
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64<<10), MaxIndexBytes)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 3 || f[0] != "alias" {
			continue
		}
		out = append(out, alias{pattern: normalizeAlias(f[1]), module: guestkernel.ModuleName(f[2])})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(ix.dir, name), err)
	}
	*list = &out
	return out, nil
}

// builtinAliasList reads the aliases of built-in modules from
// modules.builtin.modinfo (NUL-separated "module.alias=PATTERN") once.
func (ix *index) builtinAliasList() ([]alias, error) {
	if ix.builtinAliases != nil {
		return *ix.builtinAliases, nil
	}
	data, err := readIndexFile(filepath.Join(ix.dir, builtinModinfoFile))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	var out []alias
	for field := range bytes.SplitSeq(data, []byte{0}) {
		key, value, ok := strings.Cut(string(field), "=")
		if !ok {
			continue
		}
		mod, k, ok := strings.Cut(key, ".")
		if !ok || k != "alias" || mod == "" || value == "" {
			continue
		}
		out = append(out, alias{pattern: normalizeAlias(value), module: guestkernel.ModuleName(mod)})
	}
	ix.builtinAliases = &out
	return out, nil
}

// softdeps returns the "pre:" soft dependencies of module, names or
// aliases, from modules.softdep ("softdep MODULE pre: A B post: C").
func (ix *index) softdeps(module string) ([]string, error) {
	if ix.softPre == nil {
		data, err := readIndexFile(filepath.Join(ix.dir, softdepFile))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		ix.softPre = map[string][]string{}
		for line := range strings.SplitSeq(string(data), "\n") {
			f := strings.Fields(line)
			if len(f) < 3 || f[0] != "softdep" {
				continue
			}
			mod := guestkernel.ModuleName(f[1])
			pre := false
			for _, w := range f[2:] {
				switch w {
				case "pre:":
					pre = true
				case "post:":
					pre = false
				default:
					if pre {
						ix.softPre[mod] = append(ix.softPre[mod], w)
					}
				}
			}
		}
	}
	return ix.softPre[module], nil
}

// resolution is what a name stands for: modules to load, or built in.
type resolution struct {
	modules []string
	builtin bool
}

// resolve looks name up as kmod does: a module of modules.dep, a built-in
// module, a "symbol:" of modules.symbols, the patterns of modules.alias,
// the aliases of built-in modules. A name that is none of them is an
// error wrapping ErrNotFound.
func (ix *index) resolve(name string) (resolution, error) {
	if err := ix.readDep(); err != nil {
		return resolution{}, err
	}
	mod := moduleSpelling(name)
	if _, ok := ix.deps[mod]; ok {
		return resolution{modules: []string{mod}}, nil
	}
	if ix.builtin[mod] {
		return resolution{builtin: true}, nil
	}
	key := normalizeAlias(name)
	var found []string
	if strings.HasPrefix(name, "symbol:") {
		syms, err := ix.aliasList(&ix.symbols, symbolsFile)
		if err != nil {
			return resolution{}, err
		}
		for _, a := range syms {
			if a.pattern == key {
				found = appendNew(found, a.module)
			}
		}
	}
	if len(found) == 0 {
		aliases, err := ix.aliasList(&ix.aliases, aliasFile)
		if err != nil {
			return resolution{}, err
		}
		for _, a := range aliases {
			if matchGlob(a.pattern, key) {
				found = appendNew(found, a.module)
			}
		}
	}
	if len(found) > 0 {
		return resolution{modules: found}, nil
	}
	builtins, err := ix.builtinAliasList()
	if err != nil {
		return resolution{}, err
	}
	for _, a := range builtins {
		if matchGlob(a.pattern, key) {
			return resolution{builtin: true}, nil
		}
	}
	if ix.depErr != nil {
		return resolution{}, fmt.Errorf("%w: %s (the tree %s has no %s)", ErrNotFound, name, ix.dir, depFile)
	}
	return resolution{}, fmt.Errorf("%w: %s in %s", ErrNotFound, name, ix.dir)
}

func appendNew(list []string, s string) []string {
	for _, x := range list {
		if x == s {
			return list
		}
	}
	return append(list, s)
}

// moduleSpelling is name as a module name: '-' replaced by '_'.
func moduleSpelling(name string) string { return strings.ReplaceAll(name, "-", "_") }

// plainModuleName reports whether name can be a module's name, as the
// kernel's /sys/module/NAME: not empty, at most 55 bytes, no '/', not "."
// or "..".
func plainModuleName(name string) bool {
	const moduleNameLen = 56 // the kernel's MODULE_NAME_LEN, NUL included
	return name != "" && len(name) < moduleNameLen && name != "." && name != ".." &&
		!strings.ContainsAny(name, "/\x00")
}

// openRegular opens path read-only, without waiting on a FIFO or device,
// and returns it only when it is a regular file of at most limit bytes.
func openRegular(path string, limit int64) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s: not a regular file (%v)", path, fi.Mode().Type())
	}
	if fi.Size() > limit {
		f.Close()
		return nil, fmt.Errorf("%s: %d bytes, more than the %d a modprobe reads", path, fi.Size(), limit)
	}
	return f, nil
}

// readIndexFile reads one of the tree's depmod files, at most
// MaxIndexBytes.
func readIndexFile(path string) ([]byte, error) {
	f, err := openRegular(path, MaxIndexBytes)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxIndexBytes+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	if len(data) > MaxIndexBytes {
		return nil, fmt.Errorf("%s: more than the %d bytes a modprobe reads", path, MaxIndexBytes)
	}
	return data, nil
}
