package isolator

import (
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// giveVolumeRoot makes a fresh volume's root directory (at its publish
// target, which the agent owns) belong to the container's user, so that a
// container not running as root can write to it: only when the root is
// owned by root and holds nothing but lost+found (mkfs leaves it), never
// recursively, and never over data that is already someone's (the
// OnRootMismatch rule). Block volumes and read-only mounts are not
// touched; uid < 0 means the container runs as root.
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
	for {
		names, err := f.Readdirnames(16)
		for _, n := range names {
			if n != "lost+found" {
				return nil // holds data: leave its owner
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("volume root %s: %w", path, err)
		}
	}
	if err := unix.Fchown(fd, uid, gid); err != nil {
		return fmt.Errorf("giving volume root %s to %d:%d: %w", path, uid, gid, err)
	}
	return nil
}
