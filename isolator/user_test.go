package isolator

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// TestLookupUser: a name, a uid, or UID:GID as the OCI hook passes a
// container's process.user.
func TestLookupUser(t *testing.T) {
	for in, want := range map[string][2]int{"": {-1, -1}, "root": {0, 0}, "1000": {1000, 1000}, "1000:1001": {1000, 1001}} {
		uid, gid, err := lookupUser(in)
		if err != nil || uid != want[0] || gid != want[1] {
			t.Errorf("lookupUser(%q) = %d, %d, %v; want %v", in, uid, gid, err, want)
		}
	}
	for _, bad := range []string{"1000:", ":5", "a:b", "-1:0", "no-such-user-h4"} {
		if _, _, err := lookupUser(bad); !errors.Is(err, ErrInvalid) {
			t.Errorf("lookupUser(%q) = %v, want ErrInvalid", bad, err)
		}
	}
}

// TestGiveVolumeRoot: a fresh volume root (empty but for lost+found,
// owned by root) goes to the container's user; one with data, or already
// someone's, keeps its owner.
func TestGiveVolumeRoot(t *testing.T) {
	testhelp.NeedRoot(t)
	owner := func(p string) (uint32, uint32) {
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		return st.Uid, st.Gid
	}
	fresh := t.TempDir()
	if err := os.Mkdir(filepath.Join(fresh, "lost+found"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := giveVolumeRoot(fresh, 1000, 1001); err != nil {
		t.Fatal(err)
	}
	if u, g := owner(fresh); u != 1000 || g != 1001 {
		t.Errorf("fresh root owned by %d:%d, want 1000:1001", u, g)
	}
	if u, _ := owner(filepath.Join(fresh, "lost+found")); u != 0 {
		t.Error("lost+found was chowned: not recursive")
	}
	used := t.TempDir()
	if err := os.WriteFile(filepath.Join(used, "data"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := giveVolumeRoot(used, 1000, 1001); err != nil {
		t.Fatal(err)
	}
	if u, g := owner(used); u != 0 || g != 0 {
		t.Errorf("a root with data was given to %d:%d", u, g)
	}
	if err := giveVolumeRoot(fresh, 2000, 2000); err != nil {
		t.Fatal(err)
	}
	if u, _ := owner(fresh); u != 1000 {
		t.Errorf("a root already someone's was taken: now %d", u)
	}
	if err := giveVolumeRoot(used, -1, -1); err != nil {
		t.Fatal(err)
	}
}
