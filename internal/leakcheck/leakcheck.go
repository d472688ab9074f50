// Package leakcheck counts what a process and its host hold (descriptors,
// goroutines, threads, memfds, VMM processes, network interfaces, cgroups,
// mounts, files under given folders) so a soak test can take the counts
// before and after many sandbox lifetimes and fail on any difference,
// naming what was left.
//
// Counts are generic: they do not assume where a VMM process runs or how
// its namespaces are laid out. Host-wide counts (memfds named kiln*,
// VMM processes) scan every /proc/<pid>.
package leakcheck

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Options says what to count beyond this process.
type Options struct {
	// Trees are folders whose entries (recursively) are counted, by a
	// name for the table: the test's TMPDIR, a state folder.
	Trees map[string]string
	// Cgroups is a cgroup v2 folder whose subfolders are counted.
	Cgroups string
	// Netns are network namespace files (a path) whose links are
	// counted, besides this thread's own namespace's.
	Netns map[string]string
	// ProcessEnv names an environment variable that marks a VMM process
	// (vmmproc.SocketEnv); processes with it set are counted host-wide.
	ProcessEnv string
	// ProcessArgs marks VMM processes by their command line: a process
	// whose argv contains every one of these (in order) is counted.
	ProcessArgs []string
	// Counters are the caller's own counters, by a name for the table:
	// each lists what it counts now (the jail ids held, say).
	Counters map[string]func() ([]string, error)
}

// Counts is one reading: a count per counter and, per counter, what it
// counted (so a difference can name the extra items).
type Counts struct {
	N     map[string]int
	Items map[string][]string
}

func (c *Counts) set(name string, items []string) {
	slices.Sort(items)
	c.N[name] = len(items)
	c.Items[name] = items
}

// Take reads every counter.
func Take(opts Options) (*Counts, error) {
	c := &Counts{N: map[string]int{}, Items: map[string][]string{}}
	var errs []error
	fds, err := selfFDs()
	if err != nil {
		errs = append(errs, err)
	}
	c.set("fds", fds)
	var memfds []string
	for _, f := range fds {
		if _, link, _ := strings.Cut(f, " -> "); strings.HasPrefix(link, "/memfd:") {
			memfds = append(memfds, f)
		}
	}
	c.set("memfds (this process)", memfds)
	c.N["goroutines"] = runtime.NumGoroutine()
	busy, err := busyThreads()
	if err != nil {
		errs = append(errs, err)
	}
	c.set("threads (not parked)", busy)
	hostMem, procs, children, err := scanProcs(opts)
	if err != nil {
		errs = append(errs, err)
	}
	c.set("memfds kiln* (host)", hostMem)
	c.set("VMM processes (host)", procs)
	c.set("child processes", children)
	links, err := ifaces()
	if err != nil {
		errs = append(errs, err)
	}
	c.set("links (this netns)", links)
	for name, path := range opts.Netns {
		l, err := netnsLinks(path)
		if err != nil {
			errs = append(errs, err)
		}
		c.set("links ("+name+")", l)
	}
	if opts.Cgroups != "" {
		cg, err := tree(opts.Cgroups, true)
		if err != nil {
			errs = append(errs, err)
		}
		c.set("cgroups", cg)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		errs = append(errs, fmt.Errorf("leakcheck: mounts: %w", err))
	}
	var mounts []string
	for l := range strings.Lines(string(mi)) {
		// Drop the mount ID and parent ID: a remount of the same thing
		// is the same mount.
		if f := strings.SplitN(strings.TrimSpace(l), " ", 3); len(f) == 3 {
			mounts = append(mounts, f[2])
		}
	}
	c.set("mounts", mounts)
	for name, dir := range opts.Trees {
		t, err := tree(dir, false)
		if err != nil {
			errs = append(errs, err)
		}
		c.set("files ("+name+")", t)
	}
	for name, count := range opts.Counters {
		items, err := count()
		if err != nil {
			errs = append(errs, fmt.Errorf("leakcheck: %s: %w", name, err))
		}
		c.set(name, items)
	}
	return c, errors.Join(errs...)
}

func selfFDs() ([]string, error) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil, fmt.Errorf("leakcheck: fds: %w", err)
	}
	var out []string
	for _, e := range ents {
		link, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err != nil {
			continue // the ReadDir's own descriptor, closed meanwhile
		}
		out = append(out, e.Name()+" -> "+link)
	}
	return out, nil
}

func dirNames(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("leakcheck: %w", err)
	}
	out := make([]string, len(ents))
	for i, e := range ents {
		out[i] = e.Name()
	}
	return out, nil
}

// scanProcs walks /proc: memfds named kiln* in any process, VMM
// processes (by environment or argv) and this process's children.
func scanProcs(opts Options) (memfds, vmms, children []string, err error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, nil, nil, fmt.Errorf("leakcheck: /proc: %w", err)
	}
	self := os.Getpid()
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		dir := filepath.Join("/proc", e.Name())
		cmd, _ := os.ReadFile(filepath.Join(dir, "cmdline"))
		argv := strings.Split(strings.TrimRight(string(cmd), "\x00"), "\x00")
		desc := e.Name() + " " + strings.Join(argv, " ")
		if st, err := os.ReadFile(filepath.Join(dir, "stat")); err == nil {
			// pid (comm) state ppid ...: comm may hold spaces.
			if i := bytes.LastIndexByte(st, ')'); i > 0 {
				if f := strings.Fields(string(st[i+1:])); len(f) > 1 && f[1] == strconv.Itoa(self) {
					children = append(children, desc)
				}
			}
		}
		if isVMM(dir, argv, opts) {
			vmms = append(vmms, desc)
		}
		fds, _ := os.ReadDir(filepath.Join(dir, "fd"))
		for _, fd := range fds {
			link, err := os.Readlink(filepath.Join(dir, "fd", fd.Name()))
			if err == nil && strings.HasPrefix(link, "/memfd:kiln") {
				memfds = append(memfds, e.Name()+"/"+fd.Name()+" -> "+link)
			}
		}
	}
	return memfds, vmms, children, nil
}

