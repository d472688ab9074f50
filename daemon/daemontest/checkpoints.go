package daemontest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"github.com/kilnvm/kiln/daemon"
)

// Save copies the root into dir/root.
func (in *Instance) Save(ctx context.Context, dir string) error {
	if h := in.b.SaveHook; h != nil {
		if err := h(ctx, in.dir, dir); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return fmt.Errorf("daemontest: save: %w", err)
	}
	in.mu.Lock()
	m := in.meta
	in.mu.Unlock()
	if err := writeJSON(filepath.Join(dir, metaFile), m); err != nil {
		return err
	}
	return copyTree(in.rootPath(), filepath.Join(dir, rootDir))
}

// The double's "in-memory" checkpoints are folders as Save writes, in
// the sandbox folder's holds (so that they outlive a server, as a VMM
// process's holds do, and go with the sandbox).

// holdPath is hold id's folder.
func (in *Instance) holdPath(id string) (string, error) {
	if id == "" || strings.ContainsAny(id, "/\x00") || id == "." || id == ".." {
		return "", fmt.Errorf("daemontest: hold ID %q", id)
	}
	return filepath.Join(in.dir, holdsDir, id), nil
}

// newHold is the folder of a new hold id, which must not exist yet.
func (in *Instance) newHold(id string) (string, error) {
	p, err := in.holdPath(id)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(p); err == nil {
		return "", fmt.Errorf("daemontest: hold %q exists already", id)
	}
	return p, os.MkdirAll(filepath.Dir(p), 0o700)
}

// Hold keeps a copy of the root under id.
func (in *Instance) Hold(ctx context.Context, id string) error {
	p, err := in.newHold(id)
	if err != nil {
		return err
	}
	return in.Save(ctx, p)
}

// Release drops the hold id.
func (in *Instance) Release(ctx context.Context, id string) error {
	p, err := in.holdPath(id)
	if err != nil {
		return err
	}
	return os.RemoveAll(p)
}

// Held lists the holds, sorted.
func (in *Instance) Held(ctx context.Context) ([]string, error) {
	ents, err := os.ReadDir(filepath.Join(in.dir, holdsDir))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("daemontest: held: %w", err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out, nil
}

// Frozen is the double's in-memory checkpoint handed out: a copy of the
// hold, removed by Close.
type Frozen struct {
	id  string
	mu  sync.Mutex
	dir string
}

func (f *Frozen) ID() string { return f.id }

func (f *Frozen) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.dir == "" {
		return nil
	}
	err := os.RemoveAll(filepath.Dir(f.dir))
	f.dir = ""
	return err
}

// Frozen hands out a copy of the hold id.
func (in *Instance) Frozen(ctx context.Context, id string) (daemon.Frozen, error) {
	p, err := in.holdPath(id)
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(p); err != nil {
		return nil, fmt.Errorf("daemontest: hold %q: %w", id, daemon.ErrNotHeld)
	}
	tmp, err := os.MkdirTemp(filepath.Dir(in.dir), ".frozen-")
	if err != nil {
		return nil, fmt.Errorf("daemontest: frozen: %w", err)
	}
	f := &Frozen{id: id, dir: filepath.Join(tmp, "ck")}
	if err := copyTree(p, f.dir); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// Adopt holds a copy of f.
func (in *Instance) Adopt(ctx context.Context, f daemon.Frozen) error {
	df, ok := f.(*Frozen)
	if !ok {
		return fmt.Errorf("daemontest: %T is not this backend's in-memory checkpoint", f)
	}
	p, err := in.newHold(df.id)
	if err != nil {
		return err
	}
	df.mu.Lock()
	defer df.mu.Unlock()
	if df.dir == "" {
		return errors.New("daemontest: adopt a closed checkpoint")
	}
	return copyTree(df.dir, p)
}

// Fork makes a child per entry of hosts, each a copy of the root, in
// folders beside this one's.
func (in *Instance) Fork(ctx context.Context, hosts []daemon.HostSpec) (out []daemon.Instance, err error) {
	tmp, err := os.MkdirTemp(filepath.Dir(in.dir), ".fork-")
	if err != nil {
		return nil, fmt.Errorf("daemontest: fork: %w", err)
	}
	defer os.RemoveAll(tmp)
	defer func() {
		if err != nil {
			for _, c := range out {
				c.Close(context.Background())
			}
			out = nil
		}
	}()
	if err := in.Save(ctx, filepath.Join(tmp, "ck")); err != nil {
		return nil, err
	}
	for _, h := range hosts {
		dir := filepath.Join(filepath.Dir(in.dir), "fork-"+randHex())
		if err := os.Mkdir(dir, 0o700); err != nil {
			return out, fmt.Errorf("daemontest: fork: %w", err)
		}
		c, err := in.b.Create(ctx, daemon.CreateSpec{Dir: dir, Checkpoint: filepath.Join(tmp, "ck"), Host: h})
		if err != nil {
			os.RemoveAll(dir)
			return out, err
		}
		out = append(out, c)
	}
	return out, nil
}

func randHex() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// copyTree copies the folder src to dst (which must not exist): its
// folders, regular files and symlinks.
func copyTree(src, dst string) error {
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		var fi fs.FileInfo
		if err == nil {
			fi, err = d.Info()
		}
		if err != nil {
			return err
		}
		t := filepath.Join(dst, strings.TrimPrefix(p, src))
		switch link, lerr := os.Readlink(p); {
		case d.IsDir():
			return os.Mkdir(t, fi.Mode().Perm())
		case lerr == nil:
			return os.Symlink(link, t)
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err == nil {
				err = os.WriteFile(t, b, fi.Mode().Perm())
			}
			return err
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("daemontest: copy %s: %w", src, err)
	}
	return nil
}
