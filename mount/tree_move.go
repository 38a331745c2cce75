package mount

import (
	"fmt"
	"os"
	"runtime"
	"strings"

	"golang.org/x/sys/unix"
)

// CloneTree returns a detached copy of the mount tree at source, the first
// half of a bind mount: open_tree(OPEN_TREE_CLONE|AT_RECURSIVE), so the
// submounts of source come along, as with mount --rbind. source is looked up
// in the caller's mount namespace (the host's, for the agent) and is trusted:
// symlinks in it are followed.
//
// The whole copy, submounts included, is made nosuid, and nodev unless its
// root is not a directory (mount_setattr MOUNT_ATTR_NOSUID|MOUNT_ATTR_NODEV,
// AT_RECURSIVE), and with readOnly read-only too (MOUNT_ATTR_RDONLY), before
// CloneTree returns, while nothing can reach it: a container mount never
// honours a setuid bit or a device node of the volume (a container user's
// way to root on the host), and a read-only one is never writable, wherever
// it is attached later. A clone whose root is a device node (a block volume,
// bound as a file) is not nodev: that would make the device itself
// unusable. Other flags (noexec, ...) stay as they are on source.
//
// The copy is private too (propagation MS_PRIVATE, recursively): a clone of
// a shared mount (any mount on a host whose / is shared, as systemd makes
// it) would otherwise join the source's peer group, and a mount a container
// makes beneath its volume would appear in the host's publish target and in
// every other container's copy of the volume; nor do the host's later
// mounts beneath source reach it.
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
	attrs, err := cloneAttrs(fd, readOnly)
	if err == nil {
		attr := unix.MountAttr{Attr_set: attrs, Propagation: unix.MS_PRIVATE}
		if err = unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
			err = fmt.Errorf("mount_setattr %s,private: %w", attrNames(attrs), err)
		}
	}
	if err != nil {
		tree.Close()
		return nil, err
	}
	return tree, nil
}

// cloneAttrs are the mount attributes CloneTree sets on the clone fd:
// nosuid; nodev unless its root is not a directory (a block volume's
// device node); read-only when asked.
func cloneAttrs(fd int, readOnly bool) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, fmt.Errorf("fstat the clone: %w", err)
	}
	attrs := uint64(unix.MOUNT_ATTR_NOSUID)
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		attrs |= unix.MOUNT_ATTR_NODEV
	}
	if readOnly {
		attrs |= unix.MOUNT_ATTR_RDONLY
	}
	return attrs, nil
}

// attrNames names the attributes of cloneAttrs, for errors.
func attrNames(attrs uint64) string {
	var names []string
	for _, a := range []struct {
		bit  uint64
		name string
	}{{unix.MOUNT_ATTR_RDONLY, "read-only"}, {unix.MOUNT_ATTR_NOSUID, "nosuid"}, {unix.MOUNT_ATTR_NODEV, "nodev"}} {
		if attrs&a.bit != 0 {
			names = append(names, a.name)
		}
	}
	return strings.Join(names, ",")
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
