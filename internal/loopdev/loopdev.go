package loopdev

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// ErrNotAttached is returned (wrapped) by Find when no loop device is backed
// by the file.
var ErrNotAttached = errors.New("not attached to a loop device")

// attachRetries bounds how often Attach asks for another free device when the
// one it got was taken by a concurrent attacher (EBUSY from LOOP_CONFIGURE).
const attachRetries = 16

// Paths of the kernel interfaces (fixed by the kernel ABI).
const (
	controlPath = "/dev/loop-control"
	sysBlock    = "/sys/block"
	devDir      = "/dev"
)

// Device is one loop device.
type Device struct {
	Name         string // "loop3"
	Path         string // "/dev/loop3"
	Major, Minor uint32
	ReadOnly     bool // attached read-only: writes through it fail
}

// Rdev returns the device number as in unix.Stat_t.Rdev.
func (d Device) Rdev() uint64 { return unix.Mkdev(d.Major, d.Minor) }

// Options tune Attach.
type Options struct {
	// AutoClear makes the kernel detach the device when its last opener
	// closes it (LO_FLAGS_AUTOCLEAR).
	AutoClear bool
	// ReadOnly makes the device refuse writes (BLKROSET, which only
	// CAP_SYS_ADMIN can undo). The backing file is still opened read-write
	// and LO_FLAGS_READ_ONLY is not set: any opener of a device with that
	// flag, read-only and unprivileged, can re-back it with LOOP_CHANGE_FD
	// to a file of its choosing (a container feeding other readers).
	ReadOnly bool
}

// Attach attaches backing to a free loop device with LOOP_CONFIGURE and
// returns the device and an open descriptor of it. The caller must close the
// file; with AutoClear, that close detaches the device unless something else
// (a mount) holds it. If a concurrent attacher takes the free device first,
// Attach asks for another one, up to attachRetries times.
//
// A free device whose node is still bind-mounted somewhere in this mount
// namespace is skipped: it was handed to someone (a container, through a
// bind of the node) and detached under them, and whoever holds that node
// must not reach the next file attached to it.
func Attach(ctx context.Context, backing string, opts Options) (Device, *os.File, error) {
	bf, err := os.OpenFile(backing, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return Device{}, nil, fmt.Errorf("attach %s: %w", backing, err)
	}
	defer bf.Close()
	ctl, err := os.OpenFile(controlPath, os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return Device{}, nil, fmt.Errorf("attach %s: %w", backing, err)
	}
	defer ctl.Close()

	cfg := unix.LoopConfig{Fd: uint32(bf.Fd())}
	if opts.AutoClear {
		cfg.Info.Flags |= unix.LO_FLAGS_AUTOCLEAR
	}
	copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], backing)

	handedOut, err := BoundNodes()
	if err != nil {
		return Device{}, nil, fmt.Errorf("attach %s: %w", backing, err)
	}
	var lastErr error
	busy := -1 // the highest number found taken by a concurrent attacher
	for range attachRetries {
		if err := ctx.Err(); err != nil {
			return Device{}, nil, fmt.Errorf("attach %s: %w", backing, err)
		}
		n, err := freeDevice(ctl, handedOut, busy)
		if err != nil {
			return Device{}, nil, fmt.Errorf("attach %s: %w", backing, err)
		}
		name := "loop" + strconv.Itoa(n)
		df, err := os.OpenFile(filepath.Join(devDir, name), os.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return Device{}, nil, fmt.Errorf("attach %s: %w", backing, err)
		}
		err = unix.IoctlLoopConfigure(int(df.Fd()), &cfg)
		if errors.Is(err, unix.EBUSY) {
			// Another attacher got this device between GET_FREE and
			// CONFIGURE: ask for the next free one.
			df.Close()
			lastErr, busy = err, max(busy, n)
			continue
		}
		if err != nil {
			df.Close()
			return Device{}, nil, fmt.Errorf("attach %s to %s: LOOP_CONFIGURE: %w", backing, name, err)
		}
		// BLKROSET either way: a read-only policy set by an earlier
		// user ("blockdev --setro") outlives detaching.
		if err := unix.IoctlSetPointerInt(int(df.Fd()), unix.BLKROSET, boolInt(opts.ReadOnly)); err != nil {
			err = fmt.Errorf("attach %s to %s: BLKROSET: %w", backing, name, err)
			_ = unix.IoctlSetInt(int(df.Fd()), unix.LOOP_CLR_FD, 0)
			df.Close()
			return Device{}, nil, err
		}
		dev, err := deviceOf(name, df, opts.ReadOnly)
		if err != nil {
			df.Close()
			return Device{}, nil, err
		}
		return dev, df, nil
	}
	return Device{}, nil, fmt.Errorf("attach %s: every free loop device was taken by others (%d tries): %w", backing, attachRetries, lastErr)
}

