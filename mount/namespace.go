package mount

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"unsafe"

	"github.com/cyphar/filepath-securejoin/pathrs-lite/procfs"
	"golang.org/x/sys/unix"
)

// ErrWrongNamespace is returned (wrapped) by InNamespace when the process's
// mount namespace is not the one the caller recorded: the process exited and
// its pid was reused, or it moved to another namespace.
var ErrWrongNamespace = errors.New("not the expected mount namespace")

// ErrNoProcess is returned (wrapped) by InNamespace and MountNamespace when
// the process does not exist (any more) or, a zombie, has no namespaces left.
var ErrNoProcess = errors.New("no such process")

// MountNamespace returns the identity of the mount namespace of process pid:
// the inode number of /proc/<pid>/ns/mnt. Record it when the process is
// known to be the right one (an OCI hook's state names it) and pass it to
// InNamespace later, which then refuses a pid that was reused.
func MountNamespace(pid int) (uint64, error) {
	path, err := mntNSPath(pid)
	if err != nil {
		return 0, fmt.Errorf("mount namespace of pid %d: %w", pid, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("mount namespace of pid %d: %w", pid, nsErr(path, "stat", err))
	}
	return st.Ino, nil
}

// InNamespace runs f on an OS thread that has entered the mount namespace of
// process pid, and returns f's error (wrapped). When nsIno is not 0 it must be
// that namespace's identity (from MountNamespace): a different one fails with
// ErrWrongNamespace and f is not run. A missing process fails with
// ErrNoProcess.
//
// Inside f, paths are looked up in the process's namespace, from its root:
// ResolveInRoot, MoveTree (onto a handle resolved there), UnmountOwn,
// RemoveEmptyTree and List (the thread's mountinfo, read through
// pathrs-lite's own procfs, never the namespace's /proc) act on the
// process's mounts, which the host may not see (a mount namespace whose "/"
// is private does not receive the host's mounts). Before a container has
// pivoted into its rootfs (an OCI createRuntime hook) that root is the
// host's "/" as copied into the namespace, so the rootfs is at its host
// path; once the container runs, the namespace's root is the container's
// root and its paths are the container's paths.
//
// The mechanics: a new goroutine locks itself to its thread, opens
// /proc/<pid>/ns/mnt, checks the inode of that very descriptor against
// nsIno, unshares its filesystem attributes (unshare(CLONE_FS): setns into
// a mount namespace refuses, EINVAL, a thread that shares them with others,
// as every Go thread does) and setns(CLONE_NEWNS) into it. The thread is never
// unlocked: when f returns the goroutine ends and Go terminates the thread,
// so no other goroutine ever runs in the wrong namespace and nothing keeps
// the process's namespace alive. The main thread is never used (Go cannot
// terminate it: it would be parked forever, pinning the namespace and
// making /proc/self show the container's mounts). The caller's goroutine
// and thread are untouched; InNamespace waits for f.
//
// Only f's own goroutine is in the namespace: goroutines f starts run in the
// caller's. f must not call runtime.UnlockOSThread. A panic in f is raised
// again in the caller's goroutine. f should not block for long (it holds a
// thread): give it a context with a deadline.
//
// It needs CAP_SYS_ADMIN and CAP_SYS_CHROOT (and, for a namespace owned by
// another user namespace, CAP_SYS_ADMIN there).
func InNamespace(pid int, nsIno uint64, f func() error) error {
	type result struct {
		err      error
		panicked bool
		value    any
		stack    []byte
	}
	done := make(chan result, 1)
	onDiscardedThread(func() {
		var r result
		defer func() {
			if v := recover(); v != nil {
				r = result{panicked: true, value: v, stack: debug.Stack()}
			}
			done <- r
		}()
		if err := enterMountNamespace(pid, nsIno); err != nil {
			r.err = fmt.Errorf("entering the mount namespace of pid %d: %w", pid, err)
			return
		}
		tid := unix.Gettid()
		nsThreads.Store(tid, struct{}{})
		defer nsThreads.Delete(tid)
		if err := f(); err != nil {
			r.err = fmt.Errorf("in the mount namespace of pid %d: %w", pid, err)
		}
	})
	r := <-done
	if r.panicked {
		panic(fmt.Sprintf("mount.InNamespace(pid %d): panic in f: %v\n\ngoroutine of f:\n%s", pid, r.value, r.stack))
	}
	return r.err
}

// nsThreads holds the ids of the threads InNamespace has moved into
// another mount namespace (with their own working directory), while f
// runs.
var nsThreads sync.Map

// onDiscardedThread runs fn on a new goroutine locked to a thread other than
// the main one, which Go terminates when fn returns, since it stays locked.
// It does not wait for fn.
func onDiscardedThread(fn func()) {
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() != unix.Getpid() {
			fn() // never unlocked: the thread ends with this goroutine
			return
		}
		// This is the main thread, which Go never terminates (a locked
		// goroutine ending on it parks it forever). Hold it while another
		// goroutine, which therefore cannot be scheduled on it, runs fn;
		// this thread stays untouched and is released afterwards.
		finished := make(chan struct{})
		go func() {
			defer close(finished)
			runtime.LockOSThread()
			fn()
		}()
		<-finished
		runtime.UnlockOSThread()
	}()
}

