package proclog

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// writerEnv makes the test binary a log-writing child (see runWriter): it
// writes the given number of numbered lines to stdout, one write per line.
const writerEnv = "PROCLOG_TEST_WRITER_LINES"

// lineLen is the length of each line runWriter writes, newline included.
const lineLen = 100

func TestMain(m *testing.M) {
	if n := os.Getenv(writerEnv); n != "" {
		os.Exit(runWriter(n))
	}
	os.Exit(m.Run())
}

func runWriter(n string) int {
	lines, err := strconv.Atoi(n)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	pad := strings.Repeat("x", lineLen-len("00000000 \n"))
	for i := range lines {
		if _, err := fmt.Fprintf(os.Stdout, "%08d %s\n", i, pad); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	}
	return 0
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o640); err != nil {
		t.Fatal(err)
	}
}

// readOrMissing returns the file's content, or "<missing>".
func readOrMissing(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "<missing>"
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestOpen(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "logs", "plugin", "x.stderr.log")

	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("one\n"); err != nil {
		t.Fatal(err)
	}
	f.Close()

	for _, c := range []struct {
		path string
		max  fs.FileMode
	}{{filepath.Join(dir, "logs"), 0o750}, {filepath.Dir(path), 0o750}, {path, 0o640}} {
		st, err := os.Stat(c.path)
		if err != nil {
			t.Fatal(err)
		}
		if perm := st.Mode().Perm(); perm&^c.max != 0 {
			t.Errorf("%s: mode %v, want at most %v", c.path, perm, c.max)
		}
	}
	// Reopening appends; two descriptors both write at the end.
	a, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	fl, err := unix.FcntlInt(a.Fd(), unix.F_GETFD, 0)
	if err != nil || fl&unix.FD_CLOEXEC == 0 {
		t.Errorf("F_GETFD = %#x, %v: want FD_CLOEXEC", fl, err)
	}
	for _, w := range []struct {
		f *os.File
		s string
	}{{a, "two\n"}, {b, "three\n"}, {a, "four\n"}} {
		if _, err := w.f.WriteString(w.s); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := readOrMissing(t, path), "one\ntwo\nthree\nfour\n"; got != want {
		t.Errorf("content %q, want %q", got, want)
	}
}

func TestOpenError(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "file"), "")
	if _, err := Open(filepath.Join(dir, "file", "x.log")); err == nil {
		t.Fatal("Open under a regular file succeeded")
	}
}

func TestRotate(t *testing.T) {
	tests := []struct {
		name     string
		existing map[string]string // suffix ("" is the log itself) -> content
		maxBytes int64
		keep     int
		want     bool
		after    map[string]string // suffix -> content or "<missing>"
	}{
		{
			name:     "missing file",
			maxBytes: 1, keep: 3,
			after: map[string]string{"": "<missing>", ".1": "<missing>"},
		},
		{
			name:     "at the cap",
			existing: map[string]string{"": "0123456789"},
			maxBytes: 10, keep: 3,
			after: map[string]string{"": "0123456789", ".1": "<missing>"},
		},
		{
			name:     "first rotation",
			existing: map[string]string{"": "0123456789A"},
			maxBytes: 10, keep: 3, want: true,
			after: map[string]string{"": "", ".1": "0123456789A", ".2": "<missing>"},
		},
		{
			name:     "shift keeps at most keep copies",
			existing: map[string]string{"": "gen4 ...", ".1": "gen3", ".2": "gen2", ".3": "gen1"},
			maxBytes: 4, keep: 3, want: true,
			after: map[string]string{"": "", ".1": "gen4 ...", ".2": "gen3", ".3": "gen2", ".4": "<missing>"},
		},
		{
			name:     "gap in the copies",
			existing: map[string]string{"": "gen3 ...", ".2": "gen1"},
			maxBytes: 4, keep: 3, want: true,
			after: map[string]string{"": "", ".1": "gen3 ...", ".2": "<missing>", ".3": "gen1"},
		},
		{
			name:     "keep 1",
			existing: map[string]string{"": "gen2 ...", ".1": "gen1"},
			maxBytes: 4, keep: 1, want: true,
			after: map[string]string{"": "", ".1": "gen2 ...", ".2": "<missing>"},
		},
		{
			name:     "keep 0 discards",
			existing: map[string]string{"": "gen3 ...", ".1": "gen2", ".2": "gen1"},
			maxBytes: 4, keep: 0, want: true,
			after: map[string]string{"": "", ".1": "<missing>", ".2": "<missing>"},
		},
		{
			name:     "smaller keep removes the surplus",
			existing: map[string]string{"": "gen6 ...", ".1": "gen5", ".2": "gen4", ".3": "gen3", ".4": "gen2", ".5": "gen1"},
			maxBytes: 4, keep: 2, want: true,
			after: map[string]string{"": "", ".1": "gen6 ...", ".2": "gen5", ".3": "<missing>", ".4": "<missing>", ".5": "<missing>"},
		},
		{
			name:     "under the cap leaves old copies alone",
			existing: map[string]string{"": "abc", ".1": "gen2", ".5": "gen1"},
			maxBytes: 4, keep: 2,
			after: map[string]string{"": "abc", ".1": "gen2", ".5": "gen1"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "p.log")
			for suffix, content := range tt.existing {
				writeFile(t, path+suffix, content)
			}
			got, err := Rotate(path, tt.maxBytes, tt.keep)
			if err != nil {
				t.Fatal(err)
			}
			if got != tt.want {
				t.Errorf("rotated = %v, want %v", got, tt.want)
			}
			for suffix, want := range tt.after {
				if got := readOrMissing(t, path+suffix); got != want {
					t.Errorf("%s: %q, want %q", "p.log"+suffix, got, want)
				}
			}
			if _, err := os.Stat(path + ".1.tmp"); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("temporary copy left behind: %v", err)
			}
		})
	}
}

