package mount_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// nsChild is a process with its own mount namespace, whose "/" is private
// (it sees no mount made on the host after it started, and the host sees
// none of its mounts), with a tmpfs at rootfs that only it sees. It stands
// for a container between runc's unshare and pivot_root or, pivoted, for a
// running container.
type nsChild struct {
	pid    int
	ino    uint64 // its mount namespace
	rootfs string // a host path; in the child a tmpfs; "/" once pivoted
}

// childRoot is where a test's child in its own namespace has its root.
type childRoot int

const (
	hostRoot  childRoot = iota // the host's "/"
	pivotRoot                  // pivoted into its rootfs
	// jailRoot: chroot(2)ed into an empty directory of its rootfs, so
	// that its mount table shows nothing else of its namespace.
	jailRoot
)

// startNSChild starts a child with a tmpfs at rootfs in its own namespace,
// its root where root says (pivoted: the host's "/" stays below, at
// /.old). It waits on its stdin, a shell builtin: nothing to exec after the
// pivot.
func startNSChild(t *testing.T, rootfs string, root childRoot) nsChild {
	t.Helper()
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}
	script := `mount -t tmpfs -o size=1m rootfs "$0" && echo ready && read x`
	switch root {
	case jailRoot:
		script = `mount -t tmpfs -o size=4m rootfs "$0" && mkdir "$0/jail" && cp /bin/busybox "$0/jail/" &&
			exec chroot "$0/jail" /busybox sh -c 'echo ready && read x'`
	case pivotRoot:
		// Its /proc is a fake: nothing may read the mount table
		// through it.
		script = `mount -t tmpfs -o size=1m rootfs "$0" && mkdir -p "$0/.old" "$0/proc" &&
			mount -t tmpfs -o size=1m fakeproc "$0/proc" && mkdir -p "$0/proc/thread-self" "$0/proc/self" &&
			echo garbage | tee "$0/proc/thread-self/mountinfo" > "$0/proc/self/mountinfo" &&
			cd "$0" && pivot_root . .old && cd / && echo ready && read x`
	}
	cmd := exec.Command("/bin/sh", "-c", script, rootfs)
	// Unshareflags CLONE_NEWNS also makes the child's "/" rprivate.
	cmd.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = stdin.Close()
		_ = cmd.Wait()
	})
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("child: %q, %v; stderr: %s", line, err, stderr.String())
	}
	ino, err := mount.MountNamespace(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if ino == threadNS(t) {
		t.Fatal("the child is in the host's mount namespace")
	}
	if ms := hostMountsUnder(t, rootfs); len(ms) != 0 {
		t.Fatalf("the child's mounts show on the host: %v", ms)
	}
	c := nsChild{pid: cmd.Process.Pid, ino: ino, rootfs: rootfs}
	if root == pivotRoot {
		c.rootfs = "/"
	}
	return c
}

// path is p as the child sees it, reachable from the host.
func (c nsChild) path(p string) string {
	return "/proc/" + strconv.Itoa(c.pid) + "/root" + p
}

// mountsUnder lists the child's mount points at or below dir.
func (c nsChild) mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	f, err := os.Open("/proc/" + strconv.Itoa(c.pid) + "/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ms, err := mountinfo.GetMountsFromReader(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range ms {
		if m.Mountpoint == dir || strings.HasPrefix(m.Mountpoint, dir+"/") {
			out = append(out, m.Mountpoint)
		}
	}
	return out
}

// in runs f in the child's mount namespace.
func (c nsChild) in(t *testing.T, f func() error) {
	t.Helper()
	if err := mount.InNamespace(c.pid, c.ino, f); err != nil {
		t.Fatal(err)
	}
}

