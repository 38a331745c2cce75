package pluginconfig

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const (
	// maxFileSize bounds one config file; real ones are a few hundred bytes.
	maxFileSize = 1 << 20
	// readTimeout bounds reading one config file, which takes microseconds
	// unless its file system hangs.
	readTimeout = 5 * time.Second
)

// Plugin is one valid plugin config and the file it came from.
type Plugin struct {
	File string
	Info *PluginInfo
}

// FileError is why one config file was not loaded.
type FileError struct {
	File string
	Err  error
}

func (e *FileError) Error() string { return e.File + ": " + e.Err.Error() }

func (e *FileError) Unwrap() error { return e.Err }

// Set is the outcome of loading a config directory: every valid plugin,
// keyed by type, and an error for each file that was not loaded. A bad
// file never keeps the others out.
type Set struct {
	Plugins map[string]*Plugin
	Errors  []*FileError
}

// Sorted lists the plugins by type.
func (s *Set) Sorted() []*Plugin {
	out := make([]*Plugin, 0, len(s.Plugins))
	for _, p := range s.Plugins {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Info.Type < out[j].Info.Type })
	return out
}

// Load is LoadContext without a context: it runs to the end.
func Load(dir string) (*Set, error) {
	return LoadContext(context.Background(), dir)
}

// LoadContext reads every entry of dir (following symlinks; names
// starting with '.', and editors' "name~" backups and "#name#" autosaves,
// are skipped) as one CSIPluginInfo. Each must reach a
// regular file: a FIFO, device, socket, dangling symlink or directory
// named *.json is an error for that entry (other directories are skipped,
// as Mesos does). Its error is for a directory that cannot be read at
// all, or for ctx ending, which stops it at once even while a file is
// being read; problems with single files are in Set.Errors. When two
// files define one type, the first by name wins.
func LoadContext(ctx context.Context, dir string) (*Set, error) {
	return load(ctx, dir, nil)
}

// load is LoadContext where owners (type -> file) says which file held
// each type before: on a duplicate type the holder keeps it, so a new
// file cannot take over a running plugin, and neither can any other file
// while the holder is invalid.
func load(ctx context.Context, dir string, owners map[string]string) (*Set, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("reading plugin config directory: %w", err)
	}
	type parsed struct {
		file string
		info *PluginInfo
	}
	set := &Set{Plugins: map[string]*Plugin{}}
	var good []parsed
	for _, e := range entries {
		if skipName(e.Name()) {
			continue
		}
		path := filepath.Join(dir, e.Name())
		info, err := loadFile(ctx, path)
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, fmt.Errorf("reading plugin config directory: interrupted: %w", ctxErr)
		}
		switch {
		case errors.Is(err, errSkipDir):
			continue
		case err != nil:
			set.Errors = append(set.Errors, &FileError{File: path, Err: err})
		default:
			good = append(good, parsed{path, info})
		}
	}
	// The previous holder of a type goes first, then files by name.
	rank := func(p parsed) int {
		if owners[p.info.Type] == p.file {
			return 0
		}
		return 1
	}
	sort.SliceStable(good, func(i, j int) bool { return rank(good[i]) < rank(good[j]) })
	invalid := map[string]bool{}
	for _, fe := range set.Errors {
		invalid[fe.File] = true
	}
	for _, p := range good {
		if owner := owners[p.info.Type]; owner != "" && owner != p.file && invalid[owner] {
			// The holder is being edited (or broken): it keeps its type,
			// with its last good config, rather than hand it to a copy
			// (a backup, an editor's autosave).
			set.Errors = append(set.Errors, &FileError{File: p.file, Err: fieldErr("type",
				"%q is defined in %s, which is invalid now and keeps its last good config; each plugin type may be defined in one file only", p.info.Type, owner)})
			continue
		}
		if prev, ok := set.Plugins[p.info.Type]; ok {
			set.Errors = append(set.Errors, &FileError{File: p.file, Err: fieldErr("type",
				"%q is already defined in %s; each plugin type may be defined in one file only", p.info.Type, prev.File)})
			continue
		}
		set.Plugins[p.info.Type] = &Plugin{File: p.file, Info: p.info}
	}
	sort.Slice(set.Errors, func(i, j int) bool { return set.Errors[i].File < set.Errors[j].File })
	return set, nil
}

// skipName reports whether a directory entry is not read at all: hidden
// files (an editor's swap file, a ConfigMap's "..data"), an editor's
// backup ("a.json~") and autosave ("#a.json#") copies.
func skipName(name string) bool {
	return strings.HasPrefix(name, ".") || strings.HasSuffix(name, "~") ||
		len(name) > 1 && strings.HasPrefix(name, "#") && strings.HasSuffix(name, "#")
}