func boolInt(b bool) int {
	if b {
		return 1
	}
	return 0
}

// freeDevice returns the number of a free loop device that is neither among
// handedOut (device numbers whose nodes are bind-mounted) nor at or below
// busy: the kernel's first free device, or the next unbound one past it,
// created with LOOP_CTL_ADD if needed.
func freeDevice(ctl *os.File, handedOut map[uint64]bool, busy int) (int, error) {
	first, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
	if err != nil {
		return 0, fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
	}
	for n := max(first, busy+1); ; n++ {
		if n != first {
			err := unix.IoctlSetInt(int(ctl.Fd()), unix.LOOP_CTL_ADD, n)
			if err != nil && !errors.Is(err, unix.EEXIST) {
				return 0, fmt.Errorf("LOOP_CTL_ADD %d: %w", n, err)
			}
			if _, err := os.Stat(filepath.Join(sysBlock, "loop"+strconv.Itoa(n), "loop")); err == nil {
				continue // bound
			}
		}
		if len(handedOut) == 0 {
			return n, nil
		}
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(devDir, "loop"+strconv.Itoa(n)), &st); err != nil {
			return 0, fmt.Errorf("stat loop%d: %w", n, err)
		}
		if !handedOut[st.Rdev] {
			return n, nil
		}
	}
}

// BoundNodes returns the device numbers of the loop device nodes that are
// bind-mounted somewhere in this mount namespace (a mount whose root is
// "/loopN" and whose mount point is a block device node): handed out.
func BoundNodes() (map[uint64]bool, error) {
	ms, err := mountinfo.GetMounts(func(m *mountinfo.Info) (skip, stop bool) {
		_, err := strconv.Atoi(strings.TrimPrefix(m.Root, "/loop"))
		return err != nil || !strings.HasPrefix(m.Root, "/loop"), false
	})
	if err != nil {
		return nil, fmt.Errorf("read the mount table: %w", err)
	}
	out := map[uint64]bool{}
	for _, m := range ms {
		var st unix.Stat_t
		if unix.Lstat(m.Mountpoint, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFBLK && unix.Major(st.Rdev) == loopMajor {
			out[st.Rdev] = true
		}
	}
	return out, nil
}

// loopMajor is the block major number of loop devices.
const loopMajor = 7

// Unbound reports whether rdev is a loop device that backs no file: one
// detached while its node was still bound somewhere.
func Unbound(rdev uint64) bool {
	if unix.Major(rdev) != loopMajor {
		return false
	}
	_, err := os.Stat(fmt.Sprintf("/sys/dev/block/%d:%d/loop", unix.Major(rdev), unix.Minor(rdev)))
	return errors.Is(err, os.ErrNotExist)
}

func deviceOf(name string, f *os.File, ro bool) (Device, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return Device{}, fmt.Errorf("stat %s: %w", name, err)
	}
	return Device{Name: name, Path: filepath.Join(devDir, name), Major: unix.Major(st.Rdev), Minor: unix.Minor(st.Rdev), ReadOnly: ro}, nil
}

// Find returns the loop device backed by the file at backing (the same device
// and inode, wherever it is linked), or an error wrapping ErrNotAttached. If
// several devices are backed by it, the lowest-numbered one is returned.
func Find(backing string) (Device, error) {
	ds, err := FindAll(backing)
	if err != nil {
		return Device{}, err
	}
	if len(ds) == 0 {
		return Device{}, fmt.Errorf("%s: %w", backing, ErrNotAttached)
	}
	return ds[0], nil
}

// FindAll returns every loop device backed by the file at backing, ordered
// by number; none is not an error.
func FindAll(backing string) ([]Device, error) {
	var want unix.Stat_t
	if err := unix.Stat(backing, &want); err != nil {
		return nil, fmt.Errorf("find loop devices of %s: %w", backing, err)
	}
	as, err := attached(func(path string) bool {
		var st unix.Stat_t
		// A backing file deleted or renamed away is not ours to match.
		return unix.Stat(path, &st) == nil && st.Dev == want.Dev && st.Ino == want.Ino
	})
	if err != nil {
		return nil, fmt.Errorf("find loop devices of %s: %w", backing, err)
	}
	var ds []Device
	for _, a := range as {
		ds = append(ds, a.Device)
	}
	return ds, nil
}

// Attached is one attached loop device and its backing file.
type Attached struct {
	Device
	// BackingFile is the backing file's path as the kernel reports it.
	BackingFile string
}

