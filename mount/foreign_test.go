package mount_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// TestForeignMounts: the mounts of a volume's filesystem elsewhere are
// found in any mount namespace: a bind another namespace made (a
// container's), and a bind on the host at a path not its own; its own
// paths are not, nor their copies a namespace made as the host's slave
// holds (propagation removes them with the host's).
func TestForeignMounts(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	top, croot := filepath.Join(base, "top"), filepath.Join(base, "croot")
	vol, staging, other := filepath.Join(top, "vol"), filepath.Join(top, "staging"), filepath.Join(top, "other")
	mkdirs(t, top, croot)
	mountTmpfs(t, top)
	t.Cleanup(func() { must(t, mount.UnmountAll(context.Background(), top)) })
	must(t, unix.Mount("", top, "", unix.MS_SHARED, ""))

	// A namespace made as the host's slave, as systemd's services' are.
	cmd := exec.Command("unshare", "-m", "--propagation", "slave", "/bin/sh", "-c", "echo ready && read x")
	stdin, err := cmd.StdinPipe()
	must(t, err)
	out, err := cmd.StdoutPipe()
	must(t, err)
	must(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = stdin.Close()
		_ = cmd.Wait()
	})
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("child: %q, %v", line, err)
	}
	pid := cmd.Process.Pid
	ino, err := mount.MountNamespace(pid)
	must(t, err)
	c := nsChild{pid: pid, ino: ino, rootfs: croot}
	inChild := " in the mount namespace of pid " + strconv.Itoa(pid)

	// The volume: published at vol, staged at staging, both propagated to
	// the child.
	mkdirs(t, vol, staging, other)
	mountTmpfs(t, vol)
	must(t, mount.Bind(vol, staging, false))
	if ms := c.mountsUnder(t, top); !slices.Contains(ms, vol) || !slices.Contains(ms, staging) {
		t.Fatalf("the child did not receive the volume's mounts: %v", ms)
	}
	found := func(want ...string) {
		t.Helper()
		got, err := mount.ForeignMounts(context.Background(), vol, []string{staging, filepath.Join(top, "missing")})
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("ForeignMounts = %q, want %q", got, want)
		}
	}
	found()

	// A host process that made itself a namespace (unshare(1)) while the
	// volume was mounted: private copies at the volume's own paths, the
	// host's root: not counted.
	hc := startNSChild(t, filepath.Join(base, "hroot"), hostRoot)
	if ms := hc.mountsUnder(t, top); !slices.Contains(ms, vol) || !slices.Contains(ms, staging) {
		t.Fatalf("the host child has no copies of the volume's mounts: %v", ms)
	}
	found()
	// A container made meanwhile (pivoted into its own root): its copies
	// count, even one it puts at the path of the volume's own.
	pc := startNSChild(t, filepath.Join(base, "proot"), pivotRoot)
	pc.in(t, func() error {
		if err := os.MkdirAll(vol, 0o755); err != nil {
			return err
		}
		return unix.Mount("/.old"+vol, vol, "", unix.MS_BIND, "")
	})
	inPC := " in the mount namespace of pid " + strconv.Itoa(pc.pid)
	found("/.old"+vol+inPC, "/.old"+staging+inPC, vol+inPC)
	must(t, unix.Kill(pc.pid, unix.SIGKILL))
	waitGone(t, pc.pid)
	found()

	// The child binds the volume elsewhere, in its namespace only.
	elsewhere := c.moveInto(t, vol, "/elsewhere", false)
	if ms := hostMountsUnder(t, croot); len(ms) != 0 {
		t.Fatalf("the child's bind shows on the host: %v", ms)
	}
	found(elsewhere + inChild)

	// A bind root makes on the host, not at the volume's own paths: the
	// agent's namespace is not looked at (its mounts are root's or the
	// agent's), but its copy in the child's is a mount elsewhere.
	must(t, mount.Bind(vol, other, false))
	found(elsewhere+inChild, other+inChild)
	must(t, mount.Unmount(context.Background(), other))
	found(elsewhere + inChild)

	// A volume that is a directory of a larger filesystem (a host path's):
	// the filesystem's other mounts are not the volume's, a bind of a
	// directory beneath it is.
	store, hp := filepath.Join(top, "store", "v1"), filepath.Join(top, "hp")
	mkdirs(t, filepath.Join(store, "d"), hp)
	must(t, mount.Bind(store, hp, false))
	if got, err := mount.ForeignMounts(context.Background(), hp, nil); err != nil || len(got) != 0 {
		t.Errorf("ForeignMounts(%s), a directory of %s = %q, %v; want none", hp, top, got, err)
	}
	sub := c.moveInto(t, filepath.Join(store, "d"), "/sub", false)
	if got, err := mount.ForeignMounts(context.Background(), hp, nil); err != nil || !slices.Equal(got, []string{sub + inChild}) {
		t.Errorf("ForeignMounts(%s) = %q, %v; want %s", hp, got, err, sub+inChild)
	}
	c.unmountAll(t, sub)
	must(t, mount.Unmount(context.Background(), hp))

	// Another filesystem is not the volume's.
	if got, err := mount.ForeignMounts(context.Background(), top, nil); err != nil || len(got) != 0 {
		t.Errorf("ForeignMounts(%s) = %q, %v; want none", top, got, err)
	}
	// Nothing mounted at the target: none.
	if got, err := mount.ForeignMounts(context.Background(), other, nil); err != nil || len(got) != 0 {
		t.Errorf("ForeignMounts(%s), not a mount point = %q, %v; want none", other, got, err)
	}

	c.unmountAll(t, filepath.Join(croot, "elsewhere"))
	found()
	if !strings.HasPrefix(elsewhere, croot) {
		t.Errorf("the child's bind is at %s, not under %s", elsewhere, croot)
	}
}

