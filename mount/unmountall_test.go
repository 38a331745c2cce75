package mount

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/cyphar/filepath-securejoin/pathrs-lite/procfs"
	"golang.org/x/sys/unix"
)

// UnmountAll is for the tests only: their clean-up, and the test of
// unmounting a mount's submounts by id on a trusted path. The agent
// unmounts one mount with Unmount, or exactly what it recorded with
// UnmountOwn.

// maxStackedMounts bounds UnmountAll: a path with more mounts than this on it
// is being mounted on faster than it is unmounted, and is reported busy.
const maxStackedMounts = 1024

// UnmountAll removes every mount at target: the mounts stacked on it one
// after the other, and the submounts of each (a recursive bind, as BindInto
// makes, keeps the source's submounts, and umount2 refuses a mount with
// submounts with EBUSY). It stops when nothing is mounted at target any more
// (EINVAL, ENOENT), so it is idempotent: a missing path or a plain directory
// is done at once.
//
// Like Unmount, it never follows a symlink in the last component of target
// (a symlink there is not a mount point: done), never detaches lazily, and
// retries EBUSY with bounded backoff while ctx lasts. Only on EBUSY does it
// read the mount table, to find the submounts of the mount at target, which
// it unmounts by id, last mounted first, before trying target again.
//
// target is a path the agent owns (trusted but for its last component).
// For a path inside a container's rootfs use UnmountOwn.
func UnmountAll(ctx context.Context, target string) error {
	for range maxStackedMounts {
		ok, err := unmountTopAll(ctx, target)
		if err != nil || !ok {
			return err
		}
	}
	return fmt.Errorf("unmount %s: %w: still mounted after %d unmounts", target, ErrBusy, maxStackedMounts)
}

// unmountBelow unmounts the mounts inside the top mount at target (its
// children in the mount table, each by id, reached with no symlink
// followed: see UnmountOwn), last mounted first, and reports whether it
// unmounted any. target's directory is trusted; its last component is not
// followed.
func unmountBelow(ctx context.Context, target string) (bool, error) {
	dir, err := os.OpenFile(filepath.Dir(target), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	defer dir.Close()
	name := filepath.Base(target)
	top, err := mountIDAt(int(dir.Fd()), name)
	if err != nil {
		return false, &os.PathError{Op: "statx", Path: target, Err: err}
	}
	canon, err := procfs.ProcSelfFdReadlink(dir)
	if err != nil {
		return false, fmt.Errorf("read path of %s: %w", dir.Name(), err)
	}
	root, err := os.OpenFile("/", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return false, err
	}
	defer root.Close()
	return inRoot{dir: root, path: "/"}.unmountChildren(ctx, top, filepath.Join(canon, name))
}

// unmountTopAll removes the topmost mount at target and reports whether
// there was one; a target that is busy because mounts sit below it (a
// recursive bind) has those unmounted first, then is retried at once.
func unmountTopAll(ctx context.Context, target string) (bool, error) {
	err := retryBusy(ctx, func() error { return unix.Unmount(target, unix.UMOUNT_NOFOLLOW) },
		func() (bool, error) { return unmountBelow(ctx, target) })
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.EINVAL):
		return false, nil
	default:
		return false, fmt.Errorf("unmount %s: %w", target, err)
	}
}