// List returns the attached loop devices whose backing file is inside dir
// (compared by path after resolving dir's symlinks), ordered by number.
// Devices whose backing file was deleted are included.
func List(dir string) ([]Attached, error) {
	root, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return nil, fmt.Errorf("list loop devices: %w", err)
	}
	return attached(func(backing string) bool { return strings.HasPrefix(backing, root+"/") })
}

// attached returns the attached devices whose backing file (the path the
// kernel reports) match accepts, ordered by number.
func attached(match func(backing string) bool) ([]Attached, error) {
	var out []Attached
	err := scan(func(name, backing string) error {
		if !match(backing) {
			return nil
		}
		dev, err := sysDevice(name)
		if gone(err) {
			return nil
		}
		if err != nil {
			return err
		}
		out = append(out, Attached{Device: dev, BackingFile: backing})
		return nil
	})
	return out, err
}

// scan calls fn for every bound loop device with its backing file path. It
// reads sysfs only and never opens a loop device: opening and closing an
// AutoClear device could detach it.
func scan(fn func(name, backing string) error) error {
	entries, err := os.ReadDir(sysBlock)
	if err != nil {
		return err
	}
	type item struct {
		n    int
		name string
	}
	var items []item
	for _, e := range entries {
		n, err := strconv.Atoi(strings.TrimPrefix(e.Name(), "loop"))
		if err != nil || !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		items = append(items, item{n, e.Name()})
	}
	// ReadDir sorts by name ("loop10" < "loop2"); order by number instead.
	slices.SortFunc(items, func(a, b item) int { return cmp.Compare(a.n, b.n) })
	for _, it := range items {
		b, err := os.ReadFile(filepath.Join(sysBlock, it.name, "loop", "backing_file"))
		if gone(err) {
			continue // not bound, or being detached right now
		}
		if err != nil {
			return err
		}
		backing := strings.TrimSuffix(string(b), "\n")
		backing = strings.TrimSuffix(backing, " (deleted)")
		if err := fn(it.name, backing); err != nil {
			return err
		}
	}
	return nil
}

// gone reports whether a sysfs read failed because the device went away or
// was detached concurrently.
func gone(err error) bool {
	return errors.Is(err, os.ErrNotExist) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO)
}

func sysDevice(name string) (Device, error) {
	b, err := os.ReadFile(filepath.Join(sysBlock, name, "dev"))
	if err != nil {
		return Device{}, err
	}
	maj, min, ok := strings.Cut(strings.TrimSpace(string(b)), ":")
	if !ok {
		return Device{}, fmt.Errorf("%s: malformed dev %q", name, b)
	}
	ma, err1 := strconv.ParseUint(maj, 10, 32)
	mi, err2 := strconv.ParseUint(min, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return Device{}, fmt.Errorf("%s: malformed dev %q: %w", name, b, err)
	}
	ro, err := os.ReadFile(filepath.Join(sysBlock, name, "ro"))
	if err != nil {
		return Device{}, err
	}
	return Device{Name: name, Path: filepath.Join(devDir, name), Major: uint32(ma), Minor: uint32(mi),
		ReadOnly: strings.TrimSpace(string(ro)) == "1"}, nil
}

// Claimed reports whether a filesystem (or another exclusive user, such
// as device-mapper) holds dev: an exclusive open fails with EBUSY. A
// filesystem mounted in any mount namespace claims its device, so one
// still mounted where its unmount here does not reach (a copy of the
// mount in another namespace) is found. A device gone is not claimed.
func Claimed(dev Device) (bool, error) {
	f, err := os.OpenFile(dev.Path, os.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	switch {
	case errors.Is(err, unix.EBUSY):
		return true, nil
	case errors.Is(err, os.ErrNotExist), errors.Is(err, unix.ENXIO):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("checking %s for a holder: %w", dev.Path, err)
	}
	return false, f.Close()
}

// Detach detaches dev if it is still backed by the file at backing (same
// device and inode). A device that is already detached, or that now backs
// another file, is left alone and counts as done. If the device is still
// open elsewhere (mounted), the kernel detaches it when the last user closes
// it.
func Detach(dev Device, backing string) error {
	var want unix.Stat_t
	if err := unix.Stat(backing, &want); err != nil {
		return fmt.Errorf("detach %s: %w", dev.Path, err)
	}
	f, err := os.OpenFile(dev.Path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("detach %s: %w", dev.Path, err)
	}
	defer f.Close()
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if errors.Is(err, unix.ENXIO) {
		return nil // not bound
	}
	if err != nil {
		return fmt.Errorf("detach %s: LOOP_GET_STATUS64: %w", dev.Path, err)
	}
	if info.Device != want.Dev || info.Inode != want.Ino {
		return nil // reused for another file meanwhile
	}
	if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
		return fmt.Errorf("detach %s: LOOP_CLR_FD: %w", dev.Path, err)
	}
	// With the device still open (by us, at least), LOOP_CLR_FD only
	// marks it for clearing at the last close, and recent kernels clear it
	// asynchronously after that. Callers (unstage, then delete) want it
	// gone: give the kernel a moment. Someone else holding it open keeps
	// it bound until they close it, which is still a detach.
	f.Close() // the deferred Close is then a no-op
	waitUnbound(dev)
	return ReleaseReadOnly(dev)
}

