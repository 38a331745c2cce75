package isolator

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/mount"
)

// The fakes here let the isolator's state machine run without root: a
// model of the kernel's mount tables (fakeTable, used through fakeMounter,
// the isolator's Mounter) and a CSI node service that mounts into it
// (fakeNode). Directories are real (under t.TempDir()): mount points are
// resolved inside their root by the real mount.ResolveInRoot (openat2 needs
// no privilege) and removed by the real mount.RemoveEmptyTree; only the
// mounts are modelled.

// hostNS is the agent's mount namespace in the model.
const hostNS = 1

// fakeMount is one mount in the model.
type fakeMount struct {
	id, parent uint64
	ns         uint64 // 0: detached (a CloneTree not moved yet)
	path       string // mount point
	// dev and root say which filesystem and which directory of it the
	// mount shows: a bind shows the same dev and root as its source.
	dev      int
	root     string
	readonly bool
	// peers is the mount's shared peer group (0: not shared).
	peers int
	// rootStat is what mount.RootOf reads of a clone (the source
	// directory's real device and inode), zero for other mounts: the
	// identity the isolator records.
	rootStat unix.Stat_t
}

// fakeTable models the mount tables of the host and of containers' mount
// namespaces. Mount ids start again from the same number after a reboot,
// as the kernel's do.
type fakeTable struct {
	mu      sync.Mutex
	nextID  uint64
	nextDev int
	mounts  []*fakeMount // in mount order: a later one at a path is on top
	devs    map[string]int
	procs   map[int]uint64 // pid -> mount namespace
	trees   map[*os.File]*fakeMount
	// attached: volume id -> the device an attaching plugin's
	// ControllerPublishVolume made for it (a loop device: gone with a
	// reboot, another name when attached again).
	attached   map[string]string
	nextAttach int
}

func newFakeTable() *fakeTable {
	t := &fakeTable{devs: map[string]int{}}
	t.boot()
	return t
}

// boot empties the tables: only the host's root stays, mount ids start
// again, no process runs.
func (t *fakeTable) boot() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.nextID = 20
	t.mounts = []*fakeMount{t.newMount(hostNS, "/", 0, "/")}
	t.procs = map[int]uint64{}
	t.trees = map[*os.File]*fakeMount{}
	t.attached = map[string]string{}
}

func (t *fakeTable) newMount(ns uint64, path string, dev int, root string) *fakeMount {
	t.nextID++
	return &fakeMount{id: t.nextID, ns: ns, path: path, dev: dev, root: root}
}

// dev is the filesystem of a volume: one per volume id, stable across
// boots (a device).
func (t *fakeTable) dev(volumeID string) int {
	if d, ok := t.devs[volumeID]; ok {
		return d
	}
	t.nextDev++
	t.devs[volumeID] = t.nextDev
	return t.nextDev
}

// startProcess gives a container process its own mount namespace, with a
// root mount of its own.
func (t *fakeTable) startProcess(pid int, ns uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.procs[pid] = ns
	t.mounts = append(t.mounts, t.newMount(ns, "/", 0, "/"))
}

// endAll ends every container process (see endProcess).
func (t *fakeTable) endAll() {
	t.mu.Lock()
	pids := slices.Collect(maps.Keys(t.procs))
	t.mu.Unlock()
	for _, pid := range pids {
		t.endProcess(pid)
	}
}

// endProcess ends a container process: its namespace goes, and every
// mount in it.
func (t *fakeTable) endProcess(pid int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	ns := t.procs[pid]
	delete(t.procs, pid)
	t.mounts = slices.DeleteFunc(t.mounts, func(m *fakeMount) bool { return m.ns == ns })
}

// top is the visible mount at path in ns, or nil.
func (t *fakeTable) top(ns uint64, path string) *fakeMount {
	for i := len(t.mounts) - 1; i >= 0; i-- {
		if m := t.mounts[i]; m.ns == ns && m.path == path {
			return m
		}
	}
	return nil
}

