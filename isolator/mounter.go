package isolator

import (
	"context"
	"os"

	"github.com/moby/sys/mountinfo"

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
	RemoveEmptyTree(dir string) error
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

func (kernelMounts) RemoveEmptyTree(dir string) error { return mount.RemoveEmptyTree(dir) }
