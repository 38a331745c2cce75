package mount

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	pathrs "github.com/cyphar/filepath-securejoin/pathrs-lite"
	"github.com/cyphar/filepath-securejoin/pathrs-lite/procfs"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// ErrBusy is returned (wrapped) by Unmount when the target stayed busy
// through every retry.
var ErrBusy = errors.New("mount point busy")

// ErrOption is returned (wrapped) by ParseOptions and Mount for an option
// that cannot be applied with a single mount(2) call.
var ErrOption = errors.New("unsupported mount option")

// Unmount retries EBUSY this many times, waiting unmountBackoff (doubling)
// between attempts, unless its context ends first. EBUSY right after a
// process exits or a bind mount is removed is usually transient; anything
// still busy after ~1.3s is a real user of the mount.
const (
	unmountBusyRetries = 6
	unmountBackoff     = 20 * time.Millisecond
)

// Mount mounts the filesystem on source (usually a block device) at target.
// options are mount(8)-style ("ro", "noexec", "discard", ...): the VFS flags
// among them become mount(2) flags, the rest is passed to the filesystem as
// data. See ParseOptions.
func Mount(source, target, fstype string, options []string) error {
	flags, data, err := ParseOptions(options)
	if err != nil {
		return err
	}
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s (type %s, options %q): %w", source, target, fstype, strings.Join(options, ","), err)
	}
	return nil
}

// Bind bind-mounts src (a directory or any file, device nodes included) onto
// dst, which must exist and be of the same kind. With readOnly the new mount
// is then remounted read-only, keeping the nosuid/nodev/noexec/atime flags it
// inherited (dropping them is refused in user namespaces). If that remount
// fails, the bind mount is removed again, so Bind either fully succeeds or
// leaves nothing behind.
//
// Submounts of src are not carried over (no MS_REC).
func Bind(src, dst string, readOnly bool) error {
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s on %s: %w", src, dst, err)
	}
	if !readOnly {
		return nil
	}
	err := remountReadOnly(dst)
	if err == nil {
		return nil
	}
	if uerr := unix.Unmount(dst, unix.UMOUNT_NOFOLLOW); uerr != nil {
		return errors.Join(err, fmt.Errorf("undo bind mount of %s: %w", dst, uerr))
	}
	return err
}

func remountReadOnly(dst string) error {
	var st unix.Statfs_t
	if err := unix.Statfs(dst, &st); err != nil {
		return fmt.Errorf("statfs %s: %w", dst, err)
	}
	flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_RDONLY)
	for _, f := range []struct {
		st int64
		ms uintptr
	}{
		{unix.ST_NOSUID, unix.MS_NOSUID},
		{unix.ST_NODEV, unix.MS_NODEV},
		{unix.ST_NOEXEC, unix.MS_NOEXEC},
		{unix.ST_NOATIME, unix.MS_NOATIME},
		{unix.ST_NODIRATIME, unix.MS_NODIRATIME},
		{unix.ST_RELATIME, unix.MS_RELATIME},
	} {
		if st.Flags&f.st != 0 {
			flags |= f.ms
		}
	}
	if err := unix.Mount("", dst, "", flags, ""); err != nil {
		return fmt.Errorf("remount %s read-only: %w", dst, err)
	}
	return nil
}

// Unmount removes the topmost mount at target. It is idempotent: a target
// that does not exist or is not a mount point is already unmounted (ENOENT,
// EINVAL). EBUSY is retried up to unmountBusyRetries times with backoff while
// ctx lasts; the last EBUSY is returned wrapped in ErrBusy. Symlinks at target
// are not followed (UMOUNT_NOFOLLOW), so a link planted by an untrusted
// process cannot redirect the unmount elsewhere.
//
// Only one mount goes: mounts stacked below it stay, and a mount with
// submounts stays busy.
func Unmount(ctx context.Context, target string) error {
	err := retryBusy(ctx, func() error { return unix.Unmount(target, unix.UMOUNT_NOFOLLOW) }, nil)
	switch {
	case err == nil, errors.Is(err, unix.ENOENT), errors.Is(err, unix.EINVAL):
		return nil
	default:
		return fmt.Errorf("unmount %s: %w", target, err)
	}
}