// containing is the mount path is on in ns: the top one at the longest
// mount point at or above it.
func (t *fakeTable) containing(ns uint64, path string) *fakeMount {
	var best *fakeMount
	for _, m := range t.mounts {
		if m.ns == ns && within(m.path, path) && (best == nil || len(m.path) >= len(best.path)) {
			best = m
		}
	}
	return best
}

// within reports whether path is at or below dir.
func within(dir, path string) bool {
	return dir == "/" || path == dir || strings.HasPrefix(path, dir+"/")
}

// shows is the filesystem and directory a path shows in ns (what stat
// would compare): the mount's root joined with the rest of the path.
func (t *fakeTable) shows(ns uint64, path string) (int, string) {
	m := t.containing(ns, path)
	return m.dev, filepath.Join(m.root, strings.TrimPrefix(path, m.path))
}

// unmount removes m and every mount on or inside it (its descendants).
func (t *fakeTable) unmount(m *fakeMount) {
	gone := map[uint64]bool{m.id: true}
	for changed := true; changed; {
		changed = false
		for _, x := range t.mounts {
			if !gone[x.id] && gone[x.parent] && x.ns == m.ns {
				gone[x.id], changed = true, true
			}
		}
	}
	t.mounts = slices.DeleteFunc(t.mounts, func(x *fakeMount) bool { return x.ns == m.ns && gone[x.id] })
}

// fakeMounter is the isolator's Mounter on the model, acting in one
// mount namespace.
type fakeMounter struct {
	t  *fakeTable
	ns uint64
}

var _ Mounter = (*fakeMounter)(nil)

func (f *fakeMounter) IsMountPoint(path string) (bool, error) {
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	return f.t.top(f.ns, filepath.Clean(path)) != nil, nil
}

func (f *fakeMounter) List(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	var out []*mountinfo.Info
	for _, m := range f.t.mounts {
		if m.ns != f.ns {
			continue
		}
		info := &mountinfo.Info{ID: int(m.id), Parent: int(m.parent), Major: m.dev, Root: m.root, Mountpoint: m.path}
		if m.peers != 0 {
			info.Optional = fmt.Sprintf("shared:%d", m.peers)
		}
		skip, stop := false, false
		if filter != nil {
			skip, stop = filter(info)
		}
		if !skip {
			out = append(out, info)
		}
		if stop {
			break
		}
	}
	return out, nil
}

// ForeignMounts is the model's: the mounts, in the other namespaces, of
// the filesystem the top mount at target shows, each named by the lowest
// pid of its namespace.
func (f *fakeMounter) ForeignMounts(_ context.Context, target string, _ []string) ([]string, error) {
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	top := f.t.top(f.ns, filepath.Clean(target))
	if top == nil {
		return nil, nil
	}
	var out []string
	for _, m := range f.t.mounts {
		if m.ns == 0 || m.ns == f.ns || m.dev != top.dev {
			continue
		}
		pid := 0
		for p, ns := range f.t.procs {
			if ns == m.ns && (pid == 0 || p < pid) {
				pid = p
			}
		}
		out = append(out, fmt.Sprintf("%s in the mount namespace of pid %d", m.path, pid))
	}
	return out, nil
}

// BlockReadOnly: the model's plugins honour readonly.
func (f *fakeMounter) BlockReadOnly(string) (bool, error) { return true, nil }

func (f *fakeMounter) NamespacesInUse() (map[uint64]int, error) {
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	out := map[uint64]int{hostNS: os.Getpid()}
	for pid, ns := range f.t.procs {
		if low, ok := out[ns]; !ok || pid < low {
			out[ns] = pid
		}
	}
	return out, nil
}

func (f *fakeMounter) MountNamespace(pid int) (uint64, error) {
	if pid == os.Getpid() {
		return hostNS, nil
	}
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	ns, ok := f.t.procs[pid]
	if !ok {
		return 0, fmt.Errorf("mount namespace of pid %d: %w", pid, mount.ErrNoProcess)
	}
	return ns, nil
}