// waitGone waits until pid has exited (its /proc entry reaped or a zombie
// without a mount namespace).
func waitGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/ns/mnt"); err != nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pid %d did not exit", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestForeignMountsConcurrent: calls made at once share scans and each
// gets its own answer: the volumes a container bound elsewhere name it,
// the others none.
func TestForeignMountsConcurrent(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	mountTmpfs(t, base)
	t.Cleanup(func() { must(t, mount.UnmountAll(context.Background(), base)) })
	c := startNSChild(t, filepath.Join(base, "croot"), pivotRoot)
	const n = 24
	vols := make([]string, n)
	want := make([][]string, n)
	for i := range n {
		vols[i] = filepath.Join(base, strconv.Itoa(i))
		mkdirs(t, vols[i])
		mountTmpfs(t, vols[i])
		if i%3 == 0 {
			at := c.moveInto(t, vols[i], "/e"+strconv.Itoa(i), false)
			want[i] = []string{at + " in the mount namespace of pid " + strconv.Itoa(c.pid)}
		}
	}
	var wg sync.WaitGroup
	for round := range 3 {
		for i, v := range vols {
			wg.Go(func() {
				got, err := mount.ForeignMounts(context.Background(), v, nil)
				if err != nil || !slices.Equal(got, want[i]) {
					t.Errorf("round %d: ForeignMounts(%s) = %q, %v; want %q", round, v, got, err, want[i])
				}
			})
		}
	}
	wg.Wait()
}

// TestForeignMountsAfterItsProcessLeft: a scan remembers a process per
// namespace; when that process exits, a namespace another process keeps
// is still looked at (through it), and the mounts it holds are found.
func TestForeignMountsAfterItsProcessLeft(t *testing.T) {
	testhelp.NeedRoot(t)
	vol, c := volumeBesideChild(t, hostRoot)
	if got, err := mount.ForeignMounts(context.Background(), vol, nil); err != nil || len(got) != 0 {
		t.Fatalf("before the bind: %q, %v", got, err)
	}
	// A second process joins the namespace, then the first exits: the
	// process the scan remembers is gone, the namespace is not.
	second := exec.Command("nsenter", "-t", strconv.Itoa(c.pid), "-m", "/bin/sh", "-c", "echo ready && exec sleep 60")
	out, err := second.StdoutPipe()
	must(t, err)
	must(t, second.Start())
	t.Cleanup(func() {
		_ = second.Process.Kill()
		_ = second.Wait()
	})
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("second process: %q, %v", line, err)
	}
	at := c.moveInto(t, vol, "/data", false)
	must(t, unix.Kill(c.pid, unix.SIGKILL))
	waitGone(t, c.pid)
	want := at + " in the mount namespace of pid " + strconv.Itoa(second.Process.Pid)
	if got, err := mount.ForeignMounts(context.Background(), vol, nil); err != nil || !slices.Equal(got, []string{want}) {
		t.Fatalf("ForeignMounts = %q, %v; want %q", got, err, want)
	}
	must(t, second.Process.Kill())
	_ = second.Wait()
	waitGone(t, second.Process.Pid)
	if got, err := mount.ForeignMounts(context.Background(), vol, nil); err != nil || len(got) != 0 {
		t.Fatalf("once the namespace is gone: %q, %v", got, err)
	}
}

