package unixsock

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"time"
)

// MaxPath is the longest path a unix socket address holds (sun_path less
// its terminating NUL).
const MaxPath = 107

// Owner says who may connect: the socket is mode 0600 owned by the
// process's user (root for the agent), or 0660 owned by root with group
// GID when GID >= 0 (which needs root).
type Owner struct {
	GID int
}

// Listen creates a listening unix socket at path with o's owner and mode.
// The parent directory is created (0755, whatever the umask) when missing.
// An existing stale socket is replaced; anything else at path, or a socket
// that still accepts connections, is refused with an error naming it.
func Listen(path string, o Owner) (net.Listener, error) {
	if len(path) > MaxPath {
		return nil, fmt.Errorf("socket path %s is %d bytes, longer than the %d a unix socket address holds", path, len(path), MaxPath)
	}
	dir := filepath.Dir(path)
	if err := MkdirAll(dir); err != nil {
		return nil, err
	}
	if err := removeStale(path); err != nil {
		return nil, err
	}
	private, err := os.MkdirTemp(dir, ".sock-")
	if err != nil {
		return nil, fmt.Errorf("making a private directory for socket %s: %w", path, err)
	}
	defer os.RemoveAll(private)
	tmp := filepath.Join(private, "s")
	bind := tmp
	if len(tmp) > MaxPath {
		// path fits but the private name makes it too long to bind:
		// bind through the directory's descriptor, a short path
		// whatever the directory's.
		d, err := os.Open(private)
		if err != nil {
			return nil, fmt.Errorf("socket %s: %w", path, err)
		}
		defer d.Close()
		bind = fmt.Sprintf("/proc/self/fd/%d/s", d.Fd())
	}
	lis, err := net.Listen("unix", bind)
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", path, err)
	}
	ul := lis.(*net.UnixListener)
	// The listener must not unlink tmp (renamed) or, later, path: a
	// successor may own path by then.
	ul.SetUnlinkOnClose(false)
	if err := setOwner(tmp, o); err != nil {
		lis.Close()
		return nil, fmt.Errorf("socket %s: %w", path, err)
	}
	mine, err := os.Lstat(tmp)
	if err != nil {
		lis.Close()
		return nil, fmt.Errorf("socket %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		lis.Close()
		return nil, fmt.Errorf("putting socket %s in place: %w", path, err)
	}
	return &listener{UnixListener: ul, path: path, file: mine}, nil
}

// listener removes its socket on Close if the file there is still the
// one it made (a successor may have replaced it).
type listener struct {
	*net.UnixListener
	path string
	file fs.FileInfo
}

func (l *listener) Close() error {
	err := l.UnixListener.Close()
	if fi, statErr := os.Lstat(l.path); statErr == nil && os.SameFile(fi, l.file) {
		_ = os.Remove(l.path)
	}
	return err
}

func setOwner(path string, o Owner) error {
	mode := os.FileMode(0o600)
	if o.GID >= 0 {
		mode = 0o660
		if err := os.Lchown(path, 0, o.GID); err != nil {
			return fmt.Errorf("giving it to group %d: %w", o.GID, err)
		}
	}
	if err := os.Chmod(path, mode); err != nil {
		return fmt.Errorf("setting mode %o: %w", mode, err)
	}
	return nil
}

// MkdirAll creates dir and its missing parents as 0755 regardless of the
// umask (a unit's UMask=0077 would otherwise make them 0700 and lock the
// API group out); existing directories are left as they are.
func MkdirAll(dir string) error {
	fi, err := os.Stat(dir)
	if err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("socket directory %s is not a directory", dir)
		}
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("socket directory %s: %w", dir, err)
	}
	if parent := filepath.Dir(dir); parent != dir {
		if err := MkdirAll(parent); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("creating socket directory %s: %w", dir, err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return fmt.Errorf("setting mode of socket directory %s: %w", dir, err)
	}
	return nil
}

// removeStale removes a socket nobody answers on; it refuses a non-socket
// and a live socket.
func removeStale(path string) error {
	fi, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("checking %s: %w", path, err)
	}
	if fi.Mode()&fs.ModeSocket == 0 {
		return fmt.Errorf("refusing to replace %s: it is a %s, not a socket", path, kind(fi.Mode()))
	}
	c, err := net.DialTimeout("unix", path, time.Second)
	if err == nil {
		c.Close()
		return fmt.Errorf("another process is listening on %s", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing stale socket %s: %w", path, err)
	}
	return nil
}

func kind(m fs.FileMode) string {
	switch {
	case m.IsDir():
		return "directory"
	case m&fs.ModeSymlink != 0:
		return "symbolic link"
	case m.IsRegular():
		return "regular file"
	default:
		return "special file"
	}
}

// Inherit makes a listener of f, a listening unix socket another process
// made and passed down (systemd socket activation), which must be bound
// at path; the socket file gets o's owner and mode. Closing the listener
// leaves the file: it belongs to whoever made it (connections made while
// no one accepts wait in its backlog).
func Inherit(f *os.File, path string, o Owner) (net.Listener, error) {
	defer f.Close() // the listener has a copy
	lis, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("inherited socket %s: %w", f.Name(), err)
	}
	ul, ok := lis.(*net.UnixListener)
	if !ok || ul.Addr().String() != path {
		lis.Close()
		return nil, fmt.Errorf("inherited socket %s listens on %s, not %s: make the socket unit's ListenStream and the agent's flag agree", f.Name(), lis.Addr(), path)
	}
	ul.SetUnlinkOnClose(false)
	if err := setOwner(path, o); err != nil {
		lis.Close()
		return nil, fmt.Errorf("socket %s: %w", path, err)
	}
	return ul, nil
}
