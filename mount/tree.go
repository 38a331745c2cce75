package mount

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/cyphar/filepath-securejoin/pathrs-lite/procfs"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// ErrMounted is returned (wrapped) by RemoveEmptyTree when something is
// mounted at or below the directory it was asked to remove.
var ErrMounted = errors.New("mounted")

// ErrNotEmpty is returned (wrapped) by RemoveEmptyTree for an entry that is
// neither a directory nor an empty regular file.
var ErrNotEmpty = errors.New("holds something other than empty directories and empty files")

// MountsUnder returns the mount points at dir or below it, in mount-table
// order, each once (mounts stacked on one mount point are listed once). It
// reads the table once, through a prefix filter on dir's canonical path. A
// dir that does not exist has none.
//
// It sees only the calling thread's mount namespace: mounts made inside a
// container's own namespace are not listed, unless it runs in InNamespace.
func MountsUnder(dir string) ([]string, error) {
	mp, err := canonical(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	ms, err := List(mountinfo.PrefixFilter(mp))
	if err != nil {
		return nil, err
	}
	var out []string
	seen := make(map[string]bool, len(ms))
	for _, m := range ms {
		if !seen[m.Mountpoint] {
			seen[m.Mountpoint] = true
			out = append(out, m.Mountpoint)
		}
	}
	return out, nil
}

// RemoveEmptyTree removes dir and everything below it, bottom up, provided
// that all of it is directories and empty regular files (such as the
// targets ResolveInRoot creates). It never deletes recursively across a mount
// point and never deletes data:
//
//   - If anything is mounted at or below dir (MountsUnder), it removes
//     nothing and fails with ErrMounted, naming the mounts.
//   - It walks with directory handles, one entry at a time (unlinkat on the
//     parent's handle: no path is looked up twice, no symlink is followed).
//     Descending into a directory that became a mount point since the check
//     fails with EXDEV (openat2 RESOLVE_NO_XDEV); removing one fails with
//     EBUSY. Both are reported as ErrMounted.
//   - Any entry that is not a directory or an empty regular file (data,
//     symlinks, device nodes, sockets) stops it with ErrNotEmpty, naming the
//     entry. What was already removed stays removed (it was empty).
//
// A dir that does not exist is already removed. dir itself must be a
// directory, not a symlink to one.
func RemoveEmptyTree(dir string) error {
	if err := removeEmptyTree(filepath.Clean(dir), true); err != nil {
		return fmt.Errorf("remove tree %s: %w", dir, err)
	}
	return nil
}

// CheckEmptyTree fails as RemoveEmptyTree would on dir as it is now, and
// removes nothing: one directory read per directory, no unlink (whose
// cost, on a filesystem mounted discard, is a wait for the disk), for a
// caller that removes the tree later.
func CheckEmptyTree(dir string) error {
	if err := removeEmptyTree(filepath.Clean(dir), false); err != nil {
		return fmt.Errorf("tree %s: %w", dir, err)
	}
	return nil
}

// removeEmptyTree is RemoveEmptyTree, or with remove false its checks.
func removeEmptyTree(dir string, remove bool) error {
	top, err := os.OpenFile(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer top.Close()
	canon, err := procfs.ProcSelfFdReadlink(top)
	if err != nil {
		return fmt.Errorf("read path of %s: %w", dir, err)
	}
	if err := checkNothingMounted(top, canon); err != nil {
		return err
	}
	if err := removeChildren(top, dir, remove); err != nil {
		return err
	}
	if !remove {
		return nil
	}
	// rmdir does not follow a symlink in the last component either.
	if err := unix.Rmdir(dir); err != nil {
		return removeErr(dir, err)
	}
	return nil
}

// checkNothingMounted fails with ErrMounted, naming the mounts, when
// anything is mounted at or below the directory top (canonical path
// canon). It walks the (small) tree with one statx per entry, comparing
// mount ids; only a kernel without mount ids has it read the mount table.
func checkNothingMounted(top *os.File, canon string) error {
	var mounts []string
	dev, err := mountIDAt(int(top.Fd()), "")
	if err == nil {
		if m, ok, merr := mountedAt(canon); merr != nil {
			return merr
		} else if ok && m {
			mounts = append(mounts, canon)
		} else {
			below, werr := mountedBelow(top, canon, dev)
			if werr != nil {
				return werr
			}
			if below != "" {
				mounts = append(mounts, below)
			}
		}
		// top's offset was moved by the walk: removeChildren reads it again.
		if _, err := top.Seek(0, 0); err != nil {
			return err
		}
	} else if errors.Is(err, errNoMountID) {
		if mounts, err = MountsUnder(canon); err != nil {
			return err
		}
	} else {
		return err
	}
	if len(mounts) > 0 {
		return fmt.Errorf("%w: %s", ErrMounted, strings.Join(mounts, ", "))
	}
	return nil
}

// removeChildren removes the entries of the directory d (named path); with
// remove false, it checks that it could.
func removeChildren(d *os.File, path string, remove bool) error {
	entries, err := d.ReadDir(-1)
	if err != nil {
		return err
	}
	dfd := int(d.Fd())
	for _, e := range entries {
		name, p := e.Name(), filepath.Join(path, e.Name())
		var st unix.Stat_t
		if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return &os.PathError{Op: "stat", Path: p, Err: err}
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			fd, err := unix.Openat2(dfd, name, &unix.OpenHow{
				Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
				Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_XDEV,
			})
			if errors.Is(err, unix.EXDEV) {
				return fmt.Errorf("%w: %s", ErrMounted, p)
			}
			if err != nil {
				return &os.PathError{Op: "open", Path: p, Err: err}
			}
			sub := os.NewFile(uintptr(fd), p)
			err = removeChildren(sub, p, remove)
			sub.Close()
			if err != nil {
				return err
			}
			if !remove {
				continue
			}
			if err := unix.Unlinkat(dfd, name, unix.AT_REMOVEDIR); err != nil {
				return removeErr(p, err)
			}
		case unix.S_IFREG:
			if st.Size != 0 {
				return fmt.Errorf("%s: regular file of %d bytes: %w", p, st.Size, ErrNotEmpty)
			}
			if !remove {
				continue
			}
			if err := unix.Unlinkat(dfd, name, 0); err != nil {
				return removeErr(p, err)
			}
		default:
			return fmt.Errorf("%s: %s: %w", p, fileType(st.Mode), ErrNotEmpty)
		}
	}
	return nil
}

func removeErr(path string, err error) error {
	switch {
	case errors.Is(err, unix.EBUSY):
		return fmt.Errorf("%w: %s", ErrMounted, path)
	case errors.Is(err, unix.ENOTEMPTY), errors.Is(err, unix.EEXIST):
		return fmt.Errorf("%s: %w (something was added meanwhile)", path, ErrNotEmpty)
	}
	return &os.PathError{Op: "remove", Path: path, Err: err}
}