func TestRotateInvalid(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.log")
	writeFile(t, path, "0123456789")
	for _, c := range []struct {
		maxBytes int64
		keep     int
	}{{0, 1}, {-1, 1}, {1, -1}} {
		t.Run(fmt.Sprintf("max%d_keep%d", c.maxBytes, c.keep), func(t *testing.T) {
			_, err := Rotate(path, c.maxBytes, c.keep)
			if !errors.Is(err, ErrInvalidArgument) {
				t.Fatalf("err = %v, want ErrInvalidArgument", err)
			}
		})
	}
}

// TestRotateAppendsAtNewEnd checks the point of O_APPEND: after the
// truncation, a write through the descriptor from Open lands at offset 0,
// not at the old offset (which would leave a sparse hole of the old size).
func TestRotateAppendsAtNewEnd(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.log")
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(strings.Repeat("a", 4096) + "\n"); err != nil {
		t.Fatal(err)
	}
	if ok, err := Rotate(path, 1024, 2); err != nil || !ok {
		t.Fatalf("Rotate = %v, %v; want true", ok, err)
	}
	if _, err := f.WriteString("next\n"); err != nil {
		t.Fatal(err)
	}
	if got := readOrMissing(t, path); got != "next\n" {
		t.Errorf("after rotation the log holds %d bytes %.20q..., want %q", len(got), got, "next\n")
	}
}

