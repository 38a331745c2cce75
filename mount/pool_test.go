package mount

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// volumeTree makes dir with empty staging and target directories, as a
// torn-down volume leaves it.
func volumeTree(t *testing.T, dir string) {
	t.Helper()
	for _, d := range []string{"staging", "target"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o750); err != nil {
			t.Fatal(err)
		}
	}
}

func entries(t *testing.T, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// TestTreePoolReusesATree: an empty volume tree put into the pool is the
// next tree taken, with its staging directory (Keep; not its target,
// which may have to be a file next time) and the same inodes. A new pool
// on the same directory (the next start) finds it.
func TestTreePoolReusesATree(t *testing.T) {
	root := t.TempDir()
	a, b := filepath.Join(root, "a"), filepath.Join(root, "b")
	volumeTree(t, a)
	var before unix.Stat_t
	if err := unix.Stat(filepath.Join(a, "staging"), &before); err != nil {
		t.Fatal(err)
	}
	p := &TreePool{Dir: filepath.Join(root, ".spare"), Max: 4, Keep: []string{"staging"}}
	if err := p.Put(a); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(a); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("%s after Put: %v; want it gone", a, err)
	}
	p2 := &TreePool{Dir: p.Dir, Max: 4}
	if taken, err := p2.Take(b); !taken || err != nil {
		t.Fatalf("Take from a pool holding a tree: %v, %v", taken, err)
	}
	if got := entries(t, b); !slices.Equal(got, []string{"staging"}) {
		t.Errorf("taken tree holds %v; want staging alone (Keep)", got)
	}
	var after unix.Stat_t
	if err := unix.Stat(filepath.Join(b, "staging"), &after); err != nil {
		t.Fatal(err)
	}
	if after.Ino != before.Ino {
		t.Errorf("staging's inode %d; want the pooled tree's %d", after.Ino, before.Ino)
	}
	if taken, err := p2.Take(filepath.Join(root, "c")); taken || err != nil {
		t.Errorf("Take from an empty pool: %v, %v", taken, err)
	}
	// The same pid again (a restart in a new pid namespace, a reboot):
	// the next start's trees do not collide with the pool's.
	c, d := filepath.Join(root, "c"), filepath.Join(root, "d")
	volumeTree(t, c)
	volumeTree(t, d)
	if err := p2.Put(c); err != nil {
		t.Fatal(err)
	}
	p3 := &TreePool{Dir: p.Dir, Max: 4}
	if err := p3.Put(d); err != nil {
		t.Fatal(err)
	}
	if got := entries(t, p.Dir); len(got) != 2 {
		t.Errorf("pool holds %v after two runs put a tree each; want 2", got)
	}
}

// TestTreePoolKeepsOnlyTreesAsMade: a tree someone made writable by
// others, or gave a sticky bit, is removed, not handed to the next volume.
func TestTreePoolKeepsOnlyTreesAsMade(t *testing.T) {
	root := t.TempDir()
	p := &TreePool{Dir: filepath.Join(root, ".spare"), Max: 4, Keep: []string{"staging"}}
	for name, mode := range map[string]os.FileMode{"world-writable": 0o777, "sticky": 0o750 | os.ModeSticky} {
		tree := filepath.Join(root, name)
		volumeTree(t, tree)
		if err := os.Chmod(filepath.Join(tree, "staging"), mode); err != nil {
			t.Fatal(err)
		}
		if err := p.Put(tree); err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(tree); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after Put: %v; want it removed", tree, err)
		}
	}
	if got := entries(t, p.Dir); len(got) != 0 {
		t.Errorf("pool holds %v; want none", got)
	}
}