func isVMM(dir string, argv []string, opts Options) bool {
	if opts.ProcessEnv != "" {
		if env, err := os.ReadFile(filepath.Join(dir, "environ")); err == nil {
			for kv := range bytes.SplitSeq(env, []byte{0}) {
				if bytes.HasPrefix(kv, []byte(opts.ProcessEnv+"=")) {
					return true
				}
			}
		}
	}
	if len(opts.ProcessArgs) == 0 {
		return false
	}
	i := 0
	for _, a := range argv {
		if i < len(opts.ProcessArgs) && a == opts.ProcessArgs[i] {
			i++
		}
	}
	return i == len(opts.ProcessArgs)
}

func ifaces() ([]string, error) {
	is, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("leakcheck: interfaces: %w", err)
	}
	out := make([]string, len(is))
	for i, l := range is {
		out[i] = l.Name
	}
	return out, nil
}

func netnsLinks(path string) ([]string, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("leakcheck: netns %s: %w", path, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("leakcheck: netns %s: %w", path, err)
	}
	defer h.Close()
	ls, err := h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("leakcheck: links in %s: %w", path, err)
	}
	out := make([]string, len(ls))
	for i, l := range ls {
		out[i] = l.Attrs().Name
	}
	return out, nil
}

// tree lists everything beneath root (relative paths), or only the
// folders when dirsOnly. A root that does not exist counts as empty.
func tree(root string, dirsOnly bool) ([]string, error) {
	var out []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil // gone while we walked, or never there
			}
			return err
		}
		if p == root || (dirsOnly && !d.IsDir()) {
			return nil
		}
		rel, _ := filepath.Rel(root, p)
		out = append(out, rel)
		return nil
	})
	if err != nil {
		return out, fmt.Errorf("leakcheck: walk %s: %w", root, err)
	}
	return out, nil
}

// Table prints every counter of before and after as counter, start, end.
func Table(before, after *Counts) string {
	names := make([]string, 0, len(before.N))
	for n := range before.N {
		names = append(names, n)
	}
	for n := range after.N {
		if _, ok := before.N[n]; !ok {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "counter\tstart\tend\t")
	for _, n := range names {
		mark := ""
		if before.N[n] != after.N[n] {
			mark = "  <-- differs"
		}
		fmt.Fprintf(w, "%s\t%d\t%d\t%s\n", n, before.N[n], after.N[n], mark)
	}
	w.Flush()
	return b.String()
}

// Diff says, per counter that differs, what is extra and what is missing
// in after; "" when every counter is equal.
func Diff(before, after *Counts) string {
	var b strings.Builder
	names := make([]string, 0, len(after.N))
	for n := range after.N {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		if before.N[n] == after.N[n] {
			continue
		}
		fmt.Fprintf(&b, "%s: %d -> %d\n", n, before.N[n], after.N[n])
		was := map[string]int{}
		for _, it := range before.Items[n] {
			was[it]++
		}
		for _, it := range after.Items[n] {
			if was[it] > 0 {
				was[it]--
				continue
			}
			fmt.Fprintf(&b, "  + %s\n", it)
		}
		for it, k := range was {
			for range k {
				fmt.Fprintf(&b, "  - %s\n", it)
			}
		}
	}
	return b.String()
}

// busyThreads lists this process's threads that are blocked in the
// kernel in something other than a futex, a sleep or an epoll wait, each
// as "TID wchan". The Go runtime keeps the OS threads it has made (an
// idle M parks in a futex or waits in the netpoller's epoll_wait, and
// which M does that changes from one reading to the next; sysmon naps in
// nanosleep), so after a busy spell a process holds more threads with
// nothing leaked; what a leak leaves is a goroutine (counted apart, a
// goroutine locked to its thread included) or a thread blocked in some
// other call (a read, an ioctl, a wait), which this counts. A running
// thread (wchan "0": the one taking the counts, mostly) is not counted.
// Where the kernel hides every wait channel, every thread counts.
func busyThreads() ([]string, error) {
	tasks, err := dirNames("/proc/self/task")
	if err != nil {
		return nil, err
	}
	var busy []string
	hidden := true
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join("/proc/self/task", t, "wchan"))
		if err != nil {
			continue // the thread has exited
		}
		w := string(b)
		if w != "0" && w != "" {
			hidden = false
		}
		if w == "0" || w == "" || strings.HasPrefix(w, "futex_") || strings.Contains(w, "nanosleep") || strings.Contains(w, "epoll_wait") {
			continue
		}
		busy = append(busy, t+" "+w)
	}
	if hidden {
		return tasks, nil
	}
	return busy, nil
}

// Settle takes the counts until they equal before's or ctx ends, polling
// every interval: goroutines, threads and processes wind down a little
// after the last Close returns. It returns the last reading and Diff's
// text, with a goroutine dump when goroutines still differ.
func Settle(ctx context.Context, before *Counts, opts Options, interval time.Duration) (*Counts, string, error) {
	for {
		after, err := Take(opts)
		if err != nil {
			return after, "", err
		}
		d := Diff(before, after)
		if d == "" {
			return after, "", nil
		}
		select {
		case <-ctx.Done():
			if before.N["goroutines"] != after.N["goroutines"] {
				var dump bytes.Buffer
				pprof.Lookup("goroutine").WriteTo(&dump, 1)
				d += "goroutines now:\n" + dump.String()
			}
			return after, d, nil
		case <-time.After(interval):
		}
	}
}
