package atomicfile

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// putDurably puts one version and waits for it.
func putDurably(t *testing.T, c *Committer, path, payload string) {
	t.Helper()
	n, err := c.Put(path, []byte(payload), 0o600)
	if err == nil {
		err = c.Wait(context.Background(), n)
	}
	if err != nil {
		t.Fatal(err)
	}
}

// A new record's content is durable before its name appears: the journal
// holding it is fsynced while the record's name does not exist yet, and
// the checkpoint fsyncs the file under its name. (Once, the file was
// renamed into place first and fsynced by the round: a power cut could
// leave the name with no content, and recovery quarantined an operation
// nobody had been told about.)
func TestNewRecordContentDurableBeforeItsName(t *testing.T) {
	root := t.TempDir()
	c, err := New(root)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(root, "a", "state")
	var mu sync.Mutex
	var order []string
	c.Fsync = func(p string) error {
		_, err := os.Stat(path)
		mu.Lock()
		order = append(order, filepath.Base(p)+map[bool]string{true: " (name visible)", false: " (name absent)"}[err == nil])
		mu.Unlock()
		return syncFile(p)
	}
	if err := c.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	putDurably(t, c, path, "v1")
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the new record is not under its name once durable: %v", err)
	}
	if err := c.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	// The round that makes the new directory may come first (the
	// machine's load decides): the journal's last fsync before the
	// record's own is the one that held it.
	first := slices.IndexFunc(order, func(o string) bool { return strings.HasPrefix(o, ".state.new ") || strings.HasPrefix(o, "state ") })
	if first < 1 || !strings.HasPrefix(order[first-1], journalPrefix) || !strings.HasSuffix(order[first-1], "(name absent)") {
		t.Fatalf("fsyncs %v: want the journal's before the record's name exists, then the record's", order)
	}
	if b, _, err := ReadRecord(root, path); err != nil || string(b) != "v1" {
		t.Fatalf("read back %q, %v", b, err)
	}
	if names, _, err := journals(root); err != nil || len(names) != 0 {
		t.Fatalf("journals after a checkpoint: %v, %v", names, err)
	}
}

// Every directory the Committer makes is committed by the checkpoint with
// its parent's fsync, up to the root (which it never makes).
func TestMkdirAllCommitsEveryNewDirectory(t *testing.T) {
	root := t.TempDir()
	c, err := New(root)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	synced := map[string]bool{}
	c.Fsync = func(p string) error {
		mu.Lock()
		synced[p] = true
		mu.Unlock()
		return syncFile(p)
	}
	leaf := filepath.Join(root, "csi", "t", "n", "volumes", "v")
	if err := c.MkdirAll(leaf, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := c.Checkpoint(context.Background()); err != nil {
		t.Fatal(err)
	}
	for d := filepath.Dir(leaf); ; d = filepath.Dir(d) {
		if !synced[d] {
			t.Errorf("%s not fsynced: the entry of the directory made in it may be lost", d)
		}
		if d == root {
			break
		}
	}
	if err := c.MkdirAll(filepath.Join(filepath.Dir(root), "elsewhere"), 0o700); err == nil {
		t.Error("MkdirAll outside the root succeeded")
	}
}

// A valid frame copied into another record's file is not read as that
// record's version: ErrCorrupt (ErrForeign), and the next Put replaces the
// file whole.
func TestForeignFrameIsCorrupt(t *testing.T) {
	root := t.TempDir()
	c, err := New(root)
	if err != nil {
		t.Fatal(err)
	}
	a, b := filepath.Join(root, "c1", "volumes.state"), filepath.Join(root, "c2", "volumes.state")
	for _, p := range []string{a, b} {
		if err := c.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		putDurably(t, c, p, "record of "+filepath.Base(filepath.Dir(p)))
	}
	data, err := os.ReadFile(a)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(b, data, 0o600); err != nil { // an operator's cp
		t.Fatal(err)
	}
	_, _, err = ReadRecord(root, b)
	if !errors.Is(err, ErrCorrupt) || !errors.Is(err, ErrForeign) || !strings.Contains(err.Error(), "c1/volumes.state") {
		t.Fatalf("reading a copied record: %v; want ErrCorrupt naming c1's record", err)
	}
	// A fresh Committer (a restart) replaces it whole.
	c2, err := New(root)
	if err != nil {
		t.Fatal(err)
	}
	putDurably(t, c2, b, "c2 again")
	if got, _, err := ReadRecord(root, b); err != nil || string(got) != "c2 again" {
		t.Fatalf("after a put: %q, %v", got, err)
	}
}

// A root removed or replaced under a running Committer stops every later
// change with ErrRootReplaced: nothing is written into the new tree and
// no change made after is acknowledged.
func TestRootReplacedStopsAcknowledging(t *testing.T) {
	for _, tc := range []struct {
		name    string
		replace func(root string) error
	}{
		{"removed", os.RemoveAll},
		{"renamed and recreated", func(root string) error {
			if err := os.Rename(root, root+".old"); err != nil {
				return err
			}
			return os.Mkdir(root, 0o700)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "work")
			if err := MkdirAll(root, 0o700); err != nil {
				t.Fatal(err)
			}
			c, err := New(root)
			if err != nil {
				t.Fatal(err)
			}
			rec := filepath.Join(root, "c1", "volumes.state")
			if err := c.MkdirAll(filepath.Dir(rec), 0o700); err != nil {
				t.Fatal(err)
			}
			putDurably(t, c, rec, "v1")
			if err := tc.replace(root); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Put(filepath.Join(root, "c2", "volumes.state"), []byte("x"), 0o600); !errors.Is(err, ErrRootReplaced) {
				t.Fatalf("a new record after the root was replaced: %v; want ErrRootReplaced", err)
			}
			if err := c.MkdirAll(filepath.Join(root, "c2"), 0o700); !errors.Is(err, ErrRootReplaced) {
				t.Fatalf("a new directory after the root was replaced: %v; want ErrRootReplaced", err)
			}
			if _, err := c.Put(rec, []byte("v2"), 0o600); !errors.Is(err, ErrRootReplaced) {
				t.Fatalf("a later put: %v; want ErrRootReplaced", err)
			}
			if _, err := os.Stat(filepath.Join(root, "c2")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("a new tree was written into the replaced root: %v", err)
			}
		})
	}
}
