package atomicfile

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestWriteReopenRead(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "state.json")
	for _, content := range []string{"first", "second, longer than the first", "3"} {
		if err := Write(path, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(path)
		if err != nil || string(got) != content {
			t.Fatalf("read back %q, %v; want %q", got, err, content)
		}
	}
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("mode = %v, %v; want 0600", st.Mode(), err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("temp files left behind: %v", entries)
	}
}

func TestWriteMissingDirFailsCleanly(t *testing.T) {
	err := Write(filepath.Join(t.TempDir(), "nope", "f"), []byte("x"), 0o600)
	if err == nil {
		t.Fatal("want an error for a missing directory")
	}
}

func TestCommitterPutIsVisibleThenDurable(t *testing.T) {
	dir := t.TempDir()
	var c Committer
	sub := filepath.Join(dir, "a", "b")
	if err := c.MkdirAll(sub, 0o700); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(sub, "state")
	var last uint64
	for _, content := range []string{"one", "two, longer", "3"} {
		n, err := c.Put(path, []byte(content), 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if n <= last {
			t.Fatalf("change numbers not increasing: %d after %d", n, last)
		}
		last = n
		if got, err := readPayload(path); err != nil || string(got) != content {
			t.Fatalf("right after Put: read %q, %v; want %q", got, err, content)
		}
	}
	if err := c.Wait(context.Background(), last); err != nil {
		t.Fatal(err)
	}
	writes, fsyncs, pending := c.Stats()
	if writes != 3 || pending != 0 || fsyncs == 0 {
		t.Errorf("stats: %d writes, %d fsyncs, %d pending; want 3 writes, some fsyncs, none pending", writes, fsyncs, pending)
	}
	entries, _ := os.ReadDir(sub)
	if len(entries) != 1 {
		t.Errorf("temp files left behind: %v", entries)
	}
	if _, err := c.Remove(path); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Remove(path); err != nil {
		t.Errorf("removing a missing file: %v", err)
	}
	if err := c.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Errorf("removed file still there: %v", err)
	}
}

