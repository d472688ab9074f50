package guestkernel

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCacheDir(t *testing.T) {
	tests := []struct {
		name, kiln, xdg, home string
		want                  string
		wantErr               bool
	}{
		{name: "KILN_CACHE wins", kiln: "/k", xdg: "/x", home: "/h", want: "/k"},
		{name: "XDG_CACHE_HOME", xdg: "/x", home: "/h", want: "/x/kiln"},
		{name: "relative XDG ignored", xdg: "x", home: "/h", want: "/h/.cache/kiln"},
		{name: "HOME", home: "/h", want: "/h/.cache/kiln"},
		{name: "nothing set", wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("KILN_CACHE", tt.kiln)
			t.Setenv("XDG_CACHE_HOME", tt.xdg)
			t.Setenv("HOME", tt.home)
			got, err := CacheDir()
			if tt.wantErr {
				if err == nil {
					t.Fatalf("CacheDir() = %q, want an error", got)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("CacheDir() = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

func TestCacheDirRelativeKilnCache(t *testing.T) {
	t.Setenv("KILN_CACHE", "rel/cache")
	got, err := CacheDir()
	if err != nil {
		t.Fatal(err)
	}
	wd, _ := os.Getwd()
	if want := filepath.Join(wd, "rel/cache"); got != want {
		t.Fatalf("CacheDir() = %q, want %q", got, want)
	}
}

// layout creates a cache with one kernel version; current is set by link.
func layout(t *testing.T, version string) string {
	t.Helper()
	root := t.TempDir()
	vdir := filepath.Join(root, "kernel", version)
	if err := os.MkdirAll(filepath.Join(vdir, "modules"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(vdir, "vmlinuz"), []byte("bzImage"), 0o644); err != nil {
		t.Fatal(err)
	}
	return root
}

func TestFind(t *testing.T) {
	const v = "6.1.0-57-amd64"
	tests := []struct {
		name      string
		setup     func(t *testing.T, root string)
		wantErr   string
		notCached bool // error wraps ErrNotCached
		vmlinux   bool
	}{
		{name: "relative symlink", setup: func(t *testing.T, root string) {
			must(t, os.Symlink(v, filepath.Join(root, "kernel", "current")))
		}},
		{name: "absolute symlink", setup: func(t *testing.T, root string) {
			must(t, os.Symlink(filepath.Join(root, "kernel", v), filepath.Join(root, "kernel", "current")))
		}},
		{name: "file naming version", setup: func(t *testing.T, root string) {
			must(t, os.WriteFile(filepath.Join(root, "kernel", "current"), []byte(v+"\n"), 0o644))
		}},
		{name: "with vmlinux", vmlinux: true, setup: func(t *testing.T, root string) {
			must(t, os.Symlink(v, filepath.Join(root, "kernel", "current")))
			must(t, os.WriteFile(filepath.Join(root, "kernel", v, "vmlinux"), []byte("\x7fELF"), 0o644))
		}},
		{name: "no current", setup: func(*testing.T, string) {}, wantErr: "make kernel", notCached: true},
		{name: "current names missing version", setup: func(t *testing.T, root string) {
			must(t, os.WriteFile(filepath.Join(root, "kernel", "current"), []byte("6.9.9"), 0o644))
		}, wantErr: "make kernel", notCached: true},
		{name: "escaping version", setup: func(t *testing.T, root string) {
			must(t, os.WriteFile(filepath.Join(root, "kernel", "current"), []byte("../../etc"), 0o644))
		}, wantErr: "invalid kernel version"},
		{name: "empty current", setup: func(t *testing.T, root string) {
			must(t, os.WriteFile(filepath.Join(root, "kernel", "current"), nil, 0o644))
		}, wantErr: "empty kernel version"},
		{name: "no vmlinuz", setup: func(t *testing.T, root string) {
			must(t, os.Symlink(v, filepath.Join(root, "kernel", "current")))
			must(t, os.Remove(filepath.Join(root, "kernel", v, "vmlinuz")))
		}, wantErr: "vmlinuz", notCached: true},
		{name: "modules is a file", setup: func(t *testing.T, root string) {
			must(t, os.Symlink(v, filepath.Join(root, "kernel", "current")))
			must(t, os.Remove(filepath.Join(root, "kernel", v, "modules")))
			must(t, os.WriteFile(filepath.Join(root, "kernel", v, "modules"), nil, 0o644))
		}, wantErr: "not a directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := layout(t, v)
			tt.setup(t, root)
			t.Setenv("KILN_CACHE", root)
			k, err := Find()
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("Find() error = %v, want one containing %q", err, tt.wantErr)
				}
				if tt.notCached != errors.Is(err, ErrNotCached) {
					t.Fatalf("errors.Is(%v, ErrNotCached) = %v, want %v", err, !tt.notCached, tt.notCached)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			want := Kernel{
				Version:    v,
				Image:      filepath.Join(root, "kernel", v, "vmlinuz"),
				ModulesDir: filepath.Join(root, "kernel", v, "modules"),
				Cache:      root,
			}
			if tt.vmlinux {
				want.Vmlinux = filepath.Join(root, "kernel", v, "vmlinux")
			}
			if *k != want {
				t.Fatalf("Find() = %+v, want %+v", *k, want)
			}
		})
	}
}

// TestFindRealCache checks the cache that `make kernel` filled, when there is one.
func TestFindRealCache(t *testing.T) {
	k, err := Find()
	if errors.Is(err, ErrNotCached) {
		t.Skipf("no cached kernel: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	mods, err := k.ModuleLoadOrder("kvm_amd", "9p", "9pnet_virtio", "virtio_pci")
	if err != nil {
		t.Fatal(err)
	}
	pos := map[string]int{}
	for i, m := range mods {
		pos[m.Name] = i
	}
	for _, m := range mods {
		for _, d := range m.Depends {
			if dp, ok := pos[d]; ok && dp > pos[m.Name] {
				t.Errorf("%s loads before its dependency %s", m.Name, d)
			}
		}
	}
	for _, want := range []string{"kvm", "kvm_amd", "irqbypass", "9p", "9pnet"} {
		if _, ok := pos[want]; !ok {
			t.Errorf("load order %v lacks %s", mods, want)
		}
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
