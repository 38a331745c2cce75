package crashstate

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"path"
	"slices"
	"strings"
)

// inode is a file, directory or symlink of the model, with its current
// state and its durable state (what survives a power cut).
type inode struct {
	id    int
	kind  Kind
	mode  fs.FileMode
	nlink int // current entries that name it

	// Regular file. data is copy-on-write: while shared is set, the bytes
	// of data are also referenced elsewhere (durData, trees), so they are
	// copied before being overwritten. Growing in place is safe: every
	// reference is capped at its length.
	data    []byte
	shared  bool
	durData []byte

	// Directory.
	entries    map[string]*inode
	durEntries map[string]*inode

	target string // symlink
}

// content returns data for use elsewhere; it must not be modified.
func (f *inode) content() []byte {
	f.shared = true
	return f.data[:len(f.data):len(f.data)]
}

func (f *inode) resize(n int) {
	switch {
	case n < len(f.data) && f.shared:
		f.data = f.data[:n:n]
	case n < len(f.data):
		f.data = f.data[:n]
	case n > len(f.data):
		f.data = append(f.data, make([]byte, n-len(f.data))...)
	}
}

func (f *inode) writeAt(p []byte, off int64) {
	if f.shared && int(off) < len(f.data) {
		f.data = slices.Clone(f.data)
		f.shared = false
	}
	if end := int(off) + len(p); end > len(f.data) {
		f.resize(end)
	}
	copy(f.data[off:], p)
}

// differs reports whether the current state differs from the durable one.
func (f *inode) differs() bool {
	switch f.kind {
	case KindFile:
		return !bytes.Equal(f.data, f.durData)
	case KindDir:
		return !maps.Equal(f.entries, f.durEntries)
	}
	return false
}

type fdKey struct{ fd, ino int }

// fdState is an open file description as the model knows it.
type fdState struct {
	ino    *inode
	off    int64
	append bool
}

// replayer is the model after the first k ops of a trace.
type replayer struct {
	init   *Tree
	k      int
	root   *inode
	nextID int
	dirty  map[*inode]struct{} // inodes changed since they were last durable
	fds    map[fdKey]*fdState
	lastFd map[int]*fdState // by fd number: the latest open
}

func newReplayer(init *Tree) (*replayer, error) {
	r := &replayer{
		init:   init,
		dirty:  make(map[*inode]struct{}),
		fds:    make(map[fdKey]*fdState),
		lastFd: make(map[int]*fdState),
	}
	r.root = r.newInode(KindDir, 0o755)
	byNode := make(map[*Node]*inode)
	for _, p := range init.Paths() {
		n := init.nodes[p]
		dir, name, err := r.parent(p)
		if err != nil {
			return nil, fmt.Errorf("crashstate: initial tree: %w", err)
		}
		ino, ok := byNode[n]
		if !ok || n.Kind != KindFile {
			ino = r.newInode(n.Kind, n.Mode)
			byNode[n] = ino
			switch n.Kind {
			case KindFile:
				ino.data = n.Data[:len(n.Data):len(n.Data)]
				ino.shared = true
			case KindSymlink:
				ino.target = string(n.Data)
			}
		}
		r.link(dir, name, ino)
	}
	r.syncAll()
	return r, nil
}

func (r *replayer) newInode(kind Kind, mode fs.FileMode) *inode {
	r.nextID++
	ino := &inode{id: r.nextID, kind: kind, mode: mode}
	switch kind {
	case KindDir:
		ino.entries = make(map[string]*inode)
		ino.durEntries = make(map[string]*inode)
	case KindFile:
		r.dirty[ino] = struct{}{}
	}
	return ino
}

func (r *replayer) link(dir *inode, name string, ino *inode) {
	dir.entries[name] = ino
	ino.nlink++
	r.dirty[dir] = struct{}{}
}

func (r *replayer) unlink(dir *inode, name string) {
	dir.entries[name].nlink--
	delete(dir.entries, name)
	r.dirty[dir] = struct{}{}
}

func (r *replayer) makeDurable(ino *inode) {
	switch ino.kind {
	case KindFile:
		ino.durData = ino.content()
	case KindDir:
		ino.durEntries = maps.Clone(ino.entries)
	}
	delete(r.dirty, ino)
}

func (r *replayer) syncAll() {
	for ino := range r.dirty {
		r.makeDurable(ino)
	}
}

// lookup returns the inode at p in the current state.
func (r *replayer) lookup(p string) (*inode, error) {
	if p == "." {
		return r.root, nil
	}
	dir, name, err := r.parent(p)
	if err != nil {
		return nil, err
	}
	ino, ok := dir.entries[name]
	if !ok {
		return nil, fmt.Errorf("%s: %w", p, fs.ErrNotExist)
	}
	return ino, nil
}