// Concurrent writers share commit rounds: far fewer fsyncs than the two
// per write a synchronous Write costs.
func TestCommitterGroupCommit(t *testing.T) {
	dir := t.TempDir()
	var c Committer
	const n = 200
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Go(func() {
			seq, err := c.Put(filepath.Join(dir, fmt.Sprint(i)), []byte("x"), 0o600)
			if err == nil {
				err = c.Wait(context.Background(), seq)
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	_, fsyncs, pending := c.Stats()
	if pending != 0 {
		t.Errorf("%d changes pending after every Wait returned", pending)
	}
	// Every file is fsynced once; the shared directory once per round.
	if fsyncs >= 2*n {
		t.Errorf("%d fsyncs for %d concurrent writes to one directory; want fewer than %d (directory fsyncs shared)", fsyncs, n, 2*n)
	}
}

// A failed fsync has the file rewritten from its content within the round;
// when that fails too, the round's waiters get the error and the next
// round retries.
func TestCommitterRetriesAFailedFsync(t *testing.T) {
	t.Run("rewrite succeeds", func(t *testing.T) { testFailedFsync(t, 1, false) })
	t.Run("rewrite fails, next round succeeds", func(t *testing.T) { testFailedFsync(t, 2, true) })
}

func testFailedFsync(t *testing.T, fail int32, waitFails bool) {
	dir := t.TempDir()
	failures := atomic.Int32{}
	c := Committer{Fsync: func(path string) error {
		if failures.Add(-1) >= 0 {
			return errors.New("injected EIO")
		}
		return syncFile(path)
	}}
	path := filepath.Join(dir, "state")
	// The file exists, durably: the rounds commit its next version (a
	// new file's first version is fsynced by Put itself).
	n, err := c.Put(path, []byte("first"), 0o640)
	if err == nil {
		err = c.Wait(context.Background(), n)
	}
	if err != nil {
		t.Fatal(err)
	}
	failures.Store(fail)
	n, err = c.Put(path, []byte("content"), 0o640)
	if err != nil {
		t.Fatal(err)
	}
	err = c.Wait(context.Background(), n)
	if !waitFails {
		if err != nil {
			t.Fatalf("Wait = %v; want the rewrite to have made it durable", err)
		}
	} else {
		if err == nil || !strings.Contains(err.Error(), "injected EIO") {
			t.Fatalf("Wait after a failed fsync and rewrite = %v; want the injected error", err)
		}
		waitRetried(t, &c, n)
	}
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o640 {
		t.Fatalf("after the rewrite: %v, %v; want mode 0640", st, err)
	}
	if got, _ := readPayload(path); string(got) != "content" {
		t.Errorf("content after the rewrite = %q", got)
	}
}

// A round whose fsync fails rewrites the file from the content it had,
// but never over newer content put meanwhile, nor over a removal.
func TestCommitterFailedFsyncKeepsNewerChanges(t *testing.T) {
	for _, tc := range []struct {
		name  string
		later func(c *Committer, path string) error
		want  string // "" for absent
	}{
		{"newer put", func(c *Committer, path string) error { _, err := c.Put(path, []byte("v2"), 0o600); return err }, "v2"},
		{"removal", func(c *Committer, path string) error { _, err := c.Remove(path); return err }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "state")
			inFsync, release := make(chan struct{}), make(chan struct{})
			var first sync.Once
			var armed atomic.Bool
			c := &Committer{}
			c.Fsync = func(p string) error {
				failed := false
				if !armed.Load() {
					return syncFile(p)
				}
				first.Do(func() {
					close(inFsync)
					<-release
					failed = true
				})
				if failed {
					return errors.New("injected EIO")
				}
				return syncFile(p)
			}
			n, err := c.Put(path, []byte("v0"), 0o600)
			if err == nil {
				err = c.Wait(context.Background(), n)
			}
			if err != nil {
				t.Fatal(err)
			}
			armed.Store(true)
			if _, err := c.Put(path, []byte("v1"), 0o600); err != nil {
				t.Fatal(err)
			}
			<-inFsync // the round holds v1's fsync
			if err := tc.later(c, path); err != nil {
				t.Fatal(err)
			}
			close(release) // v1's fsync fails: v1 must not be rewritten
			c.mu.Lock()
			n = c.seq
			c.mu.Unlock()
			waitRetried(t, c, n)
			got, err := readPayload(path)
			switch {
			case tc.want == "" && !os.IsNotExist(err):
				t.Errorf("the removed file is back: %q, %v", got, err)
			case tc.want != "" && string(got) != tc.want:
				t.Errorf("content %q (%v), want %q", got, err, tc.want)
			}
		})
	}
}

// waitRetried waits until change n is durable, through failed rounds
// (whose error Wait reports until a later round succeeds).
func waitRetried(t *testing.T, c *Committer, n uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		c.mu.Lock()
		round := c.round
		c.mu.Unlock()
		err := c.Wait(ctx, n)
		if err == nil {
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("change %d never became durable: %v", n, err)
		}
		<-round // the round that failed, or the retry after it
	}
}

func readPayload(path string) ([]byte, error) {
	b, _, err := ReadRecord("", path)
	return b, err
}

// A record whose file and directory are removed while a round is
// committing a new version of it (a cleanup that forgets a container
// right after its CLEANING record): the round makes durable neither that
// version (the file is gone) nor, if it ignores the missing directory,
// the removal. It must not count as done before the directory's parent,
// whose fsync makes the removal durable, is fsynced after the removal.
func TestRoundCommitsARemovedDirectoryByItsParent(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "c1")
	path := filepath.Join(dir, "volumes.state")
	var c Committer
	if err := c.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Put(path, []byte("PREPARED"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Sync(ctx); err != nil {
		t.Fatal(err)
	}
	var (
		mu            sync.Mutex
		removed       bool
		parentSynced  bool // base fsynced after the removal
		removeErrs    []error
		removeTrigger sync.Once
	)
	c.Fsync = func(p string) error {
		if p == path {
			// The cleanup forgets the record while the round is here.
			removeTrigger.Do(func() {
				_, err1 := c.Remove(path)
				_, err2 := c.Remove(dir)
				mu.Lock()
				removed, removeErrs = true, []error{err1, err2}
				mu.Unlock()
			})
		}
		err := syncFile(p)
		mu.Lock()
		if p == base && removed && err == nil {
			parentSynced = true
		}
		mu.Unlock()
		return err
	}
	n, err := c.Put(path, []byte("CLEANING"), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(ctx, n); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if err := errors.Join(removeErrs...); err != nil {
		t.Fatal(err)
	}
	if !removed {
		t.Fatal("the round did not fsync the record")
	}
	if !parentSynced {
		t.Fatalf("change %d reported durable, but %s was not fsynced after %s was removed: neither the new version nor the removal is durable", n, base, dir)
	}
}