func (f *fakeMounter) InNamespace(pid int, nsIno uint64, fn func(Mounter) error) error {
	f.t.mu.Lock()
	ns, ok := f.t.procs[pid]
	f.t.mu.Unlock()
	switch {
	case !ok:
		return fmt.Errorf("entering the mount namespace of pid %d: %w", pid, mount.ErrNoProcess)
	case ns != nsIno:
		return fmt.Errorf("entering the mount namespace of pid %d: %w", pid, mount.ErrWrongNamespace)
	}
	if err := fn(&fakeMounter{t: f.t, ns: ns}); err != nil {
		return fmt.Errorf("in the mount namespace of pid %d: %w", pid, err)
	}
	return nil
}

// ResolveInRoot is the real one: directories are real.
func (f *fakeMounter) ResolveInRoot(root, unsafePath string, kind mount.TargetKind, uid, gid int) (*os.File, string, error) {
	return mount.ResolveInRoot(root, unsafePath, kind, uid, gid)
}

// ID is a clone's own id, or the id of the mount a handle's path is on.
func (f *fakeMounter) ID(file *os.File) (uint64, error) {
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	if m := f.t.trees[file]; m != nil {
		return m.id, nil
	}
	return f.t.containing(f.ns, filepath.Clean(file.Name())).id, nil
}

// CloneTree makes a detached copy of the mount source is on, showing
// source's directory. Submounts are not copied: the isolator clones only
// published targets, which have none.
func (f *fakeMounter) CloneTree(source string, readOnly bool) (*os.File, error) {
	source = filepath.Clean(source)
	h, err := os.OpenFile(source, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("clone the mount tree at %s: open_tree: %w", source, err)
	}
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	dev, root := f.t.shows(f.ns, source)
	m := f.t.newMount(0, "", dev, root)
	m.readonly = readOnly
	if err := unix.Fstat(int(h.Fd()), &m.rootStat); err != nil {
		h.Close()
		return nil, fmt.Errorf("clone the mount tree at %s: %w", source, err)
	}
	f.t.trees[h] = m
	return h, nil
}

func (f *fakeMounter) MoveTree(tree, target *os.File) error {
	return f.move(tree, target, false)
}

func (f *fakeMounter) MoveTreeBeneath(tree, target *os.File) error {
	return f.move(tree, target, true)
}

// move attaches a clone at target's path, on top or beneath the top
// mount there; a directory onto a directory only, a clone once only.
func (f *fakeMounter) move(tree, target *os.File, beneath bool) error {
	var src, dst unix.Stat_t
	if err := unix.Fstat(int(tree.Fd()), &src); err != nil {
		return fmt.Errorf("fstat tree: %w", err)
	}
	if err := unix.Fstat(int(target.Fd()), &dst); err != nil {
		return fmt.Errorf("fstat target: %w", err)
	}
	if (src.Mode&unix.S_IFMT == unix.S_IFDIR) != (dst.Mode&unix.S_IFMT == unix.S_IFDIR) {
		return fmt.Errorf("move mount tree of %s onto %s: %w", tree.Name(), target.Name(), mount.ErrKind)
	}
	path := filepath.Clean(target.Name())
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	m := f.t.trees[tree]
	if m == nil || m.ns != 0 {
		return fmt.Errorf("move mount tree of %s onto %s: %w", tree.Name(), path, unix.EINVAL)
	}
	m.ns, m.path = f.ns, path
	if !beneath {
		m.parent = f.t.containing(f.ns, path).id
		f.t.mounts = append(f.t.mounts, m)
		return nil
	}
	top := f.t.top(f.ns, path)
	if top == nil {
		m.ns, m.path = 0, ""
		return fmt.Errorf("move mount tree of %s beneath %s: %w", tree.Name(), path, unix.EINVAL)
	}
	m.parent, top.parent = top.parent, m.id
	f.t.mounts = slices.Insert(f.t.mounts, slices.Index(f.t.mounts, top), m)
	return nil
}