// ReleaseReadOnly lifts the read-only policy Attach set (Options.ReadOnly)
// from dev once the device is unbound (waited for briefly: the kernel
// unbinds an AutoClear device after its last close, asynchronously on
// recent kernels). The policy outlives the binding, and the next
// attacher, another program's losetup included, would get a device that
// refuses writes. The exclusive open keeps attachers out meanwhile
// (LOOP_CONFIGURE claims the device); a device bound again, or claimed by
// someone (still held open by a user of the volume, which the kernel
// detaches at its last close), keeps its policy. Detach calls it; call it
// after the last user of an AutoClear device is gone (an unmount).
func ReleaseReadOnly(dev Device) error {
	if !dev.ReadOnly {
		return nil
	}
	waitUnbound(dev)
	f, err := os.OpenFile(dev.Path, os.O_RDONLY|unix.O_EXCL|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.EBUSY) || errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("%s: clearing its read-only policy: %w", dev.Path, err)
	}
	defer f.Close()
	if _, err := unix.IoctlLoopGetStatus64(int(f.Fd())); !errors.Is(err, unix.ENXIO) {
		return nil // bound again, or not a loop device any more
	}
	if err := unix.IoctlSetPointerInt(int(f.Fd()), unix.BLKROSET, 0); err != nil {
		return fmt.Errorf("%s: clearing its read-only policy: BLKROSET: %w", dev.Path, err)
	}
	return nil
}

// Hold opens dev to keep it attached, if it is still backed by the file at
// backing (same device and inode), and clears LO_FLAGS_AUTOCLEAR if someone
// set it (see KeepAttached). While a descriptor is open, LOOP_CLR_FD from
// any other opener (which needs no capability) only marks the device for
// clearing at its last close: whoever was given the device cannot detach it
// from under the holder, and its number cannot go to another file.
func Hold(dev Device, backing string) (*os.File, error) {
	var want unix.Stat_t
	if err := unix.Stat(backing, &want); err != nil {
		return nil, fmt.Errorf("hold %s: %w", dev.Path, err)
	}
	f, err := os.OpenFile(dev.Path, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("hold %s: %w", dev.Path, err)
	}
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err == nil && (info.Device != want.Dev || info.Inode != want.Ino) {
		err = fmt.Errorf("backed by another file now: %w", ErrNotAttached)
	}
	if err == nil {
		_, err = KeepAttached(f)
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("hold %s: %w", dev.Path, err)
	}
	return f, nil
}

// KeepAttached clears LO_FLAGS_AUTOCLEAR on the loop device open as f, and
// sets its offset and size limit back to 0 (the whole file), reporting
// whether anything was changed. An opener's LOOP_CLR_FD sets autoclear
// while others hold the device; left set, the holder's close (its process
// dying) would detach the device. An opener with write access may also
// move the window onto the file (LOOP_SET_STATUS64) for every other user
// of the device.
func KeepAttached(f *os.File) (changed bool, err error) {
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return false, fmt.Errorf("LOOP_GET_STATUS64: %w", err)
	}
	if info.Flags&unix.LO_FLAGS_AUTOCLEAR == 0 && info.Offset == 0 && info.Sizelimit == 0 {
		return false, nil
	}
	info.Flags &^= unix.LO_FLAGS_AUTOCLEAR
	info.Offset, info.Sizelimit = 0, 0
	if err := unix.IoctlLoopSetStatus64(int(f.Fd()), info); err != nil {
		return false, fmt.Errorf("LOOP_SET_STATUS64: %w", err)
	}
	return true, nil
}

// unbindWait bounds the wait for the kernel to release a loop device.
const unbindWait = time.Second

// waitUnbound waits, at most unbindWait, until dev has no backing file
// (its sysfs "loop" directory is gone; reading it does not hold the device
// open). The kernel signals nothing for it, so it checks with a backoff
// from 1 ms.
func waitUnbound(dev Device) {
	backing := filepath.Join(sysBlock, filepath.Base(dev.Path), "loop", "backing_file")
	deadline := time.Now().Add(unbindWait)
	for pause := time.Millisecond; time.Now().Before(deadline); pause = min(pause*2, 50*time.Millisecond) {
		if _, err := os.Stat(backing); errors.Is(err, os.ErrNotExist) {
			return
		}
		time.Sleep(pause)
	}
}
