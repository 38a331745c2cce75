package mount_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// attackEnv is a container rootfs R, a volume source (a tmpfs), and a host
// directory outside R with mounts of its own (a tmpfs at host/run and one
// below it, at host/run/sub) that a planted link may point at.
type attackEnv struct {
	base, root, src, host string
	// mp is our mount point (R/x/run) and id its identity.
	mp string
	id mount.Identity
}

// table lists the mounts below base as "id path", in mount order: the
// exact mount table the test compares.
func (e *attackEnv) table(t *testing.T) []string {
	t.Helper()
	ms, err := mount.List(mountinfo.PrefixFilter(e.base))
	if err != nil {
		t.Fatal(err)
	}
	out := make([]string, 0, len(ms))
	for _, m := range ms {
		out = append(out, fmt.Sprintf("%d %s", m.ID, m.Mountpoint))
	}
	return out
}

// without is tab minus the mounts with the given ids.
func without(tab []string, ids ...uint64) []string {
	var out []string
	for _, l := range tab {
		var id uint64
		fmt.Sscanf(l, "%d", &id)
		if !slices.Contains(ids, id) {
			out = append(out, l)
		}
	}
	return out
}

func newAttackEnv(t *testing.T) *attackEnv {
	t.Helper()
	base := testhelp.LeakCheckedDir(t)
	e := &attackEnv{base: base, root: filepath.Join(base, "rootfs"), src: filepath.Join(base, "src"), host: filepath.Join(base, "host")}
	mkdirs(t, e.root, e.src, filepath.Join(e.host, "run"))
	// Registered after LeakCheckedDir's check, so it runs first: the mounts the
	// test keeps on purpose (theirs) go, deepest first.
	t.Cleanup(func() {
		ms, _ := mount.List(mountinfo.PrefixFilter(base))
		for i := len(ms) - 1; i >= 0; i-- {
			_ = unix.Unmount(ms[i].Mountpoint, unix.MNT_DETACH)
		}
	})
	mountTmpfs(t, e.src)
	writeFile(t, filepath.Join(e.src, "volume-file"), "ours")
	mountTmpfs(t, filepath.Join(e.host, "run"))
	mkdirs(t, filepath.Join(e.host, "run", "sub"))
	mountTmpfs(t, filepath.Join(e.host, "run", "sub"))
	writeFile(t, filepath.Join(e.host, "run", "sub", "host-file"), "host")
	return e
}

// prepare mounts the volume at /x/run inside R as the isolator does: resolve
// in the root, clone, read the ids, move onto the handle.
func (e *attackEnv) prepare(t *testing.T, path string) {
	t.Helper()
	target, mp, err := mount.ResolveInRoot(e.root, path, mount.Directory, -1, -1)
	if err != nil {
		t.Fatal(err)
	}
	// Closed at once, as the isolator does: an open handle on a mount
	// keeps it busy.
	defer target.Close()
	parent, err := mount.ID(target)
	if err != nil {
		t.Fatal(err)
	}
	tree, err := mount.CloneTree(e.src, false)
	if err != nil {
		t.Fatal(err)
	}
	defer tree.Close()
	id, err := mount.ID(tree)
	if err != nil {
		t.Fatal(err)
	}
	if err := mount.MoveTree(tree, target); err != nil {
		t.Fatal(err)
	}
	e.mp, e.id = mp, mount.Identity{ID: id, Parent: parent, Source: e.src}
	if got := readMountID(t, mp); got != id {
		t.Fatalf("mount id at %s is %d, the clone's was %d", mp, got, id)
	}
}

func (e *attackEnv) p(rel string) string { return filepath.Join(e.root, rel) }

func readMountID(t *testing.T, path string) uint64 {
	t.Helper()
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &st); err != nil {
		t.Fatal(err)
	}
	return st.Mnt_id
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func tmpfsAt(t *testing.T, path, file string) {
	t.Helper()
	must(t, os.MkdirAll(path, 0o755))
	mountTmpfs(t, path)
	if file != "" {
		writeFile(t, filepath.Join(path, file), file)
	}
}

