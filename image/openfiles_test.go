package image

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
)

func TestOpenFiles(t *testing.T) {
	dir := t.TempDir()
	open := func(i int) (digest.Digest, *os.File) {
		t.Helper()
		p := filepath.Join(dir, fmt.Sprint(i))
		if err := os.WriteFile(p, []byte(fmt.Sprint(i)), 0o644); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		return digest.FromString(fmt.Sprint(i)), f
	}
	now := time.Unix(1000, 0)
	o := newOpenFiles()
	o.now = func() time.Time { return now }

	d0, f0 := open(0)
	held := o.add(d0, f0, 1)
	if got := o.get(d0); got != held {
		t.Fatal("get after add missed")
	} else {
		o.release(got)
	}
	// Evicting a held file keeps it open until its last release.
	for i := 1; i <= maxOpenChunks; i++ {
		d, f := open(i)
		o.release(o.add(d, f, 1))
	}
	if o.get(d0) != nil {
		t.Fatal("the least recently used file was not evicted")
	}
	buf := make([]byte, 1)
	if _, err := held.f.ReadAt(buf, 0); err != nil || buf[0] != '0' {
		t.Fatalf("an evicted file still held: %q, %v", buf, err)
	}
	o.release(held)
	if _, err := held.f.ReadAt(buf, 0); err == nil {
		t.Fatal("an evicted, released file is still open")
	}
	// A racing add of an open digest closes the newcomer.
	d1 := digest.FromString("1")
	_, dup := open(1)
	first := o.get(d1)
	if got := o.add(d1, dup, 1); got != first {
		t.Fatal("a second add replaced the open file")
	}
	o.release(first)
	o.release(first)
	if _, err := dup.ReadAt(buf, 0); err == nil {
		t.Fatal("the duplicate was not closed")
	}
	// Past the TTL a file is reopened (through the store, which marks it
	// used).
	now = now.Add(openChunkTTL + time.Second)
	if o.get(d1) != nil {
		t.Fatal("a stale open file was reused")
	}
	if o.lru.Len() != maxOpenChunks-1 {
		t.Fatalf("%d open, want %d", o.lru.Len(), maxOpenChunks-1)
	}
	// Concurrent readers.
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range 200 {
				d := digest.FromString(fmt.Sprint((i + j) % 300))
				if of := o.get(d); of != nil {
					of.f.ReadAt(buf[:0], 0)
					o.release(of)
				}
			}
		}()
	}
	wg.Wait()
}
