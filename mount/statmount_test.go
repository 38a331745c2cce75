package mount

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestStatmountMatchesMountTable: what statmount says of a mount (device,
// root, propagation) is what the mount table says, for a tmpfs, a bind of
// a directory beneath it (root not "/"), a shared mount and its slave; so
// the fallback for kernels without statmount answers the same.
func TestStatmountMatchesMountTable(t *testing.T) {
	if os.Geteuid() != 0 || testing.Short() {
		t.Skip("needs root: mounts (skipped under -short; make test runs it)")
	}
	if _, err := statmount("/"); err == errNoStatmount {
		t.Skip("the kernel has no statmount (Linux 6.8): the mount table is read instead")
	}
	base := t.TempDir()
	fs, sub, bind, shared, slave := filepath.Join(base, "fs"), filepath.Join(base, "fs", "a b"), filepath.Join(base, "bind"), filepath.Join(base, "shared"), filepath.Join(base, "slave")
	for _, d := range []string{fs, bind, shared, slave} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	steps := []func() error{
		func() error { return unix.Mount("t", fs, "tmpfs", 0, "size=1m") },
		func() error { return os.Mkdir(sub, 0o755) },
		func() error { return unix.Mount(sub, bind, "", unix.MS_BIND, "") },
		func() error { return unix.Mount("t", shared, "tmpfs", 0, "size=1m") },
		func() error { return unix.Mount("", shared, "", unix.MS_SHARED, "") },
		func() error { return unix.Mount(shared, slave, "", unix.MS_BIND, "") },
		func() error { return unix.Mount("", slave, "", unix.MS_SLAVE, "") },
	}
	t.Cleanup(func() {
		for _, p := range []string{slave, shared, bind, fs} {
			_ = unix.Unmount(p, unix.MNT_DETACH)
		}
	})
	for _, step := range steps {
		if err := step(); err != nil {
			t.Fatal(err)
		}
	}
	raw, err := readThreadTable()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{fs, bind, shared, slave, "/"} {
		c, err := Canonical(p)
		if err != nil {
			t.Fatal(err)
		}
		got, err := statmount(c)
		if err != nil {
			t.Fatal(err)
		}
		want, err := mountOf(raw, c)
		if err != nil {
			t.Fatal(err)
		}
		var opt []string
		for _, tag := range []string{"shared:", "master:"} {
			if g := PeerGroup(want.Optional, tag); g != "" {
				opt = append(opt, tag+g)
			}
		}
		wantOpt := strings.Join(opt, " ")
		if got.Major != want.Major || got.Minor != want.Minor || got.Root != want.Root || got.Optional != wantOpt {
			t.Errorf("%s: statmount %d:%d %q %q, the mount table %d:%d %q %q", p, got.Major, got.Minor, got.Root, got.Optional, want.Major, want.Minor, want.Root, wantOpt)
		}
	}
}
