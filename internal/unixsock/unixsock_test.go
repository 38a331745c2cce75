package unixsock

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestListenModeAndStale(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("gives a socket to root's group, which needs root")
	}
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	dir := t.TempDir()
	path := filepath.Join(dir, "run", "api.sock")
	lis, err := Listen(path, Owner{GID: -1})
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, want socket 0600", fi.Mode())
	}
	di, err := os.Stat(filepath.Dir(path))
	if err != nil {
		t.Fatal(err)
	}
	if di.Mode().Perm() != 0o755 {
		t.Fatalf("socket directory made under umask 077 has mode %v, want 0755 so the API group can reach it", di.Mode().Perm())
	}
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("dialing the new socket: %v", err)
	}
	c.Close()

	if _, err := Listen(path, Owner{GID: -1}); err == nil || !strings.Contains(err.Error(), "another process is listening") {
		t.Fatalf("second Listen on a live socket: %v, want refusal", err)
	}
	ents, _ := os.ReadDir(filepath.Dir(path))
	if len(ents) != 1 {
		t.Fatalf("directory holds %d entries after a refused Listen, want the socket only", len(ents))
	}
	// A listener that dies without Close leaves a stale socket: replaced.
	lis.(*listener).UnixListener.SetUnlinkOnClose(false)
	lis.(*listener).UnixListener.Close()
	lis2, err := Listen(path, Owner{GID: 0})
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	fi, _ = os.Lstat(path)
	if fi.Mode().Perm() != 0o660 {
		t.Fatalf("group socket mode %v, want 0660", fi.Mode().Perm())
	}
	lis2.Close()
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Fatalf("Close left the socket: %v", err)
	}
}

func TestListenRefusesNonSocket(t *testing.T) {
	dir := t.TempDir()
	for name, make := range map[string]func(string) error{
		"file":    func(p string) error { return os.WriteFile(p, []byte("keep"), 0o644) },
		"dir":     func(p string) error { return os.Mkdir(p, 0o755) },
		"symlink": func(p string) error { return os.Symlink("/etc/passwd", p) },
	} {
		path := filepath.Join(dir, name)
		if err := make(path); err != nil {
			t.Fatal(err)
		}
		if _, err := Listen(path, Owner{GID: -1}); err == nil || !strings.Contains(err.Error(), "not a socket") {
			t.Fatalf("%s: Listen = %v, want a refusal naming it", name, err)
		}
		if _, err := os.Lstat(path); err != nil {
			t.Fatalf("%s was removed: %v", name, err)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(dir, "file")); string(b) != "keep" {
		t.Fatal("regular file changed")
	}
}

func TestCloseKeepsSuccessorsSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	lis, err := Listen(path, Owner{GID: -1})
	if err != nil {
		t.Fatal(err)
	}
	// A successor replaces the socket (after the first stopped answering
	// is not needed: rename over it directly).
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	lis2, err := Listen(path, Owner{GID: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer lis2.Close()
	lis.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("the old listener's Close removed its successor's socket: %v", err)
	}
}

func TestListenTooLong(t *testing.T) {
	if _, err := Listen("/tmp/"+strings.Repeat("x", 120), Owner{GID: -1}); err == nil || !strings.Contains(err.Error(), "longer than") {
		t.Fatalf("got %v", err)
	}
}

func TestMkdirAllUnderStrictUmask(t *testing.T) {
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	dir := filepath.Join(t.TempDir(), "a", "b")
	if err := MkdirAll(dir); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{dir, filepath.Dir(dir)} {
		fi, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o755 {
			t.Fatalf("%s: mode %v, want 0755", d, fi.Mode().Perm())
		}
	}
}

// TestListenLongDirectory: a path that fits a socket address, in a
// directory too long for the private temporary name beside it, is still
// listened on, with its mode, and leaves no private directory behind.
func TestListenLongDirectory(t *testing.T) {
	// dir/ssssssss is MaxPath bytes: the socket's 8-byte name is shorter
	// than the private name (.sock-NNN/s) would be.
	dir := t.TempDir()
	for len(dir) < MaxPath-60 {
		dir = filepath.Join(dir, strings.Repeat("d", 40))
	}
	dir = filepath.Join(dir, strings.Repeat("d", MaxPath-9-len(dir)-1))
	path := filepath.Join(dir, "ssssssss")
	if len(path) != MaxPath {
		t.Fatalf("test set-up: path of %d bytes, want %d", len(path), MaxPath)
	}
	lis, err := Listen(path, Owner{GID: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	fi, err := os.Lstat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v, want socket 0600", fi.Mode())
	}
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatalf("dialing the new socket: %v", err)
	}
	c.Close()
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("directory holds %d entries, want the socket only", len(ents))
	}
}
