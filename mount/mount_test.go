package mount_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

func TestParseOptions(t *testing.T) {
	for _, tc := range []struct {
		name      string
		in        []string
		wantFlags uintptr
		wantData  string
		wantErr   bool
	}{
		{name: "empty"},
		{name: "defaults ignored", in: []string{"defaults", ""}},
		{name: "vfs flags", in: []string{"ro", "noexec", "nosuid", "nodev"}, wantFlags: unix.MS_RDONLY | unix.MS_NOEXEC | unix.MS_NOSUID | unix.MS_NODEV},
		{name: "later wins", in: []string{"ro", "rw", "noexec", "exec"}},
		{name: "fs data", in: []string{"noatime", "discard", "errors=remount-ro"}, wantFlags: unix.MS_NOATIME, wantData: "discard,errors=remount-ro"},
		{name: "comma separated entry", in: []string{"ro,discard", "data=ordered"}, wantFlags: unix.MS_RDONLY, wantData: "discard,data=ordered"},
		{name: "bind rejected", in: []string{"bind"}, wantErr: true},
		{name: "remount rejected", in: []string{"remount,ro"}, wantErr: true},
		{name: "propagation rejected", in: []string{"rshared"}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			flags, data, err := mount.ParseOptions(tc.in)
			if tc.wantErr {
				if !errors.Is(err, mount.ErrOption) {
					t.Fatalf("err = %v, want ErrOption", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if flags != tc.wantFlags || data != tc.wantData {
				t.Fatalf("got %#x %q, want %#x %q", flags, data, tc.wantFlags, tc.wantData)
			}
		})
	}
}

func TestHasOption(t *testing.T) {
	for _, tc := range []struct {
		opts, opt string
		want      bool
	}{
		{"rw,relatime", "rw", true},
		{"rw,relatime", "ro", false},
		{"rw,noatime", "atime", false},
		{"", "ro", false},
	} {
		if got := mount.HasOption(tc.opts, tc.opt); got != tc.want {
			t.Errorf("HasOption(%q, %q) = %v", tc.opts, tc.opt, got)
		}
	}
}

func TestLookupNotMounted(t *testing.T) {
	dir := t.TempDir()
	for _, p := range []string{dir, filepath.Join(dir, "missing")} {
		if ok, err := mount.IsMountPoint(p); err != nil || ok {
			t.Errorf("IsMountPoint(%s) = %v, %v", p, ok, err)
		}
	}
	if ok, err := mount.IsMountPoint("/"); err != nil || !ok {
		t.Errorf("IsMountPoint(/) = %v, %v", ok, err)
	}
}

func mountTmpfs(t *testing.T, dir string) {
	t.Helper()
	if err := mount.Mount("tmpfs", dir, "tmpfs", []string{"size=1m", "nosuid"}); err != nil {
		t.Fatal(err)
	}
}

func TestMountBindUnmount(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	src, dst, file := filepath.Join(base, "src"), filepath.Join(base, "dst"), filepath.Join(base, "file")
	for _, d := range []string{src, dst} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	mountTmpfs(t, src)
	if err := os.WriteFile(filepath.Join(src, "hello"), []byte("hi"), 0o644); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name     string
		readOnly bool
	}{{"read-write", false}, {"read-only", true}} {
		t.Run(tc.name, func(t *testing.T) {
			if err := mount.Bind(src, dst, tc.readOnly); err != nil {
				t.Fatal(err)
			}
			m, ok, err := mount.Lookup(dst)
			if err != nil || !ok {
				t.Fatalf("Lookup = %v, %v", ok, err)
			}
			if m.FSType != "tmpfs" || mount.HasOption(m.Options, "ro") != tc.readOnly {
				t.Errorf("mount %+v: want tmpfs, ro=%v", m, tc.readOnly)
			}
			if !mount.HasOption(m.Options, "nosuid") {
				t.Errorf("bind lost nosuid: %s", m.Options)
			}
			b, err := os.ReadFile(filepath.Join(dst, "hello"))
			if err != nil || string(b) != "hi" {
				t.Fatalf("read through bind = %q, %v", b, err)
			}
			err = os.WriteFile(filepath.Join(dst, "new"), nil, 0o644)
			if tc.readOnly && !errors.Is(err, unix.EROFS) {
				t.Errorf("write to read-only bind: err = %v, want EROFS", err)
			}
			if !tc.readOnly && err != nil {
				t.Errorf("write to read-write bind: %v", err)
			}
			// The source stays writable either way.
			if err := os.WriteFile(filepath.Join(src, "new2"), nil, 0o644); err != nil {
				t.Errorf("source became read-only: %v", err)
			}
			for range 2 { // idempotent
				if err := mount.Unmount(context.Background(), dst); err != nil {
					t.Fatal(err)
				}
			}
			if ok, _ := mount.IsMountPoint(dst); ok {
				t.Fatal("still mounted")
			}
		})
	}

	t.Run("device node onto file", func(t *testing.T) {
		if err := os.WriteFile(file, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := mount.Bind("/dev/null", file, false); err != nil {
			t.Fatal(err)
		}
		var st unix.Stat_t
		if err := unix.Stat(file, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR {
			t.Errorf("bound file is not a char device: %v %o", err, st.Mode)
		}
		if err := mount.Unmount(context.Background(), file); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("unmount missing path", func(t *testing.T) {
		if err := mount.Unmount(context.Background(), filepath.Join(base, "nope")); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("unmount busy", func(t *testing.T) {
		if err := mount.Bind(src, dst, false); err != nil {
			t.Fatal(err)
		}
		// A process with its working directory inside keeps it busy.
		cmd := exec.Command("cat")
		cmd.Dir = dst
		stdin, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		cancel() // do not wait through the retries
		err = mount.Unmount(ctx, dst)
		stdin.Close()
		_ = cmd.Wait()
		if !errors.Is(err, context.Canceled) {
			t.Errorf("unmount of busy mount: err = %v, want context.Canceled", err)
		}
		if err := mount.Unmount(context.Background(), dst); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("stacked mounts: lookup sees the top", func(t *testing.T) {
		if err := mount.Bind(src, dst, false); err != nil {
			t.Fatal(err)
		}
		if err := mount.Bind(src, dst, true); err != nil {
			t.Fatal(err)
		}
		m, _, err := mount.Lookup(dst)
		if err != nil || !mount.HasOption(m.Options, "ro") {
			t.Errorf("top mount = %+v, %v; want the read-only one", m, err)
		}
		ms, err := mount.List(func(m *mountinfo.Info) (bool, bool) { return m.Mountpoint != dst, false })
		if err != nil || len(ms) != 2 {
			t.Errorf("List = %d entries, %v; want 2", len(ms), err)
		}
		for range 2 {
			if err := mount.Unmount(context.Background(), dst); err != nil {
				t.Fatal(err)
			}
		}
	})

	if err := mount.Unmount(context.Background(), src); err != nil {
		t.Fatal(err)
	}
}

// ext4 on a sparse image on a loop device: FITRIM gives freed blocks back to
// the image file, and freezing blocks writers until the thaw.
func TestTrimAndFreeze(t *testing.T) {
	testhelp.NeedRoot(t)
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		t.Fatal("mkfs.ext4 is not installed: make deps installs e2fsprogs")
	}
	base := testhelp.LeakCheckedDir(t)
	img, mnt := filepath.Join(base, "fs.img"), filepath.Join(base, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 128<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(mkfs, "-q", "-F", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v: %s", err, out)
	}
	dev, f, err := loopdev.Attach(context.Background(), img, loopdev.Options{AutoClear: true})
	if err != nil {
		t.Fatal(err)
	}
	err = mount.Mount(dev.Path, mnt, "ext4", nil)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := mount.Unmount(context.Background(), mnt); err != nil {
			t.Error(err)
		}
		// AutoClear: the unmount released the last user.
		if d, err := loopdev.Find(img); err == nil {
			t.Errorf("%s still attached after unmount", d.Path)
			_ = loopdev.Detach(d, img)
		}
	})

	allocated := func() int64 {
		var st unix.Stat_t
		if err := unix.Stat(img, &st); err != nil {
			t.Fatal(err)
		}
		return st.Blocks * 512
	}
	data := filepath.Join(mnt, "data")
	df, err := os.Create(data)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := df.WriteString(strings.Repeat("x", 32<<20)); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(df.Sync(), df.Close()); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(data); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	before := allocated()
	trimmed, err := mount.Trim(mnt)
	if err != nil {
		t.Fatal(err)
	}
	after := allocated()
	if before-after < 24<<20 || trimmed < 24<<20 {
		t.Errorf("trim: allocated %d -> %d, reported %d; want >= 24 MiB back", before, after, trimmed)
	}

	t.Run("WhileFrozen", func(t *testing.T) {
		err := mount.WhileFrozen(context.Background(), mnt, func(ctx context.Context) error {
			// Freezing a frozen filesystem fails with EBUSY: proof it is frozen.
			if err := mount.Freeze(mnt); !errors.Is(err, unix.EBUSY) {
				t.Errorf("second freeze: err = %v, want EBUSY", err)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(mnt, "after"), nil, 0o644); err != nil {
			t.Fatalf("write after thaw: %v", err)
		}
	})

	t.Run("WhileFrozen thaws a blocked writer at the deadline", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		err := mount.WhileFrozen(ctx, mnt, func(ctx context.Context) error {
			// Blocks on the frozen filesystem until the deadline thaws it.
			return os.WriteFile(filepath.Join(mnt, "blocked"), []byte("x"), 0o644)
		})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := os.Stat(filepath.Join(mnt, "blocked")); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("WhileAllFrozen leaves a filesystem frozen by someone else to them", func(t *testing.T) {
		if err := mount.Freeze(mnt); err != nil {
			t.Fatal(err)
		}
		defer mount.Thaw(mnt)
		var shared []string
		ran := false
		err := mount.WhileAllFrozen(context.Background(), []string{mnt}, func(p string) { shared = append(shared, p) }, func(context.Context) error {
			ran = true
			return nil
		})
		if err != nil || !ran || len(shared) != 1 || shared[0] != mnt {
			t.Fatalf("WhileAllFrozen on a frozen filesystem: %v, ran %t, shared %v", err, ran, shared)
		}
		// Still frozen: the one who froze it thaws it.
		if err := mount.Freeze(mnt); !errors.Is(err, mount.ErrAlreadyFrozen) {
			t.Errorf("after WhileAllFrozen: FIFREEZE gave %v, want it still frozen (ErrAlreadyFrozen)", err)
		}
	})

	t.Run("thaw is idempotent", func(t *testing.T) {
		if err := mount.Thaw(mnt); err != nil {
			t.Fatal(err)
		}
	})
}

// TestIsMountPoint: IsMountPoint's one statx agrees with the mount table
// on every kind of mount point the agent meets: a filesystem, a bind of a
// directory of the same filesystem (same st_dev as its parent), a bind on
// a file, stacked mounts, a symlink to a mount point (followed), and on
// what is not one (a directory inside a mount, a plain directory, a
// missing path).
func TestIsMountPoint(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	p := func(name string) string { return filepath.Join(base, name) }
	for _, d := range []string{"fs", "fs/sub", "samefs-src", "samefs-dst", "stacked", "plain"} {
		if err := os.Mkdir(p(d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"file-src", "file-dst"} {
		if err := os.WriteFile(p(f), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	mountTmpfs(t, p("fs"))
	if err := os.Mkdir(p("fs/inside"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, b := range [][2]string{{p("samefs-src"), p("samefs-dst")}, {p("file-src"), p("file-dst")}} {
		if err := mount.Bind(b[0], b[1], false); err != nil {
			t.Fatal(err)
		}
	}
	mountTmpfs(t, p("stacked"))
	mountTmpfs(t, p("stacked"))
	if err := os.Symlink(p("fs"), p("link")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, m := range []string{"stacked", "stacked", "file-dst", "samefs-dst", "fs"} {
			_ = mount.Unmount(context.Background(), p(m))
		}
	})
	for _, tc := range []struct {
		name string
		want bool
	}{
		{"fs", true}, {"samefs-dst", true}, {"file-dst", true}, {"stacked", true}, {"link", true},
		{"fs/inside", false}, {"samefs-src", false}, {"plain", false}, {"missing", false}, {"file-src", false},
	} {
		got, err := mount.IsMountPoint(p(tc.name))
		if err != nil || got != tc.want {
			t.Errorf("IsMountPoint(%s) = %v, %v; want %v", tc.name, got, err, tc.want)
		}
		canon, err := filepath.EvalSymlinks(p(tc.name))
		if err != nil {
			canon = p(tc.name)
		}
		ms, err := mount.List(func(m *mountinfo.Info) (bool, bool) { return m.Mountpoint != canon, false })
		if err != nil {
			t.Fatal(err)
		}
		if inTable := len(ms) > 0; inTable != tc.want {
			t.Errorf("%s: the mount table says %v", tc.name, inTable)
		}
	}
}