// parent returns the directory holding the entry p and the entry's name.
func (r *replayer) parent(p string) (*inode, string, error) {
	if p == "." || p == "" {
		return nil, "", errors.New("the root has no entry in the model")
	}
	dir := r.root
	parts := strings.Split(p, "/")
	for i, name := range parts[:len(parts)-1] {
		next, ok := dir.entries[name]
		if !ok {
			return nil, "", fmt.Errorf("%s: %w", path.Join(parts[:i+1]...), fs.ErrNotExist)
		}
		if next.kind != KindDir {
			return nil, "", fmt.Errorf("%s: not a directory", path.Join(parts[:i+1]...))
		}
		dir = next
	}
	return dir, parts[len(parts)-1], nil
}

func (r *replayer) lookupFile(p string) (*inode, error) {
	ino, err := r.lookup(p)
	if err != nil {
		return nil, err
	}
	if ino.kind != KindFile {
		return nil, fmt.Errorf("%s: %v, not a regular file", p, ino.kind)
	}
	return ino, nil
}

// fdTarget resolves the descriptor of an op: by the path strace printed
// (the inode's current name), else by the latest open of the fd number.
// A nil inode means the op is on an unreachable file the model never saw
// opened, which changes nothing a crash state can show.
func (r *replayer) fdTarget(op Op) (*inode, *fdState, error) {
	if !op.Deleted {
		if ino, err := r.lookup(op.Path); err == nil {
			key := fdKey{op.Fd, ino.id}
			st := r.fds[key]
			if st == nil {
				// Opened before the trace (e.g. inherited): the model
				// assumes it is positioned at the end of the file.
				st = &fdState{ino: ino, off: int64(len(ino.data))}
				r.fds[key] = st
			}
			return ino, st, nil
		}
	}
	st := r.lastFd[op.Fd]
	switch {
	case op.Deleted && st != nil && st.ino.nlink == 0:
		return st.ino, st, nil
	case op.Deleted:
		return nil, nil, nil
	case st != nil:
		return st.ino, st, nil
	}
	return nil, nil, fmt.Errorf("%s: %w and fd %d was not opened in the trace", op.Path, fs.ErrNotExist, op.Fd)
}

// fileTarget resolves the file of an op by descriptor or by path; nil
// means an unreachable file (see fdTarget).
func (r *replayer) fileTarget(op Op) (*inode, *fdState, error) {
	if op.Fd < 0 {
		ino, err := r.lookupFile(op.Path)
		return ino, nil, err
	}
	ino, st, err := r.fdTarget(op)
	if err == nil && ino != nil && ino.kind != KindFile {
		err = fmt.Errorf("%s: %v, not a regular file", op.Path, ino.kind)
	}
	return ino, st, err
}

func (r *replayer) apply(op Op) error {
	switch op.Kind {
	case OpOpen:
		return r.open(op)
	case OpWrite:
		f, st, err := r.fileTarget(op)
		if err != nil || f == nil {
			return err
		}
		off := op.Offset
		if st.append || op.Append {
			off = int64(len(f.data)) // Linux appends even for pwrite on O_APPEND
		} else if off < 0 {
			off = st.off
		}
		f.writeAt(op.Data, off)
		if op.Offset < 0 {
			st.off = off + int64(len(op.Data))
		}
		r.dirty[f] = struct{}{}
	case OpSeek:
		_, st, err := r.fdTarget(op)
		if err != nil || st == nil {
			return err
		}
		st.off = op.Offset
	case OpDup:
		ino, st, err := r.fdTarget(op)
		if err != nil || st == nil {
			return err
		}
		r.fds[fdKey{op.NewFd, ino.id}] = st
		r.lastFd[op.NewFd] = st
	case OpTruncate:
		f, _, err := r.fileTarget(op)
		if err != nil || f == nil {
			return err
		}
		f.resize(int(op.Size))
		r.dirty[f] = struct{}{}
	case OpFallocate:
		f, _, err := r.fileTarget(op)
		if err != nil || f == nil {
			return err
		}
		end := op.Offset + op.Size
		if op.ZeroRange {
			zeroEnd := end
			if op.KeepSize {
				zeroEnd = min(end, int64(len(f.data)))
			}
			if zeroEnd > op.Offset {
				f.writeAt(make([]byte, zeroEnd-op.Offset), op.Offset)
			}
		} else if !op.KeepSize && end > int64(len(f.data)) {
			f.resize(int(end))
		}
		r.dirty[f] = struct{}{}
	case OpFsync:
		ino, _, err := r.fdTarget(op)
		if err != nil || ino == nil {
			return err
		}
		r.makeDurable(ino)
	case OpSync:
		r.syncAll()
	case OpMkdir:
		dir, name, err := r.freeEntry(op.Path)
		if err != nil {
			return err
		}
		r.link(dir, name, r.newInode(KindDir, op.Mode))
	case OpSymlink:
		dir, name, err := r.freeEntry(op.Path)
		if err != nil {
			return err
		}
		ino := r.newInode(KindSymlink, 0o777)
		ino.target = op.Target
		r.link(dir, name, ino)
	case OpRemove:
		dir, name, err := r.entry(op.Path)
		if err != nil {
			return err
		}
		r.unlink(dir, name)
	case OpRename:
		return r.rename(op)
	case OpLink:
		odir, oname, err := r.entry(op.Path)
		if err != nil {
			return err
		}
		ino := odir.entries[oname]
		if ino.kind == KindDir || (op.Follow && ino.kind == KindSymlink) {
			return fmt.Errorf("link of %v %s is not supported", ino.kind, op.Path)
		}
		dir, name, err := r.freeEntry(op.NewPath)
		if err != nil {
			return err
		}
		r.link(dir, name, ino)
	case OpChmod:
		var ino *inode
		var err error
		if op.Fd >= 0 {
			ino, _, err = r.fdTarget(op)
		} else {
			ino, err = r.lookup(op.Path)
		}
		if err != nil || ino == nil || ino.kind == KindSymlink {
			return err // chmod through a symlink is not followed
		}
		ino.mode = op.Mode
	default:
		return fmt.Errorf("unknown op kind %v", op.Kind)
	}
	return nil
}

