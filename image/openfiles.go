package image

import (
	"container/list"
	"os"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"
)

// Stored chunks stay open between reads: a guest reading a file through
// 9p asks for it 512 KB at a time, and opening, stat-ing and closing the
// 4 MiB chunk file for each Tread cost more than the pread (the first
// sequential read through Kiln's 9p ran at 0.29 of QEMU's; docs/bench.md).
const (
	maxOpenChunks = 256
	// openChunkTTL: an open chunk is reopened through the store after this
	// long, which marks it used for the store's LRU (at most once a minute
	// anyway) and notices a GC that removed it.
	openChunkTTL = time.Minute
)

// openFiles is an LRU of open store files, shared by an Images' readers.
// Safe for concurrent use.
type openFiles struct {
	mu  sync.Mutex
	m   map[digest.Digest]*list.Element
	lru *list.List // of *openFile, most recently used first
	now func() time.Time
}

// openFile is one open file; it is closed once evicted and released by
// every reader holding it.
type openFile struct {
	d       digest.Digest
	f       *os.File
	size    int64
	opened  time.Time
	refs    int
	evicted bool
}

func newOpenFiles() *openFiles {
	return &openFiles{m: map[digest.Digest]*list.Element{}, lru: list.New(), now: time.Now}
}

// get returns d's open file, held, if it is open and fresh.
func (o *openFiles) get(d digest.Digest) *openFile {
	o.mu.Lock()
	defer o.mu.Unlock()
	e, ok := o.m[d]
	if !ok {
		return nil
	}
	of := e.Value.(*openFile)
	if o.now().Sub(of.opened) > openChunkTTL {
		o.evict(e)
		return nil
	}
	o.lru.MoveToFront(e)
	of.refs++
	return of
}

// add keeps f (d's content, size bytes) open and returns it held. If d
// is open already (another reader raced), f is closed and that one is
// returned.
func (o *openFiles) add(d digest.Digest, f *os.File, size int64) *openFile {
	o.mu.Lock()
	defer o.mu.Unlock()
	if e, ok := o.m[d]; ok {
		f.Close()
		of := e.Value.(*openFile)
		o.lru.MoveToFront(e)
		of.refs++
		return of
	}
	of := &openFile{d: d, f: f, size: size, opened: o.now(), refs: 1}
	o.m[d] = o.lru.PushFront(of)
	for o.lru.Len() > maxOpenChunks {
		o.evict(o.lru.Back())
	}
	return of
}

// release drops a hold from get or add.
func (o *openFiles) release(of *openFile) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if of.refs--; of.refs == 0 && of.evicted {
		of.f.Close()
	}
}

// evict forgets e, closing its file unless a reader holds it.
func (o *openFiles) evict(e *list.Element) {
	of := e.Value.(*openFile)
	o.lru.Remove(e)
	delete(o.m, of.d)
	of.evicted = true
	if of.refs == 0 {
		of.f.Close()
	}
}

// forget closes d's file (once no reader holds it), after a GC removed d:
// its disk space is freed, and the next read finds it gone.
func (o *openFiles) forget(ds ...digest.Digest) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, d := range ds {
		if e, ok := o.m[d]; ok {
			o.evict(e)
		}
	}
}
