package isolator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// TestUnitRemountMakesAMissingMountPoint: a mount point a reboot took
// (made on a tmpfs of the rootfs, say) is made again when its mount is
// restored, where the Prepare made it.
func TestUnitRemountMakesAMissingMountPoint(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"loop", "vol-1", "/run/app/data", false})
	ms := w.prepare(iso, req)
	w.reboot()
	if err := os.RemoveAll(filepath.Join(req.GetRootfs(), "run")); err != nil {
		t.Fatal(err)
	}
	iso = w.run(Config{})
	if !w.mountedAt(ms[0].GetMountPoint()) {
		t.Fatalf("after the reboot, nothing mounted at %s (its directory gone with the reboot)", ms[0].GetMountPoint())
	}
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// renameBehindOurBack renames a directory of the host as a process that
// owns it would, mounts below it moving with it.
func (w *world) renameBehindOurBack(from, to string) {
	w.t.Helper()
	if err := os.Rename(from, to); err != nil {
		w.t.Fatal(err)
	}
	w.table.mu.Lock()
	defer w.table.mu.Unlock()
	for _, m := range w.table.mounts {
		if m.ns == hostNS && within(from, m.path) {
			m.path = filepath.Join(to, m.path[len(from):])
		}
	}
}

// rootfsToHost puts a symlink to another tree, <dir>/host (made with the
// directories dirs), in place of req's rootfs, which goes aside with its
// mounts, and returns that tree.
func (w *world) rootfsToHost(req *statev1.PrepareRequest, dirs ...string) string {
	w.t.Helper()
	host := filepath.Join(w.dir, "host")
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(host, d), 0o755); err != nil {
			w.t.Fatal(err)
		}
	}
	w.renameBehindOurBack(req.GetRootfs(), req.GetRootfs()+".old")
	if err := os.Symlink(host, req.GetRootfs()); err != nil {
		w.t.Fatal(err)
	}
	return host
}

// mountedAt reports whether the host namespace has a mount at path.
func (w *world) mountedAt(path string) bool {
	w.table.mu.Lock()
	defer w.table.mu.Unlock()
	return w.table.top(hostNS, path) != nil
}

// TestUnitRemountFollowsNoSwappedRootfs: recovery restores a prepared
// container's missing mounts where its Prepare put them, and nowhere else.
// Whoever owns the rootfs (a member of the API group, below its prefix)
// unmounted the volume and put a symlink to another tree in the rootfs's
// place: the restore mounted through it (over a directory of the host) and
// made the missing directories there, owned by the container's user. A
// member's rootfs (confined) is not followed at all; root's is trusted
// (directories may be made through it), but nothing is mounted anywhere
// but where the Prepare put it.
func TestUnitRemountFollowsNoSwappedRootfs(t *testing.T) {
	for _, confined := range []bool{true, false} {
		t.Run(fmt.Sprint("confined ", confined), func(t *testing.T) { remountSwappedRootfs(t, confined) })
	}
}

