package atomicfile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// Frames round-trip; any change of a byte is detected.
func TestRecordFrameDetectsDamage(t *testing.T) {
	f := frame(7, "csi/t/n/volumes/v/volume.state", []byte(`{"state":"PUBLISHED"}`))
	v, ok := parseFrame(f)
	if !ok || v.gen != 7 || string(v.payload) != `{"state":"PUBLISHED"}` || v.id != "csi/t/n/volumes/v/volume.state" {
		t.Fatalf("round trip: %+v %v", v, ok)
	}
	for i := range f {
		g := bytes.Clone(f)
		g[i] ^= 0x40
		if _, ok := parseFrame(g); ok {
			t.Errorf("a flipped byte %d went undetected", i)
		}
	}
}

// A file of the previous release (plain JSON, padded) is read whole and
// flagged; the first Put replaces it whole and durably.
func TestRecordReadsAndReplacesLegacyFiles(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state")
	if err := os.WriteFile(path, []byte(`{"a": 1}      `), 0o600); err != nil {
		t.Fatal(err)
	}
	b, legacy, err := ReadRecord("", path)
	if err != nil || !legacy || string(b) != `{"a": 1}      ` {
		t.Fatalf("legacy read: %q %v %v", b, legacy, err)
	}
	var c Committer
	if _, err := c.Put(path, []byte(`{"a": 2}`), 0o600); err != nil {
		t.Fatal(err)
	}
	b, legacy, err = ReadRecord("", path)
	if err != nil || legacy || string(b) != `{"a": 2}` {
		t.Fatalf("after put: %q %v %v", b, legacy, err)
	}
}

