package mount

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// ForeignMounts lists where the volume mounted at target (the top mount
// there, in the calling thread's mount namespace: the agent's) is also
// mounted in the host's other mount namespaces, where containers live: the
// mounts of the same device (major:minor) whose root is the target
// mount's root or, for a directory, beneath it (a whole filesystem when
// the target mount's root is its root; a plugin that publishes a directory
// of a larger filesystem, a host path, shares the device with every mount
// of that filesystem, and those are not the volume's), except
//
//   - the copies of the mounts at target and at the paths own (the
//     volume's own staging and target paths) that propagation ties to
//     them (a peer of, or a slave to, the peer group of the agent's
//     mount at that path): the unmount of the agent's mount removes them
//     too. Such copies are what a namespace made as a slave of the
//     host's (a systemd service's, say) holds;
//   - in a namespace whose processes have the agent's root directory (not
//     a container's: a host process that made itself a mount namespace,
//     with unshare(1) say, while the volume was mounted), the private
//     copies at those same paths: on a host whose / is private, every
//     namespace made then holds one, whoever made it, and nobody uses
//     them (they are in the agent's work directory). A container's
//     namespace never has the host's root: every mount of the volume a
//     container holds counts, wherever it is.
//
// The agent's own namespace is not looked at: its mounts are the agent's
// or root's (a bind root makes there is root's business), and its table,
// thousands of lines on a busy host, would cost milliseconds a call. The
// agent's own mounts are looked up one at a time with statmount(2)
// (Linux 6.8; before it, the agent's table is read once per scan).
//
// Each is described as "<mount point> in the mount namespace of pid <pid>"
// (the mount point as that process sees it, from its root; one pid per
// namespace). A namespace no process holds (a descriptor or a bind mount
// of its nsfs file keeps it; the kernel lists it) is read with
// listmount(2) (Linux 6.11), its mounts described as "<mount point> in
// mount namespace <inode>, which no process holds ..." (from the
// namespace's root); all of them count, wherever they are. Nothing
// mounted at target: nil.
//
// A process's table lacks the mounts outside its root (one that
// chroot(2)ed hides the rest of its namespace): where the kernel lists a
// namespace's mounts (listmount, Linux 6.11) and that list is longer than
// the process's table, the namespace is read from it instead.
//
// The namespaces are found in one pass over /proc/[0-9]*/ns/mnt, each
// read once whatever the number of its processes (a process that exits
// meanwhile is skipped, and so is one whose namespace the caller may not
// read: root has ptrace access to the processes of the containers it
// runs), and only the lines of the volume's device are parsed. The pass
// costs microseconds a process; where the kernel lists mount namespaces
// itself (nsfs NS_MNT_GET_NEXT, recent Linux), a scan that finds the same
// namespaces as the last pass, each still holding the process that pass
// found in it (or none, as then), reads them without a pass. Concurrent calls share scans: a call waits for the next scan to
// start (one begun before the call would miss the caller's latest
// unmounts) and that one scan answers every call waiting for it.
func ForeignMounts(ctx context.Context, target string, own []string) ([]string, error) {
	q, err := newForeignQuery(target, own)
	if err != nil {
		return nil, fmt.Errorf("mounts elsewhere of %s: %w", target, err)
	}
	if err := foreign.ask(ctx, q); err != nil {
		return nil, fmt.Errorf("mounts elsewhere of %s: %w", target, err)
	}
	if q.err != nil {
		return nil, fmt.Errorf("mounts elsewhere of %s: %w", q.target, q.err)
	}
	return q.out, nil
}

// foreignQuery is one ForeignMounts call: its paths, then, once its scan
// is done, its answer.
type foreignQuery struct {
	target string   // canonical
	owned  []string // canonical, target included
	// Set by the scan.
	top    *mountinfo.Info // nil: nothing mounted at target
	dev    string          // top's "major:minor"
	dir    bool            // target is a directory
	groups map[string][]string
	out    []string
	err    error
}

