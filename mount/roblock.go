package mount

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/loopdev"
)

// ReadOnlyBlock returns the device node a block volume's read-only users
// get: target (a plugin's read-only publish, a bind of a device node) when
// its device refuses writes (BLKROGET), else own, where it binds a
// read-only loop device of its own over target's device, made once (a
// later call finds it there). A plugin that ignores CSI readonly for block
// (csi-driver-host-path does) publishes the same writable device, and a
// read-only bind of a device node does not stop writes: without this the
// read-only users could write.
//
// own is the agent's path (in its work directory, never a container's),
// a file the call creates; DropReadOnlyBlock undoes what it makes.
func ReadOnlyBlock(ctx context.Context, target, own string) (string, error) {
	if mounted, err := IsMountPoint(own); err != nil {
		return "", err
	} else if mounted {
		return own, mustBeReadOnly(own)
	}
	ro, err := blockReadOnly(target)
	if err != nil {
		return "", err
	}
	if ro {
		return target, nil
	}
	f, err := os.OpenFile(own, os.O_CREATE|os.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return "", fmt.Errorf("read-only device for %s: %w", target, err)
	}
	f.Close()
	dev, df, err := loopdev.Attach(ctx, target, loopdev.Options{ReadOnly: true})
	if err != nil {
		return "", fmt.Errorf("read-only device for %s: %w", target, err)
	}
	defer df.Close()
	if err := Bind(dev.Path, own, false); err != nil {
		return "", errors.Join(fmt.Errorf("read-only device for %s: %w", target, err), loopdev.Detach(dev, target))
	}
	return own, mustBeReadOnly(own)
}

// DropReadOnlyBlock undoes ReadOnlyBlock(target, own): unmounts own,
// removes it and detaches every loop device backed by target's device
// node (one a crash left between attaching and binding included), before
// the plugin unpublishes target (a loop device holding it keeps the mount
// busy). Nothing made: nothing to do.
func DropReadOnlyBlock(ctx context.Context, target, own string) error {
	if mounted, err := IsMountPoint(own); err != nil {
		return err
	} else if mounted {
		if err := Unmount(ctx, own); err != nil {
			return err
		}
	}
	if err := os.Remove(own); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("drop read-only device: %w", err)
	}
	if mounted, err := IsMountPoint(target); err != nil || !mounted {
		return err // no device node there: no loop device can be backed by it
	}
	devs, err := loopdev.FindAll(target)
	if err != nil {
		return fmt.Errorf("drop read-only device for %s: %w", target, err)
	}
	for _, d := range devs {
		if err := loopdev.Detach(d, target); err != nil {
			return fmt.Errorf("drop read-only device for %s: %w", target, err)
		}
	}
	return nil
}

// mustBeReadOnly fails unless path's block device refuses writes.
func mustBeReadOnly(path string) error {
	ro, err := blockReadOnly(path)
	if err == nil && !ro {
		err = fmt.Errorf("the device at %s is writable", path)
	}
	return err
}

// blockReadOnly reports whether the block device node at path refuses
// writes (BLKROGET).
func blockReadOnly(path string) (bool, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return false, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return false, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return false, fmt.Errorf("%s is not a block device", path)
	}
	ro, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKROGET)
	if err != nil {
		return false, &os.PathError{Op: "BLKROGET", Path: path, Err: err}
	}
	return ro != 0, nil
}
