package atomicfile

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// stopCleanly is what the agent does at a clean stop: a checkpoint, then
// the start image.
func stopCleanly(t *testing.T, c *Committer) {
	t.Helper()
	if err := c.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := c.WriteImage(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// stoppedWith is a root whose Committer wrote recs and stopped cleanly.
func stoppedWith(t *testing.T, recs map[string]string) string {
	t.Helper()
	root, c := newCommitter(t)
	putRecords(t, c, root, recs)
	stopCleanly(t, c)
	return root
}

// reopen is New(root), as the next start does.
func reopen(t *testing.T, root string) *Committer {
	t.Helper()
	c, err := New(root)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// putRecords writes records name → payload below root, durably.
func putRecords(t *testing.T, c *Committer, root string, recs map[string]string) {
	t.Helper()
	var last uint64
	for name, payload := range recs {
		n, err := c.Put(filepath.Join(root, name), []byte(payload), 0o600)
		if err != nil {
			t.Fatal(err)
		}
		last = max(last, n)
	}
	if err := c.Wait(context.Background(), last); err != nil {
		t.Fatal(err)
	}
}

// readAll reads each record through c and returns what it read ("" for
// a record that does not exist).
func readAll(t *testing.T, c *Committer, root string, names ...string) map[string]string {
	t.Helper()
	out := map[string]string{}
	for _, name := range names {
		b, _, err := c.ReadRecord(filepath.Join(root, name))
		switch {
		case errors.Is(err, fs.ErrNotExist):
			out[name] = ""
		case err != nil:
			t.Fatal(err)
		default:
			out[name] = string(b)
		}
	}
	return out
}

func TestImageServesRecordsAfterACleanStop(t *testing.T) {
	root := stoppedWith(t, map[string]string{"a": "one", "b": "two"})

	c2 := reopen(t, root)
	got := readAll(t, c2, root, "a", "b")
	if got["a"] != "one" || got["b"] != "two" {
		t.Fatalf("read %v", got)
	}
	if h := c2.imageHits.Load(); h != 2 {
		t.Fatalf("%d of 2 records read from the image", h)
	}
	// Records read from the image are in the next one.
	c2.ReleaseImage()
	stopCleanly(t, c2)
	c3 := reopen(t, root)
	if got := readAll(t, c3, root, "a", "b"); got["a"] != "one" || got["b"] != "two" || c3.imageHits.Load() != 2 {
		t.Fatalf("after a second stop: read %v, %d from the image", got, c3.imageHits.Load())
	}
}

// A record written after the image, by anyone, is read from its file:
// the image is a cache checked against each file's stat.
func TestImageNeverServesAChangedRecord(t *testing.T) {
	root := stoppedWith(t, map[string]string{"a": "one", "b": "two", "gone": "x"})
	image, err := os.ReadFile(filepath.Join(root, imageFile))
	if err != nil {
		t.Fatal(err)
	}

	// Another Committer (as a release without the image, which would
	// leave the image's file: put back below) changes a, to a version of
	// the same size, and removes gone; its clean stop leaves no journal.
	other := reopen(t, root)
	other.ReleaseImage()
	putRecords(t, other, root, map[string]string{"a": "ONE"})
	if _, err := other.Remove(filepath.Join(root, "gone")); err != nil {
		t.Fatal(err)
	}
	if err := other.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	// An operator's copy over b.
	if err := os.Rename(filepath.Join(root, "a"), filepath.Join(root, "b.tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(root, "b.tmp"), filepath.Join(root, "b")); err != nil {
		t.Fatal(err)
	}
	again := reopen(t, root)
	putRecords(t, again, root, map[string]string{"a": "one again"})
	if err := again.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}

	if err := os.WriteFile(filepath.Join(root, imageFile), image, 0o600); err != nil {
		t.Fatal(err)
	}
	c2 := reopen(t, root)
	if c2.image == nil {
		t.Fatal("the image was not loaded")
	}
	got := readAll(t, c2, root, "a", "gone")
	if got["a"] != "one again" || got["gone"] != "" {
		t.Fatalf("read %v, want the files' versions", got)
	}
	// b's file holds a's frame now: corrupt, never the image's "two".
	if _, _, err := c2.ReadRecord(filepath.Join(root, "b")); !errors.Is(err, ErrForeign) {
		t.Fatalf("b: %v, want ErrForeign", err)
	}
	if h := c2.imageHits.Load(); h != 0 {
		t.Fatalf("%d records read from the image", h)
	}
}

// A start that replays a journal (a crash) does not use the image.
func TestImageIgnoredAfterACrash(t *testing.T) {
	root := stoppedWith(t, map[string]string{"a": "one"})
	c2 := reopen(t, root)
	putRecords(t, c2, root, map[string]string{"b": "two"}) // its journal stays: a crash
	c3, err := Open(root, rebooted)
	if err != nil {
		t.Fatal(err)
	}
	if c3.image != nil {
		t.Fatal("the image was loaded after a journal was replayed")
	}
	if got := readAll(t, c3, root, "a", "b"); got["a"] != "one" || got["b"] != "two" {
		t.Fatalf("read %v", got)
	}
}

// A damaged or truncated image is ignored whole.
func TestImageDamagedIsIgnored(t *testing.T) {
	for name, damage := range map[string]func([]byte) []byte{
		"a byte flipped": func(b []byte) []byte { b[len(b)/2] ^= 1; return b },
		"truncated":      func(b []byte) []byte { return b[:len(b)-5] },
		"empty":          func([]byte) []byte { return nil },
	} {
		t.Run(name, func(t *testing.T) {
			root := stoppedWith(t, map[string]string{"a": "one"})
			p := filepath.Join(root, imageFile)
			b, err := os.ReadFile(p)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, damage(b), 0o600); err != nil {
				t.Fatal(err)
			}
			c2 := reopen(t, root)
			if c2.image != nil {
				t.Fatal("a damaged image was loaded")
			}
			if got := readAll(t, c2, root, "a"); got["a"] != "one" {
				t.Fatalf("read %v", got)
			}
		})
	}
}

// The image's file goes, durably, before the first change after a start:
// an image on disk never predates a change of this release.
func TestImageFileRemovedBeforeTheFirstChange(t *testing.T) {
	root := stoppedWith(t, map[string]string{"a": "one"})
	c2 := reopen(t, root)
	if _, err := os.Stat(filepath.Join(root, imageFile)); err != nil {
		t.Fatalf("the image is gone before any change: %v", err)
	}
	var mu sync.Mutex
	var synced []string
	c2.Fsync = func(p string) error {
		mu.Lock()
		synced = append(synced, p)
		mu.Unlock()
		return syncFile(p)
	}
	n, err := c2.Put(filepath.Join(root, "b"), []byte("two"), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := c2.Wait(context.Background(), n); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if _, err := os.Stat(filepath.Join(root, imageFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the image is still there after a change: %v", err)
	}
	if len(synced) == 0 || synced[0] != root {
		t.Fatalf("the removal was not made durable first: fsyncs %v", synced)
	}
	// Its entries still serve the loaders while their files are unchanged.
	if got := readAll(t, c2, root, "a"); got["a"] != "one" || c2.imageHits.Load() != 1 {
		t.Fatalf("read %v, %d from the image", got, c2.imageHits.Load())
	}
}

// An image left beside journals (a release without the image, or a
// change after the stop's checkpoint) is removed by the start that
// replays them: a later start without journals must not load it.
func TestImageRemovedByAReplay(t *testing.T) {
	root := stoppedWith(t, map[string]string{"a": "one"})
	image, err := os.ReadFile(filepath.Join(root, imageFile))
	if err != nil {
		t.Fatal(err)
	}
	c2 := reopen(t, root)
	putRecords(t, c2, root, map[string]string{"a": "two"}) // its journal stays: a crash
	if err := os.WriteFile(filepath.Join(root, imageFile), image, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(root, rebooted); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(root, imageFile)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the image outlived the replay: %v", err)
	}
}