// TestRotateLocked checks that a Rotate that finds the lock held by another
// rotator reports nothing rotated and touches nothing.
func TestRotateLocked(t *testing.T) {
	path := filepath.Join(t.TempDir(), "p.log")
	writeFile(t, path, "0123456789")
	other, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := unix.Flock(int(other.Fd()), unix.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	ok, err := Rotate(path, 5, 2)
	if err != nil || ok {
		t.Fatalf("Rotate while locked = %v, %v; want false, nil", ok, err)
	}
	if got := readOrMissing(t, path); got != "0123456789" {
		t.Errorf("log changed to %q", got)
	}
	if got := readOrMissing(t, path+".1"); got != "<missing>" {
		t.Errorf("p.log.1 = %q, want missing", got)
	}
	if err := unix.Flock(int(other.Fd()), unix.LOCK_UN); err != nil {
		t.Fatal(err)
	}
	if ok, err := Rotate(path, 5, 2); err != nil || !ok {
		t.Fatalf("Rotate after unlock = %v, %v; want true", ok, err)
	}
}

// TestRotateWhileChildWrites rotates as fast as it can while a real child
// process (this test binary, see runWriter) writes numbered lines straight
// into the log through a descriptor from Open, the way a plugin does. With
// a keep larger than the number of rotations nothing is dropped by keep, so
// the lines lost to copytruncate can be counted.
func TestRotateWhileChildWrites(t *testing.T) {
	for _, keep := range []int{3, 1000} {
		t.Run(fmt.Sprintf("keep%d", keep), func(t *testing.T) {
			t.Parallel()
			testRotateWhileChildWrites(t, keep)
		})
	}
}

func testRotateWhileChildWrites(t *testing.T, keep int) {
	const (
		lines    = 10000 // 1 MB at lineLen bytes a line
		maxBytes = 32 << 10
	)
	path := filepath.Join(t.TempDir(), "logs", "child.stdout.log")
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	// GORACE: a -race binary otherwise sleeps a second before it exits.
	cmd.Env = append(os.Environ(), writerEnv+"="+strconv.Itoa(lines), "GORACE=atexit_sleep_ms=0")
	cmd.Stdout = f
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	f.Close() // the child has its own copy, as a plugin does
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()

	rotations := 0
	sizeNow := func() int64 {
		st, err := os.Stat(path)
		if err != nil {
			t.Fatal(err)
		}
		return st.Size()
	}
loop:
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("writer: %v\n%s", err, stderr.Bytes())
			}
			break loop
		default:
		}
		ok, err := Rotate(path, maxBytes, keep)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			// How big the log is right after a rotation depends on how
			// long this goroutine is descheduled: only checked below,
			// once the child has exited.
			rotations++
		}
	}
	concurrent := rotations
	if ok, err := Rotate(path, maxBytes, keep); err != nil {
		t.Fatal(err)
	} else if ok {
		rotations++
	}
	if rotations == 0 {
		t.Fatalf("no rotation of a log of %d bytes", lines*lineLen)
	}
	t.Logf("%d of %d rotations while the child wrote", concurrent, rotations)
	if size := sizeNow(); size > maxBytes {
		t.Errorf("after the child exited and a last rotation the log holds %d bytes, want <= %d", size, maxBytes)
	}

	// At most keep copies, and oldest to newest the lines are in order
	// with no duplicate: lines may be lost at each rotation, never reordered.
	var files []string
	for n := keep + 3; n >= 1; n-- {
		name := rotatedName(path, n)
		if _, err := os.Stat(name); err == nil {
			if n > keep {
				t.Errorf("%s exists with keep %d", filepath.Base(name), keep)
			}
			files = append(files, name)
		}
	}
	if want := min(rotations, keep); len(files) != want {
		t.Errorf("%d rotated copies after %d rotations with keep %d, want %d", len(files), rotations, keep, want)
	}
	// A file is only rotated when it is over the cap, and only Rotate
	// shrinks it: every copy holds more than maxBytes.
	for _, name := range files {
		if st, err := os.Stat(name); err != nil {
			t.Fatal(err)
		} else if st.Size() <= maxBytes {
			t.Errorf("%s holds %d bytes, want more than %d", filepath.Base(name), st.Size(), maxBytes)
		}
	}
	files = append(files, path)
	last, seen := -1, 0
	for _, name := range files {
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(bytes.NewReader(b))
		for sc.Scan() {
			line := sc.Text()
			if strings.ContainsRune(line, 0) {
				t.Fatalf("%s: NUL bytes: the child wrote at its old offset after a truncation", filepath.Base(name))
			}
			if len(line) != lineLen-1 {
				continue // cut by the copy racing a write
			}
			n, err := strconv.Atoi(line[:8])
			if err != nil {
				t.Fatalf("%s: bad line %q", filepath.Base(name), line)
			}
			if n <= last {
				t.Fatalf("%s: line %d after line %d", filepath.Base(name), n, last)
			}
			last = n
			seen++
		}
	}
	// How many lines are lost (and whether the last ones are among them)
	// depends on scheduling: the copytruncate window is only narrow if
	// this process is not preempted inside it. So it is logged, not
	// checked.
	if rotations <= keep {
		t.Logf("%d rotations lost %d of %d lines; last line seen %d", rotations, lines-seen, lines, last)
	} else {
		t.Logf("%d rotations; the last %d copies and the log hold %d of %d lines", rotations, len(files)-1, seen, lines)
	}
}