// TestUnmountOwnAttacks: what a container (root in its rootfs) or a runtime
// can do to the path of a mount csiagent made, between prepare and
// cleanup. Each case states the exact mount table after the cleanup (ours
// gone, everything else as it was: nothing outside the root touched, the
// container's and runtime's mounts kept) and what UnmountOwn reports.
func TestUnmountOwnAttacks(t *testing.T) {
	testhelp.NeedRoot(t)
	type want struct {
		where   mount.Where
		err     error // wrapped error expected; then nothing is unmounted
		gone    func(e *attackEnv) []uint64
		kept    []string // files that must still be readable afterwards
		movedTo string   // for Moved: the path below R
	}
	ours := func(e *attackEnv) []uint64 { return []uint64{e.id.ID} }
	cases := []struct {
		name   string
		before func(t *testing.T, e *attackEnv) // before prepare (the runtime)
		attack func(t *testing.T, e *attackEnv) // after prepare (the container)
		id     func(e *attackEnv) mount.Identity
		want   want
	}{
		{name: "untouched", want: want{where: mount.AtRecorded, gone: ours}},
		{
			name:   "finding 2: a runtime tmpfs at the path before prepare survives",
			before: func(t *testing.T, e *attackEnv) { tmpfsAt(t, e.p("x/run"), "runtime-file") },
			want:   want{where: mount.AtRecorded, gone: ours, kept: []string{"x/run/runtime-file"}},
		},
		{
			name: "the container path is itself a bind mount point of the runtime",
			before: func(t *testing.T, e *attackEnv) {
				mkdirs(t, e.p("x/run"), e.p("bindsrc"))
				writeFile(t, e.p("bindsrc/bound-file"), "b")
				must(t, mount.Bind(e.p("bindsrc"), e.p("x/run"), false))
			},
			want: want{where: mount.AtRecorded, gone: ours, kept: []string{"x/run/bound-file"}},
		},
		{
			name: "finding 1: parent renamed, a symlink to a host dir with mounts put in its place",
			attack: func(t *testing.T, e *attackEnv) {
				must(t, os.Rename(e.p("x"), e.p("y")))
				must(t, os.Symlink(e.host, e.p("x")))
			},
			want: want{where: mount.Moved, movedTo: "y/run", gone: ours},
		},
		{
			name: "the mount point itself cannot be renamed; its parent renamed and made a symlink loop",
			attack: func(t *testing.T, e *attackEnv) {
				if err := os.Rename(e.p("x/run"), e.p("x/run2")); !errors.Is(err, unix.EBUSY) {
					t.Fatalf("renaming a mount point: %v, want EBUSY", err)
				}
				must(t, os.Rename(e.p("x"), e.p("y")))
				must(t, os.Symlink("x", e.p("x")))
			},
			want: want{where: mount.Moved, movedTo: "y/run", gone: ours},
		},
		{
			name: "parent replaced by a .. symlink climbing out of the root",
			attack: func(t *testing.T, e *attackEnv) {
				must(t, os.Rename(e.p("x"), e.p("z")))
				must(t, os.Symlink("../host", e.p("x")))
			},
			want: want{where: mount.Moved, movedTo: "z/run", gone: ours},
		},
		{
			name: "parent renamed, a link to the container's own tmpfs at the same name",
			attack: func(t *testing.T, e *attackEnv) {
				must(t, os.Rename(e.p("x"), e.p("y")))
				tmpfsAt(t, e.p("w/run"), "their-file")
				must(t, os.Symlink("/w", e.p("x")))
			},
			want: want{where: mount.Moved, movedTo: "y/run", gone: ours, kept: []string{"w/run/their-file"}},
		},
		{
			name: "parent renamed, a real directory with their tmpfs at the same name",
			attack: func(t *testing.T, e *attackEnv) {
				must(t, os.Rename(e.p("x"), e.p("y")))
				tmpfsAt(t, e.p("x/run"), "their-file")
			},
			want: want{where: mount.Moved, movedTo: "y/run", gone: ours, kept: []string{"x/run/their-file"}},
		},
		{
			name:   "a tmpfs the container puts over its own volume path: covered, nothing touched",
			attack: func(t *testing.T, e *attackEnv) { tmpfsAt(t, e.p("x/run"), "their-file") },
			want:   want{err: mount.ErrCovered, kept: []string{"x/run/their-file"}},
		},
		{
			name: "a bind the container puts over its own volume path: covered, nothing touched",
			attack: func(t *testing.T, e *attackEnv) {
				mkdirs(t, e.p("mine"))
				writeFile(t, e.p("mine/their-file"), "t")
				must(t, mount.Bind(e.p("mine"), e.p("x/run"), false))
			},
			want: want{err: mount.ErrCovered, kept: []string{"x/run/their-file"}},
		},
		{
			name:   "a tmpfs the container mounts inside the volume goes with it",
			attack: func(t *testing.T, e *attackEnv) { tmpfsAt(t, e.p("x/run/inner"), "") },
			want: want{where: mount.AtRecorded, gone: func(e *attackEnv) []uint64 {
				return []uint64{e.id.ID, readMountID(t, e.p("x/run/inner"))}
			}},
		},
		{
			name:   "the container unmounted it: gone, nothing else touched",
			before: func(t *testing.T, e *attackEnv) { tmpfsAt(t, e.p("x/run"), "runtime-file") },
			attack: func(t *testing.T, e *attackEnv) { must(t, unix.Unmount(e.mp, 0)) },
			want:   want{where: mount.Gone, kept: []string{"x/run/runtime-file"}},
		},
		{
			name: "the container unmounted it and mounted its own tmpfs there",
			attack: func(t *testing.T, e *attackEnv) {
				must(t, unix.Unmount(e.mp, 0))
				tmpfsAt(t, e.mp, "their-file")
			},
			want: want{where: mount.Gone, kept: []string{"x/run/their-file"}},
		},
		{
			name:   "record without a mount id (an older agent): found by its source",
			before: func(t *testing.T, e *attackEnv) { tmpfsAt(t, e.p("x/run"), "runtime-file") },
			id:     func(e *attackEnv) mount.Identity { return mount.Identity{Parent: e.id.Parent, Source: e.src} },
			want:   want{where: mount.AtRecorded, gone: ours, kept: []string{"x/run/runtime-file"}},
		},
		{
			name:   "record without a mount id, never made: the runtime's tmpfs is not taken for ours",
			before: func(t *testing.T, e *attackEnv) { tmpfsAt(t, e.p("x/run"), "runtime-file") },
			attack: func(t *testing.T, e *attackEnv) { must(t, unix.Unmount(e.mp, 0)) },
			id:     func(e *attackEnv) mount.Identity { return mount.Identity{Parent: e.id.Parent, Source: e.src} },
			want:   want{where: mount.Gone, kept: []string{"x/run/runtime-file"}},
		},
		{
			name: "recorded but never attached (a crash before the move): gone",
			attack: func(t *testing.T, e *attackEnv) {
				must(t, unix.Unmount(e.mp, 0))
			},
			id: func(e *attackEnv) mount.Identity {
				return mount.Identity{ID: 1 << 40, Parent: e.id.Parent, Source: e.src}
			},
			want: want{where: mount.Gone},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newAttackEnv(t)
			etc := etcMounts(t)
			if tc.before != nil {
				tc.before(t, e)
			}
			e.prepare(t, "/x/run")
			if tc.attack != nil {
				tc.attack(t, e)
			}
			id := e.id
			if tc.id != nil {
				id = tc.id(e)
			}
			before := e.table(t)
			var gone []uint64
			if tc.want.gone != nil {
				gone = tc.want.gone(e)
			}
			res, err := mount.UnmountOwn(context.Background(), e.root, e.mp, id)
			after := e.table(t)
			if tc.want.err != nil {
				if !errors.Is(err, tc.want.err) {
					t.Fatalf("UnmountOwn: %v, want %v", err, tc.want.err)
				}
				if !slices.Equal(after, before) {
					t.Errorf("mount table changed on a refusal:\n before %v\n after  %v", before, after)
				}
			} else {
				if err != nil {
					t.Fatalf("UnmountOwn: %v", err)
				}
				if res.Where != tc.want.where {
					t.Errorf("UnmountOwn where = %v, want %v", res.Where, tc.want.where)
				}
				if tc.want.movedTo != "" && res.Path != e.p(tc.want.movedTo) {
					t.Errorf("unmounted at %s, want %s", res.Path, e.p(tc.want.movedTo))
				}
				if want := without(before, gone...); !slices.Equal(after, want) {
					t.Errorf("mount table after cleanup:\n got  %v\n want %v\n (before %v)", after, want, before)
				}
			}
			// The host directory's mounts and files are never touched.
			if _, err := os.Stat(filepath.Join(e.host, "run", "sub", "host-file")); err != nil {
				t.Errorf("host mount lost: %v", err)
			}
			for _, f := range tc.want.kept {
				if _, err := os.Stat(e.p(f)); err != nil {
					t.Errorf("their file %s lost: %v", f, err)
				}
			}
			if etcAfter := etcMounts(t); !slices.Equal(etcAfter, etc) {
				t.Errorf("host /etc mounts changed: %v -> %v", etc, etcAfter)
			}
		})
	}
}