// TestTreePoolRemovesWhatItCannotKeep: a tree with an empty file in it,
// or beyond Max, is removed; one with data is neither kept nor removed
// (RemoveEmptyTree's error); Take never moves into place a tree that
// holds a file, nor over an existing directory.
func TestTreePoolRemovesWhatItCannotKeep(t *testing.T) {
	root := t.TempDir()
	p := &TreePool{Dir: filepath.Join(root, ".spare"), Max: 1, Keep: []string{"staging"}}
	kept, over, withFile, withData := filepath.Join(root, "kept"), filepath.Join(root, "over"), filepath.Join(root, "file"), filepath.Join(root, "data")
	for _, d := range []string{kept, over, withFile, withData} {
		volumeTree(t, d)
	}
	if err := os.WriteFile(filepath.Join(withFile, "staging", "empty"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(withData, "target", "data"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{kept, over, withFile} {
		if err := p.Put(d); err != nil {
			t.Fatalf("Put %s: %v", d, err)
		}
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s after Put: %v; want it gone", d, err)
		}
	}
	if got := entries(t, p.Dir); len(got) != 1 {
		t.Errorf("pool holds %v; want one tree (Max 1)", got)
	}
	if err := p.Put(withData); !errors.Is(err, ErrNotEmpty) {
		t.Errorf("Put of a tree holding data: %v; want ErrNotEmpty", err)
	}
	if _, err := os.Stat(filepath.Join(withData, "target", "data")); err != nil {
		t.Errorf("the data: %v", err)
	}
	// The pooled tree gets a file: not taken.
	spare := filepath.Join(p.Dir, entries(t, p.Dir)[0])
	if err := os.WriteFile(filepath.Join(spare, "staging", "data"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if taken, err := p.Take(filepath.Join(root, "new")); taken || !errors.Is(err, ErrNotEmpty) {
		t.Errorf("Take of a pool whose tree holds a file: %v, %v; want false, ErrNotEmpty", taken, err)
	}
	if _, err := os.Stat(filepath.Join(spare, "staging", "data")); err != nil {
		t.Errorf("the file in the pooled tree: %v", err)
	}
	// Over an existing directory: refused, the spare stays.
	q := &TreePool{Dir: filepath.Join(root, ".spare2"), Max: 1}
	volumeTree(t, kept)
	if err := q.Put(kept); err != nil {
		t.Fatal(err)
	}
	volumeTree(t, over)
	if taken, err := q.Take(over); taken || !errors.Is(err, unix.EEXIST) {
		t.Errorf("Take over an existing directory: %v, %v; want false, EEXIST", taken, err)
	}
	if got := entries(t, q.Dir); len(got) != 1 {
		t.Errorf("pool after a refused Take: %v", got)
	}
}

// TestTreePoolNeverMovesAMount: a tree with something mounted in it is
// neither pooled nor removed (ErrMounted); a pooled tree that got a mount
// is never taken.
func TestTreePoolNeverMovesAMount(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a tmpfs")
	}
	root := t.TempDir()
	p := &TreePool{Dir: filepath.Join(root, ".spare"), Max: 4, Keep: []string{"staging"}}
	a := filepath.Join(root, "a")
	volumeTree(t, a)
	staging := filepath.Join(a, "staging")
	if err := unix.Mount("tmpfs", staging, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(staging, unix.MNT_DETACH) })
	if err := p.Put(a); !errors.Is(err, ErrMounted) {
		t.Fatalf("Put of a tree with a mount: %v; want ErrMounted", err)
	}
	if ok, err := IsMountPoint(staging); err != nil || !ok {
		t.Fatalf("the mount at %s after Put: %v, %v", staging, ok, err)
	}
	if err := unix.Unmount(staging, 0); err != nil {
		t.Fatal(err)
	}
	if err := p.Put(a); err != nil {
		t.Fatal(err)
	}
	spare := filepath.Join(p.Dir, entries(t, p.Dir)[0], "staging")
	if err := unix.Mount("tmpfs", spare, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(spare, unix.MNT_DETACH) })
	if taken, err := p.Take(filepath.Join(root, "b")); taken || !errors.Is(err, ErrMounted) {
		t.Errorf("Take of a pool whose tree has a mount: %v, %v; want false, ErrMounted", taken, err)
	}
	if ok, err := IsMountPoint(spare); err != nil || !ok {
		t.Errorf("the mount in the pooled tree: %v, %v", ok, err)
	}
}

// TestCheckEmptyTree: CheckEmptyTree refuses what RemoveEmptyTree refuses
// (data, a mount) and removes nothing, whatever it answers.
func TestCheckEmptyTree(t *testing.T) {
	root := t.TempDir()
	empty, withData := filepath.Join(root, "empty"), filepath.Join(root, "data")
	volumeTree(t, empty)
	volumeTree(t, withData)
	if err := os.WriteFile(filepath.Join(empty, "staging", "empty-file"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(withData, "target", "data"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := CheckEmptyTree(empty); err != nil {
		t.Errorf("CheckEmptyTree of empty directories and an empty file: %v", err)
	}
	if err := CheckEmptyTree(withData); !errors.Is(err, ErrNotEmpty) {
		t.Errorf("CheckEmptyTree of a tree holding data: %v; want ErrNotEmpty", err)
	}
	if err := CheckEmptyTree(filepath.Join(root, "missing")); err != nil {
		t.Errorf("CheckEmptyTree of a missing tree: %v; want nil (already removed)", err)
	}
	for _, p := range []string{filepath.Join(empty, "staging", "empty-file"), filepath.Join(empty, "target"), filepath.Join(withData, "target", "data")} {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s after the checks: %v; want it kept", p, err)
		}
	}
	if os.Geteuid() != 0 {
		t.Log("not root: the mount case is not run")
		return
	}
	staging := filepath.Join(empty, "staging")
	if err := unix.Mount("tmpfs", staging, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(staging, unix.MNT_DETACH) })
	if err := CheckEmptyTree(empty); !errors.Is(err, ErrMounted) {
		t.Errorf("CheckEmptyTree of a tree with a mount: %v; want ErrMounted", err)
	}
}

// TestNoTreePoolRemoves: with no pool (a layout of its own), Put removes
// the tree as RemoveEmptyTree does.
func TestNoTreePoolRemoves(t *testing.T) {
	tree := filepath.Join(t.TempDir(), "a")
	volumeTree(t, tree)
	var p *TreePool
	if err := p.Put(tree); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(tree); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("%s after Put with no pool: %v; want it removed", tree, err)
	}
}
