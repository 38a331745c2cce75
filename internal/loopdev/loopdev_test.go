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
