package testhelp

import (
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/mount"
)

// NeedRoot skips the test unless it runs as root, which mounts, loop
// devices, runc and changing users need. It skips it under -short too
// (make unit), even as root: the root tests are make test's.
func NeedRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts filesystems, attaches loop devices or runs containers")
	}
	if testing.Short() {
		t.Skip("needs root (mounts, loop devices, containers): skipped under -short; make test runs it")
	}
}

// LeakCheckedDir returns a new canonical temporary directory. When the
// test ends it fails the test for each mount still below the directory
// and each loop device still backed by a file in it, and undoes them so
// that later tests are not affected.
func LeakCheckedDir(t testing.TB) string {
	t.Helper()
	dir, err := mount.Canonical(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ms, err := mount.List(mountinfo.PrefixFilter(dir))
		if err != nil {
			t.Error(err)
		}
		for i := len(ms) - 1; i >= 0; i-- {
			t.Errorf("left mounted: %s (%s)", ms[i].Mountpoint, ms[i].FSType)
			_ = unix.Unmount(ms[i].Mountpoint, unix.MNT_DETACH)
		}
		if os.Geteuid() != 0 {
			return // no loop device could have been attached
		}
		attached, err := loopdev.List(dir)
		if err != nil {
			t.Error(err)
		}
		for _, a := range attached {
			t.Errorf("left attached: %s -> %s", a.Path, a.BackingFile)
			_ = loopdev.Detach(a.Device, a.BackingFile)
		}
	})
	return dir
}

// BuildBinaries builds the main packages pkgs (import paths) into a new
// temporary directory that every user may read, since some tests run a
// binary as another user. Call it once, from TestMain. It returns each
// binary's path (named after the last element of its package path), in
// the order of pkgs, and the function that removes them.
func BuildBinaries(pkgs ...string) (paths []string, remove func(), err error) {
	dir, err := os.MkdirTemp("", "csiagent-bins-")
	if err != nil {
		return nil, nil, fmt.Errorf("building the test binaries: %w", err)
	}
	remove = func() { os.RemoveAll(dir) }
	if err := os.Chmod(dir, 0o755); err != nil {
		remove()
		return nil, nil, fmt.Errorf("building the test binaries: %w", err)
	}
	for _, pkg := range pkgs {
		out := filepath.Join(dir, path.Base(pkg))
		if b, err := exec.Command("go", "build", "-o", out, pkg).CombinedOutput(); err != nil {
			remove()
			return nil, nil, fmt.Errorf("building %s: %w\n%s", pkg, err, b)
		}
		paths = append(paths, out)
	}
	return paths, remove, nil
}