// A file in the record format with no valid version is reported as such.
func TestRecordAllSlotsDamaged(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state")
	f := frame(1, path, []byte("x"))
	f[len(f)-1] = 'y'
	if err := os.WriteFile(path, f, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ReadRecord("", path); err == nil || !strings.Contains(err.Error(), "torn or damaged") {
		t.Fatalf("want a damage error, got %v", err)
	}
}

// TestRecordPowerCut checks the record contract against every disk state a
// power cut can leave: each 512-byte sector holds its content at the last
// successful fsync or any content written to it since (torn writes,
// reordered write-back). After every step of a sequence of puts (small,
// large, with and without waiting for durability, while rounds run), in
// every such state the newest valid version is a complete version that was
// written, at least as new as the newest one acknowledged durable.
func TestRecordPowerCut(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state")
	var (
		mu      sync.Mutex
		durable []byte   // the file at the last successful fsync
		since   [][]byte // the file after each put since
		whole   []byte   // a whole-file replacement's temp file, fsynced
	)
	hook := func(p string) error {
		mu.Lock()
		defer mu.Unlock()
		b, _ := os.ReadFile(p)
		if err := syncFile(p); err != nil {
			return err
		}
		switch {
		case p == path:
			durable, since = b, nil
		case strings.HasPrefix(filepath.Base(p), ".state.tmp-"), filepath.Base(p) == ".state.new":
			whole = b
		case p == filepath.Dir(path) && whole != nil:
			durable, since, whole = whole, nil, nil
		}
		return nil
	}
	c := &Committer{Fsync: hook}
	written := map[uint64]string{}
	var acked uint64
	rng := rand.New(rand.NewPCG(1, 2))
	states, steps := 0, 0
	for i := 1; i <= 60; i++ {
		size := 50 + rng.IntN(3000)
		if i%17 == 0 {
			size = slotSize + 100 // a large version: replaced whole
		}
		if i%20 == 0 {
			// A restart: the file's filesystem synced (as the isolator
			// does before its first write), a new Committer reads it.
			if err := c.Sync(context.Background()); err != nil {
				t.Fatal(err)
			}
			c = &Committer{Fsync: hook}
			mu.Lock()
			durable, since = mustRead(t, path), nil
			mu.Unlock()
		}
		payload := fmt.Sprintf("v%d:%s", i, strings.Repeat(string(rune('a'+i%26)), size))
		n, err := c.Put(path, []byte(payload), 0o600)
		if err != nil {
			t.Fatal(err)
		}
		c.mu.Lock()
		gen := c.slots[path].gen
		c.mu.Unlock()
		written[gen] = payload
		cur := mustRead(t, path)
		mu.Lock()
		since = append(since, cur)
		mu.Unlock()
		if i == 1 || rng.IntN(3) == 0 {
			if err := c.Wait(context.Background(), n); err != nil {
				t.Fatal(err)
			}
			acked = gen
		}
		mu.Lock()
		images := append([][]byte{durable}, since...)
		mu.Unlock()
		steps++
		for _, disk := range cutStates(images, rng) {
			states++
			vs, _, _ := versions(disk, path)
			if acked == 0 {
				continue
			}
			if len(vs) == 0 {
				t.Fatalf("step %d: no valid version after a cut; acknowledged generation %d lost", i, acked)
			}
			if vs[0].gen < acked {
				t.Fatalf("step %d: newest valid version %d older than acknowledged %d", i, vs[0].gen, acked)
			}
			if string(vs[0].payload) != written[vs[0].gen] {
				t.Fatalf("step %d: version %d read back is not what was written", i, vs[0].gen)
			}
		}
	}
	t.Logf("record power cut: %d steps, %d disk states checked, 0 violations", steps, states)
}

// cutStates lists disk images a power cut can leave given the durable
// image and the images written since (images[0] is the durable one):
// each sector from any of them. Systematically each single sector from
// each later image over the durable one, and over the newest, then random
// mixes.
func cutStates(images [][]byte, rng *rand.Rand) [][]byte {
	const sector = 512
	size := 0
	for _, im := range images {
		size = max(size, len(im))
	}
	sectorOf := func(im []byte, s int) []byte {
		out := make([]byte, sector)
		if s*sector < len(im) {
			copy(out, im[s*sector:])
		}
		return out
	}
	build := func(pick func(s int) []byte) []byte {
		var b []byte
		for s := 0; s*sector < size; s++ {
			b = append(b, pick(s)...)
		}
		return b
	}
	base, newest := images[0], images[len(images)-1]
	out := [][]byte{base, newest}
	for k := 1; k < len(images); k++ {
		for s := 0; s*sector < size; s++ {
			out = append(out,
				build(func(x int) []byte { return sectorOf(map[bool][]byte{true: images[k], false: base}[x == s], x) }),
				build(func(x int) []byte { return sectorOf(map[bool][]byte{true: images[k], false: newest}[x == s], x) }))
		}
	}
	for range 20 {
		out = append(out, build(func(x int) []byte { return sectorOf(images[rng.IntN(len(images))], x) }))
	}
	return out
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) { // a new record, before its round
		b, err = os.ReadFile(newName(path))
	}
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A file found with several versions takes new ones while a round is in
// flight: a slot is always free (the newest found counts as durable).
func TestRecordPutsWhileRoundInFlightOnLoadedFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state")
	img := make([]byte, 2*slotSize)
	copy(img, frame(1, path, []byte("one")))
	copy(img[slotSize:], frame(2, path, []byte("two")))
	if err := os.WriteFile(path, img, 0o600); err != nil {
		t.Fatal(err)
	}
	inFsync, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	c := &Committer{Fsync: func(p string) error {
		once.Do(func() { close(inFsync); <-release })
		return syncFile(p)
	}}
	if _, err := c.Put(path, []byte("three"), 0o600); err != nil {
		t.Fatal(err)
	}
	<-inFsync
	for _, v := range []string{"four", "five"} {
		if _, err := c.Put(path, []byte(v), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	close(release)
	if err := c.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if b, _, err := ReadRecord("", path); err != nil || string(b) != "five" {
		t.Fatalf("read %q, %v; want five", b, err)
	}
}

// A failed directory fsync redoes the entries it was to commit: a file
// made in that round is written afresh (temp file, fsync, rename, fsync
// of the directory) before its change counts as durable.
func TestFailedDirectoryFsyncRedoesItsEntries(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "state")
	var mu sync.Mutex
	var dirFails, tmpSynced int
	c := &Committer{Fsync: func(p string) error {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case p == dir && dirFails == 0:
			dirFails++
			return fmt.Errorf("injected: %w", os.ErrInvalid)
		case strings.HasPrefix(filepath.Base(p), ".state.tmp-"), filepath.Base(p) == ".state.new":
			tmpSynced++
		}
		return syncFile(p)
	}}
	n, err := c.Put(path, []byte("v1"), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(context.Background(), n); err == nil {
		t.Fatal("Wait succeeded although the directory fsync failed")
	}
	waitRetried(t, c, n)
	mu.Lock()
	defer mu.Unlock()
	if tmpSynced == 0 {
		t.Error("the file was not written afresh after its directory's fsync failed")
	}
	if b, _, err := ReadRecord("", path); err != nil || string(b) != "v1" {
		t.Errorf("read %q, %v", b, err)
	}
}
