package isolator

import (
	"os"
	"path/filepath"
	"testing"
)

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
// made the missing directories there, owned by the container's user.
func TestUnitRemountFollowsNoSwappedRootfs(t *testing.T) {
	w := newWorld(t)
	iso := w.run(Config{})
	req := w.request("c1", vol{"loop", "vol-1", "/etc/profile.d", false}, vol{"loop", "vol-2", "/newdir/data", false})
	for _, m := range w.prepare(iso, req) {
		w.unmountBehindOurBack(m.GetMountPoint())
	}
	host := filepath.Join(w.dir, "host")
	if err := os.MkdirAll(filepath.Join(host, "etc", "profile.d"), 0o755); err != nil {
		t.Fatal(err)
	}
	w.renameBehindOurBack(req.GetRootfs(), req.GetRootfs()+".old")
	if err := os.Symlink(host, req.GetRootfs()); err != nil {
		t.Fatal(err)
	}
	iso = w.run(Config{}) // its recovery restores every missing mount
	if w.mountedAt(filepath.Join(host, "etc", "profile.d")) {
		t.Error("the restore mounted the volume through the rootfs's symlink, over the other tree's etc/profile.d")
	}
	if _, err := os.Lstat(filepath.Join(host, "newdir")); err == nil {
		t.Error("the restore made newdir in the tree the rootfs's symlink points to")
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