// TestUnmountOwnStackedAndSubmounts: two of our mounts stacked at one path
// come off top first, each by its id; a recursive bind's submounts go with
// it; the mount under both stays.
func TestUnmountOwnStackedAndSubmounts(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newAttackEnv(t)
	tmpfsAt(t, e.p("x/run"), "runtime-file")
	mkdirs(t, filepath.Join(e.src, "nested"))
	mountTmpfs(t, filepath.Join(e.src, "nested"))
	start := e.table(t)
	e.prepare(t, "/x/run")
	first := e.id
	e.prepare(t, "/x/run")
	second := e.id
	if _, err := mount.UnmountOwn(context.Background(), e.root, e.mp, first); !errors.Is(err, mount.ErrCovered) {
		t.Fatalf("unmounting the lower of two stacked mounts: %v, want ErrCovered", err)
	}
	for _, id := range []mount.Identity{second, first} {
		if res, err := mount.UnmountOwn(context.Background(), e.root, e.mp, id); err != nil || res.Where != mount.AtRecorded {
			ms, _ := mount.List(mountinfo.PrefixFilter(e.base))
			for _, m := range ms {
				t.Logf("%d %d %s %s", m.ID, m.Parent, m.Mountpoint, m.Optional)
			}
			t.Fatalf("UnmountOwn(%d) = %v, %v", id.ID, res, err)
		}
	}
	if got := e.table(t); !slices.Equal(got, start) {
		t.Errorf("mount table:\n got  %v\n want %v", got, start)
	}
	if _, err := os.Stat(e.p("x/run/runtime-file")); err != nil {
		t.Errorf("the runtime's tmpfs lost: %v", err)
	}
}

