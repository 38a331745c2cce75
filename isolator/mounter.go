package isolator

import (
	"context"
	"os"

	"github.com/moby/sys/mountinfo"

	"github.com/csiagent/csiagent/internal/optrace"
	"github.com/csiagent/csiagent/mount"
)

// Mounter is the mount work the isolator does: the functions of package
// mount it calls, each with the contract of the function of the same name
// there. Config.Mounts nil means the kernel's (package mount itself);
// tests put a model of the mount table in its place, so that the state
// machine runs without root.
type Mounter interface {
	IsMountPoint(path string) (bool, error)
	List(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error)
	MountNamespace(pid int) (uint64, error)
	// InNamespace runs f in the mount namespace of pid, checked against
	// nsIno; f does its mount work there through the Mounter it is
	// given, on its own goroutine (as with mount.InNamespace, goroutines
	// f starts are not in the namespace).
	InNamespace(pid int, nsIno uint64, f func(Mounter) error) error
	ResolveInRoot(root, unsafePath string, kind mount.TargetKind, uid, gid int) (*os.File, string, error)
	ID(f *os.File) (uint64, error)
	CloneTree(source string, readOnly bool) (*os.File, error)
	MoveTree(tree, target *os.File) error
	MoveTreeBeneath(tree, target *os.File) error
	UnmountOwn(ctx context.Context, root, mountPoint string, id mount.Identity) (mount.Result, error)
	// Locate is where the mount of identity id is, wherever it moved;
	// "" when it is gone (as mount.Locate).
	Locate(id mount.Identity) (string, error)
	RemoveEmptyTree(dir string) error
	CheckEmptyTree(dir string) error
	// RecycleTree puts a torn-down volume's tree into pool, or removes
	// it (as mount.TreePool.Put; a nil pool keeps none); TakeTree moves one of pool's to tree,
	// if it has one fit (as mount.TreePool.Take: its error names the
	// unfit ones it could not remove).
	RecycleTree(pool *mount.TreePool, tree string) error
	TakeTree(pool *mount.TreePool, tree string) error
	// ForeignMounts describes where the volume mounted at target is
	// mounted in the other mount namespaces, besides copies of its own
	// mounts at target and own (as mount.ForeignMounts); nothing mounted
	// at target: nil.
	ForeignMounts(ctx context.Context, target string, own []string) ([]string, error)
	// BlockReadOnly reports whether the block device node at path refuses
	// writes (as mount.BlockReadOnly).
	BlockReadOnly(path string) (bool, error)
	// NamespacesInUse is the mount namespaces that have a process, each
	// with its lowest pid (as mount.NamespacesInUse).
	NamespacesInUse() (map[uint64]int, error)
}

// kernelMounts is the Mounter of package mount: the calling thread's
// mount namespace.
type kernelMounts struct{}

var _ Mounter = kernelMounts{}

func (kernelMounts) IsMountPoint(path string) (bool, error) { return mount.IsMountPoint(path) }

func (kernelMounts) List(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	return mount.List(filter)
}

func (kernelMounts) ForeignMounts(ctx context.Context, target string, own []string) ([]string, error) {
	return mount.ForeignMounts(ctx, target, own)
}

func (kernelMounts) BlockReadOnly(path string) (bool, error) { return mount.BlockReadOnly(path) }

func (kernelMounts) MountNamespace(pid int) (uint64, error) { return mount.MountNamespace(pid) }

func (kernelMounts) NamespacesInUse() (map[uint64]int, error) { return mount.NamespacesInUse() }

// InNamespace gives f the kernel's mounts: on InNamespace's thread they are
// the namespace's.
func (k kernelMounts) InNamespace(pid int, nsIno uint64, f func(Mounter) error) error {
	return mount.InNamespace(pid, nsIno, func() error { return f(k) })
}

func (kernelMounts) ResolveInRoot(root, unsafePath string, kind mount.TargetKind, uid, gid int) (*os.File, string, error) {
	return mount.ResolveInRoot(root, unsafePath, kind, uid, gid)
}

func (kernelMounts) ID(f *os.File) (uint64, error) { return mount.ID(f) }

func (kernelMounts) CloneTree(source string, readOnly bool) (*os.File, error) {
	return mount.CloneTree(source, readOnly)
}

func (kernelMounts) MoveTree(tree, target *os.File) error { return mount.MoveTree(tree, target) }

func (kernelMounts) MoveTreeBeneath(tree, target *os.File) error {
	return mount.MoveTreeBeneath(tree, target)
}

func (kernelMounts) UnmountOwn(ctx context.Context, root, mountPoint string, id mount.Identity) (mount.Result, error) {
	return mount.UnmountOwn(ctx, root, mountPoint, id)
}

func (kernelMounts) Locate(id mount.Identity) (string, error) { return mount.Locate(id) }

func (kernelMounts) RemoveEmptyTree(dir string) error { return mount.RemoveEmptyTree(dir) }