// moveInto clones src (on the host) and moves it onto path inside the
// child's rootfs, resolved in the child's namespace. It returns the host
// path of the target.
func (c nsChild) moveInto(t *testing.T, src, path string, readOnly bool) string {
	t.Helper()
	tree, err := mount.CloneTree(src, readOnly)
	if err != nil {
		t.Fatal(err)
	}
	defer tree.Close()
	var target string
	c.in(t, func() error {
		h, hostPath, err := mount.ResolveInRoot(c.rootfs, path, mount.Directory, -1, -1)
		if err != nil {
			return err
		}
		defer h.Close()
		target = hostPath
		return mount.MoveTree(tree, h)
	})
	return target
}

func (c nsChild) unmountAll(t *testing.T, path string) {
	t.Helper()
	c.in(t, func() error { return mount.UnmountAll(context.Background(), path) })
	if ms := c.mountsUnder(t, path); len(ms) != 0 {
		t.Fatalf("left mounted in the child: %v", ms)
	}
}

// threadNS is the mount namespace of the calling thread.
func threadNS(t *testing.T) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat("/proc/thread-self/ns/mnt", &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

func hostMountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	ms, err := mount.List(mountinfo.PrefixFilter(dir))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range ms {
		out = append(out, m.Mountpoint)
	}
	return out
}

func readFile(t *testing.T, path, want string) {
	t.Helper()
	if b, err := os.ReadFile(path); err != nil || string(b) != want {
		t.Errorf("read %s = %q, %v; want %q", path, b, err, want)
	}
}