func newForeignQuery(target string, own []string) (*foreignQuery, error) {
	target, err := Canonical(target)
	if err != nil {
		return nil, err
	}
	q := &foreignQuery{target: target, owned: []string{target}, groups: map[string][]string{}}
	for _, p := range own {
		if c, err := Canonical(p); err == nil {
			q.owned = append(q.owned, c)
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
	}
	return q, nil
}

// same reports whether m mounts the query's volume: the same device and a
// root that is the volume's own directory or one beneath it (not the
// filesystem around it: a plugin may publish a directory of the host's
// root filesystem).
func (q *foreignQuery) same(m *mountinfo.Info) bool {
	top := q.top
	return m.Major == top.Major && m.Minor == top.Minor &&
		(m.Root == top.Root || q.dir && (top.Root == "/" || strings.HasPrefix(m.Root, top.Root+"/")))
}

// scanner batches ForeignMounts calls into scans (see ForeignMounts).
type scanner struct {
	mu      sync.Mutex
	next    *scanBatch // the calls waiting for the next scan
	running bool
	// pids is a process in each mount namespace the last /proc pass
	// found, by namespace, and orphans the namespaces the kernel listed
	// then that it found no process in; the scanning goroutine alone uses
	// them.
	pids    map[uint64]int
	orphans map[uint64]bool
}

type scanBatch struct {
	queries []*foreignQuery
	done    chan struct{}
}

// foreign is the process's scanner: a scan covers the whole host.
var foreign scanner

// agentNamespace is the inode of the agent's mount namespace, looked up
// once (a stat through /proc/thread-self was a third of a scan's cost).
// It is the namespace of every thread the scanning goroutine can run on:
// a thread moved into another namespace (InNamespace) is locked to its
// goroutine while there, and never returned to the others. A failed
// look-up is not kept: the next scan tries again.
func agentNamespace() (uint64, error) {
	if ino := selfNamespace.Load(); ino != 0 {
		return ino, nil
	}
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/mnt", &st); err != nil {
		return 0, fmt.Errorf("the agent's mount namespace: %w", err)
	}
	selfNamespace.Store(st.Ino)
	return st.Ino, nil
}

// selfNamespace caches agentNamespace's answer (0: not looked up yet).
var selfNamespace atomic.Uint64