// enterMountNamespace moves the calling thread, locked to its goroutine,
// into the mount namespace of pid.
func enterMountNamespace(pid int, nsIno uint64) error {
	path, err := mntNSPath(pid)
	if err != nil {
		return err
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nsErr(path, "open", err)
	}
	defer unix.Close(fd)
	// The descriptor pins the namespace: what is checked is what is
	// entered, even if pid exits and is reused meanwhile.
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nsErr(path, "fstat", err)
	}
	if nsIno != 0 && st.Ino != nsIno {
		return fmt.Errorf("%w: %s is mnt:[%d], want mnt:[%d] (the process exited and its pid was reused?)", ErrWrongNamespace, path, st.Ino, nsIno)
	}
	warmProcfs()
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare(CLONE_FS): %w", err)
	}
	if err := unix.Setns(fd, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("setns(%s, CLONE_NEWNS): %w", path, err)
	}
	return nil
}

// warmProcfs has pathrs-lite open (and cache, on Linux 5.8+) its procfs
// handle while the thread is still in the caller's mount namespace, so that
// the procfs lookups in f (ResolveInRoot, List) never fall back to the /proc
// of the namespace entered. Failures are ignored here: the lookups report
// them.
func warmProcfs() {
	proc, err := procfs.OpenProcRoot()
	if err != nil {
		return
	}
	defer proc.Close()
	if h, closeThread, err := proc.OpenThreadSelf("mountinfo"); err == nil {
		h.Close()
		closeThread()
	}
}

func mntNSPath(pid int) (string, error) {
	if pid <= 0 {
		return "", fmt.Errorf("invalid pid %d", pid)
	}
	return "/proc/" + strconv.Itoa(pid) + "/ns/mnt", nil
}

// processGone reports whether err, from reading a process's /proc
// entries, means the process exited (or is a zombie).
func processGone(err error) bool {
	return errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ESRCH) || errors.Is(err, unix.EINVAL)
}

// nsErr describes a failure to reach /proc/<pid>/ns/mnt; processGone's
// errors mean the process is gone (or a zombie).
func nsErr(path, op string, err error) error {
	if processGone(err) {
		return fmt.Errorf("%w (exited?): %s %s: %w", ErrNoProcess, op, path, err)
	}
	return &os.PathError{Op: op, Path: path, Err: err}
}

// NamespacesInUse returns the mount namespaces that have a process, each
// with its lowest pid, from one pass over /proc. A process whose main
// thread has exited while others run (its /proc/PID/ns/mnt is gone) counts
// by its threads' namespaces. Processes whose namespace cannot be read
// (gone meanwhile, or not the caller's to look at: EACCES) are not counted.
func NamespacesInUse() (map[uint64]int, error) {
	procs, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("listing processes: %w", err)
	}
	out := map[uint64]int{}
	note := func(ns uint64, pid int) {
		if low, ok := out[ns]; !ok || pid < low {
			out[ns] = pid
		}
	}
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid <= 0 {
			continue
		}
		ns, err := MountNamespace(pid)
		if err == nil {
			note(ns, pid)
			continue
		}
		if !errors.Is(err, ErrNoProcess) {
			continue
		}
		// A zombie main thread: its live threads say.
		tasks, _ := os.ReadDir(filepath.Join("/proc", p.Name(), "task"))
		for _, t := range tasks {
			var st unix.Stat_t
			if unix.Stat(filepath.Join("/proc", p.Name(), "task", t.Name(), "ns", "mnt"), &st) == nil {
				note(st.Ino, pid)
			}
		}
	}
	return out, nil
}

// nsfs ioctls (linux/nsfs.h, recent Linux): the mount namespace after or
// before the one a descriptor refers to, as a new descriptor.
const (
	ioctlNSMntGetNext = 0x8010b70b // _IOR(0xb7, 11, struct mnt_ns_info)
	ioctlNSMntGetPrev = 0x8010b70c // _IOR(0xb7, 12, struct mnt_ns_info)
)

// mntNSInfo is struct mnt_ns_info from linux/nsfs.h.
type mntNSInfo struct {
	size     uint32
	nrMounts uint32
	id       uint64
}

// nsRef is a mount namespace as the kernel lists it: its identity as
// MountNamespace gives it (ino) and its unique id (for listmount and
// statmount; 0 for the caller's own).
type nsRef struct {
	ino, id uint64
}

// mountNamespaces lists every mount namespace of the host the caller may
// act on (root: all), the calling thread's included, from the kernel's
// own list: no pass over /proc. An error (a kernel without these ioctls)
// says nothing of the host's namespaces.
func mountNamespaces() ([]nsRef, error) {
	self, err := unix.Open("/proc/thread-self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("listing mount namespaces: %w", err)
	}
	defer unix.Close(self)
	var st unix.Stat_t
	if err := unix.Fstat(self, &st); err != nil {
		return nil, fmt.Errorf("listing mount namespaces: %w", err)
	}
	out := []nsRef{{ino: st.Ino}}
	for _, req := range []uintptr{ioctlNSMntGetPrev, ioctlNSMntGetNext} {
		fd := self
		for {
			info := mntNSInfo{size: uint32(unsafe.Sizeof(mntNSInfo{}))}
			next, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(unsafe.Pointer(&info)))
			if fd != self {
				unix.Close(fd)
			}
			if errno == unix.ENOENT {
				break // the end of the list
			}
			if errno != 0 {
				return nil, fmt.Errorf("listing mount namespaces: %w", errno)
			}
			fd = int(next)
			if err := unix.Fstat(fd, &st); err != nil {
				unix.Close(fd)
				return nil, fmt.Errorf("listing mount namespaces: %w", err)
			}
			out = append(out, nsRef{ino: st.Ino, id: info.id})
		}
	}
	return out, nil
}
