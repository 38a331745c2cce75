package mount

import (
	"errors"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// errNoMountID: the kernel does not report mount ids (statx STATX_MNT_ID,
// Linux 5.8); callers fall back to reading the mount table.
var errNoMountID = errors.New("statx: no mount id")

// mountIDAt returns the id of the mount that name (relative to dirfd, or
// dirfd itself for "") is on, without following a symlink in the last
// component. It costs one statx: no mount table is read.
func mountIDAt(dirfd int, name string) (uint64, error) {
	flags := unix.AT_SYMLINK_NOFOLLOW | unix.AT_STATX_DONT_SYNC | unix.AT_NO_AUTOMOUNT
	if name == "" {
		flags |= unix.AT_EMPTY_PATH
	}
	var st unix.Statx_t
	if err := unix.Statx(dirfd, name, flags, unix.STATX_MNT_ID, &st); err != nil {
		return 0, err
	}
	if st.Mask&unix.STATX_MNT_ID == 0 {
		return 0, errNoMountID
	}
	return st.Mnt_id, nil
}

// mountedAt is IsMountPoint's fast answer for a path, or ok=false when only
// the mount table can tell. It is one statx: STATX_ATTR_MOUNT_ROOT says
// whether the path (symlinks followed) is the root of the mount it is on,
// so mounts stacked on the path, binds of a directory of the same
// filesystem and mounts on files are all seen (st_dev comparisons miss the
// last two). An automount point is not triggered (AT_NO_AUTOMOUNT: its
// daemon may never answer); the autofs mount there counts. Kernels before
// 5.8 do not report the attribute.
func mountedAt(path string) (mounted, ok bool, err error) {
	var st unix.Statx_t
	err = unix.Statx(unix.AT_FDCWD, path, unix.AT_STATX_DONT_SYNC|unix.AT_NO_AUTOMOUNT, unix.STATX_TYPE, &st)
	if errors.Is(err, unix.ENOENT) {
		return false, true, nil
	}
	if err != nil {
		return false, true, &os.PathError{Op: "statx", Path: path, Err: err}
	}
	if st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 {
		return false, false, nil
	}
	return st.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, true, nil
}

// mountedBelow reports the first mount found at or below the directory d
// (named path; d's own mount id is dev) by walking it with one statx per
// entry, without reading the mount table. It descends only into
// directories on the same mount.
func mountedBelow(d *os.File, path string, dev uint64) (string, error) {
	entries, err := d.ReadDir(-1)
	if err != nil {
		return "", err
	}
	dfd := int(d.Fd())
	for _, e := range entries {
		p := filepath.Join(path, e.Name())
		id, err := mountIDAt(dfd, e.Name())
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return "", &os.PathError{Op: "statx", Path: p, Err: err}
		}
		if id != dev {
			return p, nil
		}
		if !e.IsDir() {
			continue
		}
		fd, err := unix.Openat2(dfd, e.Name(), &unix.OpenHow{
			Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_XDEV,
		})
		if errors.Is(err, unix.EXDEV) {
			return p, nil
		}
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
			continue
		}
		if err != nil {
			return "", &os.PathError{Op: "open", Path: p, Err: err}
		}
		sub := os.NewFile(uintptr(fd), p)
		m, err := mountedBelow(sub, p, dev)
		sub.Close()
		if m != "" || err != nil {
			return m, err
		}
	}
	return "", nil
}