// ask adds q to the next scan and waits until it is done or ctx ends (the
// scan then goes on for the others; q is not read again).
func (s *scanner) ask(ctx context.Context, q *foreignQuery) error {
	s.mu.Lock()
	if s.next == nil {
		s.next = &scanBatch{done: make(chan struct{})}
	}
	b := s.next
	b.queries = append(b.queries, q)
	if !s.running {
		s.running = true
		go s.run()
	}
	s.mu.Unlock()
	select {
	case <-b.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// run scans for the waiting batches, one after the other, until none is
// left.
func (s *scanner) run() {
	for {
		s.mu.Lock()
		b := s.next
		s.next = nil
		if b == nil {
			s.running = false
			s.mu.Unlock()
			return
		}
		s.mu.Unlock()
		if err := s.scan(b.queries); err != nil {
			for _, q := range b.queries {
				if q.err == nil {
					q.err = err
				}
			}
		}
		close(b.done)
	}
}

// scan answers queries: the facts of each query's own mounts (statmount,
// or one read of the agent's table where the kernel has no statmount; a
// query whose target cannot be looked up gets its own error), then one
// read of every other mount namespace's table, of which only the lines of
// the queries' devices are parsed.
func (s *scanner) scan(queries []*foreignQuery) error {
	self, err := agentNamespace()
	if err != nil {
		return err
	}
	own := ownMounts{}
	byDev := map[string][]*foreignQuery{}
	for _, q := range queries {
		if q.err = q.lookOwn(&own); q.err == nil && q.top != nil {
			byDev[q.dev] = append(byDev[q.dev], q)
		}
	}
	if len(byDev) == 0 {
		return nil
	}
	var rootSt unix.Stat_t
	if err := unix.Stat("/", &rootSt); err != nil {
		return err
	}
	for pass := false; ; pass = true {
		nss, known, err := s.namespaces(self, pass)
		if err != nil {
			return err
		}
		for _, q := range queries {
			q.out = nil
		}
		if stale, err := readNamespaces(nss, byDev, rootSt); err != nil || !stale || !known {
			return err
		}
	}
}

// namespace is a mount namespace other than the agent's and the
// processes in it (their pids, in /proc's order); one no process holds
// has none, and its kernel id (id) to read it by.
type namespace struct {
	ino  uint64
	pids []int
	id   uint64
}

// namespaces lists the host's other mount namespaces with their
// processes: from the pids the last pass found (known) when the kernel's
// list of namespaces (mountNamespaces) shows the same ones, each still
// holding its process or still holding none (unless pass), else from a
// pass over /proc. The namespaces the kernel lists that no process is in
// (a descriptor or a bind mount of the namespace keeps it) come with their
// ids.
func (s *scanner) namespaces(self uint64, pass bool) (nss []namespace, known bool, err error) {
	listed, lerr := mountNamespaces()
	if lerr != nil {
		listed = nil // a kernel that does not list them
	}
	if !pass && s.pids != nil && listed != nil {
		if nss, ok := s.known(self, listed); ok {
			return nss, true, nil
		}
	}
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return nil, false, err
	}
	at := map[uint64]int{}
	s.pids, s.orphans = map[uint64]int{}, map[uint64]bool{}
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid <= 0 {
			continue
		}
		ns, err := MountNamespace(pid)
		if err != nil || ns == self {
			// Gone, a zombie, or one the agent may not look at
			// (EACCES: a process it has no ptrace access to, such as a
			// sandbox's own init): failing every teardown for it would
			// keep every volume published.
			continue
		}
		i, seen := at[ns]
		if !seen {
			i, at[ns] = len(nss), len(nss)
			nss = append(nss, namespace{ino: ns})
			s.pids[ns] = pid
		}
		nss[i].pids = append(nss[i].pids, pid)
	}
	for _, r := range listed {
		if i, seen := at[r.ino]; seen {
			nss[i].id = r.id
		} else if r.ino != self {
			nss = append(nss, namespace{ino: r.ino, id: r.id})
			s.orphans[r.ino] = true
		}
	}
	return nss, false, nil
}

// known is the namespaces of the last pass, if the kernel lists exactly
// those besides self, each holding the process the pass found in it or,
// for one the pass found none in, still listed.
func (s *scanner) known(self uint64, listed []nsRef) ([]namespace, bool) {
	var nss, held []namespace
	for _, r := range listed {
		if r.ino == self {
			continue
		}
		if s.orphans[r.ino] {
			held = append(held, namespace{ino: r.ino, id: r.id})
			continue
		}
		pid, ok := s.pids[r.ino]
		if !ok {
			return nil, false
		}
		if cur, err := MountNamespace(pid); err != nil || cur != r.ino {
			return nil, false
		}
		nss = append(nss, namespace{ino: r.ino, pids: []int{pid}, id: r.id})
	}
	slices.SortFunc(nss, func(a, b namespace) int { return a.pids[0] - b.pids[0] })
	return append(nss, held...), true
}

