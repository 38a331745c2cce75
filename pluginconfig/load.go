package pluginconfig

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// maxFileSize bounds one config file; real ones are a few hundred bytes.
const maxFileSize = 1 << 20

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

// Load reads every regular file in dir (following symlinks; names starting
// with '.' are skipped) as one CSIPluginInfo. Its error is for a directory
// that cannot be read at all; problems with single files are in
// Set.Errors. When two files define one type, the first by name wins.
func Load(dir string) (*Set, error) {
	return load(dir, nil)
}

// load is Load where owners (type -> file) says which file held each type
// before: on a duplicate type the holder keeps it, so a new file cannot
// take over a running plugin.
func load(dir string, owners map[string]string) (*Set, error) {
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
		if strings.HasPrefix(e.Name(), ".") {
			continue
		}
		path := filepath.Join(dir, e.Name())
		info, err := loadFile(path)
		switch {
		case errors.Is(err, errNotRegular):
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
	for _, p := range good {
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

var errNotRegular = errors.New("not a regular file")

// loadFile reads and parses one file. Directories, sockets and the like
// give errNotRegular; a dangling symlink is an error worth reporting.
func loadFile(path string) (*PluginInfo, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("cannot read: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, errNotRegular
	}
	// O_NONBLOCK: should the file have been swapped for a FIFO since the
	// stat, opening it must not hang the loader.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("cannot open: %w", err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	if st, err = f.Stat(); err != nil {
		return nil, fmt.Errorf("cannot stat: %w", err)
	}
	if !st.Mode().IsRegular() {
		return nil, errNotRegular
	}
	data, err := io.ReadAll(io.LimitReader(f, maxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("cannot read: %w", err)
	}
	if len(data) > maxFileSize {
		return nil, fmt.Errorf("larger than %d bytes; a CSIPluginInfo file is a small JSON object", maxFileSize)
	}
	return Parse(data)
}