// UnmountOwn follows mount.UnmountOwn's contract on the model: below a
// root that is gone nothing is mounted (unless the id is found
// elsewhere: refused); the mount with the recorded id (and the recorded
// root, or else the source's filesystem and directory) is
// removed where it is, if that is below root; a mount on top of it is
// refused (ErrCovered); with id 0, the top mount at the mount point is
// ours only if it is not the recorded parent and shows the source.
func (f *fakeMounter) UnmountOwn(_ context.Context, root, mountPoint string, id mount.Identity) (mount.Result, error) {
	fail := func(err error) (mount.Result, error) {
		return mount.Result{}, fmt.Errorf("unmount mount %d at %s: %w", id.ID, mountPoint, err)
	}
	root, mountPoint = filepath.Clean(root), filepath.Clean(mountPoint)
	if !within(root, mountPoint) {
		return fail(fmt.Errorf("%w: %s is not below %s", mount.ErrOutsideRoot, mountPoint, root))
	}
	_, serr := os.Stat(root)
	if serr != nil && !errors.Is(serr, fs.ErrNotExist) {
		return fail(serr)
	}
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	showsSource := func(m *fakeMount) bool { return f.t.showsSource(m, id) }
	if serr != nil {
		// The root is gone: so is any mount that was below it, unless
		// the root moved with it.
		for _, x := range f.t.mounts {
			if x.ns == f.ns && x.id == id.ID && id.ID != 0 && x.dev == f.t.containing(hostNS, id.Source).dev {
				return fail(fmt.Errorf("%w: root %s is gone and the mount is at %s", mount.ErrOutsideRoot, root, x.path))
			}
		}
		return mount.Result{Where: mount.Gone}, nil
	}
	if id.ID == 0 {
		top := f.t.top(f.ns, mountPoint)
		if top == nil || top.id == id.Parent || !showsSource(top) {
			return mount.Result{Where: mount.Gone}, nil
		}
		id.ID = top.id
	}
	m := f.t.byID(f.ns, id)
	if m == nil {
		return mount.Result{Where: mount.Gone}, nil
	}
	where := mount.AtRecorded
	if m.path != mountPoint {
		if !within(root, m.path) {
			return fail(fmt.Errorf("%w: mount %d is at %s", mount.ErrOutsideRoot, m.id, m.path))
		}
		where = mount.Moved
	}
	if f.t.top(f.ns, m.path) != m {
		return fail(mount.ErrCovered)
	}
	f.t.unmount(m)
	return mount.Result{Where: where, Path: m.path}, nil
}

// Locate is where the mount of identity id is in the namespace.
func (f *fakeMounter) Locate(id mount.Identity) (string, error) {
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	if m := f.t.byID(f.ns, id); m != nil && id.ID != 0 {
		return m.path, nil
	}
	return "", nil
}

// byID is the mount of namespace ns with id's id and root (t.mu held).
func (t *fakeTable) byID(ns uint64, id mount.Identity) *fakeMount {
	var m *fakeMount
	for _, x := range t.mounts {
		if x.ns == ns && x.id == id.ID {
			m = x
		}
	}
	if m == nil || !t.showsSource(m, id) {
		return nil
	}
	return m
}

// showsSource reports whether m shows what id recorded: its root, or
// (not recorded) the directory id.Source shows (t.mu held).
func (t *fakeTable) showsSource(m *fakeMount, id mount.Identity) bool {
	if id.RootIno != 0 {
		// Recorded, the root's identity decides; Source is not
		// looked up (mount.Identity).
		return uint64(m.rootStat.Dev) == id.RootDev && m.rootStat.Ino == id.RootIno
	}
	if id.Source == "" {
		return true
	}
	dev, dir := t.shows(hostNS, filepath.Clean(id.Source))
	return m.dev == dev && m.root == dir
}

// RemoveEmptyTree refuses a tree with a mount at or below it (in the
// model), then is the real one.
func (f *fakeMounter) RemoveEmptyTree(dir string) error {
	if err := f.mountedWithin(dir); err != nil {
		return err
	}
	return mount.RemoveEmptyTree(dir)
}

func (f *fakeMounter) CheckEmptyTree(dir string) error {
	if err := f.mountedWithin(dir); err != nil {
		return err
	}
	return mount.CheckEmptyTree(dir)
}

func (f *fakeMounter) RecycleTree(pool *mount.TreePool, tree string) error {
	if err := f.mountedWithin(tree); err != nil {
		return err
	}
	return pool.Put(tree)
}