// errSkipDir is loadFile's answer for a directory that is not named like a
// config file: skipped without a word, as Mesos skips directories.
var errSkipDir = errors.New("a directory")

// loadFile reads and parses one file, giving up after readTimeout or when
// ctx ends (the read goes on in the background, its result dropped).
func loadFile(ctx context.Context, path string) (*PluginInfo, error) {
	data, err := within(ctx, readTimeout, func(deadline time.Time) ([]byte, error) {
		return readRegular(path, deadline)
	})
	if err != nil {
		return nil, err
	}
	return Parse(data)
}

// within runs read in a goroutine and waits for it for at most timeout,
// or until ctx ends. read is given the deadline, to stop by itself too.
func within(ctx context.Context, timeout time.Duration, read func(deadline time.Time) ([]byte, error)) ([]byte, error) {
	type result struct {
		data []byte
		err  error
	}
	done := make(chan result, 1) // the goroutine never blocks on it
	go func() {
		data, err := read(time.Now().Add(timeout))
		done <- result{data, err}
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case r := <-done:
		return r.data, r.err
	case <-timer.C:
		return nil, fmt.Errorf("cannot read: not read within %v (a hung file system?)", timeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// readRegular reads path, which must reach a regular file of at most
// maxFileSize bytes, without ever blocking on the file's kind:
//
//   - stat first, so that a device, FIFO or socket is refused without
//     even being opened (opening some devices has effects of its own);
//   - open O_NONBLOCK (a FIFO swapped in after the stat does not block
//     the open) and O_NOCTTY (nor does a terminal become ours);
//   - fstat the open file, which is what is read: it must be regular;
//   - read with raw read(2) on the non-blocking descriptor, so that a
//     regular-looking file that would block (/proc/kmsg) fails with
//     EAGAIN instead of waiting in Go's poller, and stop at deadline.
//
// A file of size 0 is not read at all: an empty config is empty, and
// kernel pseudo-files (which say 0) are not configs and may be consumed
// by reading them.
func readRegular(path string, deadline time.Time) ([]byte, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		if target, lerr := os.Readlink(path); lerr == nil && errors.Is(err, unix.ENOENT) {
			return nil, fmt.Errorf("cannot read: dangling symlink to %s: %w", target, err)
		}
		return nil, fmt.Errorf("cannot read: %w", err)
	}
	if err := checkRegular(path, st.Mode); err != nil {
		return nil, err
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC|unix.O_NOCTTY, 0)
	if err != nil {
		return nil, fmt.Errorf("cannot open: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("cannot stat: %w", err)
	}
	if err := checkRegular(path, st.Mode); err != nil {
		return nil, err
	}
	if st.Size > maxFileSize {
		return nil, errTooLarge
	}
	if st.Size == 0 {
		return nil, nil
	}
	buf := make([]byte, 0, min(st.Size+1, maxFileSize+1))
	for {
		if time.Now().After(deadline) {
			return nil, errors.New("cannot read: reading took too long")
		}
		if len(buf) == cap(buf) {
			buf = slices.Grow(buf, min(cap(buf), maxFileSize+1-len(buf)))
		}
		n, err := unix.Read(fd, buf[len(buf):cap(buf)])
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case errors.Is(err, unix.EAGAIN):
			return nil, fmt.Errorf("cannot read: %w (a file whose reads block is not a config file)", err)
		case err != nil:
			return nil, fmt.Errorf("cannot read: %w", err)
		case n == 0:
			return buf, nil
		}
		buf = buf[:len(buf)+n]
		if len(buf) > maxFileSize {
			return nil, errTooLarge
		}
	}
}

var errTooLarge = fmt.Errorf("larger than %d bytes (1 MiB); a CSIPluginInfo file is a small JSON object", maxFileSize)

// checkRegular accepts a regular file's mode, and says what else it is.
func checkRegular(path string, mode uint32) error {
	var what string
	switch mode & unix.S_IFMT {
	case unix.S_IFREG:
		return nil
	case unix.S_IFDIR:
		if !strings.HasSuffix(path, ".json") {
			return errSkipDir
		}
		what = "a directory"
	case unix.S_IFIFO:
		what = "a FIFO (named pipe)"
	case unix.S_IFCHR:
		what = "a character device"
	case unix.S_IFBLK:
		what = "a block device"
	case unix.S_IFSOCK:
		what = "a socket"
	default:
		what = fmt.Sprintf("of file type %#o", mode&unix.S_IFMT)
	}
	return fmt.Errorf("not a regular file: it is %s; a config file must be (or link to) a regular file", what)
}