func remountSwappedRootfs(t *testing.T, confined bool) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"loop", "vol-1", "/etc/profile.d", false}, vol{"loop", "vol-2", "/newdir/data", false})
	req.Confined = confined
	for _, m := range w.prepare(iso, req) {
		w.unmountBehindOurBack(m.GetMountPoint())
	}
	host := w.rootfsToHost(req, filepath.Join("etc", "profile.d"))
	iso = w.run(Config{}) // its recovery restores every missing mount
	for _, p := range []string{filepath.Join(host, "etc", "profile.d"), filepath.Join(host, "newdir", "data")} {
		if w.mountedAt(p) {
			t.Errorf("the restore mounted a volume through the rootfs's symlink, at %s", p)
		}
	}
	if _, err := os.Lstat(filepath.Join(host, "newdir")); err == nil && confined {
		t.Error("the restore made newdir, as the member's user, in the tree the member's rootfs symlink points to")
	}
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitMovedMountNotMountedAgain: a container renamed a directory
// above its volume's mount point, which moved the mount with it. Recovery
// does not take the mount for missing: a second mount took the record's
// identity, so the cleanup unmounted that one and tore the volume down
// under the first, left mounted in the agent's namespace.
func TestUnitMovedMountNotMountedAgain(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"loop", "vol-1", "/mnt/data", false})
	w.prepare(iso, req)
	w.renameBehindOurBack(filepath.Join(req.GetRootfs(), "mnt"), filepath.Join(req.GetRootfs(), "mnt2"))
	iso = w.run(Config{})
	if w.mountedAt(filepath.Join(req.GetRootfs(), "mnt", "data")) {
		t.Error("recovery mounted the volume again at its recorded mount point, the first mount being still there (moved)")
	}
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitCleanupAfterRootfsSwappedBack: a Prepare whose rootfs was a
// symlink to another tree put the mount there (a member's race between
// its check and the mount: the API server undoes such a Prepare at once).
// The rootfs is a directory again when the undo runs: the cleanup still
// removes the mount, the agent's by its identity, where the agent put it.
// Before, it failed (not below the rootfs), and the mount stayed.
func TestUnitCleanupAfterRootfsSwappedBack(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	host := w.rootfsToHost(req, "data")
	ms := w.prepare(iso, req)
	if want := filepath.Join(host, "data"); ms[0].GetMountPoint() != want {
		t.Fatalf("mounted at %s; want %s (through the symlink)", ms[0].GetMountPoint(), want)
	}
	if err := os.Remove(req.GetRootfs()); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(req.GetRootfs(), 0o755); err != nil {
		t.Fatal(err)
	}
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitConfinedRootfsOpenedWithoutSymlinks: a member's request
// (Confined: the API server checked its rootfs below the member's prefix,
// resolved) is refused if a symlink is found on the way to its rootfs when
// the volume is mounted (the member swapped it after the check): before,
// the Prepare made the missing directories in the tree the symlink leads
// to, as the member's user, and mounted the volume there. Root's requests
// follow symlinks in their rootfs as before.
func TestUnitConfinedRootfsOpenedWithoutSymlinks(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"loop", "vol-1", "/newdir/data", false})
	host := w.rootfsToHost(req, "")
	req.Confined = true
	_, err := iso.Prepare(context.Background(), req)
	if !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "no symlink on the way") {
		t.Fatalf("a confined Prepare through a symlinked rootfs: %v; want ErrPrecondition naming the symlink", err)
	}
	if _, err := os.Lstat(filepath.Join(host, "newdir")); err == nil {
		t.Error("the refused Prepare made newdir in the tree the rootfs's symlink points to")
	}
	w.cleanup(iso, "c1")
	// The same with a pid (the member's own process, in a namespace
	// the host made): pinned in that namespace.
	w.table.startProcess(crashPid, 77)
	req.Pid = crashPid
	req.CheckedMountNamespace = 76 // it made itself another since the check
	if _, err := iso.Prepare(context.Background(), req); !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "no longer in the mount namespace it was checked in") {
		t.Fatalf("a confined Prepare whose pid left the namespace checked: %v; want ErrPrecondition saying so", err)
	}
	w.cleanup(iso, "c1")
	req.CheckedMountNamespace = 77
	if _, err := iso.Prepare(context.Background(), req); !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "no symlink on the way") {
		t.Fatalf("a confined Prepare with a pid through a symlinked rootfs: %v; want ErrPrecondition naming the symlink", err)
	}
	if _, err := os.Lstat(filepath.Join(host, "newdir")); err == nil {
		t.Error("the refused Prepare with a pid made newdir in the tree the rootfs's symlink points to")
	}
	w.cleanup(iso, "c1")
	w.table.endProcess(crashPid)
	req.Confined, req.Pid, req.CheckedMountNamespace = false, 0, 0
	w.prepare(iso, req)
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitBadControllerSecretRefusedFirst: a Prepare whose
// controller_publish_secrets cannot be resolved (a secret of no type, a
// reference that does not exist) is refused before anything is done, as
// bad node secrets are. Before, the attach intent was recorded, the attach
// failed on the secret, and so did its undo: the volume stayed half
// attached for good, and every later Prepare of it failed on the first
// caller's secret.
func TestUnitBadControllerSecretRefusedFirst(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"attach", "vol-1", "/data", false})
	req.Volumes[0].GetSource().GetCsiVolume().GetStaticProvisioning().ControllerPublishSecrets = map[string]*statev1.Secret{"k": {}}
	_, err := iso.Prepare(context.Background(), req)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "controller_publish_secrets") {
		t.Fatalf("Prepare with an unresolvable controller secret: %v; want ErrInvalid naming controller_publish_secrets", err)
	}
	if got := w.calls("attach"); len(got) > 0 {
		t.Errorf("the refused Prepare called the plugin: %v", got)
	}
	if v := iso.ListVolumes(); len(v) > 0 {
		t.Errorf("volumes after the refused Prepare: %v; want none", v)
	}
	w.cleanup(iso, "c1")
	w.prepare(iso, w.request("c2", vol{"attach", "vol-1", "/data", false}))
	w.cleanup(iso, "c2")
	w.checkEmpty(iso)
}

// TestUnitSharedMountPointRefused: in a container's own namespace, a mount
// point on a shared mount (its creator bound a host directory there with
// rshared propagation) is refused: the volume would propagate to the
// host's copy of that mount, which the agent does not record, and the
// cleanup would tear the volume down under it once the namespace is gone.
func TestUnitSharedMountPointRefused(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	w.table.startProcess(crashPid, 77)
	w.table.mu.Lock()
	w.table.top(77, "/").peers = 5
	w.table.mu.Unlock()
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	req.Pid = crashPid
	_, err := iso.Prepare(context.Background(), req)
	if !errors.Is(err, ErrPrecondition) || !strings.Contains(err.Error(), "shared (peer group 5)") {
		t.Fatalf("a mount point on a shared mount: %v; want ErrPrecondition naming the peer group", err)
	}
	w.table.endProcess(crashPid)
	w.cleanup(iso, "c1")
	w.checkEmpty(iso)
}

// TestUnitCleanupIfChecksUnderTheLock: CleanupIf shows allow the container
// as it is once locked, and a refusal leaves it as it was (the API
// server's check of a member's cleanup: made on a list taken before the
// lock, a root Prepare of the same id could slip in between, and the
// member cleaned up root's container).
func TestUnitCleanupIfChecksUnderTheLock(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"loop", "vol-1", "/data", false})
	w.prepare(iso, req)
	refusal := errors.New("not yours")
	var seen ContainerInfo
	err := iso.CleanupIf(context.Background(), "c1", false, func(ci ContainerInfo) error {
		seen = ci
		return refusal
	})
	if !errors.Is(err, refusal) {
		t.Fatalf("CleanupIf refused by allow: %v", err)
	}
	if seen.ID != "c1" || seen.Rootfs != req.GetRootfs() || len(seen.Mounts) != 1 {
		t.Errorf("allow saw %+v; want c1 as prepared", seen)
	}
	if c := containerOf(iso, "c1"); c == nil || c.Phase != statev1.ContainerCheckpoint_PREPARED {
		t.Errorf("c1 after a refused CleanupIf: %+v; want it prepared", c)
	}
	if err := iso.CleanupIf(context.Background(), "c1", false, func(ContainerInfo) error { return nil }); err != nil {
		t.Fatal(err)
	}
	w.checkEmpty(iso)
}
