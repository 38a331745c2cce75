package atomicfile

import (
	"os"
	"path/filepath"
	"testing"
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