// TestUnmountOwnInNamespace: the same rules inside a running container's
// own mount namespace (pivoted, with a fake /proc): the container renames
// the parent of its volume path, plants a link to the host's old root in
// its place and makes the source's host path a directory of its own; the
// agent unmounts exactly its mount where it moved to, identified by the
// root recorded when it was made, and the runtime's tmpfs that was under
// it stays.
func TestUnmountOwnInNamespace(t *testing.T) {
	testhelp.NeedRoot(t)
	src, c := nsSandbox(t, true)
	c.in(t, func() error {
		if err := os.MkdirAll("/x/run", 0o755); err != nil {
			return err
		}
		return mount.Mount("tmpfs", "/x/run", "tmpfs", []string{"size=1m"})
	})
	before := c.mountsUnder(t, "/x")
	tree, err := mount.CloneTree(src, false)
	if err != nil {
		t.Fatal(err)
	}
	defer tree.Close()
	var id mount.Identity
	c.in(t, func() error {
		h, _, err := mount.ResolveInRoot("/", "/x/run", mount.Directory, -1, -1)
		if err != nil {
			return err
		}
		defer h.Close()
		if id.Parent, err = mount.ID(h); err != nil {
			return err
		}
		if id.ID, err = mount.ID(tree); err != nil {
			return err
		}
		id.Source = src
		return mount.MoveTree(tree, h)
	})
	// The clone's root, recorded as the isolator does: src is a host
	// path, not to be looked up in the container's namespace.
	root, err := mount.RootOf(tree)
	if err != nil {
		t.Fatal(err)
	}
	id.RootDev, id.RootIno = root.Dev, root.Ino
	tree.Close()
	c.in(t, func() error {
		if err := os.Rename("/x", "/y"); err != nil {
			return err
		}
		if err := os.Symlink("/.old"+filepath.Dir(src), "/x"); err != nil {
			return err
		}
		// The container makes the source's host path a directory of
		// its own: with the source looked up in its namespace, the mount
		// was not ours and was forgotten (Gone) while still mounted.
		return os.MkdirAll(src, 0o755)
	})
	var res mount.Result
	c.in(t, func() error {
		res, err = mount.UnmountOwn(context.Background(), "/", "/x/run", id)
		return err
	})
	if res.Where != mount.Moved || res.Path != "/y/run" {
		t.Errorf("UnmountOwn = %+v, want moved to /y/run", res)
	}
	if got, want := c.mountsUnder(t, "/y"), []string{"/y/run"}; !slices.Equal(got, want) {
		t.Errorf("the container's mounts: %v, want the runtime's tmpfs only %v (before: %v)", got, want, before)
	}
	if got := hostMountsUnder(t, src); !slices.Equal(got, []string{src, filepath.Join(src, "sub")}) {
		t.Errorf("host mounts of the source changed: %v", got)
	}
}

