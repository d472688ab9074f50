package ninep

import (
	"container/list"
	"sync"

	"github.com/kilnvm/kiln/rofs"
)

// dirCache keeps directory listings for Treaddir, shared by every fid open
// on a directory and bounded in entries (least recently used go first), so
// that a guest opening many fids on a large directory cannot make the
// server hold a copy per fid. A listing larger than the whole budget is not
// kept: each Treaddir reads it again.
type dirCache struct {
	max int // entries

	mu    sync.Mutex
	n     int
	byIno map[uint64]*list.Element
	lru   list.List // of *dirListing, most recent first
}

type dirListing struct {
	ino  uint64
	ents []rofs.Dirent
}

// defaultDirCacheEntries bounds the cached entries: about 64 MiB.
const defaultDirCacheEntries = 1 << 20

func newDirCache(max int) *dirCache {
	return &dirCache{max: max, byIno: map[uint64]*list.Element{}}
}

// list returns dir's entries, from the cache or from fs.
func (c *dirCache) list(fs rofs.FS, dir uint64) ([]rofs.Dirent, error) {
	c.mu.Lock()
	if e, ok := c.byIno[dir]; ok {
		c.lru.MoveToFront(e)
		ents := e.Value.(*dirListing).ents
		c.mu.Unlock()
		return ents, nil
	}
	c.mu.Unlock()
	ents, err := fs.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	if len(ents) > c.max {
		return ents, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.byIno[dir]; ok { // another request listed it meanwhile
		return ents, nil
	}
	for c.n+len(ents) > c.max {
		old := c.lru.Back()
		l := old.Value.(*dirListing)
		c.lru.Remove(old)
		delete(c.byIno, l.ino)
		c.n -= len(l.ents)
	}
	c.byIno[dir] = c.lru.PushFront(&dirListing{ino: dir, ents: ents})
	c.n += len(ents)
	return ents, nil
}
