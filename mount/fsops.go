package mount

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Filesystem ioctls missing from golang.org/x/sys/unix (linux/fs.h).
const (
	ioctlFITRIM   = 0xc0185879 // _IOWR('X', 121, struct fstrim_range)
	ioctlFIFREEZE = 0xc0045877 // _IOWR('X', 119, int)
	ioctlFITHAW   = 0xc0045878 // _IOWR('X', 120, int)

	// _IOR('X', 58, struct xfs_fs_eofblocks) from xfs/xfs_fs.h.
	ioctlXFSFreeEOFBlocks = 0x8080583a
	xfsEOFBlocksVersion   = 1
	xfsEOFFlagsSync       = 1 << 0
)

// xfsEOFBlocks is struct xfs_fs_eofblocks from xfs/xfs_fs.h (128 bytes).
type xfsEOFBlocks struct {
	version, flags uint32
	uid, gid, prid uint32
	_              uint32
	minFileSize    uint64
	_              [12]uint64
}

// DefaultMaxFrozen bounds how long WhileFrozen keeps a filesystem frozen when
// its context has no earlier deadline. Writers to the filesystem block (and
// cannot be killed) for that long at most.
const DefaultMaxFrozen = 30 * time.Second

// fstrimRange is struct fstrim_range from linux/fs.h.
type fstrimRange struct {
	start  uint64
	len    uint64
	minLen uint64
}

// Trim discards the unused blocks of the whole filesystem that holds path
// (FITRIM, what fstrim(8) does) and returns the number of bytes the
// filesystem reports as trimmed. That number is an upper bound of what the
// device gave back; measure the device to know. Filesystems or devices
// without discard support fail with EOPNOTSUPP.
func Trim(path string) (uint64, error) {
	r := fstrimRange{start: 0, len: math.MaxUint64, minLen: 0}
	err := onFS(path, "trim", func(fd int) error { return ioctlPtr(fd, ioctlFITRIM, "FITRIM", unsafe.Pointer(&r)) })
	return r.len, err
}

// SettleFrees makes the frees of files deleted before the call final on
// the filesystem that holds path, so that a Trim after it finds their
// blocks. xfs frees an unlinked file's extents in the background (inode
// inactivation), and since Linux 6.1 statfs no longer waits for it; a
// synchronous XFS_IOC_FREE_EOFBLOCKS does (it also drops the speculative
// preallocations past the end of files, space a trim wants back too).
// Other filesystems free at unlink: nothing to do.
func SettleFrees(path string) error {
	return onFS(path, "settle frees on", func(fd int) error {
		var st unix.Statfs_t
		if err := unix.Fstatfs(fd, &st); err != nil {
			return fmt.Errorf("statfs: %w", err)
		}
		if st.Type != unix.XFS_SUPER_MAGIC {
			return nil
		}
		e := xfsEOFBlocks{version: xfsEOFBlocksVersion, flags: xfsEOFFlagsSync}
		return ioctlPtr(fd, ioctlXFSFreeEOFBlocks, "XFS_IOC_FREE_EOFBLOCKS", unsafe.Pointer(&e))
	})
}

// onFS runs f on a descriptor of path (a directory or file of the
// filesystem to act on; not followed if a symlink), its errors prefixed
// with what and path.
func onFS(path, what string, f func(fd int) error) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("%s %s: open: %w", what, path, err)
	}
	defer unix.Close(fd)
	if err := f(fd); err != nil {
		return fmt.Errorf("%s %s: %w", what, path, err)
	}
	return nil
}

// ioctlPtr is an ioctl whose argument is a pointer to a struct.
func ioctlPtr(fd int, req uintptr, name string, arg unsafe.Pointer) error {
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); errno != 0 {
		return fmt.Errorf("%s: %w", name, errno)
	}
	return nil
}

// ErrAlreadyFrozen is Freeze's error when the filesystem is frozen
// already (FIFREEZE's EBUSY): by someone else, who will thaw it.
var ErrAlreadyFrozen = errors.New("filesystem already frozen")

// Freeze suspends writes to the filesystem that holds path and flushes it to
// a consistent state (FIFREEZE). Until Thaw, every writer blocks,
// uninterruptibly. A filesystem frozen already is ErrAlreadyFrozen.
// Prefer WhileFrozen.
func Freeze(path string) error {
	err := fsIoctl(path, ioctlFIFREEZE, "FIFREEZE")
	if errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("%w: %w", ErrAlreadyFrozen, err)
	}
	return err
}

// Thaw resumes a filesystem frozen by Freeze (FITHAW). Thawing a filesystem
// that is not frozen is not an error (EINVAL counts as done).
func Thaw(path string) error {
	f, err := os.OpenFile(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("FITHAW %s: open: %w", path, err)
	}
	defer f.Close()
	return ThawFile(f)
}

// ThawFile is Thaw of the filesystem f (opened, not O_PATH) is on.
func ThawFile(f *os.File) error {
	err := unix.IoctlSetInt(int(f.Fd()), ioctlFITHAW, 0)
	if err == nil || errors.Is(err, unix.EINVAL) {
		return nil
	}
	return fmt.Errorf("FITHAW %s: %w", f.Name(), err)
}

func fsIoctl(path string, req uint, name string) error {
	return onFS(path, name, func(fd int) error { return unix.IoctlSetInt(fd, req, 0) })
}

// WhileFrozen freezes the filesystem that holds path, runs fn, and thaws it.
// The thaw runs on its own goroutine when fn returns or when ctx ends,
// whichever comes first (a deadline of DefaultMaxFrozen is added if ctx has
// none), so a fn that blocks on the frozen filesystem is released at the
// deadline instead of hanging forever. fn receives that bounded context. The
// errors of fn and of the thaw are both returned.
func WhileFrozen(ctx context.Context, path string, fn func(context.Context) error) error {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, DefaultMaxFrozen)
		defer cancel()
	}
	if err := Freeze(path); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	thawed := make(chan error, 1)
	go func() {
		<-ctx.Done()
		thawed <- Thaw(path)
	}()
	err := fn(ctx)
	cancel()
	return errors.Join(err, <-thawed)
}

// WhileAllFrozen freezes the filesystems at paths, in order, runs fn and
// thaws them, in reverse order, each as WhileFrozen does (so all are
// thawed when fn returns or when ctx ends, whichever is first). A
// filesystem frozen already by someone else (ErrAlreadyFrozen) is left
// to them: it stays frozen while fn runs and is not thawed here; shared
// is called with its path. With no paths, fn just runs.
func WhileAllFrozen(ctx context.Context, paths []string, shared func(path string), fn func(context.Context) error) error {
	if len(paths) == 0 {
		return fn(ctx)
	}
	rest := func(ctx context.Context) error { return WhileAllFrozen(ctx, paths[1:], shared, fn) }
	ran := false
	err := WhileFrozen(ctx, paths[0], func(ctx context.Context) error {
		ran = true
		return rest(ctx)
	})
	if !ran && errors.Is(err, ErrAlreadyFrozen) {
		shared(paths[0])
		return rest(ctx)
	}
	return err
}
