package loopplugin

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

func sameContent(t *testing.T, a, b *os.File) {
	t.Helper()
	x, err := os.ReadFile(a.Name())
	if err != nil {
		t.Fatal(err)
	}
	y, err := os.ReadFile(b.Name())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(x, y) {
		t.Fatalf("%s and %s differ (%d and %d bytes)", a.Name(), b.Name(), len(x), len(y))
	}
}

func writeAt(t *testing.T, f *os.File, off int64, b []byte) {
	t.Helper()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// TestSyncImage: a sparse copy reads and writes only data, and later syncs
// write only the blocks that changed and punch out what became holes. No
// root needed.
func TestSyncImage(t *testing.T) {
	dir := t.TempDir()
	src, err := os.Create(filepath.Join(dir, "src"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	dst, err := os.Create(filepath.Join(dir, "dst"))
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	if err := src.Truncate(8 << 20); err != nil {
		t.Fatal(err)
	}
	writeAt(t, src, 0, randomData(64<<10))
	writeAt(t, src, 100<<10, make([]byte, 64<<10)) // allocated zeros
	writeAt(t, src, 3<<20, randomData(4<<10))
	writeAt(t, src, 6<<20, randomData(1<<20))
	ctx := context.Background()

	type want struct{ written, punched int64 }
	for _, step := range []struct {
		name   string
		change func()
		want   want
	}{
		{"initial copy", nil, want{written: 64<<10 + 4<<10 + 1<<20}},
		{"unchanged", func() {}, want{}},
		{"one block changed", func() { writeAt(t, src, 3<<20, randomData(4<<10)) }, want{written: 4 << 10}},
		{"a range became a hole", func() {
			if err := unix.Fallocate(int(src.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 6<<20, 1<<20); err != nil {
				t.Fatal(err)
			}
		}, want{punched: 1 << 20}},
		{"a range became zeros", func() { writeAt(t, src, 0, make([]byte, 8<<10)) }, want{punched: 8 << 10}},
		{"the target diverged", func() { writeAt(t, dst, 5<<20, randomData(4<<10)) }, want{punched: 4 << 10}},
		{"the source grew", func() {
			if err := src.Truncate(10 << 20); err != nil {
				t.Fatal(err)
			}
			writeAt(t, src, 9<<20, randomData(4<<10))
		}, want{written: 4 << 10}},
	} {
		t.Run(step.name, func(t *testing.T) {
			var st copyStats
			var err error
			if step.change == nil {
				st, err = copyImage(ctx, src, dst, false)
			} else {
				step.change()
				st, err = syncImage(ctx, src, dst, false)
			}
			if err != nil {
				t.Fatal(err)
			}
			sameContent(t, src, dst)
			if st.written != step.want.written || st.punched < step.want.punched || (step.want.punched == 0 && st.punched != 0) {
				t.Errorf("stats = %+v, want %+v", st, step.want)
			}
			if a, b := allocated(t, src.Name()), allocated(t, dst.Name()); b > a {
				t.Errorf("target allocates %d bytes, source %d: not sparse", b, a)
			}
		})
	}

	t.Run("cancelled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(ctx)
		cancel()
		if _, err := syncImage(ctx, src, dst, true); !errors.Is(err, context.Canceled) {
			t.Errorf("err = %v, want context.Canceled", err)
		}
	})
}

// TestCopyReflink: on a filesystem with reflink (xfs), snapshot copies
// share extents with their source instead of copying.
func TestCopyReflink(t *testing.T) {
	testhelp.NeedRoot(t)
	mkfs := lookTool("mkfs.xfs")
	if mkfs == "" {
		t.Fatal("mkfs.xfs is not installed: make deps installs xfsprogs")
	}
	dir := testhelp.LeakCheckedDir(t)
	img := filepath.Join(dir, "xfs.img")
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(img, 320<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(mkfs, "-q", "-m", "reflink=1", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.xfs -m reflink=1 (xfsprogs is installed by make deps): %v: %s", err, out)
	}
	dev, f, err := loopdev.Attach(context.Background(), img, loopdev.Options{AutoClear: true})
	if err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o700); err != nil {
		t.Fatal(err)
	}
	err = mount.Mount(dev.Path, mnt, "xfs", nil)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := mount.Unmount(context.Background(), mnt); err != nil {
			t.Error(err)
		}
	})

	src, err := os.Create(filepath.Join(mnt, "src"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	writeAt(t, src, 1<<20, randomData(2<<20))
	if err := src.Truncate(16 << 20); err != nil {
		t.Fatal(err)
	}
	dst, err := os.Create(filepath.Join(mnt, "dst"))
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Close()
	st, err := copyImage(context.Background(), src, dst, true)
	if err != nil {
		t.Fatal(err)
	}
	if !st.reflinked || st.written != 0 {
		t.Errorf("stats = %+v, want a reflink", st)
	}
	sameContent(t, src, dst)
}
