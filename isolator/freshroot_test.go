package isolator

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// TestGiveVolumeRootFreshShape: a root is fresh, and goes to the
// container's user, only if it is empty or holds nothing but a lost+found
// exactly as mkfs.ext4 leaves it (a directory, mode 0700, owned by 0:0,
// empty). Any other lost+found, or anything beside it, leaves the root
// as it is: a new user could otherwise rename lost+found and read a
// previous tenant's files in it. Plain directories stand in for volume
// roots; changing owners needs root.
func TestGiveVolumeRootFreshShape(t *testing.T) {
	testhelp.NeedRoot(t)
	const uid, gid = 1000, 1001
	lostFound := func(t *testing.T, root string) string {
		lf := filepath.Join(root, "lost+found")
		if err := os.Mkdir(lf, 0o700); err != nil {
			t.Fatal(err)
		}
		// the mode exactly, whatever the umask
		if err := os.Chmod(lf, 0o700); err != nil {
			t.Fatal(err)
		}
		return lf
	}
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, root string)
		fresh bool
	}{
		{"lost+found empty 0700 root:root", func(t *testing.T, root string) { lostFound(t, root) }, true},
		{"empty root, no lost+found", func(t *testing.T, root string) {}, true},
		{"lost+found holds a file", func(t *testing.T, root string) {
			if err := os.WriteFile(filepath.Join(lostFound(t, root), "secret"), []byte("tenant A"), 0o600); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"lost+found holds a directory", func(t *testing.T, root string) {
			if err := os.Mkdir(filepath.Join(lostFound(t, root), "#12"), 0o700); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"lost+found 0755", func(t *testing.T, root string) {
			if err := os.Chmod(lostFound(t, root), 0o755); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"lost+found 0700 and sticky", func(t *testing.T, root string) {
			if err := os.Chmod(lostFound(t, root), 0o700|os.ModeSticky); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"lost+found owned by 1000", func(t *testing.T, root string) {
			if err := os.Chown(lostFound(t, root), 1000, 0); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"lost+found group 1000", func(t *testing.T, root string) {
			if err := os.Chown(lostFound(t, root), 0, 1000); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"lost+found a symlink to an empty 0700 root:root directory", func(t *testing.T, root string) {
			target := t.TempDir()
			if err := os.Chmod(target, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.Symlink(target, filepath.Join(root, "lost+found")); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"lost+found a regular file", func(t *testing.T, root string) {
			if err := os.WriteFile(filepath.Join(root, "lost+found"), nil, 0o700); err != nil {
				t.Fatal(err)
			}
		}, false},
		{"lost+found and another entry", func(t *testing.T, root string) {
			lostFound(t, root)
			if err := os.WriteFile(filepath.Join(root, "data"), nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			tc.setup(t, root)
			var before, after unix.Stat_t
			lf := filepath.Join(root, "lost+found")
			_ = unix.Lstat(lf, &before) // absent in one case
			if err := giveVolumeRoot(root, uid, gid); err != nil {
				t.Fatal(err)
			}
			_ = unix.Lstat(lf, &after)
			if after.Uid != before.Uid || after.Gid != before.Gid || after.Mode != before.Mode {
				t.Errorf("lost+found changed: not recursive")
			}
			var st unix.Stat_t
			if err := unix.Lstat(root, &st); err != nil {
				t.Fatal(err)
			}
			want := [2]uint32{0, 0}
			if tc.fresh {
				want = [2]uint32{uid, gid}
			}
			if got := [2]uint32{st.Uid, st.Gid}; got != want {
				t.Errorf("root owned by %d:%d, want %d:%d", got[0], got[1], want[0], want[1])
			}
		})
	}
}

// TestGiveVolumeRootUnreadable: a root that cannot be opened (missing, or
// a symlink, which is not followed) is an error, as before; nothing is
// changed through it.
func TestGiveVolumeRootUnreadable(t *testing.T) {
	testhelp.NeedRoot(t)
	dir := t.TempDir()
	if err := giveVolumeRoot(filepath.Join(dir, "missing"), 1000, 1001); err == nil {
		t.Error("a missing root gave no error")
	}
	target := t.TempDir()
	link := filepath.Join(dir, "link")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if err := giveVolumeRoot(link, 1000, 1001); err == nil {
		t.Error("a symlinked root gave no error")
	}
	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 || st.Gid != 0 {
		t.Errorf("a symlink's target was given to %d:%d", st.Uid, st.Gid)
	}
}

// TestUnitSharedVolumeRootNotGiven: a fresh volume root goes to its first
// user's user only; a second container on the volume (of another caller,
// maybe, which needs no secret to join it) does not take it over while the
// first uses it.
func TestUnitSharedVolumeRootNotGiven(t *testing.T) {
	testhelp.NeedRoot(t)
	w := newWorld(t)
	iso := w.run(Config{})
	w.prepare(iso, w.request("c1", vol{"loop", "vol-1", "/data", false}))
	c2 := w.request("c2", vol{"loop", "vol-1", "/data", false})
	c2.User = "1000:1000"
	w.prepare(iso, c2)
	root := iso.ListVolumes()[0].TargetPath
	var st unix.Stat_t
	if err := unix.Stat(root, &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 0 || st.Gid != 0 {
		t.Errorf("the volume root, used by c1 (root), now belongs to %d:%d, c2's user", st.Uid, st.Gid)
	}
	w.cleanup(iso, "c1")
	w.cleanup(iso, "c2")
	w.checkEmpty(iso)
}