func (kernelMounts) CheckEmptyTree(dir string) error { return mount.CheckEmptyTree(dir) }

func (kernelMounts) RecycleTree(pool *mount.TreePool, tree string) error { return pool.Put(tree) }

func (kernelMounts) TakeTree(pool *mount.TreePool, tree string) error {
	_, err := pool.Take(tree)
	return err
}

// mounter is the Mounter of an operation whose context is ctx: iso.mounts,
// each call of which is recorded as a mount event of ctx's trace when ctx
// carries one (package optrace).
func (iso *Isolator) mounter(ctx context.Context) Mounter {
	if tr := optrace.From(ctx); tr != nil {
		return tracedMounts{m: iso.mounts, tr: tr}
	}
	return iso.mounts
}

// tracedMounts is m with each call recorded in tr, under the method's
// name. InNamespace's f gets the namespace's Mounter traced too: its calls
// are events of their own, within InNamespace's.
type tracedMounts struct {
	m  Mounter
	tr *optrace.Trace
}

var _ Mounter = tracedMounts{}

func (t tracedMounts) IsMountPoint(path string) (bool, error) {
	defer t.tr.Begin(optrace.Mount, "IsMountPoint")()
	return t.m.IsMountPoint(path)
}

func (t tracedMounts) List(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	defer t.tr.Begin(optrace.Mount, "List")()
	return t.m.List(filter)
}

func (t tracedMounts) MountNamespace(pid int) (uint64, error) {
	defer t.tr.Begin(optrace.Mount, "MountNamespace")()
	return t.m.MountNamespace(pid)
}

func (t tracedMounts) InNamespace(pid int, nsIno uint64, f func(Mounter) error) error {
	defer t.tr.Begin(optrace.Mount, "InNamespace")()
	return t.m.InNamespace(pid, nsIno, func(m Mounter) error { return f(tracedMounts{m: m, tr: t.tr}) })
}

func (t tracedMounts) ResolveInRoot(root, unsafePath string, kind mount.TargetKind, uid, gid int) (*os.File, string, error) {
	defer t.tr.Begin(optrace.Mount, "ResolveInRoot")()
	return t.m.ResolveInRoot(root, unsafePath, kind, uid, gid)
}

func (t tracedMounts) ID(f *os.File) (uint64, error) {
	defer t.tr.Begin(optrace.Mount, "ID")()
	return t.m.ID(f)
}

func (t tracedMounts) CloneTree(source string, readOnly bool) (*os.File, error) {
	defer t.tr.Begin(optrace.Mount, "CloneTree")()
	return t.m.CloneTree(source, readOnly)
}

func (t tracedMounts) MoveTree(tree, target *os.File) error {
	defer t.tr.Begin(optrace.Mount, "MoveTree")()
	return t.m.MoveTree(tree, target)
}

func (t tracedMounts) MoveTreeBeneath(tree, target *os.File) error {
	defer t.tr.Begin(optrace.Mount, "MoveTreeBeneath")()
	return t.m.MoveTreeBeneath(tree, target)
}

func (t tracedMounts) Locate(id mount.Identity) (string, error) {
	defer t.tr.Begin(optrace.Mount, "Locate")()
	return t.m.Locate(id)
}

func (t tracedMounts) UnmountOwn(ctx context.Context, root, mountPoint string, id mount.Identity) (mount.Result, error) {
	defer t.tr.Begin(optrace.Mount, "UnmountOwn")()
	return t.m.UnmountOwn(ctx, root, mountPoint, id)
}

func (t tracedMounts) RemoveEmptyTree(dir string) error {
	defer t.tr.Begin(optrace.Mount, "RemoveEmptyTree")()
	return t.m.RemoveEmptyTree(dir)
}

func (t tracedMounts) CheckEmptyTree(dir string) error {
	defer t.tr.Begin(optrace.Mount, "CheckEmptyTree")()
	return t.m.CheckEmptyTree(dir)
}

func (t tracedMounts) RecycleTree(pool *mount.TreePool, tree string) error {
	defer t.tr.Begin(optrace.Mount, "RecycleTree")()
	return t.m.RecycleTree(pool, tree)
}

func (t tracedMounts) TakeTree(pool *mount.TreePool, tree string) error {
	defer t.tr.Begin(optrace.Mount, "TakeTree")()
	return t.m.TakeTree(pool, tree)
}

func (t tracedMounts) ForeignMounts(ctx context.Context, target string, own []string) ([]string, error) {
	defer t.tr.Begin(optrace.Mount, "ForeignMounts")()
	return t.m.ForeignMounts(ctx, target, own)
}

func (t tracedMounts) BlockReadOnly(path string) (bool, error) {
	defer t.tr.Begin(optrace.Mount, "BlockReadOnly")()
	return t.m.BlockReadOnly(path)
}

func (t tracedMounts) NamespacesInUse() (map[uint64]int, error) {
	defer t.tr.Begin(optrace.Mount, "NamespacesInUse")()
	return t.m.NamespacesInUse()
}