// readNamespaces reads the mounts of the queries' devices in each of nss,
// through the first of its processes still there (for one no process
// holds, with listmount: its mounts count whatever their path, since no
// root directory tells a host-made namespace's copies apart), and adds
// what counts to the queries' answers. stale: every process of one
// namespace is gone (for a known namespace, a pass finds others, or that
// it is gone). A namespace no process holds that cannot be read (gone
// meanwhile, or a kernel before 6.11, which cannot list another
// namespace's mounts) is not examined.
func readNamespaces(nss []namespace, byDev map[string][]*foreignQuery, rootSt unix.Stat_t) (stale bool, err error) {
	for _, ns := range nss {
		if len(ns.pids) == 0 {
			ms, err := nsMounts(ns.id, func(m *mountinfo.Info) bool { return byDev[devOf(m)] != nil })
			if err == nil {
				addForeign(ms, byDev, func() bool { return false }, fmt.Sprintf("in mount namespace %d, which no process holds (a descriptor or a bind mount of it keeps it)", ns.ino))
			}
			continue
		}
		var ms []*mountinfo.Info
		var seen int
		pid := 0
		for _, p := range ns.pids {
			if ms, seen, err = processMounts(p, byDev); err == nil {
				pid = p
				break
			}
			if !processGone(err) {
				return false, err
			}
		}
		if pid == 0 {
			return true, nil
		}
		if ns.id != 0 {
			// A process's table lacks the mounts outside its root: one
			// that chroot(2)ed (into an empty directory, say) hides
			// the rest of its namespace. The kernel's list of the
			// namespace's mounts says whether any are missing; if so,
			// they are all read from it.
			if ids, err := nsMountIDs(ns.id); err == nil && len(ids) != seen {
				if all, err := statmountIDs(ns.id, ids, func(m *mountinfo.Info) bool { return byDev[devOf(m)] != nil }); err == nil {
					ms = all
				}
			}
		}
		hostRoot := sync.OnceValue(func() bool { return sameRoot(pid, rootSt) })
		addForeign(ms, byDev, hostRoot, fmt.Sprintf("in the mount namespace of pid %d", pid))
	}
	return false, nil
}

// addForeign adds to the queries' answers the mounts of ms (of one
// namespace, described by where) that are theirs and count: not tied to
// their own mounts by propagation, and not at one of their own paths in a
// namespace with the agent's root (hostRoot).
func addForeign(ms []*mountinfo.Info, byDev map[string][]*foreignQuery, hostRoot func() bool, where string) {
	for _, m := range ms {
		for _, q := range byDev[devOf(m)] {
			if !q.same(m) || propagated(m, q.groups) {
				continue
			}
			if slices.Contains(q.owned, m.Mountpoint) && hostRoot() {
				continue
			}
			q.out = append(q.out, m.Mountpoint+" "+where)
		}
	}
}

// lookOwn sets the query's facts from the agent's namespace: the top
// mount at its target (none: nothing to look for), and the peer groups
// of the top mounts at its own paths.
func (q *foreignQuery) lookOwn(own *ownMounts) error {
	top, err := own.top(q.target)
	if err != nil || top == nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Stat(q.target, &st); err != nil {
		return err
	}
	q.top, q.dir, q.dev = top, st.Mode&unix.S_IFMT == unix.S_IFDIR, devOf(top)
	for _, p := range q.owned {
		m, err := own.top(p)
		if err != nil {
			return err
		}
		if m != nil && q.same(m) {
			if g := PeerGroup(m.Optional, "shared:"); g != "" {
				q.groups[p] = append(q.groups[p], g)
			}
		}
	}
	return nil
}

// ownMounts looks up mounts in the agent's namespace, for one scan: with
// statmount (Linux 6.8) one mount at a time, else from the agent's mount
// table, read once.
type ownMounts struct {
	noStatmount bool
	raw         []byte
}

// top is the top mount at path (canonical), nil if none.
func (o *ownMounts) top(path string) (*mountinfo.Info, error) {
	if mounted, err := IsMountPoint(path); err != nil || !mounted {
		return nil, err
	}
	if !o.noStatmount {
		m, err := statmount(path)
		if !errors.Is(err, errNoStatmount) {
			return m, err
		}
		o.noStatmount = true
	}
	if o.raw == nil {
		raw, err := readThreadTable()
		if err != nil {
			return nil, err
		}
		o.raw = raw
	}
	return mountOf(o.raw, path)
}

