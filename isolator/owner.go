package isolator

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// lostFound is the one entry a fresh volume's root may hold.
const lostFound = "lost+found"

// giveVolumeRoot makes a fresh volume's root directory (at its publish
// target, which the agent owns) belong to the container's user, so that a
// container not running as root can write to it: only when the root is
// owned by root and is empty or holds nothing but lost+found exactly as
// mkfs.ext4 leaves it (a directory, mode 0700, owned by 0:0, empty),
// never recursively, and never over data that is already someone's (the
// OnRootMismatch rule). A lost+found holding anything, of another mode or
// owner, or not a directory, makes the root not fresh: it keeps its
// owner, so a new user cannot take over a previous tenant's files by
// renaming lost+found. Nothing is followed through a symlink. Block
// volumes and read-only mounts are not touched; uid < 0 means the
// container runs as root.
func giveVolumeRoot(path string, uid, gid int) error {
	if uid < 0 {
		return nil
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("volume root %s: %w", path, err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("volume root %s: %w", path, err)
	}
	if int(st.Uid) == uid && int(st.Gid) == gid || st.Uid != 0 || st.Gid != 0 {
		return nil // already the user's, or someone else's on purpose
	}
	hasLostFound := false
	for {
		names, err := f.Readdirnames(16)
		for _, n := range names {
			if n != lostFound {
				return nil // holds data: leave its owner
			}
			hasLostFound = true
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("volume root %s: %w", path, err)
		}
	}
	if hasLostFound {
		fresh, err := freshLostFound(fd, &st)
		if err != nil {
			return fmt.Errorf("volume root %s: %w", path, err)
		}
		if !fresh {
			return nil // lost+found is not as mkfs left it: leave the owner
		}
	}
	if err := unix.Fchown(fd, uid, gid); err != nil {
		return fmt.Errorf("giving volume root %s to %d:%d: %w", path, uid, gid, err)
	}
	return nil
}

// freshLostFound reports whether the lost+found entry of the directory
// open at rootFd (whose stat is root) is as mkfs.ext4 leaves it: a
// directory on the root's file system, mode 0700 and no other bits, owned
// by 0:0, with no entries. It is opened relative to rootFd without
// following a symlink (a symlink, or anything but a directory, is not
// fresh) and examined through that handle.
func freshLostFound(rootFd int, root *unix.Stat_t) (bool, error) {
	fd, err := unix.Openat(rootFd, lostFound, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			return false, nil // gone, a symlink, or not a directory
		}
		return false, fmt.Errorf("%s: %w", lostFound, err)
	}
	f := os.NewFile(uintptr(fd), lostFound)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false, fmt.Errorf("%s: %w", lostFound, err)
	}
	if st.Mode&0o7777 != 0o700 || st.Uid != 0 || st.Gid != 0 || st.Dev != root.Dev {
		return false, nil
	}
	names, err := f.Readdirnames(1)
	if len(names) > 0 {
		return false, nil // holds something: maybe a previous tenant's
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return false, fmt.Errorf("%s: %w", lostFound, err)
	}
	return true, nil
}
