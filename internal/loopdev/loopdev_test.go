package loopdev_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
)

// image creates a sparse file of size bytes and registers a cleanup that
// fails the test if a loop device is still backed by it.
func image(t *testing.T, size int64) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk.img")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	t.Cleanup(func() {
		if d, err := loopdev.Find(p); err == nil {
			t.Errorf("%s still attached to %s", p, d.Path)
			_ = loopdev.Detach(d, p)
		}
	})
	return p
}

func TestAttachFindDetach(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, tc := range []struct {
		name      string
		autoClear bool
	}{
		{"autoclear", true},
		{"explicit detach", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			img := image(t, 16<<20)
			dev, f, err := loopdev.Attach(context.Background(), img, loopdev.Options{AutoClear: tc.autoClear})
			if err != nil {
				t.Fatal(err)
			}
			got, err := loopdev.Find(img)
			if err != nil {
				t.Fatal(err)
			}
			if got != dev {
				t.Fatalf("Find = %+v, Attach = %+v", got, dev)
			}
			// A symlink to the image is the same file.
			link := filepath.Join(filepath.Dir(img), "link.img")
			if err := os.Symlink(img, link); err != nil {
				t.Fatal(err)
			}
			if got, err := loopdev.Find(link); err != nil || got != dev {
				t.Fatalf("Find(symlink) = %+v, %v", got, err)
			}
			// Discard must work, or FITRIM cannot give blocks back.
			b, err := os.ReadFile(filepath.Join("/sys/block", dev.Name, "queue/discard_max_bytes"))
			if err != nil {
				t.Fatal(err)
			}
			if n, _ := strconv.Atoi(strings.TrimSpace(string(b))); n == 0 {
				t.Errorf("%s has no discard support", dev.Name)
			}
			attached, err := loopdev.List(filepath.Dir(img))
			if err != nil || len(attached) != 1 || attached[0].Device != dev {
				t.Fatalf("List = %+v, %v", attached, err)
			}
			f.Close()
			if !tc.autoClear {
				if _, err := loopdev.Find(img); err != nil {
					t.Fatalf("device without autoclear went away on close: %v", err)
				}
				if err := loopdev.Detach(dev, img); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := loopdev.Find(img); !errors.Is(err, loopdev.ErrNotAttached) {
				t.Fatalf("after close/detach: Find err = %v, want ErrNotAttached", err)
			}
			// Detaching again is a no-op.
			if err := loopdev.Detach(dev, img); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// Concurrent attachers race for the same free device; Attach retries on
// EBUSY and every image ends up on its own device.
func TestAttachConcurrent(t *testing.T) {
	testhelp.NeedRoot(t)
	const n = 6
	imgs := make([]string, n)
	for i := range imgs {
		imgs[i] = image(t, 8<<20)
	}
	devs := make([]loopdev.Device, n)
	files := make([]*os.File, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range imgs {
		wg.Go(func() {
			devs[i], files[i], errs[i] = loopdev.Attach(context.Background(), imgs[i], loopdev.Options{AutoClear: true})
		})
	}
	wg.Wait()
	seen := map[string]bool{}
	for i := range imgs {
		if errs[i] != nil {
			t.Errorf("attach %d: %v", i, errs[i])
			continue
		}
		if seen[devs[i].Name] {
			t.Errorf("%s handed out twice", devs[i].Name)
		}
		seen[devs[i].Name] = true
		files[i].Close()
	}
}

func TestDetachLeavesReusedDeviceAlone(t *testing.T) {
	testhelp.NeedRoot(t)
	a, b := image(t, 8<<20), image(t, 8<<20)
	dev, f, err := loopdev.Attach(context.Background(), b, loopdev.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// The device backs b, not a: detaching "a's device" must not touch it.
	if err := loopdev.Detach(dev, a); err != nil {
		t.Fatal(err)
	}
	if got, err := loopdev.Find(b); err != nil || got != dev {
		t.Fatalf("Find(b) = %+v, %v; want %+v still attached", got, err, dev)
	}
	if err := loopdev.Detach(dev, b); err != nil {
		t.Fatal(err)
	}
}

// loopChangeFD is LOOP_CHANGE_FD (linux/loop.h; x/sys/unix lacks it).
const loopChangeFD = 0x4C06

// A read-only device refuses writes and cannot be re-backed by an opener
// without privileges: LOOP_CHANGE_FD works on LO_FLAGS_READ_ONLY devices for
// anyone who can open them, read-only.
func TestReadOnlyCannotBeRebacked(t *testing.T) {
	testhelp.NeedRoot(t)
	img, other := image(t, 8<<20), image(t, 8<<20)
	dev, f, err := loopdev.Attach(context.Background(), img, loopdev.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { f.Close(); _ = loopdev.Detach(dev, img) }()
	if got, err := loopdev.Find(img); err != nil || !got.ReadOnly {
		t.Fatalf("Find = %+v, %v; want a read-only device", got, err)
	}
	opener, err := os.Open(dev.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer opener.Close()
	o, err := os.Open(other)
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if err := unix.IoctlSetInt(int(opener.Fd()), loopChangeFD, int(o.Fd())); err == nil {
		t.Fatal("LOOP_CHANGE_FD re-backed a read-only device")
	}
	if got, err := loopdev.Find(img); err != nil || got.Name != dev.Name {
		t.Fatalf("after LOOP_CHANGE_FD: Find(img) = %+v, %v", got, err)
	}
	if w, err := os.OpenFile(dev.Path, os.O_WRONLY, 0); err == nil {
		_, err = w.WriteAt(make([]byte, 4096), 0)
		w.Close()
		if err == nil {
			t.Fatal("a write through a read-only device succeeded")
		}
	}
}

// A read-only device, detached, does not stay read-only for the next
// attacher (csi-driver-host-path's losetup got one, and its "writable"
// block volume refused writes).
func TestDetachClearsReadOnly(t *testing.T) {
	testhelp.NeedRoot(t)
	img := image(t, 8<<20)
	dev, f, err := loopdev.Attach(context.Background(), img, loopdev.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	if err := loopdev.Detach(dev, img); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join("/sys/block", dev.Name, "ro"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(string(b)) != "0" {
		t.Errorf("%s is read-only (ro %s) after its detach", dev.Name, strings.TrimSpace(string(b)))
	}
}

// While Hold's descriptor is open, an opener's LOOP_CLR_FD (no capability
// needed) cannot detach the device; a later Hold clears the autoclear mark
// it left.
func TestHoldKeepsDeviceAttached(t *testing.T) {
	testhelp.NeedRoot(t)
	img := image(t, 8<<20)
	dev, f, err := loopdev.Attach(context.Background(), img, loopdev.Options{})
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	hold, err := loopdev.Hold(dev, img)
	if err != nil {
		t.Fatal(err)
	}
	opener, err := os.Open(dev.Path)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.IoctlSetInt(int(opener.Fd()), unix.LOOP_CLR_FD, 0); err != nil {
		t.Fatal(err)
	}
	opener.Close()
	if got, err := loopdev.Find(img); err != nil || got.Name != dev.Name {
		t.Fatalf("an opener's LOOP_CLR_FD detached a held device: Find = %+v, %v", got, err)
	}
	again, err := loopdev.Hold(dev, img)
	if err != nil {
		t.Fatal(err)
	}
	if info, err := unix.IoctlLoopGetStatus64(int(again.Fd())); err != nil || info.Flags&unix.LO_FLAGS_AUTOCLEAR != 0 {
		t.Fatalf("Hold left flags %#x, %v; want autoclear cleared", info.Flags, err)
	}
	hold.Close()
	again.Close()
	if _, err := loopdev.Find(img); err != nil {
		t.Fatalf("device detached at the holders' close: %v", err)
	}
	if err := loopdev.Detach(dev, img); err != nil {
		t.Fatal(err)
	}
	// Holding a device that now backs nothing fails.
	if f, err := loopdev.Hold(dev, img); err == nil {
		f.Close()
		t.Fatal("Hold of a detached device succeeded")
	}
}

// A device detached while its node is still bound somewhere (given to a
// container) is not handed to the next file.
func TestAttachSkipsHandedOutDevice(t *testing.T) {
	testhelp.NeedRoot(t)
	a, b := image(t, 8<<20), image(t, 8<<20)
	dev, f, err := loopdev.Attach(context.Background(), a, loopdev.Options{})
	if err != nil {
		t.Fatal(err)
	}
	f.Close()
	node := filepath.Join(t.TempDir(), "node")
	if err := os.WriteFile(node, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dev.Path, node, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(node, unix.MNT_DETACH)
	if err := loopdev.Detach(dev, a); err != nil {
		t.Fatal(err)
	}
	got, g, err := loopdev.Attach(context.Background(), b, loopdev.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { g.Close(); _ = loopdev.Detach(got, b) }()
	if got.Name == dev.Name {
		t.Fatalf("%s, whose node is still bound at %s, went to another file", dev.Name, node)
	}
}
