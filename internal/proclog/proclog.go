package proclog

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

const (
	// dirPerm is the mode (before umask) of the directories Open creates.
	dirPerm = 0o750
	// filePerm is the mode (before umask) of log files and rotated copies.
	filePerm = 0o640
)

// ErrInvalidArgument marks a Rotate call with a non-positive maxBytes or a
// negative keep.
var ErrInvalidArgument = errors.New("invalid argument")

// Open opens the log file at path for appending, creating it (mode 0640) and
// its parent directories (mode 0750) as needed, both before umask. The file
// is opened O_WRONLY|O_APPEND|O_CLOEXEC: pass it as exec.Cmd.Stdout or
// Stderr (exec dups it into the child without the close-on-exec flag) and
// close the parent's copy once the child has started.
func Open(path string) (*os.File, error) {
	if err := os.MkdirAll(filepath.Dir(path), dirPerm); err != nil {
		return nil, fmt.Errorf("proclog: create log directory: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE|unix.O_CLOEXEC, filePerm)
	if err != nil {
		return nil, fmt.Errorf("proclog: open log: %w", err)
	}
	return f, nil
}

// Rotate caps the log file at path. If it is larger than maxBytes, path.1 ..
// path.(keep-1) become path.2 .. path.keep (the old path.keep and any
// path.N beyond keep are removed), the content of path is copied to path.1,
// and path is truncated to zero in place, so a child writing to it through a
// descriptor from Open goes on writing at its new end. With keep 0 the
// content is discarded. rotated reports whether the file was rotated.
//
// A missing file is nothing to do. If another Rotate (in this or another
// process) holds the file's lock, Rotate returns false and no error: the
// other caller is rotating it. Lines the child writes between the end of the
// copy and the truncation are lost (see the package documentation). Rotate
// never blocks on the writer.
func Rotate(path string, maxBytes int64, keep int) (rotated bool, err error) {
	if maxBytes <= 0 || keep < 0 {
		return false, fmt.Errorf("proclog: rotate %s: maxBytes %d, keep %d: %w", path, maxBytes, keep, ErrInvalidArgument)
	}
	// O_RDWR: the copy reads from this descriptor and the truncation
	// needs write access. No O_APPEND: reads start at offset 0.
	f, err := os.OpenFile(path, os.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("proclog: rotate: %w", err)
	}
	defer f.Close() // also releases the lock

	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return false, nil
		}
		return false, fmt.Errorf("proclog: rotate %s: lock: %w", path, err)
	}
	st, err := f.Stat()
	if err != nil {
		return false, fmt.Errorf("proclog: rotate: %w", err)
	}
	if st.Size() <= maxBytes {
		return false, nil
	}
	if err := shift(path, keep); err != nil {
		return false, fmt.Errorf("proclog: rotate %s: %w", path, err)
	}
	if keep == 0 {
		if err := f.Truncate(0); err != nil {
			return false, fmt.Errorf("proclog: rotate: %w", err)
		}
		return true, nil
	}
	if err := copyTruncate(f, rotatedName(path, 1)); err != nil {
		return false, fmt.Errorf("proclog: rotate %s: %w", path, err)
	}
	return true, nil
}

// rotatedName is the name of the n-th rotated copy of path.
func rotatedName(path string, n int) string {
	return path + "." + strconv.Itoa(n)
}

// shift makes room for a new path.1: it removes path.keep and every
// path.N beyond it (left over from a larger keep), then renames path.N to
// path.N+1 for N from keep-1 down to 1. Missing files are skipped.
func shift(path string, keep int) error {
	for n := max(keep, 1); ; n++ {
		err := os.Remove(rotatedName(path, n))
		if errors.Is(err, fs.ErrNotExist) {
			if n > keep {
				break
			}
			continue
		}
		if err != nil {
			return err
		}
	}
	for n := keep - 1; n >= 1; n-- {
		err := os.Rename(rotatedName(path, n), rotatedName(path, n+1))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

// copyTruncate copies src from offset 0 to its current end into a new file
// dst, truncates src, and only then moves the copy into place under dst
// (from a temporary name, so dst is never seen half written). The
// truncation comes right after the copy: what the child writes in between
// is the copytruncate loss.
func copyTruncate(src *os.File, dst string) error {
	tmp := dst + ".tmp"
	out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_CLOEXEC, filePerm)
	if err != nil {
		return err
	}
	abort := func(err error) error {
		out.Close()
		_ = os.Remove(tmp)
		return err
	}
	if _, err := src.Seek(0, io.SeekStart); err != nil {
		return abort(err)
	}
	// io.Copy between two files uses copy_file_range: no user-space
	// buffer, and it reads up to the end of the file as it is then.
	if _, err := io.Copy(out, src); err != nil {
		return abort(err)
	}
	if err := src.Truncate(0); err != nil {
		return abort(err)
	}
	// From here on the copy is the only place the old lines live: on an
	// error it stays behind under the temporary name.
	if err := out.Close(); err != nil {
		return fmt.Errorf("close %s: %w", tmp, err)
	}
	return os.Rename(tmp, dst)
}
