package mount_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// sandbox is a rootfs, a tmpfs-backed volume source with a file "hello" in
// it, and a directory outside the rootfs that nothing may touch.
type sandbox struct {
	root, src, outside string
}

func newSandbox(t *testing.T) sandbox {
	t.Helper()
	base := testhelp.LeakCheckedDir(t)
	s := sandbox{
		root:    filepath.Join(base, "rootfs"),
		src:     filepath.Join(base, "src"),
		outside: filepath.Join(base, "outside"),
	}
	for _, d := range []string{s.root, s.src, s.outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mountTmpfs(t, s.src)
	t.Cleanup(func() {
		if err := mount.UnmountAll(context.Background(), s.src); err != nil {
			t.Error(err)
		}
	})
	if err := os.WriteFile(filepath.Join(s.src, "hello"), []byte("hi"), 0o644); err != nil {
		t.Fatal(err)
	}
	return s
}

// untouched fails the test if anything was mounted on or created in the
// outside directory, or if the host's /etc mounts changed.
func (s sandbox) untouched(t *testing.T, etcBefore []string) {
	t.Helper()
	if ms, err := mount.MountsUnder(s.outside); err != nil || len(ms) > 0 {
		t.Errorf("mounts outside the root: %v, %v", ms, err)
	}
	if ents, err := os.ReadDir(s.outside); err != nil || len(ents) > 0 {
		t.Errorf("created outside the root: %v, %v", ents, err)
	}
	if etc := etcMounts(t); !slices.Equal(etc, etcBefore) {
		t.Errorf("host /etc mounts changed: %v -> %v", etcBefore, etc)
	}
}

func etcMounts(t *testing.T) []string {
	t.Helper()
	ms, err := mount.MountsUnder("/etc")
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

func resolve(t *testing.T, root, path string, kind mount.TargetKind) (*os.File, string) {
	t.Helper()
	h, hostPath, err := mount.ResolveInRoot(root, path, kind, -1, -1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	if h.Name() != hostPath {
		t.Errorf("handle named %q, host path %q", h.Name(), hostPath)
	}
	return h, hostPath
}

func unmountAll(t *testing.T, path string) {
	t.Helper()
	if err := mount.UnmountAll(context.Background(), path); err != nil {
		t.Fatal(err)
	}
	if ok, err := mount.IsMountPoint(path); err != nil || ok {
		t.Fatalf("%s still mounted (%v)", path, err)
	}
}

func TestBindIntoRootfs(t *testing.T) {
	testhelp.NeedRoot(t)
	s := newSandbox(t)
	for _, tc := range []struct {
		name, path, want string // want: where it lands, relative to the root
		readOnly         bool
	}{
		{name: "absolute", path: "/data", want: "data"},
		{name: "relative", path: "data2/sub", want: "data2/sub"},
		{name: "nested missing read-only", path: "/a/b/c", want: "a/b/c", readOnly: true},
		{name: "dot-dot stays at root", path: "/../../../x", want: "x", readOnly: true},
		{name: "dots and slashes", path: "//./y/./z/", want: "y/z"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, hostPath := resolve(t, s.root, tc.path, mount.Directory)
			want := filepath.Join(s.root, tc.want)
			if hostPath != want {
				t.Fatalf("host path %s, want %s", hostPath, want)
			}
			if err := mount.BindInto(s.src, h, tc.readOnly); err != nil {
				t.Fatal(err)
			}
			defer unmountAll(t, hostPath)
			m, ok, err := mount.Lookup(hostPath)
			if err != nil || !ok || mount.HasOption(m.Options, "ro") != tc.readOnly || !mount.HasOption(m.Options, "nosuid") {
				t.Fatalf("Lookup = %+v, %v, %v; want tmpfs with nosuid, ro=%v", m, ok, err, tc.readOnly)
			}
			if b, err := os.ReadFile(filepath.Join(hostPath, "hello")); err != nil || string(b) != "hi" {
				t.Fatalf("read through the container path = %q, %v", b, err)
			}
			name := "from-container-" + filepath.Base(want)
			err = os.WriteFile(filepath.Join(hostPath, name), []byte("c"), 0o644)
			switch {
			case tc.readOnly && !errors.Is(err, unix.EROFS):
				t.Errorf("write to read-only bind: err = %v, want EROFS", err)
			case !tc.readOnly && err != nil:
				t.Errorf("write to read-write bind: %v", err)
			case !tc.readOnly:
				if b, err := os.ReadFile(filepath.Join(s.src, name)); err != nil || string(b) != "c" {
					t.Errorf("container write not in source: %q, %v", b, err)
				}
			}
			if err := os.WriteFile(filepath.Join(s.src, "from-host"), []byte("h"), 0o644); err != nil {
				t.Errorf("source not writable: %v", err)
			}
			if b, err := os.ReadFile(filepath.Join(hostPath, "from-host")); err != nil || string(b) != "h" {
				t.Errorf("host write not visible in container: %q, %v", b, err)
			}
		})
	}
}

func TestResolveInRootEscapes(t *testing.T) {
	testhelp.NeedRoot(t)
	// $OUT is the outside directory's host path without its leading "/":
	// a symlink to the host path means that path inside the root.
	for _, tc := range []struct {
		name  string
		setup func(t *testing.T, s sandbox, out string)
		path  string
		kind  mount.TargetKind
		// want: where the mount lands, relative to the root; "" means
		// ResolveInRoot must fail (with wantErr, if set).
		want    string
		wantErr error
	}{
		{
			name: "absolute symlink to /etc",
			setup: func(t *testing.T, s sandbox, out string) {
				mkdirs(t, filepath.Join(s.root, "etc"))
				symlink(t, "/etc", filepath.Join(s.root, "data"))
			},
			path: "/data", want: "etc",
		},
		{
			name: "absolute symlink to /etc, missing in root",
			setup: func(t *testing.T, s sandbox, out string) {
				symlink(t, "/etc", filepath.Join(s.root, "data"))
			},
			path: "/data", wantErr: unix.ENOENT, // never created through a symlink
		},
		{
			name: "dot-dot symlink",
			setup: func(t *testing.T, s sandbox, out string) {
				symlink(t, "../../..", filepath.Join(s.root, "a"))
			},
			path: "/a/x", want: "x",
		},
		{
			name: "relative symlink to the outside dir",
			setup: func(t *testing.T, s sandbox, out string) {
				mkdirs(t, filepath.Join(s.root, "outside"))
				symlink(t, "../outside", filepath.Join(s.root, "r"))
			},
			path: "/r/x", want: "outside/x",
		},
		{
			name: "symlinked parent to a host path",
			setup: func(t *testing.T, s sandbox, out string) {
				mkdirs(t, filepath.Join(s.root, out))
				symlink(t, s.outside, filepath.Join(s.root, "p"))
			},
			path: "/p/x", want: "$OUT/x",
		},
		{
			name: "symlinked parent to a host path, missing in root",
			setup: func(t *testing.T, s sandbox, out string) {
				symlink(t, s.outside, filepath.Join(s.root, "p"))
			},
			path: "/p/x", wantErr: unix.ENOENT,
		},
		{
			name: "symlink loop",
			setup: func(t *testing.T, s sandbox, out string) {
				symlink(t, "l2", filepath.Join(s.root, "l1"))
				symlink(t, "l1", filepath.Join(s.root, "l2"))
			},
			path: "/l1/x", wantErr: unix.ELOOP,
		},
		{
			name: "missing part with dot-dot",
			path: "/missing/../x", wantErr: unix.ENOENT,
		},
		{
			name: "file kind: symlink to /etc/passwd",
			setup: func(t *testing.T, s sandbox, out string) {
				mkdirs(t, filepath.Join(s.root, "etc"), filepath.Join(s.root, "dev"))
				if err := os.WriteFile(filepath.Join(s.root, "etc", "passwd"), nil, 0o644); err != nil {
					t.Fatal(err)
				}
				symlink(t, "/etc/passwd", filepath.Join(s.root, "dev", "vol"))
			},
			path: "/dev/vol", kind: mount.File, want: "etc/passwd",
		},
		{
			name: "file kind: dangling symlink",
			setup: func(t *testing.T, s sandbox, out string) {
				symlink(t, "/etc/hostname", filepath.Join(s.root, "vol"))
			},
			path: "/vol", kind: mount.File, wantErr: unix.ENOENT,
		},
		{
			name: "file kind: symlink to a host directory",
			setup: func(t *testing.T, s sandbox, out string) {
				mkdirs(t, filepath.Join(s.root, out))
				symlink(t, s.outside, filepath.Join(s.root, "vol"))
			},
			path: "/vol", kind: mount.File, wantErr: mount.ErrKind,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSandbox(t)
			out := strings.TrimPrefix(s.outside, "/")
			if tc.setup != nil {
				tc.setup(t, s, out)
			}
			etcBefore := etcMounts(t)
			defer s.untouched(t, etcBefore)

			h, hostPath, err := mount.ResolveInRoot(s.root, tc.path, tc.kind, -1, -1)
			if tc.want == "" {
				if err == nil {
					h.Close()
					t.Fatalf("resolved to %s, want an error", hostPath)
				}
				if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				t.Logf("error, as wanted: %v", err)
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer h.Close()
			want := filepath.Join(s.root, strings.ReplaceAll(tc.want, "$OUT", out))
			if hostPath != want {
				t.Fatalf("host path %s, want %s", hostPath, want)
			}
			src := s.src
			if tc.kind == mount.File {
				src = filepath.Join(s.src, "hello")
			}
			if err := mount.BindInto(src, h, false); err != nil {
				t.Fatal(err)
			}
			if ok, err := mount.IsMountPoint(hostPath); err != nil || !ok {
				t.Errorf("%s is not a mount point: %v", hostPath, err)
			}
			unmountAll(t, hostPath)
		})
	}
}

// The path is swapped for a symlink to the outside between ResolveInRoot and
// BindInto: the mount follows the resolved inode, never the new path.
func TestBindIntoTOCTOU(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, tc := range []struct {
		name    string
		path    string
		kind    mount.TargetKind
		swap    string // the component that is moved away and replaced
		remove  bool   // remove it instead of moving it
		movedTo string // where the target is after the swap, relative to the root
	}{
		{name: "directory renamed", path: "/data", swap: "data", movedTo: "moved"},
		{name: "parent renamed", path: "/p/data", swap: "p", movedTo: "moved/data"},
		{name: "file renamed", path: "/dev/vol", kind: mount.File, swap: "dev/vol", movedTo: "moved"},
		{name: "directory removed", path: "/data", swap: "data", remove: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newSandbox(t)
			etcBefore := etcMounts(t)
			defer s.untouched(t, etcBefore)
			h, _ := resolve(t, s.root, tc.path, tc.kind)

			swapped := filepath.Join(s.root, tc.swap)
			var err error
			if tc.remove {
				err = os.Remove(swapped)
			} else {
				err = os.Rename(swapped, filepath.Join(s.root, "moved"))
			}
			if err != nil {
				t.Fatal(err)
			}
			symlink(t, s.outside, swapped)

			src := s.src
			if tc.kind == mount.File {
				src = filepath.Join(s.src, "hello")
			}
			err = mount.BindInto(src, h, false)
			if tc.remove {
				if !errors.Is(err, unix.ENOENT) {
					t.Fatalf("bind onto a removed directory: err = %v, want ENOENT", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			landed := filepath.Join(s.root, tc.movedTo)
			defer unmountAll(t, landed)
			if ok, err := mount.IsMountPoint(landed); err != nil || !ok {
				t.Fatalf("%s is not a mount point: %v", landed, err)
			}
		})
	}
}

func TestResolveInRootKinds(t *testing.T) {
	testhelp.NeedRoot(t)
	s := newSandbox(t)
	old := unix.Umask(0o077) // modes must not depend on it
	defer unix.Umask(old)
	mkdirs(t, filepath.Join(s.root, "existing"), filepath.Join(s.root, "isdir"))
	if err := os.WriteFile(filepath.Join(s.root, "isfile"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}

	t.Run("file target: device node and regular file", func(t *testing.T) {
		h, hostPath, err := mount.ResolveInRoot(s.root, "/existing/dev/vol", mount.File, 1234, 5678)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		checkOwner(t, filepath.Join(s.root, "existing"), 0, 0, -1)
		checkOwner(t, filepath.Join(s.root, "existing/dev"), 1234, 5678, unix.S_IFDIR|0o755)
		checkOwner(t, hostPath, 1234, 5678, unix.S_IFREG|0o644)
		for _, src := range []string{"/dev/null", filepath.Join(s.src, "hello")} {
			if err := mount.BindInto(src, h, true); err != nil {
				t.Fatal(err)
			}
			var st unix.Stat_t
			if err := unix.Stat(hostPath, &st); err != nil {
				t.Fatal(err)
			}
			if src == "/dev/null" && st.Mode&unix.S_IFMT != unix.S_IFCHR {
				t.Errorf("bound file is a %o, want a char device", st.Mode)
			}
			if src != "/dev/null" {
				if b, err := os.ReadFile(hostPath); err != nil || string(b) != "hi" {
					t.Errorf("read bound file = %q, %v", b, err)
				}
			}
			unmountAll(t, hostPath)
		}
		// Resolving it again finds the existing file.
		h2, again := resolve(t, s.root, "existing/dev/vol", mount.File)
		if again != hostPath {
			t.Errorf("second resolve = %s, want %s", again, hostPath)
		}
		h2.Close()
	})

	t.Run("directories: modes and owners", func(t *testing.T) {
		h, hostPath, err := mount.ResolveInRoot(s.root, "/existing/new1/new2", mount.Directory, 1234, -1)
		if err != nil {
			t.Fatal(err)
		}
		h.Close()
		checkOwner(t, filepath.Join(s.root, "existing/new1"), 1234, 0, unix.S_IFDIR|0o755)
		checkOwner(t, hostPath, 1234, 0, unix.S_IFDIR|0o755)
		checkOwner(t, filepath.Join(s.root, "existing"), 0, 0, -1)
	})

	for _, tc := range []struct {
		name string
		path string
		kind mount.TargetKind
	}{
		{"file kind onto a directory", "/isdir", mount.File},
		{"file kind onto the root", "/", mount.File},
		{"directory kind onto a file", "/isfile", mount.Directory},
		{"directory below a file", "/isfile/sub", mount.Directory},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, p, err := mount.ResolveInRoot(s.root, tc.path, tc.kind, -1, -1)
			if err == nil {
				h.Close()
				t.Fatalf("resolved to %s, want an error", p)
			}
			if !errors.Is(err, mount.ErrKind) && !errors.Is(err, unix.ENOTDIR) {
				t.Errorf("err = %v, want ErrKind or ENOTDIR", err)
			}
		})
	}

	t.Run("bind a directory onto a file", func(t *testing.T) {
		h, _ := resolve(t, s.root, "/isfile", mount.File)
		if err := mount.BindInto(s.src, h, false); !errors.Is(err, mount.ErrKind) {
			t.Errorf("err = %v, want ErrKind", err)
		}
	})

	t.Run("missing source", func(t *testing.T) {
		h, _ := resolve(t, s.root, "/isdir", mount.Directory)
		err := mount.BindInto(filepath.Join(s.src, "nope"), h, false)
		if !errors.Is(err, unix.ENOENT) || !strings.Contains(err.Error(), "nope") || !strings.Contains(err.Error(), "isdir") {
			t.Errorf("err = %v, want ENOENT naming source and target", err)
		}
	})
}

func TestUnmountAll(t *testing.T) {
	testhelp.NeedRoot(t)
	s := newSandbox(t)
	dst := filepath.Join(s.root, "dst")
	mkdirs(t, dst)
	ctx := context.Background()

	t.Run("three stacked binds", func(t *testing.T) {
		for i := range 3 {
			if err := mount.Bind(s.src, dst, i == 1); err != nil {
				t.Fatal(err)
			}
		}
		ms, err := mount.List(func(m *mountinfo.Info) (bool, bool) { return m.Mountpoint != dst, false })
		if err != nil || len(ms) != 3 {
			t.Fatalf("%d mounts at %s, %v; want 3", len(ms), dst, err)
		}
		unmountAll(t, dst)
		ms, err = mount.List(func(m *mountinfo.Info) (bool, bool) { return m.Mountpoint != dst, false })
		if err != nil || len(ms) != 0 {
			t.Fatalf("%d mounts left at %s, %v", len(ms), dst, err)
		}
	})

	t.Run("recursive bind with a submount", func(t *testing.T) {
		sub := filepath.Join(s.src, "sub")
		mkdirs(t, sub)
		mountTmpfs(t, sub)
		defer unmountAll(t, sub)
		h, _ := resolve(t, s.root, "/dst", mount.Directory)
		if err := mount.BindInto(s.src, h, true); err != nil {
			t.Fatal(err)
		}
		if ok, _ := mount.IsMountPoint(filepath.Join(dst, "sub")); !ok {
			t.Fatal("submount not carried over")
		}
		if err := os.WriteFile(filepath.Join(dst, "sub", "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
			t.Errorf("submount of a read-only bind: err = %v, want EROFS", err)
		}
		// Unmount alone: the submount keeps the mount busy.
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		if err := mount.Unmount(cancelled, dst); !errors.Is(err, context.Canceled) {
			t.Errorf("Unmount of a mount with a submount: err = %v, want busy", err)
		}
		unmountAll(t, dst)
		if ms, _ := mount.MountsUnder(dst); len(ms) != 0 {
			t.Errorf("left mounted: %v", ms)
		}
	})

	t.Run("idempotent", func(t *testing.T) {
		for _, p := range []string{dst, filepath.Join(s.root, "missing"), filepath.Join(s.root, "missing/deeper")} {
			for range 2 {
				if err := mount.UnmountAll(ctx, p); err != nil {
					t.Errorf("UnmountAll(%s) = %v", p, err)
				}
			}
		}
	})

	t.Run("symlink to a mount point is not followed", func(t *testing.T) {
		link := filepath.Join(s.root, "link")
		symlink(t, s.src, link)
		if err := mount.UnmountAll(ctx, link); err != nil {
			t.Fatal(err)
		}
		if ok, _ := mount.IsMountPoint(s.src); !ok {
			t.Fatal("UnmountAll followed the symlink")
		}
	})
}

func TestRemoveEmptyTree(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	tree := filepath.Join(base, "t")
	sibling := filepath.Join(base, "t2") // shares the prefix "t"
	mkdirs(t, filepath.Join(tree, "a/b/c"), filepath.Join(tree, "d"), sibling)
	for _, f := range []string{"a/empty", "a/b/c/block-target"} {
		if err := os.WriteFile(filepath.Join(tree, f), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	mountTmpfs(t, sibling)
	defer unmountAll(t, sibling)
	mounted := filepath.Join(tree, "a/b")
	mountTmpfs(t, mounted)
	defer unmountAll(t, mounted) // if the test fails early

	ms, err := mount.MountsUnder(tree)
	if err != nil || !slices.Equal(ms, []string{mounted}) {
		t.Fatalf("MountsUnder = %v, %v; want [%s]", ms, err, mounted)
	}
	err = mount.RemoveEmptyTree(tree)
	if !errors.Is(err, mount.ErrMounted) || !strings.Contains(err.Error(), mounted) {
		t.Fatalf("err = %v, want ErrMounted naming %s", err, mounted)
	}
	if _, err := os.Stat(filepath.Join(tree, "a/empty")); err != nil {
		t.Fatalf("removed something although a mount is below: %v", err)
	}

	unmountAll(t, mounted)
	if ms, err := mount.MountsUnder(tree); err != nil || len(ms) != 0 {
		t.Fatalf("MountsUnder = %v, %v; want none", ms, err)
	}
	if err := mount.RemoveEmptyTree(tree); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(tree); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("tree still there: %v", err)
	}
	if err := mount.RemoveEmptyTree(tree); err != nil {
		t.Fatalf("second remove: %v", err)
	}
	if ms, err := mount.MountsUnder(tree); err != nil || ms != nil {
		t.Fatalf("MountsUnder(missing) = %v, %v", ms, err)
	}

	for _, tc := range []struct {
		name  string
		setup func(dir string)
	}{
		{"data file", func(dir string) { _ = os.WriteFile(filepath.Join(dir, "x/data"), []byte("keep"), 0o600) }},
		{"symlink", func(dir string) { _ = os.Symlink("/etc", filepath.Join(dir, "x/link")) }},
		{"fifo", func(dir string) { _ = unix.Mkfifo(filepath.Join(dir, "x/fifo"), 0o600) }},
	} {
		t.Run("refuses "+tc.name, func(t *testing.T) {
			dir := filepath.Join(base, "n")
			mkdirs(t, filepath.Join(dir, "x"))
			tc.setup(dir)
			if err := mount.RemoveEmptyTree(dir); !errors.Is(err, mount.ErrNotEmpty) {
				t.Fatalf("err = %v, want ErrNotEmpty", err)
			}
			if ents, _ := os.ReadDir(filepath.Join(dir, "x")); len(ents) != 1 {
				t.Fatalf("entries left: %v", ents)
			}
			if err := os.RemoveAll(dir); err != nil {
				t.Fatal(err)
			}
		})
	}

	t.Run("refuses a symlink to a directory", func(t *testing.T) {
		target := filepath.Join(base, "target")
		mkdirs(t, target)
		link := filepath.Join(base, "link")
		symlink(t, target, link)
		if err := mount.RemoveEmptyTree(link); err == nil {
			t.Fatal("removed through a symlink")
		}
		if _, err := os.Stat(target); err != nil {
			t.Fatal(err)
		}
	})
}

func mkdirs(t *testing.T, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

func symlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

// checkOwner checks path's owner and, unless mode is -1, its type and mode.
func checkOwner(t *testing.T, path string, uid, gid uint32, mode int) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != uid || st.Gid != gid || (mode >= 0 && st.Mode != uint32(mode)) {
		t.Errorf("%s: owner %d:%d mode %o, want %d:%d mode %o", path, st.Uid, st.Gid, st.Mode, uid, gid, mode)
	}
}

// TestPinRoot: PinRoot refuses a path with a symlink on the way, and the
// root it returns keeps naming the directory it opened after its path is
// swapped for a symlink elsewhere: ResolveInRoot makes the mount point in
// that directory, not where the symlink leads.
func TestPinRoot(t *testing.T) {
	base := t.TempDir()
	root, elsewhere := filepath.Join(base, "root"), filepath.Join(base, "elsewhere")
	mkdirs(t, root, elsewhere)
	symlink(t, root, filepath.Join(base, "link"))
	if _, _, err := mount.PinRoot(filepath.Join(base, "link")); !errors.Is(err, unix.ELOOP) {
		t.Errorf("PinRoot of a symlink: %v; want ELOOP", err)
	}
	pinned, done, err := mount.PinRoot(root)
	if err != nil {
		t.Fatal(err)
	}
	defer done()
	if err := os.Rename(root, root+".old"); err != nil {
		t.Fatal(err)
	}
	symlink(t, elsewhere, root)
	h, at, err := mount.ResolveInRoot(pinned, "/data", mount.Directory, -1, -1)
	if err != nil {
		t.Fatal(err)
	}
	h.Close()
	if want := filepath.Join(root+".old", "data"); at != want {
		t.Errorf("resolved in the pinned root at %s; want %s, in the directory pinned", at, want)
	}
	if _, err := os.Lstat(filepath.Join(elsewhere, "data")); err == nil {
		t.Error("made data where the swapped path leads")
	}
}
