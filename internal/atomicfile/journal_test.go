package atomicfile

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/bootid"
)

// newCommitter is a Committer of a new root.
func newCommitter(t *testing.T) (string, *Committer) {
	t.Helper()
	root := t.TempDir()
	c, err := New(root)
	if err != nil {
		t.Fatal(err)
	}
	return root, c
}

// journalFiles returns the journals' contents in root.
func journalFiles(t *testing.T, root string) map[string][]byte {
	t.Helper()
	names, _, err := journals(root)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			t.Fatal(err)
		}
		out[n] = b
	}
	return out
}

// rebooted is the boot after a simulated power cut.
const rebooted = "the boot after the power cut"

// powerCutKeepingJournals leaves root as a power cut that kept only the
// journals can: every record file and directory made since is gone (the
// next Open is on another boot: rebooted).
func powerCutKeepingJournals(t *testing.T, root string) {
	t.Helper()
	js := journalFiles(t, root)
	if len(js) == 0 {
		t.Fatal("no journal to keep")
	}
	des, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, de := range des {
		if de.Name() == bootFile { // durable before any journal
			continue
		}
		if err := os.RemoveAll(filepath.Join(root, de.Name())); err != nil {
			t.Fatal(err)
		}
	}
	for n, b := range js {
		if err := os.WriteFile(n, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

func readString(t *testing.T, root, path string) string {
	t.Helper()
	b, _, err := ReadRecord(root, path)
	if err != nil {
		t.Fatalf("reading %s: %v", path, err)
	}
	return string(b)
}

// What was acknowledged survives a power cut that kept the journal alone:
// versions, removals, a record removed and made again, directories made;
// the replay leaves no journal behind, and a restart after it finds the
// same.
func TestReplayRestoresAcknowledgedChanges(t *testing.T) {
	root, c := newCommitter(t)
	a, b, again := filepath.Join(root, "x", "a"), filepath.Join(root, "x", "b"), filepath.Join(root, "y", "again")
	empty := filepath.Join(root, "z", "empty")
	for _, d := range []string{filepath.Dir(a), filepath.Dir(again), empty} {
		if err := c.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	putDurably(t, c, a, "a1")
	putDurably(t, c, a, "a2")
	putDurably(t, c, b, "b1")
	putDurably(t, c, again, "first life")
	putDurably(t, c, again, "first life, v2")
	for _, p := range []string{b, again} {
		n, err := c.Remove(p)
		if err == nil {
			err = c.Wait(context.Background(), n)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	putDurably(t, c, again, "second life")
	// The first life's last version comes back with the power cut (its
	// removal and the new file were not durable in the directory).
	powerCutKeepingJournals(t, root)
	if err := os.MkdirAll(filepath.Dir(again), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(again, frame(2, Identity(root, again), []byte("first life, v2"), pageSize), 0o600); err != nil {
		t.Fatal(err)
	}

	for i := range 2 { // the replay, then a restart with nothing to replay
		if _, err := Open(root, rebooted); err != nil {
			t.Fatal(err)
		}
		if got := readString(t, root, a); got != "a2" {
			t.Errorf("start %d: a = %q, want a2", i, got)
		}
		if _, _, err := ReadRecord(root, b); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("start %d: b, removed: %v", i, err)
		}
		if got := readString(t, root, again); got != "second life" {
			t.Errorf("start %d: again = %q, want its second life", i, got)
		}
		if st, err := os.Stat(empty); err != nil || !st.IsDir() {
			t.Errorf("start %d: the directory made is not back: %v", i, err)
		}
		if js := journalFiles(t, root); len(js) != 0 {
			t.Errorf("start %d: journals left after the replay: %d", i, len(js))
		}
	}
}

// A torn append ends the journal: the entries before it are replayed,
// nothing after it (never acknowledged).
func TestReplayStopsAtATornEntry(t *testing.T) {
	root, c := newCommitter(t)
	p, q := filepath.Join(root, "p"), filepath.Join(root, "q")
	putDurably(t, c, p, "p1")
	js := journalFiles(t, root)
	putDurably(t, c, p, "p2")
	putDurably(t, c, q, "q1")
	for n, before := range js {
		b, err := os.ReadFile(n)
		if err != nil {
			t.Fatal(err)
		}
		// p2's entry torn (a sector of zeros in it), q1's intact after it.
		torn := append([]byte{}, b...)
		for i := len(before) + 25; i < len(before)+30; i++ {
			torn[i] = 0
		}
		powerCutKeepingJournals(t, root)
		if err := os.WriteFile(n, torn, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := Open(root, rebooted); err != nil {
		t.Fatal(err)
	}
	if got := readString(t, root, p); got != "p1" {
		t.Errorf("p = %q, want p1 (p2's entry is torn)", got)
	}
	if _, _, err := ReadRecord(root, q); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("q, after the torn entry: %v; want it never replayed", err)
	}
}

// A record file holding a newer version than the journal's (visible when
// the agent crashed, durable since: New syncs first) keeps it.
func TestReplayKeepsANewerVersion(t *testing.T) {
	root, c := newCommitter(t)
	p := filepath.Join(root, "p")
	putDurably(t, c, p, "v1")
	if _, err := c.Put(p, []byte("v2, not yet durable"), 0o600); err != nil {
		t.Fatal(err)
	}
	c2, err := New(root) // a restart after a crash of the process
	if err != nil {
		t.Fatal(err)
	}
	if got := readString(t, root, p); got != "v2, not yet durable" {
		t.Errorf("p = %q, want the newer version kept", got)
	}
	putDurably(t, c2, p, "v3")
	if got := readString(t, root, p); got != "v3" {
		t.Errorf("p = %q after a put, want v3", got)
	}
}

// Concurrent puts into distinct records share rounds: far fewer fsyncs
// than records, and none of a record file or directory before a
// checkpoint.
func TestRoundsShareOneFsync(t *testing.T) {
	root, c := newCommitter(t)
	var mu sync.Mutex
	var synced []string
	// The first fsync (the first round's) waits until every record has
	// been put: the rest then share the rounds after it, however the
	// scheduler runs the goroutines (with -race on a busy machine they
	// ran one after another, 44 fsyncs for 64 records).
	const records = 64
	var put atomic.Int32
	allPut := make(chan struct{})
	var first sync.Once
	c.Fsync = func(p string) error {
		mu.Lock()
		synced = append(synced, p)
		mu.Unlock()
		first.Do(func() {
			select {
			case <-allPut:
			case <-time.After(30 * time.Second):
				t.Error("the records were not all put within 30 s")
			}
		})
		return syncFile(p)
	}
	var wg sync.WaitGroup
	for i := range records {
		wg.Go(func() {
			d := filepath.Join(root, "r", string(rune('a'+i%26))+strings.Repeat("x", i/26))
			if err := c.MkdirAll(d, 0o700); err != nil {
				t.Error(err)
				return
			}
			n, err := c.Put(filepath.Join(d, "state"), []byte("v"), 0o600)
			if put.Add(1) == records {
				close(allPut)
			}
			if err == nil {
				err = c.Wait(context.Background(), n)
			}
			if err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	for _, p := range synced {
		if p != root && !strings.HasPrefix(filepath.Base(p), journalPrefix) {
			t.Errorf("fsynced %s before any checkpoint", p)
		}
	}
	if _, fsyncs, _ := c.Stats(); fsyncs >= records/2 {
		t.Errorf("%d fsyncs for %d records made concurrently", fsyncs, records)
	}
}

// On a full disk (the journal cannot grow) a round's changes are made
// durable in their own files, whose slots are reserved, with everything
// the journals held: the put is acknowledged, and no journal is left.
func TestFullDiskCommitsToTheFiles(t *testing.T) {
	root, c := newCommitter(t)
	p, q := filepath.Join(root, "p"), filepath.Join(root, "q")
	putDurably(t, c, p, "p1")
	var mu sync.Mutex
	synced := map[string]bool{}
	c.Fsync = func(f string) error {
		if strings.HasPrefix(filepath.Base(f), journalPrefix) {
			return unix.ENOSPC
		}
		mu.Lock()
		synced[f] = true
		mu.Unlock()
		return syncFile(f)
	}
	putDurably(t, c, q, "q1")
	mu.Lock()
	defer mu.Unlock()
	for _, f := range []string{p, q, root} {
		if !synced[f] && !synced[newName(f)] { // q: before its rename
			t.Errorf("%s not fsynced: %v", f, synced)
		}
	}
	if js := journalFiles(t, root); len(js) != 0 {
		t.Errorf("journals left: %d", len(js))
	}
	for f, want := range map[string]string{p: "p1", q: "q1"} {
		if got := readString(t, root, f); got != want {
			t.Errorf("%s = %q, want %q", f, got, want)
		}
	}
}

// A new record whose rename a cut lost, its content kept under its new
// name, is put into place by the replay: every reader finds it by its
// name (a directory listing, as the named volumes' is, too).
func TestReplayRenamesANewRecordIntoPlace(t *testing.T) {
	root, c := newCommitter(t)
	p := filepath.Join(root, "d", "p.json")
	if err := c.MkdirAll(filepath.Dir(p), 0o700); err != nil {
		t.Fatal(err)
	}
	putDurably(t, c, p, "p1")
	if err := os.Rename(p, newName(p)); err != nil { // the rename lost
		t.Fatal(err)
	}
	if _, err := Open(root, rebooted); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Fatalf("not under its name after the replay: %v", err)
	}
	if _, err := os.Stat(newName(p)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("its new name is left: %v", err)
	}
	if got := readString(t, root, p); got != "p1" {
		t.Errorf("p = %q, want p1", got)
	}
}

// A process that died (same boot: the page cache kept every change it
// made) leaves the files as the truth: a record removed, or made again
// after a journaled removal, after the journal's last entry for it stays
// as the files have it, and a lost rename is still put into place. The
// same journals after a power cut (another boot) are applied.
func TestSameBootReplayKeepsTheFiles(t *testing.T) {
	state := func(boot string) (string, string) {
		root, c := newCommitter(t)
		gone, back := filepath.Join(root, "gone"), filepath.Join(root, "back")
		putDurably(t, c, gone, "removed since")
		putDurably(t, c, back, "first life")
		n, err := c.Remove(back)
		if err == nil {
			err = c.Wait(context.Background(), n)
		}
		if err != nil {
			t.Fatal(err)
		}
		// The process's last changes, which its death kept out of the
		// journal: gone removed, back made again.
		if err := os.Remove(gone); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(back, frame(2, Identity(root, back), []byte("second life"), pageSize), 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := Open(root, boot); err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, p := range []string{gone, back} {
			b, _, err := ReadRecord(root, p)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				got = append(got, "-")
			case err != nil:
				t.Fatal(err)
			default:
				got = append(got, string(b))
			}
		}
		if js := journalFiles(t, root); len(js) != 0 {
			t.Errorf("journals left after the replay: %d", len(js))
		}
		return got[0], got[1]
	}
	bootNow, err := bootid.Current()
	if err != nil {
		t.Fatal(err)
	}
	if gone, back := state(bootNow); gone != "-" || back != "second life" {
		t.Errorf("after the process died: gone = %q, back = %q; want it removed and its second life", gone, back)
	}
	if gone, back := state(rebooted); gone != "removed since" || back != "-" {
		t.Errorf("after a power cut: gone = %q, back = %q; want the journal's: its version, and removed", gone, back)
	}
}
