package agent

import (
	"path/filepath"
	"time"
)

// AddTestRoot makes dir/root container root name of s, as MountRoot
// would after its mounts (which need a virtio-9p device); UnmountRoot
// removes dir.
func (s *Server) AddTestRoot(name, dir string) {
	s.roots.mu.Lock()
	defer s.roots.mu.Unlock()
	if s.roots.m == nil {
		s.roots.m = map[string]*containerRoot{}
	}
	s.roots.m[name] = &containerRoot{name: name, dir: dir, path: filepath.Join(dir, "root"), mntns: map[uint64]bool{}}
}

// SetTestDirs moves the folders of the host's trees and the guest's
// volumes (TreesDir, VolumesDir) for a test.
func (s *Server) SetTestDirs(trees, volumes string) { s.treesDir, s.volumesDir = trees, volumes }

// SetTestFindDisk makes AddMounts find a disk by serial with find (its
// device and its size file) instead of in /sys/block.
func (s *Server) SetTestFindDisk(find func(serial string) (dev, sizeFile string, err error)) {
	s.findDisk = find
}

// SetTestDiskSizeWait shortens the wait for a disk's capacity.
func SetTestDiskSizeWait(d time.Duration) { diskSizeWait = d }

// SetTestRootsDir moves RootsDir for a test.
func (s *Server) SetTestRootsDir(dir string) { s.rootsDir = dir }

// Exported for the tests of package agent_test.
var (
	CheckRootName = checkRootName
	IsZombieStat  = isZombieStat
)