// devOf is m's device, "major:minor".
func devOf(m *mountinfo.Info) string { return fmt.Sprintf("%d:%d", m.Major, m.Minor) }

// processMounts reads the mounts of pid's mount table whose device is one
// of devs', and says how many mounts the table has.
func processMounts(pid int, devs map[string][]*foreignQuery) (ms []*mountinfo.Info, seen int, err error) {
	raw, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "mountinfo"))
	if err != nil {
		return nil, 0, err
	}
	ms, err = deviceMounts(raw, devs)
	return ms, bytes.Count(raw, []byte{'\n'}), err
}

// deviceMounts parses the lines of the mount table raw whose device
// (field 3, "major:minor") is one of devs'; other lines are skipped
// unparsed.
func deviceMounts(raw []byte, devs map[string][]*foreignQuery) ([]*mountinfo.Info, error) {
	var lines []byte
	for line := range bytes.Lines(raw) {
		if _, ok := devs[string(field(line, 2))]; ok {
			lines = append(lines, line...)
		}
	}
	if len(lines) == 0 {
		return nil, nil
	}
	return mountinfo.GetMountsFromReader(bytes.NewReader(lines), nil)
}

// mountOf parses the entry of the top mount at path (canonical, a mount
// point) from the mount table raw: the mount whose id statx gives for
// path.
func mountOf(raw []byte, path string) (*mountinfo.Info, error) {
	id, err := mountIDAt(unix.AT_FDCWD, path)
	if errors.Is(err, errNoMountID) {
		// Before Linux 5.8: the last entry at path is on top.
		ms, err := mountinfo.GetMountsFromReader(bytes.NewReader(raw), mountinfo.SingleEntryFilter(path))
		if err != nil || len(ms) == 0 {
			return nil, err
		}
		return ms[len(ms)-1], nil
	}
	if err != nil {
		return nil, &os.PathError{Op: "statx", Path: path, Err: err}
	}
	want := strconv.AppendUint(nil, id, 10)
	for line := range bytes.Lines(raw) {
		if bytes.Equal(field(line, 0), want) {
			ms, err := mountinfo.GetMountsFromReader(bytes.NewReader(line), nil)
			if err != nil || len(ms) == 0 {
				return nil, err
			}
			return ms[0], nil
		}
	}
	return nil, fmt.Errorf("mount %d at %s is not in the mount table", id, path)
}

// field is the n-th space-separated field of a mount table line (0-based),
// or nil.
func field(line []byte, n int) []byte {
	for range n {
		i := bytes.IndexByte(line, ' ')
		if i < 0 {
			return nil
		}
		line = line[i+1:]
	}
	if i := bytes.IndexByte(line, ' '); i >= 0 {
		return line[:i]
	}
	return nil
}

// sameRoot reports whether pid's root directory is root (the caller's);
// a process gone meanwhile has not.
func sameRoot(pid int, root unix.Stat_t) bool {
	var st unix.Stat_t
	err := unix.Stat("/proc/"+strconv.Itoa(pid)+"/root", &st)
	return err == nil && st.Dev == root.Dev && st.Ino == root.Ino
}

// propagated reports whether m, in another namespace, is a copy of one of
// the caller's own mounts at the same path that propagation ties to it.
func propagated(m *mountinfo.Info, groups map[string][]string) bool {
	for _, tag := range []string{"shared:", "master:"} {
		if g := PeerGroup(m.Optional, tag); g != "" && slices.Contains(groups[m.Mountpoint], g) {
			return true
		}
	}
	return false
}

// PeerGroup is the peer group a mountinfo line's optional fields give
// with tag ("shared:" or "master:"), or "".
func PeerGroup(optional, tag string) string {
	for _, f := range strings.Fields(optional) {
		if g, ok := strings.CutPrefix(f, tag); ok {
			return g
		}
	}
	return ""
}