// entry returns the directory holding the existing entry p and its name.
func (r *replayer) entry(p string) (*inode, string, error) {
	dir, name, err := r.parent(p)
	if err != nil {
		return nil, "", err
	}
	if _, ok := dir.entries[name]; !ok {
		return nil, "", fmt.Errorf("%s: %w", p, fs.ErrNotExist)
	}
	return dir, name, nil
}

// freeEntry returns the directory for the new entry p and its name.
func (r *replayer) freeEntry(p string) (*inode, string, error) {
	dir, name, err := r.parent(p)
	if err != nil {
		return nil, "", err
	}
	if _, ok := dir.entries[name]; ok {
		return nil, "", fmt.Errorf("%s: %w", p, fs.ErrExist)
	}
	return dir, name, nil
}

func (r *replayer) open(op Op) error {
	if op.ReadOnly {
		// Binds the descriptor only (a file, a directory, the root).
		if f, err := r.lookup(op.Path); err == nil {
			st := &fdState{ino: f}
			r.fds[fdKey{op.Fd, f.id}] = st
			r.lastFd[op.Fd] = st
		}
		return nil
	}
	dir, name, err := r.parent(op.Path)
	if err != nil {
		return err
	}
	f, ok := dir.entries[name]
	switch {
	case !ok && !op.Create:
		return fmt.Errorf("%s: %w", op.Path, fs.ErrNotExist)
	case !ok:
		f = r.newInode(KindFile, op.Mode)
		r.link(dir, name, f)
	case f.kind != KindFile:
		return fmt.Errorf("%s: %v, not a regular file", op.Path, f.kind)
	}
	if op.Trunc && len(f.data) > 0 {
		f.resize(0)
		r.dirty[f] = struct{}{}
	}
	st := &fdState{ino: f, append: op.Append}
	r.fds[fdKey{op.Fd, f.id}] = st
	r.lastFd[op.Fd] = st
	return nil
}

func (r *replayer) rename(op Op) error {
	odir, oname, err := r.entry(op.Path)
	if err != nil {
		return err
	}
	ndir, nname, err := r.parent(op.NewPath)
	if err != nil {
		return err
	}
	src := odir.entries[oname]
	dst, exists := ndir.entries[nname]
	switch {
	case op.Exchange && !exists:
		return fmt.Errorf("exchange with %s: %w", op.NewPath, fs.ErrNotExist)
	case op.Exchange:
		odir.entries[oname], ndir.entries[nname] = dst, src
		r.dirty[odir], r.dirty[ndir] = struct{}{}, struct{}{}
		return nil
	case exists && op.NoReplace:
		return fmt.Errorf("%s: %w", op.NewPath, fs.ErrExist)
	case exists && dst == src:
		return nil // two links to one file: rename does nothing
	case exists:
		r.unlink(ndir, nname)
	}
	r.unlink(odir, oname)
	r.link(ndir, nname, src)
	return nil
}