// TestForeignMountsInANamespaceNoProcessHolds: a mount namespace whose
// last process exited while a descriptor keeps it (as a bind mount of its
// nsfs file would) still holds the volume's filesystem: it is found, and
// gone once the namespace is.
func TestForeignMountsInANamespaceNoProcessHolds(t *testing.T) {
	testhelp.NeedRoot(t)
	if !kernelAtLeast(t, 6, 12) {
		t.Skip("the kernel lists mount namespaces (nsfs NS_MNT_GET_NEXT) from Linux 6.12 only; before, a namespace no process holds cannot be found")
	}
	vol, c := volumeBesideChild(t, hostRoot)
	c.moveInto(t, vol, "/data", false)
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/mnt", c.pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	must(t, err)
	closed := false
	t.Cleanup(func() {
		if !closed {
			unix.Close(fd)
		}
	})
	must(t, unix.Kill(c.pid, unix.SIGKILL))
	waitGone(t, c.pid)
	got, err := mount.ForeignMounts(context.Background(), vol, nil)
	if err != nil || len(got) != 1 || !strings.Contains(got[0], "which no process holds") || !strings.Contains(got[0], "/data") {
		t.Fatalf("ForeignMounts = %q, %v; want the copy at /data in the namespace no process holds", got, err)
	}
	t.Logf("found: %q", got)
	// Asked again: from the namespaces the last pass found, the same.
	if again, err := mount.ForeignMounts(context.Background(), vol, nil); err != nil || !slices.Equal(again, got) {
		t.Fatalf("asked again: %q, %v; want %q", again, err, got)
	}
	unix.Close(fd)
	closed = true
	deadline := time.Now().Add(10 * time.Second)
	for {
		got, err := mount.ForeignMounts(context.Background(), vol, nil)
		if err == nil && len(got) == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("once the namespace is gone: %q, %v", got, err)
		}
		time.Sleep(10 * time.Millisecond) // the namespace is freed asynchronously (RCU)
	}
}

// kernelAtLeast reports whether the running kernel is major.minor or
// later.
func kernelAtLeast(t *testing.T, major, minor int) bool {
	t.Helper()
	var u unix.Utsname
	must(t, unix.Uname(&u))
	var ma, mi int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &ma, &mi); err != nil {
		t.Fatalf("kernel release %q: %v", u.Release[:], err)
	}
	return ma > major || ma == major && mi >= minor
}

// volumeBesideChild mounts a tmpfs "volume" on a private mount after
// starting a child in a mount namespace of its own, its root where root
// says (the child therefore has no copy of it), and returns both.
func volumeBesideChild(t *testing.T, root childRoot) (string, nsChild) {
	t.Helper()
	base := testhelp.LeakCheckedDir(t)
	top := filepath.Join(base, "top")
	vol := filepath.Join(top, "vol")
	mkdirs(t, top)
	mountTmpfs(t, top)
	t.Cleanup(func() { must(t, mount.UnmountAll(context.Background(), top)) })
	must(t, unix.Mount("", top, "", unix.MS_PRIVATE, ""))
	c := startNSChild(t, filepath.Join(base, "croot"), root)
	mkdirs(t, vol)
	mountTmpfs(t, vol) // after the child: it has no copy
	return vol, c
}

// TestForeignMountsBehindAChroot: a container's copy of a volume is found
// even when every process of its namespace has chroot(2)ed where the copy
// is not (a process's mount table shows only the mounts below its root):
// the namespace's own list (listmount, Linux 6.11) is read when the
// process's table lacks mounts. Before, the copy was missed, and the
// volume torn down under it.
func TestForeignMountsBehindAChroot(t *testing.T) {
	testhelp.NeedRoot(t)
	if !kernelAtLeast(t, 6, 12) {
		t.Skip("the kernel lists a namespace's mounts (listmount) and namespaces (nsfs NS_MNT_GET_NEXT) from Linux 6.12 only")
	}
	vol, c := volumeBesideChild(t, jailRoot)
	at := c.moveInto(t, vol, "/stash", false)
	got, err := mount.ForeignMounts(context.Background(), vol, nil)
	if err != nil || len(got) != 1 || !strings.Contains(got[0], at) {
		t.Fatalf("ForeignMounts = %q, %v; want the copy at %s, outside the jailed process's root", got, err, at)
	}
}