// nsSandbox is a host tmpfs src (with "hello" and a tmpfs submount "sub"
// holding "deep") and a child with its own rootfs, pivoted into or not.
func nsSandbox(t *testing.T, pivot bool) (src string, c nsChild) {
	t.Helper()
	base := testhelp.LeakCheckedDir(t)
	src = filepath.Join(base, "src")
	mkdirs(t, src)
	mountTmpfs(t, src)
	t.Cleanup(func() {
		if err := mount.UnmountAll(context.Background(), src); err != nil {
			t.Error(err)
		}
	})
	sub := filepath.Join(src, "sub")
	mkdirs(t, sub)
	mountTmpfs(t, sub)
	for p, data := range map[string]string{"hello": "hi", "sub/deep": "deep"} {
		if err := os.WriteFile(filepath.Join(src, p), []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// Registered last, so killed first: its namespace goes before src.
	return src, startNSChild(t, filepath.Join(base, "rootfs"), map[bool]childRoot{false: hostRoot, true: pivotRoot}[pivot])
}

func TestInNamespaceMoveTree(t *testing.T) {
	testhelp.NeedRoot(t)
	src, c := nsSandbox(t, false)
	etcBefore := etcMounts(t)
	childEtcBefore := c.mountsUnder(t, "/etc")

	t.Run("read-write volume is in the child only", func(t *testing.T) {
		target := c.moveInto(t, src, "/data", false)
		if want := filepath.Join(c.rootfs, "data"); target != want {
			t.Fatalf("target %s, want %s", target, want)
		}
		defer c.unmountAll(t, target)
		if ms := c.mountsUnder(t, target); !slices.Equal(ms, []string{target, target + "/sub"}) {
			t.Errorf("child mounts at the target: %v, want it and its submount", ms)
		}
		if ms := hostMountsUnder(t, c.rootfs); len(ms) != 0 {
			t.Errorf("host mounts under the rootfs: %v", ms)
		}
		// ResolveInRoot created "data" in the child's rootfs tmpfs.
		if _, err := os.Lstat(target); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("target exists on the host: %v", err)
		}
		readFile(t, c.path(target+"/hello"), "hi")
		readFile(t, c.path(target+"/sub/deep"), "deep")
		if err := os.WriteFile(filepath.Join(src, "from-host"), []byte("h"), 0o644); err != nil {
			t.Fatal(err)
		}
		readFile(t, c.path(target+"/from-host"), "h")
		if err := os.WriteFile(c.path(target+"/from-child"), []byte("c"), 0o644); err != nil {
			t.Fatal(err)
		}
		readFile(t, filepath.Join(src, "from-child"), "c")
	})

	t.Run("read-only volume", func(t *testing.T) {
		target := c.moveInto(t, src, "/ro/vol", true)
		defer c.unmountAll(t, target)
		readFile(t, c.path(target+"/hello"), "hi")
		for _, p := range []string{"/x", "/sub/x"} {
			if err := os.WriteFile(c.path(target+p), nil, 0o644); !errors.Is(err, unix.EROFS) {
				t.Errorf("write %s%s: err = %v, want EROFS", target, p, err)
			}
		}
		if err := os.WriteFile(filepath.Join(src, "still-writable"), nil, 0o644); err != nil {
			t.Errorf("the source became read-only: %v", err)
		}
	})

	t.Run("symlink to /etc stays in the rootfs", func(t *testing.T) {
		mkdirs(t, c.path(c.rootfs+"/etc"))
		symlink(t, "/etc", c.path(c.rootfs+"/link"))
		target := c.moveInto(t, src, "/link", true)
		if want := filepath.Join(c.rootfs, "etc"); target != want {
			t.Fatalf("target %s, want %s", target, want)
		}
		defer c.unmountAll(t, target)
		readFile(t, c.path(target+"/hello"), "hi")
		if _, err := os.Stat(c.path("/etc/hello")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the child's /etc/hello: %v", err)
		}
		if ms := c.mountsUnder(t, "/etc"); !slices.Equal(ms, childEtcBefore) {
			t.Errorf("the child's /etc mounts changed: %v -> %v", childEtcBefore, ms)
		}
		if ms := etcMounts(t); !slices.Equal(ms, etcBefore) {
			t.Errorf("the host's /etc mounts changed: %v -> %v", etcBefore, ms)
		}
	})

	t.Run("a host mount is not seen by the child", func(t *testing.T) {
		// The fact that makes InNamespace necessary: the child's "/"
		// is private, so a mount made on the host stays there.
		dir := filepath.Join(filepath.Dir(c.rootfs), "hostside")
		mkdirs(t, dir)
		h, _ := resolve(t, dir, "/", mount.Directory)
		if err := mount.BindInto(src, h, true); err != nil {
			t.Fatal(err)
		}
		defer unmountAll(t, dir)
		readFile(t, filepath.Join(dir, "hello"), "hi")
		if _, err := os.Stat(c.path(dir + "/hello")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("host mount visible in the child: %v", err)
		}
		// And a handle resolved on the host is no target inside the
		// child's namespace.
		tree, err := mount.CloneTree(src, true)
		if err != nil {
			t.Fatal(err)
		}
		defer tree.Close()
		err = mount.InNamespace(c.pid, c.ino, func() error { return mount.MoveTree(tree, h) })
		if !errors.Is(err, unix.EINVAL) {
			t.Errorf("MoveTree onto a host handle in the child: err = %v, want EINVAL", err)
		}
	})

	if ms := c.mountsUnder(t, c.rootfs); !slices.Equal(ms, []string{c.rootfs}) {
		t.Errorf("child mounts left under its rootfs: %v", ms)
	}
}

// TestInNamespaceRunningContainer is the cleanup (and a late mount) for a
// container that has pivoted into its rootfs: in its namespace its paths
// are container paths.
func TestInNamespaceRunningContainer(t *testing.T) {
	testhelp.NeedRoot(t)
	src, c := nsSandbox(t, true)
	target := c.moveInto(t, src, "/vol/data", false)
	if target != "/vol/data" {
		t.Fatalf("target %s, want /vol/data", target)
	}
	if ms := c.mountsUnder(t, target); !slices.Equal(ms, []string{target, target + "/sub"}) {
		t.Errorf("child mounts at the target: %v, want it and its submount", ms)
	}
	readFile(t, c.path("/vol/data/sub/deep"), "deep")
	readFile(t, c.path("/proc/thread-self/mountinfo"), "garbage\n")
	if err := mount.InNamespace(c.pid, c.ino, func() error {
		ms, err := mount.List(mountinfo.PrefixFilter("/vol"))
		if err == nil && len(ms) != 2 {
			err = fmt.Errorf("List(/vol) = %d mounts, want 2", len(ms))
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	readFile(t, c.path("/.old"+src+"/hello"), "hi") // the old root is below
	c.unmountAll(t, target)
	if err := mount.InNamespace(c.pid, c.ino, func() error {
		return mount.RemoveEmptyTree("/vol")
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(c.path("/vol")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("/vol left in the container: %v", err)
	}
}

func TestInNamespaceErrors(t *testing.T) {
	testhelp.NeedRoot(t)
	self := os.Getpid()
	host, err := mount.MountNamespace(self)
	if err != nil {
		t.Fatal(err)
	}
	if host != threadNS(t) {
		t.Fatalf("MountNamespace(self) = %d, thread's %d", host, threadNS(t))
	}
	dead := exec.Command("/bin/true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	deadPid := dead.Process.Pid
	errF := errors.New("f failed")

	for _, tc := range []struct {
		name    string
		pid     int
		ino     uint64
		f       func() error
		want    error
		message string
		ran     bool
	}{
		{name: "wrong namespace", pid: self, ino: host + 1, want: mount.ErrWrongNamespace,
			message: fmt.Sprintf("entering the mount namespace of pid %d: not the expected mount namespace", self)},
		{name: "dead pid", pid: deadPid, want: mount.ErrNoProcess,
			message: fmt.Sprintf("entering the mount namespace of pid %d: no such process (exited?)", deadPid)},
		{name: "invalid pid", pid: 0, message: "entering the mount namespace of pid 0: invalid pid 0"},
		{name: "error of f", pid: self, ino: host, f: func() error { return errF }, want: errF, ran: true,
			message: fmt.Sprintf("in the mount namespace of pid %d: f failed", self)},
		{name: "no check without ino", pid: self, ran: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ran := false
			err := mount.InNamespace(tc.pid, tc.ino, func() error {
				ran = true
				if tc.f != nil {
					return tc.f()
				}
				return nil
			})
			if ran != tc.ran {
				t.Errorf("f ran: %v, want %v", ran, tc.ran)
			}
			if tc.message == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), tc.message) {
				t.Errorf("err = %v, want it to start with %q", err, tc.message)
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want errors.Is %v", err, tc.want)
			}
		})
	}

	t.Run("MountNamespace of a dead pid", func(t *testing.T) {
		if _, err := mount.MountNamespace(deadPid); !errors.Is(err, mount.ErrNoProcess) {
			t.Errorf("err = %v, want ErrNoProcess", err)
		}
	})

	t.Run("panic in f reaches the caller", func(t *testing.T) {
		defer func() {
			if v := recover(); v == nil || !strings.Contains(fmt.Sprint(v), "panic in f: boom") {
				t.Errorf("recovered %v", v)
			}
		}()
		_ = mount.InNamespace(self, 0, func() error { panic("boom") })
		t.Error("no panic")
	})
}

func TestMoveTreeKinds(t *testing.T) {
	testhelp.NeedRoot(t)
	s := newSandbox(t)
	if _, err := mount.CloneTree(filepath.Join(s.src, "missing"), false); !errors.Is(err, unix.ENOENT) {
		t.Errorf("CloneTree of a missing path: err = %v, want ENOENT", err)
	}
	tree, err := mount.CloneTree(s.src, false)
	if err != nil {
		t.Fatal(err)
	}
	defer tree.Close()
	file, _ := resolve(t, s.root, "/file", mount.File)
	if err := mount.MoveTree(tree, file); !errors.Is(err, mount.ErrKind) {
		t.Errorf("directory onto a file: err = %v, want ErrKind", err)
	}
	// The tree is still detached and usable.
	dir, hostPath := resolve(t, s.root, "/dir", mount.Directory)
	if err := mount.MoveTree(tree, dir); err != nil {
		t.Fatal(err)
	}
	readFile(t, filepath.Join(hostPath, "hello"), "hi")
	// The descriptor of a moved tree still holds the mount: busy.
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	if err := mount.UnmountAll(cancelled, hostPath); !errors.Is(err, context.Canceled) {
		t.Errorf("UnmountAll with the tree open: err = %v, want busy", err)
	}
	tree.Close()
	unmountAll(t, hostPath)
}

func TestInNamespaceLeavesCallerAlone(t *testing.T) {
	testhelp.NeedRoot(t)
	_, c := nsSandbox(t, false)

	// enter checks, inside f, that f runs in the child's namespace on a
	// thread that is not the main one, and returns that thread's id.
	enter := func() (int, error) {
		var tid int
		err := mount.InNamespace(c.pid, c.ino, func() error {
			tid = unix.Gettid()
			var st unix.Stat_t
			if err := unix.Stat("/proc/thread-self/ns/mnt", &st); err != nil {
				return err
			}
			if st.Ino != c.ino {
				return fmt.Errorf("f runs in mnt:[%d], want the child's mnt:[%d]", st.Ino, c.ino)
			}
			if tid == unix.Getpid() {
				return errors.New("f runs on the main thread")
			}
			// The child's rootfs tmpfs is visible by its host path.
			if ms, err := mount.List(mountinfo.SingleEntryFilter(c.rootfs)); err != nil || len(ms) != 1 {
				return fmt.Errorf("List in the child's namespace: %v, %v", ms, err)
			}
			return nil
		})
		return tid, err
	}

	// The test's goroutine holds its thread while it calls InNamespace 20
	// times at once, then checks the thread's namespace.
	runtime.LockOSThread()
	before := threadNS(t)
	var wg sync.WaitGroup
	tids := make(chan int, 20)
	for range 20 {
		wg.Go(func() {
			tid, err := enter()
			if err != nil {
				t.Error(err)
			}
			tids <- tid
		})
	}
	wg.Wait()
	close(tids)
	after := threadNS(t)
	// Released, as the thread may be the main one, needed below.
	runtime.UnlockOSThread()
	if after != before {
		t.Fatalf("the caller's thread moved from mnt:[%d] to mnt:[%d]", before, after)
	}

	// The threads that ran f end.
	deadline := time.Now().Add(5 * time.Second)
	for tid := range tids {
		for {
			_, err := os.Stat("/proc/self/task/" + strconv.Itoa(tid))
			if errors.Is(err, os.ErrNotExist) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("thread %d that ran f still exists (%v)", tid, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}

	// 50 goroutines at once, each holding its own thread: every thread
	// the runtime has to offer, idle ones included, is in the host's
	// namespace. Then the one that got the main thread, if one did (it is
	// idle while the test binary's main goroutine waits), releases it and
	// calls InNamespace at once: the goroutine InNamespace starts is queued
	// on that thread's P, and the main thread, free now, picks it up first.
	// The main thread must not end up in the child's namespace (Go never
	// terminates it).
	allThreads := func() (onMain bool) {
		var ready, wg sync.WaitGroup
		ready.Add(50)
		release := make(chan struct{})
		var called atomic.Bool
		for range 50 {
			wg.Go(func() {
				runtime.LockOSThread()
				var st unix.Stat_t
				if err := unix.Stat("/proc/thread-self/ns/mnt", &st); err != nil || st.Ino != before {
					t.Errorf("thread %d in mnt:[%d] (%v), want the host's mnt:[%d]", unix.Gettid(), st.Ino, err, before)
				}
				isMain := unix.Gettid() == unix.Getpid()
				ready.Done()
				<-release
				runtime.UnlockOSThread()
				if isMain {
					called.Store(true)
					if _, err := enter(); err != nil {
						t.Error(err)
					}
				}
			})
		}
		ready.Wait()
		close(release)
		wg.Wait()
		return called.Load()
	}
	fromMain := 0
	for range 20 {
		if allThreads() {
			fromMain++
		}
	}
	t.Logf("InNamespace called from the main thread %d times", fromMain)
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/mnt", &st); err != nil || st.Ino != before {
		t.Errorf("the main thread is in mnt:[%d] (%v), want the host's mnt:[%d]", st.Ino, err, before)
	}
}
