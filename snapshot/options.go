package snapshot

import (
	"bytes"
	"crypto/sha256"
	"log/slog"
	"maps"
)

// Option changes what Save, Sign, Info, Verify or Load do.
type Option func(*config)

// config is what the options set.
type config struct {
	overwrite bool
	noVerity  bool // NoVerity
	labels    map[string]string
	log       *slog.Logger
	key       []byte
	pin       *[sha256.Size]byte
	cache     *Cache
	memFD     int               // a sealed memory image given (WithSealedMemory), or -1
	disks     map[string]string // ExpectDisks; nil: not checked
}

func newConfig(opts []Option) *config {
	c := &config{log: slog.Default(), memFD: -1}
	for _, o := range opts {
		o(c)
	}
	return c
}

// Overwrite lets Save replace an existing snapshot at its target (never a
// directory that is not a snapshot). The old one is replaced atomically
// where the filesystem can exchange two directories, and otherwise moved
// aside first.
func Overwrite() Option { return func(c *config) { c.overwrite = true } }

// NoVerity has Save leave the memory file without fs-verity where its
// file system has it: the save does not read and hash the whole file
// again, and every restore copies and checks it instead of mapping it.
func NoVerity() Option { return func(c *config) { c.noVerity = true } }

// WithLogger sets where Save logs; slog.Default() otherwise.
func WithLogger(l *slog.Logger) Option { return func(c *config) { c.log = l } }

// WithLabels records labels in the manifest: what a caller above the VM
// (a sandbox: its host name) needs to bring the snapshot back. They are
// checked against MaxLabels and the key and value sizes.
func WithLabels(labels map[string]string) Option {
	return func(c *config) { c.labels = maps.Clone(labels) }
}

// WithKey is the host key (LoadKey) that Save and Sign authenticate the
// manifest with (MACFile), and that Info, Verify and Load check it
// against. Load needs it, or WithManifestDigest.
func WithKey(key []byte) Option { return func(c *config) { c.key = bytes.Clone(key) } }

// WithManifestDigest pins the manifest: Load (or Info) accepts only a
// manifest of this SHA-256, the one Verify returned to a caller that holds
// the key, instead of checking its MAC. A VMM process is handed it
// without the key.
func WithManifestDigest(sum [sha256.Size]byte) Option {
	return func(c *config) { c.pin = &sum }
}

// ExpectDisks makes Save and Sign refuse a snapshot whose disks are not
// exactly these images (by device ID): what the caller gave its VM, so
// that a snapshot it authenticates names no other host file.
func ExpectDisks(disks map[string]string) Option {
	return func(c *config) {
		c.disks = maps.Clone(disks)
		if c.disks == nil {
			c.disks = map[string]string{}
		}
	}
}

// WithCache keeps the sealed copies of memory files Load makes in c, so
// that restores of one snapshot in this process copy it once.
func WithCache(c *Cache) Option { return func(cf *config) { cf.cache = c } }

// WithSealedMemory gives Load the snapshot's memory as a sealed memory
// image (memory.NewSealed; Verify's Memory, passed from the process that
// checked it), instead of reading the memory file. Load checks the seals
// and the size; the digest was checked when it was made. For a snapshot
// whose manifest has an fs-verity digest, fd may instead be its memory
// file, whose digest Load measures. Load takes ownership of fd.
func WithSealedMemory(fd int) Option { return func(c *config) { c.memFD = fd } }
