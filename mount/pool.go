package mount

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
)

// TreePool keeps the directory trees of torn-down volumes (a volume's
// directory with its empty staging and target directories) for new
// volumes to take, in Dir, a directory beside them on the same
// filesystem: a tree moves in and out with one rename. Making a tree and
// removing it costs an inode and a block per directory, which on some
// filesystems means waiting for the disk (ext4 mounted discard waits for
// each freed block's discard, and its inode allocator skips the inodes
// freed in the last minutes).
//
// A tree goes into the pool only as empty directories with nothing
// mounted in them, and comes out only after the same check; the pool
// holds no state: whatever a crash leaves in it is taken or removed
// later, and a tree a crash leaves where a volume's was is the caller's
// to remove (an orphan).
type TreePool struct {
	Dir string
	Max int // trees kept at most; beyond, Put removes
	// Keep names the entries a tree keeps in the pool (a volume's
	// staging directory, always a directory); Put removes the others
	// (a target may be a directory or a file, by the volume's kind).
	Keep []string

	mu     sync.Mutex
	loaded bool
	names  []string // the trees in Dir
	seq    uint64
}

// Put moves tree into the pool if it is fit for reuse (nothing mounted at
// or below it, every entry an empty directory) and the pool has room;
// otherwise it removes it as RemoveEmptyTree does (and fails as it does:
// never across a mount point, never data).
func (p *TreePool) Put(tree string) error {
	if p.park(tree) {
		return nil
	}
	return RemoveEmptyTree(tree)
}

func (p *TreePool) park(tree string) bool {
	names, ok := reusable(tree)
	if !ok {
		return false
	}
	for _, name := range names {
		if !slices.Contains(p.Keep, name) {
			if err := unix.Rmdir(filepath.Join(tree, name)); err != nil {
				return false
			}
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.loadLocked()
	if len(p.names) >= p.Max {
		return false
	}
	if err := os.Mkdir(p.Dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return false
	}
	p.seq++
	name := fmt.Sprintf("%d-%d", os.Getpid(), p.seq)
	if err := unix.Renameat2(unix.AT_FDCWD, tree, unix.AT_FDCWD, filepath.Join(p.Dir, name), unix.RENAME_NOREPLACE); err != nil {
		return false
	}
	p.names = append(p.names, name)
	return true
}

// Take moves a tree of the pool to tree, which must not exist (its parent
// must), and reports whether it did. A tree of the pool found unfit (a
// mount or a file appeared in it) is removed if it can be, else left.
func (p *TreePool) Take(tree string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.loadLocked()
	for len(p.names) > 0 {
		name := p.names[len(p.names)-1]
		spare := filepath.Join(p.Dir, name)
		if _, ok := reusable(spare); !ok {
			p.names = p.names[:len(p.names)-1]
			_ = RemoveEmptyTree(spare)
			continue
		}
		if err := unix.Renameat2(unix.AT_FDCWD, spare, unix.AT_FDCWD, tree, unix.RENAME_NOREPLACE); err != nil {
			return false // tree exists, or its parent does not: the spare stays
		}
		p.names = p.names[:len(p.names)-1]
		return true
	}
	return false
}

// loadLocked lists the trees a previous run left in Dir, once.
func (p *TreePool) loadLocked() {
	if p.loaded {
		return
	}
	p.loaded = true
	entries, _ := os.ReadDir(p.Dir) // none yet: empty
	for _, e := range entries {
		if e.IsDir() {
			p.names = append(p.names, e.Name())
		}
	}
}

// reusable reports whether dir is a directory (not a symlink), not a
// mount point, whose entries are all empty directories on its own mount,
// and names them. A kernel without statx mount ids (before Linux 5.8)
// has none reusable.
func reusable(dir string) (names []string, ok bool) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, false
	}
	top := os.NewFile(uintptr(fd), dir)
	defer top.Close()
	var st unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_TYPE|unix.STATX_MNT_ID, &st); err != nil ||
		st.Mask&unix.STATX_MNT_ID == 0 || st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 || st.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		return nil, false
	}
	mnt := st.Mnt_id
	names, err = top.Readdirnames(-1)
	if err != nil {
		return nil, false
	}
	for _, name := range names {
		var est unix.Statx_t
		if err := unix.Statx(fd, name, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_TYPE|unix.STATX_MNT_ID, &est); err != nil ||
			est.Mode&unix.S_IFMT != unix.S_IFDIR || est.Mnt_id != mnt || est.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0 {
			return nil, false
		}
		sub, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, false
		}
		f := os.NewFile(uintptr(sub), name)
		inner, err := f.Readdirnames(1)
		f.Close()
		if len(inner) > 0 || !errors.Is(err, io.EOF) {
			return nil, false
		}
	}
	return names, true
}