func (f *fakeMounter) TakeTree(pool *mount.TreePool, tree string) error {
	_, err := pool.Take(tree)
	return err
}

// mountedWithin fails with mount.ErrMounted when the model has a mount at
// or below dir in f's namespace.
func (f *fakeMounter) mountedWithin(dir string) error {
	dir = filepath.Clean(dir)
	f.t.mu.Lock()
	defer f.t.mu.Unlock()
	for _, m := range f.t.mounts {
		if m.ns == f.ns && m.path != "/" && within(dir, m.path) {
			return fmt.Errorf("tree %s: %s: %w", dir, m.path, mount.ErrMounted)
		}
	}
	return nil
}

// fakeNode is a CSI node service that mounts into the model: staging
// mounts the volume's filesystem, publishing binds it (or, without
// STAGE_UNSTAGE, mounts it) at the target. Every call is idempotent, as
// CSI asks. It records the calls and what a real plugin would refuse
// (violations).
type fakeNode struct {
	t            *fakeTable
	stageUnstage bool
	// targetExists: the plugin expects the target to exist (Mesos's
	// target_path_exists); else it makes its target, as CSI says.
	targetExists bool
	// maxVolumes is its NodeGetInfo max_volumes_per_node (0: none).
	maxVolumes int64
	// attach: its controller attaches volumes (PUBLISH_UNPUBLISH_VOLUME):
	// it is the Controller too, node calls need the publish_context.
	attach bool
	// topology is its NodeGetInfo accessible_topology.
	topology map[string]string
	// targets are the targets of its NodePublishVolume calls that
	// existed when it was called.
	existed []string

	mu         sync.Mutex
	calls      []string
	violations []string
	// fail, when set, is asked before each call; an error it returns is
	// the call's answer, nothing done.
	fail func(rpc, volumeID string) error
}

func (n *fakeNode) record(rpc, volumeID, path string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.calls = append(n.calls, rpc+" "+volumeID+" "+path)
	if n.fail != nil {
		return n.fail(rpc, volumeID)
	}
	return nil
}

func (n *fakeNode) violation(format string, args ...any) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	v := fmt.Sprintf(format, args...)
	n.violations = append(n.violations, v)
	return status.Error(codes.FailedPrecondition, v)
}

// mountAt mounts the volume's filesystem (or binds its staged mount) at
// path, unless it is already the top mount there.
func (n *fakeNode) mountAt(volumeID, path string, bindOf string, readonly bool) error {
	if st, err := os.Stat(path); err != nil || !st.IsDir() {
		return status.Errorf(codes.Internal, "mount point %s: not a directory (%v)", path, err)
	}
	n.t.mu.Lock()
	defer n.t.mu.Unlock()
	dev := n.t.dev(volumeID)
	if top := n.t.top(hostNS, path); top != nil && top.dev == dev {
		return nil
	}
	root := "/"
	if bindOf != "" {
		src := n.t.top(hostNS, bindOf)
		if src == nil || src.dev != dev {
			return n.violation("publish of %s: staging path %s not staged", volumeID, bindOf)
		}
		root = src.root
	}
	m := n.t.newMount(hostNS, path, dev, root)
	m.parent, m.readonly = n.t.containing(hostNS, path).id, readonly
	n.t.mounts = append(n.t.mounts, m)
	return nil
}

// unmountAt unmounts the volume's mounts at path (none: done).
func (n *fakeNode) unmountAt(volumeID, path string) {
	n.t.mu.Lock()
	defer n.t.mu.Unlock()
	dev := n.t.dev(volumeID)
	for m := n.t.top(hostNS, path); m != nil && m.dev == dev; m = n.t.top(hostNS, path) {
		n.t.unmount(m)
	}
}

// fakeNodeID is the node id of the model's host.
const fakeNodeID = "node-1"

