package atomicfile

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// Frames round-trip; any change of a byte is detected.
func TestRecordFrameDetectsDamage(t *testing.T) {
	f := frame(7, "csi/t/n/volumes/v/volume.state", []byte(`{"state":"PUBLISHED"}`), 2*pageSize)
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
	f := frame(1, path, []byte("x"), pageSize)
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
		switch {
		case i%17 == 0:
			size = maxSlot + 100 // a version filling a file of its own
		case i%5 == 0:
			size = rng.IntN(5 * pageSize) // slots of 4, 8, 16 or 32 KiB
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
	img := make([]byte, 2*pageSize)
	copy(img, frame(1, path, []byte("one"), pageSize))
	copy(img[pageSize:], frame(2, path, []byte("two"), pageSize))
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

// A record of a few KiB takes its new versions in place, in slots sized
// for it, as a small one does (before, any version over 4 KiB replaced
// the file whole, with two fsyncs); only a version that outgrows the
// file's slots replaces it, and the slots do not shrink.
func TestRecordSlotsSizedToTheRecord(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state")
	var c Committer
	put := func(size int) {
		t.Helper()
		payload := strings.Repeat("x", size)
		putDurably(t, &c, path, payload)
		if b, _, err := ReadRecord("", path); err != nil || string(b) != payload {
			t.Fatalf("read back %d bytes, %v; want %d", len(b), err, size)
		}
	}
	inode := func() uint64 {
		t.Helper()
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return st.Sys().(*syscall.Stat_t).Ino
	}
	put(4300) // a container with ten volumes, made with them
	first := inode()
	for i := range 20 {
		put(4000 + 150*i) // up to 6850 bytes: within 8 KiB slots
	}
	if ino, fsyncs := inode(), c.fsyncs.Load(); ino != first || fsyncs > 25 {
		t.Errorf("after 20 versions of 4-7 KiB: inode %d (was %d), %d fsyncs; want them in place", ino, first, fsyncs)
	}
	if st, _ := os.Stat(path); st.Size() > 3*8192 {
		t.Errorf("the file is %d bytes, more than three 8 KiB slots", st.Size())
	}
	put(20000) // outgrows its slots: replaced with 32 KiB ones
	grown := inode()
	if grown == first {
		t.Error("a version larger than the file's slots was written into them")
	}
	put(100)
	put(30000)
	if inode() != grown {
		t.Error("versions within the grown slots replaced the file")
	}
	put(maxSlot + 1) // a file of its own
	put(10)
}

// frameV2 is a frame of the previous format ("CSR2": 4 KiB slots, no
// slot size).
func frameV2(gen uint64, id string, payload []byte) []byte {
	b := frame(gen, id, payload, pageSize)
	b = append(b[:22:22], b[23:]...)
	copy(b, csr2Magic)
	binary.LittleEndian.PutUint32(b[16:], frameCRC(b))
	return b
}

// Files of the previous format (4 KiB slots; a larger version filling the
// file) are read, and take new versions; a frame found where its own slot
// size has no slot is not a version.
func TestRecordReadsPreviousFormat(t *testing.T) {
	dir := t.TempDir()
	slotted, large := filepath.Join(dir, "slotted"), filepath.Join(dir, "large")
	img := make([]byte, pageSize+100)
	copy(img, frameV2(1, slotted, []byte("one")))
	copy(img[pageSize:], frameV2(2, slotted, []byte("two")))
	if err := os.WriteFile(slotted, img, 0o600); err != nil {
		t.Fatal(err)
	}
	big := strings.Repeat("b", 6000)
	if err := os.WriteFile(large, frameV2(5, large, []byte(big)), 0o600); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]string{slotted: "two", large: big} {
		if b, legacy, err := ReadRecord("", path); err != nil || legacy || string(b) != want {
			t.Fatalf("%s: read %d bytes %v %v", path, len(b), legacy, err)
		}
	}
	var c Committer
	for path, want := range map[string]string{slotted: "three", large: "small now"} {
		putDurably(t, &c, path, want)
		if b, _, err := ReadRecord("", path); err != nil || string(b) != want {
			t.Fatalf("%s after a put: %q %v", path, b, err)
		}
	}
	if vs, _, _ := versions(mustRead(t, slotted), slotted); len(vs) != 2 || vs[0].slot != 0 || vs[1].slot != 1 {
		t.Errorf("the previous format's file after a put holds %+v, want the new version in slot 0 beside the durable one in its 4 KiB slot 1", vs)
	}
	// An 8 KiB-slot frame at 4 KiB is at no slot of its file.
	odd := filepath.Join(dir, "odd")
	img = make([]byte, pageSize)
	copy(img, frame(1, odd, []byte("one"), 2*pageSize))
	img = append(img, frame(9, odd, []byte("misplaced"), 2*pageSize)...)
	if err := os.WriteFile(odd, img, 0o600); err != nil {
		t.Fatal(err)
	}
	if b, _, err := ReadRecord("", odd); err != nil || string(b) != "one" {
		t.Errorf("a frame off its slot grid: read %q %v, want one", b, err)
	}
}