// retryBusy calls unmount until it fails with anything but EBUSY (or
// succeeds) and returns that. EBUSY is retried up to unmountBusyRetries
// times, waiting unmountBackoff (doubling) while ctx lasts; before each
// wait, clearBusy (if not nil) may unmount what keeps the mount busy, and
// if it cleared anything the next call is at once. The last EBUSY is
// returned wrapped in ErrBusy, an ended ctx as "still busy".
func retryBusy(ctx context.Context, unmount func() error, clearBusy func() (bool, error)) error {
	wait := unmountBackoff
	for attempt := 0; ; attempt++ {
		err := unmount()
		switch {
		case !errors.Is(err, unix.EBUSY):
			return err
		case attempt == unmountBusyRetries:
			return fmt.Errorf("%w after %d attempts: %w", ErrBusy, attempt+1, err)
		}
		if clearBusy != nil {
			cleared, err := clearBusy()
			if err != nil {
				return err
			}
			if cleared {
				continue
			}
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("still busy: %w", ctx.Err())
		case <-t.C:
		}
		wait *= 2
	}
}

// Lookup returns the topmost mount whose mount point is path, and whether
// there is one. A path that does not exist is not a mount point. It reads the
// mount table once, and not at all when path is not a mount point (one
// statx tells).
func Lookup(path string) (*mountinfo.Info, bool, error) {
	if mounted, ok, err := mountedAt(path); ok && err == nil && !mounted {
		return nil, false, nil
	}
	mp, err := canonical(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	var top *mountinfo.Info
	// Not SingleEntryFilter: mounts can be stacked on one mount point and
	// the one that is visible is the last in the table.
	ms, err := List(func(m *mountinfo.Info) (skip, stop bool) {
		return m.Mountpoint != mp, false
	})
	if err != nil {
		return nil, false, err
	}
	if len(ms) > 0 {
		top = ms[len(ms)-1]
	}
	return top, top != nil, nil
}

// IsMountPoint reports whether something is mounted at path (symlinks
// followed). A path that does not exist is not a mount point. It is one
// statx (STATX_ATTR_MOUNT_ROOT): no mount table read, so it belongs on hot
// paths; only a kernel before 5.8 has it read the table.
func IsMountPoint(path string) (bool, error) {
	if mounted, ok, err := mountedAt(path); ok {
		return mounted, err
	}
	_, ok, err := Lookup(path)
	return ok, err
}

// List returns the entries of the calling thread's mount table that filter
// keeps, in table order (parents before the mounts stacked on them), reading
// the table once. A nil filter keeps everything; filters compare against
// canonical paths (see Canonical).
//
// The table is the thread's mountinfo read through pathrs-lite's procfs
// handle (a private procfs instance of the agent's pid namespace), never
// through the /proc the thread's mount namespace shows: inside InNamespace
// that is the container's, which may be missing, of another pid namespace
// (no thread-self for the agent there) or anything the container mounted.
func List(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	ms, err := readMountTable(filter)
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	return ms, nil
}

func readMountTable(filter mountinfo.FilterFunc) ([]*mountinfo.Info, error) {
	raw, err := readThreadTable()
	if err != nil {
		return nil, err
	}
	return mountinfo.GetMountsFromReader(bytes.NewReader(raw), filter)
}

// readThreadTable reads the calling thread's mountinfo, unparsed, as List
// does.
func readThreadTable() ([]byte, error) {
	proc, err := procfs.OpenProcRoot()
	if err != nil {
		return nil, err
	}
	defer proc.Close()
	// Locks the goroutine to its thread until closeThread.
	h, closeThread, err := proc.OpenThreadSelf("mountinfo")
	if err != nil {
		return nil, err
	}
	defer closeThread()
	defer h.Close()
	// h is an O_PATH handle; reopen it (through the same procfs) to read.
	f, err := pathrs.Reopen(h, unix.O_RDONLY)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(f)
}

// Canonical returns path the way the mount table spells it: absolute, clean,
// with symlinks resolved. The path must exist.
func Canonical(path string) (string, error) {
	return canonical(path)
}

func canonical(path string) (string, error) {
	abs, err := filepath.Abs(path)
	if err != nil {
		return "", fmt.Errorf("resolve %s: %w", path, err)
	}
	p, err := filepath.EvalSymlinks(abs)
	if err != nil {
		return "", fmt.Errorf("resolve %s: %w", path, err)
	}
	return p, nil
}

// HasOption reports whether the comma-separated option list opts (a
// mountinfo Options or VFSOptions field) contains opt exactly.
func HasOption(opts, opt string) bool {
	for o := range strings.SplitSeq(opts, ",") {
		if o == opt {
			return true
		}
	}
	return false
}

// mountFlag maps a mount(8) option name onto its mount(2) flag; clear means
// the option removes the flag ("rw", "suid", ...).
func mountFlag(name string) (flag uintptr, clear, ok bool) {
	switch name {
	case "ro":
		return unix.MS_RDONLY, false, true
	case "rw":
		return unix.MS_RDONLY, true, true
	case "nosuid":
		return unix.MS_NOSUID, false, true
	case "suid":
		return unix.MS_NOSUID, true, true
	case "nodev":
		return unix.MS_NODEV, false, true
	case "dev":
		return unix.MS_NODEV, true, true
	case "noexec":
		return unix.MS_NOEXEC, false, true
	case "exec":
		return unix.MS_NOEXEC, true, true
	case "sync":
		return unix.MS_SYNCHRONOUS, false, true
	case "async":
		return unix.MS_SYNCHRONOUS, true, true
	case "dirsync":
		return unix.MS_DIRSYNC, false, true
	case "noatime":
		return unix.MS_NOATIME, false, true
	case "atime":
		return unix.MS_NOATIME, true, true
	case "nodiratime":
		return unix.MS_NODIRATIME, false, true
	case "diratime":
		return unix.MS_NODIRATIME, true, true
	case "relatime":
		return unix.MS_RELATIME, false, true
	case "norelatime":
		return unix.MS_RELATIME, true, true
	case "strictatime":
		return unix.MS_STRICTATIME, false, true
	case "lazytime":
		return unix.MS_LAZYTIME, false, true
	case "nolazytime":
		return unix.MS_LAZYTIME, true, true
	case "silent":
		return unix.MS_SILENT, false, true
	case "loud":
		return unix.MS_SILENT, true, true
	case "mand":
		return unix.MS_MANDLOCK, false, true
	case "nomand":
		return unix.MS_MANDLOCK, true, true
	}
	return 0, false, false
}

// ParseOptions splits mount(8)-style options into mount(2) flags and the
// filesystem's data string. Later options win ("ro,rw" is read-write);
// "defaults" and empty entries are ignored. Options that need a separate
// mount(2) call (bind, rbind, move, remount and the propagation types) are
// rejected with ErrOption: use Bind, or set propagation yourself. Each entry
// may itself be comma-separated.
func ParseOptions(options []string) (flags uintptr, data string, err error) {
	var fsOpts []string
	for _, entry := range options {
		for o := range strings.SplitSeq(entry, ",") {
			o = strings.TrimSpace(o)
			switch o {
			case "", "defaults":
				continue
			case "bind", "rbind", "move", "remount",
				"shared", "rshared", "private", "rprivate",
				"slave", "rslave", "unbindable", "runbindable":
				return 0, "", fmt.Errorf("%w: %q", ErrOption, o)
			}
			if f, clear, ok := mountFlag(o); ok {
				if clear {
					flags &^= f
				} else {
					flags |= f
				}
				continue
			}
			fsOpts = append(fsOpts, o)
		}
	}
	return flags, strings.Join(fsOpts, ","), nil
}