// ControllerPublishVolume attaches the volume: a device of its own,
// named in the publish_context; the same answer while attached.
func (n *fakeNode) ControllerPublishVolume(_ context.Context, in *csi.ControllerPublishVolumeRequest, _ ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	if err := n.record("ControllerPublishVolume", in.GetVolumeId(), ""); err != nil {
		return nil, err
	}
	if !n.attach || in.GetNodeId() != fakeNodeID {
		return nil, n.violation("ControllerPublishVolume of %s to node %q: attach %v", in.GetVolumeId(), in.GetNodeId(), n.attach)
	}
	n.t.mu.Lock()
	defer n.t.mu.Unlock()
	dev, ok := n.t.attached[in.GetVolumeId()]
	if !ok {
		n.t.nextAttach++
		dev = fmt.Sprintf("/dev/fake%d", n.t.nextAttach)
		n.t.attached[in.GetVolumeId()] = dev
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{"device": dev}}, nil
}

// ControllerUnpublishVolume detaches the volume; refused (a violation)
// while its filesystem is mounted anywhere.
func (n *fakeNode) ControllerUnpublishVolume(_ context.Context, in *csi.ControllerUnpublishVolumeRequest, _ ...grpc.CallOption) (*csi.ControllerUnpublishVolumeResponse, error) {
	if err := n.record("ControllerUnpublishVolume", in.GetVolumeId(), ""); err != nil {
		return nil, err
	}
	n.t.mu.Lock()
	dev := n.t.dev(in.GetVolumeId())
	var busy []string
	for _, m := range n.t.mounts {
		if m.dev == dev {
			busy = append(busy, m.path)
		}
	}
	if len(busy) == 0 {
		delete(n.t.attached, in.GetVolumeId())
	}
	n.t.mu.Unlock()
	if len(busy) > 0 {
		return nil, n.violation("ControllerUnpublishVolume of %s while mounted at %v", in.GetVolumeId(), busy)
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// checkAttached refuses a node call of an attaching plugin whose
// publish_context does not name the volume's current device (never
// attached, detached, or attached again since).
func (n *fakeNode) checkAttached(rpc, volumeID string, pc map[string]string) error {
	if !n.attach {
		return nil
	}
	n.t.mu.Lock()
	dev, ok := n.t.attached[volumeID]
	n.t.mu.Unlock()
	if !ok || pc["device"] != dev {
		return n.violation("%s of %s with publish_context %v: attached %q", rpc, volumeID, pc, dev)
	}
	return nil
}

func (n *fakeNode) NodeStageVolume(_ context.Context, in *csi.NodeStageVolumeRequest, _ ...grpc.CallOption) (*csi.NodeStageVolumeResponse, error) {
	if err := n.record("NodeStageVolume", in.GetVolumeId(), in.GetStagingTargetPath()); err != nil {
		return nil, err
	}
	if err := n.checkAttached("NodeStageVolume", in.GetVolumeId(), in.GetPublishContext()); err != nil {
		return nil, err
	}
	if !n.stageUnstage {
		return nil, n.violation("NodeStageVolume of %s: the plugin has no STAGE_UNSTAGE_VOLUME", in.GetVolumeId())
	}
	if err := n.mountAt(in.GetVolumeId(), in.GetStagingTargetPath(), "", false); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (n *fakeNode) NodePublishVolume(_ context.Context, in *csi.NodePublishVolumeRequest, _ ...grpc.CallOption) (*csi.NodePublishVolumeResponse, error) {
	if err := n.record("NodePublishVolume", in.GetVolumeId(), in.GetTargetPath()); err != nil {
		return nil, err
	}
	if err := n.checkAttached("NodePublishVolume", in.GetVolumeId(), in.GetPublishContext()); err != nil {
		return nil, err
	}
	if n.stageUnstage != (in.GetStagingTargetPath() != "") {
		return nil, n.violation("NodePublishVolume of %s: staging_target_path %q with STAGE_UNSTAGE %v", in.GetVolumeId(), in.GetStagingTargetPath(), n.stageUnstage)
	}
	target := in.GetTargetPath()
	if _, err := os.Lstat(target); err == nil {
		n.mu.Lock()
		n.existed = append(n.existed, target)
		n.mu.Unlock()
	} else if n.targetExists {
		return nil, status.Errorf(codes.Internal, "target %s: %v", target, err)
	} else if err := os.Mkdir(target, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "target %s: %v", target, err)
	}
	if err := n.mountAt(in.GetVolumeId(), in.GetTargetPath(), in.GetStagingTargetPath(), in.GetReadonly()); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (n *fakeNode) NodeUnpublishVolume(_ context.Context, in *csi.NodeUnpublishVolumeRequest, _ ...grpc.CallOption) (*csi.NodeUnpublishVolumeResponse, error) {
	if err := n.record("NodeUnpublishVolume", in.GetVolumeId(), in.GetTargetPath()); err != nil {
		return nil, err
	}
	n.unmountAt(in.GetVolumeId(), in.GetTargetPath())
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// NodeUnstageVolume refuses while the volume's filesystem is mounted
// anywhere but the staging path (a container still has it): a real
// plugin could not detach its device.
func (n *fakeNode) NodeUnstageVolume(_ context.Context, in *csi.NodeUnstageVolumeRequest, _ ...grpc.CallOption) (*csi.NodeUnstageVolumeResponse, error) {
	if err := n.record("NodeUnstageVolume", in.GetVolumeId(), in.GetStagingTargetPath()); err != nil {
		return nil, err
	}
	n.t.mu.Lock()
	dev := n.t.dev(in.GetVolumeId())
	var busy []string
	for _, m := range n.t.mounts {
		if m.dev == dev && m.path != in.GetStagingTargetPath() {
			busy = append(busy, m.path)
		}
	}
	n.t.mu.Unlock()
	if len(busy) > 0 {
		return nil, n.violation("NodeUnstageVolume of %s while mounted at %v", in.GetVolumeId(), busy)
	}
	n.unmountAt(in.GetVolumeId(), in.GetStagingTargetPath())
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// setFail sets fail (nil: every call answers).
func (n *fakeNode) setFail(fail func(rpc, volumeID string) error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.fail = fail
}

// takeCalls returns what the node service was asked ("RPC volume path"
// each) since the last time, and forgets it.
func (n *fakeNode) takeCalls() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	c := n.calls
	n.calls = nil
	return c
}

// takeViolations likewise returns what a real plugin would have refused.
func (n *fakeNode) takeViolations() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	v := n.violations
	n.violations = nil
	return v
}

// nodePlugins has three plugins: "loop" with STAGE_UNSTAGE_VOLUME,
// "plain" without, and "attach" with it whose controller attaches volumes. A plugin that is down keeps Node waiting until its
// context ends, as the agent's does.
type nodePlugins struct {
	nodes map[string]*fakeNode
	mu    sync.Mutex
	down  map[string]bool
}

func newNodePlugins(t *fakeTable) *nodePlugins {
	return &nodePlugins{
		nodes: map[string]*fakeNode{"loop": {t: t, stageUnstage: true}, "plain": {t: t}, "attach": {t: t, stageUnstage: true, attach: true}},
		down:  map[string]bool{},
	}
}

func (p *nodePlugins) Lookup(typ string) (Plugin, error) {
	if p.nodes[typ] == nil {
		return Plugin{}, fmt.Errorf("plugin %q: %w", typ, ErrUnknownPlugin)
	}
	return Plugin{Type: typ, Name: "default", TargetPathExists: p.nodes[typ].targetExists}, nil
}

func (p *nodePlugins) Node(ctx context.Context, typ string) (Node, error) {
	n := p.nodes[typ]
	if n == nil {
		return Node{}, fmt.Errorf("plugin %q: %w", typ, ErrUnknownPlugin)
	}
	p.mu.Lock()
	down := p.down[typ]
	p.mu.Unlock()
	if down {
		<-ctx.Done()
		return Node{}, fmt.Errorf("plugin %s: %w: not ready: %w", typ, ErrUnavailable, ctx.Err())
	}
	node := Node{Client: n, StageUnstage: n.stageUnstage, MaxVolumes: n.maxVolumes, NodeID: fakeNodeID, Topology: n.topology}
	if n.attach {
		node.Controller = n
	}
	return node, nil
}

func (p *nodePlugins) setDown(typ string, down bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.down[typ] = down
}
