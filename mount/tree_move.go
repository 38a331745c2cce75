package mount

import (
	"fmt"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// CloneTree returns a detached copy of the mount tree at source, the first
// half of a bind mount: open_tree(OPEN_TREE_CLONE|AT_RECURSIVE), so the
// submounts of source come along, as with mount --rbind. source is looked up
// in the caller's mount namespace (the host's, for the agent) and is trusted:
// symlinks in it are followed.
//
// With readOnly the whole copy, submounts included, is made read-only
// (mount_setattr MOUNT_ATTR_RDONLY, AT_RECURSIVE) before CloneTree returns,
// while nothing can reach it: it is never writable wherever it is attached
// later. Other flags (nosuid, nodev, ...) stay as they are on source.
//
// The copy belongs to no mount namespace yet. Attach it with MoveTree, in
// this mount namespace or, inside InNamespace, in another one (a
// container's, which cannot see the host's mounts). Attach it once: the
// descriptor keeps referring to the mount after the move, and a second
// MoveTree would move it again. The caller closes the returned file. Closing
// it before a successful MoveTree unmounts the copy (the kernel does so
// lazily, as umount -l would); closing it after leaves the attached mount
// alone, and should come right after: while the descriptor is open the
// mount is busy (umount gets EBUSY).
func CloneTree(source string, readOnly bool) (*os.File, error) {
	tree, err := cloneTree(source, readOnly)
	if err != nil {
		return nil, fmt.Errorf("clone the mount tree at %s: %w", source, err)
	}
	return tree, nil
}

func cloneTree(source string, readOnly bool) (*os.File, error) {
	fd, err := unix.OpenTree(unix.AT_FDCWD, source, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
	if err != nil {
		return nil, fmt.Errorf("open_tree: %w", err)
	}
	tree := os.NewFile(uintptr(fd), source)
	if readOnly {
		attr := unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
			tree.Close()
			return nil, fmt.Errorf("mount_setattr read-only: %w", err)
		}
	}
	return tree, nil
}

// MoveTree attaches tree, a detached mount tree from CloneTree, onto the file
// or directory that target refers to (an O_PATH handle, typically from
// ResolveInRoot): move_mount(tree, "", target, "",
// MOVE_MOUNT_F_EMPTY_PATH|MOVE_MOUNT_T_EMPTY_PATH). Nothing is looked up by
// name: the mount lands on target's inode wherever it is now.
//
// A directory goes onto a directory and anything else onto a non-directory
// (ErrKind otherwise, and nothing is moved). Stacking on an existing mount
// is allowed, as with mount(2).
//
// target must be in the calling thread's mount namespace (the kernel refuses
// other targets with EINVAL): to mount inside a container, resolve the
// target inside InNamespace and call MoveTree there too. On error tree stays
// detached; closing it drops it.
func MoveTree(tree, target *os.File) error {
	if err := moveTree(tree, target, 0); err != nil {
		return fmt.Errorf("move mount tree of %s onto %s: %w", tree.Name(), target.Name(), err)
	}
	return nil
}

// moveMountBeneath is MOVE_MOUNT_BENEATH (Linux 6.5), not in x/sys yet.
const moveMountBeneath = 0x200

// MoveTreeBeneath attaches tree beneath the mount whose root target is (an
// O_PATH handle on the top mount at a mount point), at the same mount
// point: unmounting that top mount afterwards reveals tree, so a mount is
// replaced with no moment where the mount point shows what is under both.
// The same rules as MoveTree apply otherwise.
func MoveTreeBeneath(tree, target *os.File) error {
	if err := moveTree(tree, target, moveMountBeneath); err != nil {
		return fmt.Errorf("move mount tree of %s beneath %s: %w", tree.Name(), target.Name(), err)
	}
	return nil
}

func moveTree(tree, target *os.File, flags int) error {
	defer runtime.KeepAlive(tree)
	defer runtime.KeepAlive(target)
	treeFD, targetFD := int(tree.Fd()), int(target.Fd())
	var src, dst unix.Stat_t
	if err := unix.Fstat(treeFD, &src); err != nil {
		return fmt.Errorf("fstat tree: %w", err)
	}
	if err := unix.Fstat(targetFD, &dst); err != nil {
		return fmt.Errorf("fstat target: %w", err)
	}
	srcDir, dstDir := src.Mode&unix.S_IFMT == unix.S_IFDIR, dst.Mode&unix.S_IFMT == unix.S_IFDIR
	if srcDir != dstDir {
		return fmt.Errorf("%w: cannot mount a %s onto a %s", ErrKind, fileType(src.Mode), fileType(dst.Mode))
	}
	if err := unix.MoveMount(treeFD, "", targetFD, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH|flags); err != nil {
		return fmt.Errorf("move_mount: %w", err)
	}
	return nil
}
