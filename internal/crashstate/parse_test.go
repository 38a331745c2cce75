package crashstate

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

const helperEnv = "CRASHSTATE_HELPER_ROOT"

const helperWorkers = 3

// TestHelperProcess is the traced workload of TestParseStrace; it does
// nothing unless run by it.
func TestHelperProcess(t *testing.T) {
	root := os.Getenv(helperEnv)
	if root == "" {
		t.Skip("helper process of TestParseStrace")
	}
	unix.Umask(0o022)
	var wg sync.WaitGroup
	errs := make([]error, helperWorkers)
	for i := range helperWorkers {
		wg.Go(func() { errs[i] = helperWork(filepath.Join(root, fmt.Sprintf("w%d", i)), i) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// helperWork does, in dir: mkdir, create "g", create and write and fsync
// "f", rename it over "g", fsync the directory, create and unlink "x",
// pwrite and ftruncate the renamed file, mark.
func helperWork(dir string, i int) error {
	if err := os.Mkdir(dir, 0o750); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "g"), []byte("other"), 0o644); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(dir, "f"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o640)
	if err != nil {
		return err
	}
	defer f.Close()
	if _, err := f.Write([]byte("hello \"world\"\n\x00\xff")); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := os.Rename(filepath.Join(dir, "f"), filepath.Join(dir, "g")); err != nil {
		return err
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "x"), nil, 0o600); err != nil {
		return err
	}
	if err := unix.Unlink(filepath.Join(dir, "x")); err != nil {
		return err
	}
	if _, err := unix.Pwrite(int(f.Fd()), []byte("PW"), 2); err != nil {
		return err
	}
	if err := unix.Ftruncate(int(f.Fd()), 9); err != nil {
		return err
	}
	Mark(fmt.Sprintf("done %d/%d", i, helperWorkers))
	return nil
}

func TestParseStrace(t *testing.T) {
	if _, err := exec.LookPath("strace"); err != nil {
		t.Fatalf("strace is not installed (make deps installs Debian's strace): %v", err)
	}
	tmp := t.TempDir()
	root := filepath.Join(tmp, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	init, err := Snapshot(root)
	if err != nil {
		t.Fatal(err)
	}
	log := filepath.Join(tmp, "strace.log")
	args := append(StraceArgs(log), os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd := exec.Command("strace", args...)
	cmd.Env = append(os.Environ(), helperEnv+"="+root)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("strace: %v\n%s", err, out)
	}
	f, err := os.Open(log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	tr, err := Parse(f, root)
	if err != nil {
		t.Fatal(err)
	}

	want := []string{
		"mkdir w",
		"open w/g create trunc",
		"write w/g \"other\" at -1",
		"open w/f create trunc",
		"write w/f \"hello \\\"world\\\"\\n\\x00\\xff\" at -1",
		"fsync w/f",
		"rename w/f w/g",
		"open w readonly",
		"fsync w",
		"open w/x create trunc",
		`write w/x "" at -1`,
		"remove w/x",
		"write w/g \"PW\" at 2",
		"truncate w/g 9",
	}
	for i := range helperWorkers {
		w := fmt.Sprintf("w%d", i)
		var got []string
		for _, op := range tr.Ops {
			if op.Path == w || strings.HasPrefix(op.Path, w+"/") {
				got = append(got, strings.ReplaceAll(summary(op), w, "w"))
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("ops of %s:\n%s\nwant:\n%s", w, strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
	var marks []string
	for _, m := range tr.Markers {
		marks = append(marks, m.Text)
		if m.Op < 12 || m.Op > len(tr.Ops) {
			t.Errorf("marker %q at op %d, want in [12, %d]", m.Text, m.Op, len(tr.Ops))
		}
	}
	slices.Sort(marks)
	if want := []string{"done 0/3", "done 1/3", "done 2/3"}; !slices.Equal(marks, want) {
		t.Errorf("markers %q, want %q", marks, want)
	}

	// The model's current tree is the tree strace saw being made.
	cur, err := tr.Current(init, len(tr.Ops))
	if err != nil {
		t.Fatal(err)
	}
	after, err := Snapshot(root)
	if err != nil {
		t.Fatal(err)
	}
	if !cur.Equal(after) {
		t.Errorf("model after the trace:\n%s\nsnapshot:\n%s", cur, after)
	}
}

// summary prints the fields of op that matter for its kind.
func summary(op Op) string {
	switch op.Kind {
	case OpOpen:
		s := "open " + op.Path
		if op.Create {
			s += " create"
		}
		if op.Trunc {
			s += " trunc"
		}
		if op.Append {
			s += " append"
		}
		if op.ReadOnly {
			s += " readonly"
		}
		return s
	case OpWrite:
		return fmt.Sprintf("write %s %s at %d", op.Path, quoteHex(op.Data), op.Offset)
	case OpTruncate:
		return fmt.Sprintf("truncate %s %d", op.Path, op.Size)
	case OpRename, OpLink:
		return fmt.Sprintf("%v %s %s", op.Kind, op.Path, op.NewPath)
	}
	return fmt.Sprintf("%v %s", op.Kind, op.Path)
}

func quoteHex(b []byte) string {
	return strings.ReplaceAll(fmt.Sprintf("%+q", b), `\u00ff`, `\xff`)
}

func parseLog(t *testing.T, root string, lines ...string) (*Trace, error) {
	t.Helper()
	return Parse(strings.NewReader(strings.Join(lines, "\n")+"\n"), root)
}

func TestParseLines(t *testing.T) {
	tr, err := parseLog(t, "/r",
		`10  openat(AT_FDCWD</home>, "/r/a", O_WRONLY|O_CREAT|O_APPEND, 0666 <unfinished ...>`,
		`11  mkdirat(AT_FDCWD</home>, "/r/d", 0777) = 0`,
		`10  <... openat resumed>) = 3</r/a>`,
		`10  write(3</r/a>, "\x61\142\n", 3) = 2`,
		`11  unlinkat(AT_FDCWD</r>, "gone", 0) = -1 ENOENT (No such file or directory)`,
		`11  faccessat(AT_FDCWD</>, "/csiagent-crash-marker/step%201", F_OK) = -1 ENOENT (No such file or directory)`,
		`[pid    11] renameat2(AT_FDCWD</r>, "d", 5</r>, "e", RENAME_NOREPLACE) = 0`,
		`11  write(3</r/x\x20y>(deleted), "zz", 2) = 2`,
		`11  rename("/r/e", "/elsewhere/e") = 0`,
		`11  openat(AT_FDCWD</home>, "/r/a", O_RDONLY|O_CLOEXEC) = 4</r/a>`,
		`11  write(1</dev/pts/0>, "out", 3) = 3`,
		`11  umask(077) = 022`,
		`11  symlinkat("t", AT_FDCWD</r>, "s") = 0`,
		`11  mkdir("m", 0777) = 0`,
		`11  pwritev2(3</r/a>, [{iov_base="ab", iov_len=2}, {iov_base="c", iov_len=1}], 2, -1, RWF_APPEND) = 3`,
		`11  sync() = 0`,
		`11  dup2(3</r/a>, 1) = 1</r/a>`,
		`11  fcntl(3</r/a>, F_GETFL) = 0x8001 (flags O_WRONLY|O_LARGEFILE)`,
		`11  chdir("/r/m") = 0`,
		`11  mkdir("n", 0777) = 0`,
		`11  copy_file_range(3</r/a>, NULL, 4</tmp/b>, NULL, 65536, 0) = 10`,
		`11  syscall_0x189(0x7f, [0x2`,
		`12  unlinkat(AT_FDCWD</r>, "/r/m", AT_REMOVEDIR <detached ...>`,
		`11  +++ exited with 0 +++`,
	)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, op := range tr.Ops {
		got = append(got, summary(op))
	}
	want := []string{
		"mkdir d",
		"open a create append",
		`write a "ab" at -1`,
		"rename d e",
		`write x y "zz" at -1`,
		"remove e",
		"open a readonly",
		"symlink s",
		"mkdir m",
		`write a "abc" at -1`,
		"sync ",
		"dup a",
		"mkdir m/n",
	}
	if !slices.Equal(got, want) {
		t.Errorf("ops:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if len(tr.Ops) == len(want) {
		if op := tr.Ops[0]; op.Mode != 0o755 || op.Line != 2 {
			t.Errorf("mkdir mode %v line %d, want 0755 (umask 022) line 2", op.Mode, op.Line)
		}
		if op := tr.Ops[1]; op.Mode != 0o644 || op.Line != 3 || op.Fd != 3 {
			t.Errorf("open mode %v line %d fd %d, want 0644 line 3 fd 3", op.Mode, op.Line, op.Fd)
		}
		if !tr.Ops[3].NoReplace || !tr.Ops[4].Deleted || !tr.Ops[6].ReadOnly || !tr.Ops[9].Append {
			t.Errorf("flags lost: %v %v %v %v", tr.Ops[3], tr.Ops[4], tr.Ops[6], tr.Ops[9])
		}
		if op := tr.Ops[8]; op.Mode != 0o700 {
			t.Errorf("mkdir after umask 077: mode %v", op.Mode)
		}
	}
	if want := []Marker{{Text: "step 1", Op: 3}}; !slices.Equal(tr.Markers, want) {
		t.Errorf("markers %v, want %v", tr.Markers, want)
	}
}

func TestParseErrors(t *testing.T) {
	for name, line := range map[string]string{
		"truncated":     `1  write(3</r/a>, "\x61\x62"..., 100) = 100`,
		"into the root": `1  rename("/tmp/x", "/r/x") = 0`,
		"no -y":         `1  write(3, "ab", 2) = 2`,
		"resumed alone": `1  <... write resumed>) = 2`,
		"tmpfile":       `1  openat(AT_FDCWD</>, "/r", O_RDWR|O_TMPFILE, 0600) = 3</r/#12 (deleted)>`,
		"relative":      `1  mkdir("m", 0777) = 0`,
		"copy":          `1  copy_file_range(3</tmp/a>, NULL, 4</r/b>, NULL, 65536, 0) = 10`,
	} {
		if _, err := parseLog(t, "/r", line); err == nil {
			t.Errorf("%s: Parse(%s) succeeded", name, line)
		}
	}
}