// TestUnmountOwnRootGone: a root that no longer exists (a container's
// rootfs removed) holds no mount: Gone, by id or without one. A root
// renamed with our mount in it is not where it was: the mount, found by
// id elsewhere, is not touched.
func TestUnmountOwnRootGone(t *testing.T) {
	testhelp.NeedRoot(t)
	t.Run("removed", func(t *testing.T) {
		e := newAttackEnv(t)
		e.prepare(t, "/x/run")
		must(t, unix.Unmount(e.mp, 0))
		must(t, os.RemoveAll(e.root))
		for _, id := range []mount.Identity{e.id, {Parent: e.id.Parent, Source: e.src}} {
			res, err := mount.UnmountOwn(context.Background(), e.root, e.mp, id)
			if err != nil || res.Where != mount.Gone {
				t.Errorf("UnmountOwn(%+v) with the root removed = %+v, %v; want Gone", id, res, err)
			}
		}
	})
	t.Run("renamed with the mount", func(t *testing.T) {
		e := newAttackEnv(t)
		e.prepare(t, "/x/run")
		must(t, os.Rename(e.root, filepath.Join(e.base, "elsewhere")))
		before := e.table(t)
		_, err := mount.UnmountOwn(context.Background(), e.root, e.mp, e.id)
		if !errors.Is(err, mount.ErrOutsideRoot) {
			t.Errorf("UnmountOwn with the root moved away with the mount: %v; want ErrOutsideRoot", err)
		}
		if after := e.table(t); !slices.Equal(after, before) {
			t.Errorf("mount table changed on a refusal:\n before %v\n after  %v", before, after)
		}
	})
}

// TestUnmountOwnIDReused: our mount is gone and the kernel gave its mount
// id to a later bind of the same filesystem and root outside the root (in
// the cluster soak, the volume's new staging mount; in make test, a
// filesystem on a loop device of the same number): with the unique id
// recorded, ours is Gone, and that mount is not touched.
func TestUnmountOwnIDReused(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newAttackEnv(t)
	e.prepare(t, "/x/run")
	f, err := os.OpenFile(e.mp, unix.O_PATH|unix.O_CLOEXEC, 0)
	must(t, err)
	r, err := mount.RootOf(f)
	f.Close()
	must(t, err)
	if r.UniqueID == 0 {
		t.Skip("the kernel has no unique mount ids (statx STATX_MNT_ID_UNIQUE, Linux 6.8)")
	}
	id := e.id
	id.RootDev, id.RootIno, id.UniqueID = r.Dev, r.Ino, r.UniqueID
	must(t, unix.Unmount(e.mp, 0))
	// The same filesystem bound outside the root: the kernel hands out
	// the lowest free mount id, ours.
	other := filepath.Join(e.base, "other")
	mkdirs(t, other)
	must(t, unix.Mount(e.src, other, "", unix.MS_BIND, ""))
	if got := readMountID(t, other); got != id.ID {
		t.Skipf("the new mount got id %d, not the freed %d (another mount on the host took it meanwhile)", got, id.ID)
	}
	before := e.table(t)
	res, err := mount.UnmountOwn(context.Background(), e.root, e.mp, id)
	if err != nil || res.Where != mount.Gone {
		t.Fatalf("UnmountOwn with our mount gone and its id reused outside the root = %+v, %v; want Gone", res, err)
	}
	if after := e.table(t); !slices.Equal(after, before) {
		t.Errorf("the mount table changed:\nbefore %q\nafter  %q", before, after)
	}
}
