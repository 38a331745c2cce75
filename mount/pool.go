package mount

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
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
}

// Put moves tree into the pool if it is fit for reuse (nothing mounted at
// or below it, every entry an empty directory of this process's user) and
// the pool has room; otherwise (or with no pool, p nil) it removes it as
// RemoveEmptyTree does (and fails as it does: never across a mount point,
// never data).
func (p *TreePool) Put(tree string) error {
	if p != nil {
		if parked, err := p.park(tree); parked || err != nil {
			return err
		}
	}
	return RemoveEmptyTree(tree)
}

// park moves tree into the pool if it is fit and the pool has room. A
// tree found unfit once in the pool (a mount made in it meanwhile: a
// rename moves mounts with it) is moved back, to be refused by
// RemoveEmptyTree; err says where it is if it cannot be.
func (p *TreePool) park(tree string) (parked bool, err error) {
	names, ok := reusable(tree)
	if !ok {
		return false, nil
	}
	for _, name := range names {
		if !slices.Contains(p.Keep, name) {
			if err := unix.Rmdir(filepath.Join(tree, name)); err != nil {
				return false, nil
			}
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.loadLocked()
	if len(p.names) >= p.Max {
		return false, nil
	}
	if err := os.Mkdir(p.Dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return false, nil
	}
	// Unique across runs and boots (a pid is not).
	name := fmt.Sprintf("%d-%x", os.Getpid(), rand.Uint64())
	spare := filepath.Join(p.Dir, name)
	if err := unix.Renameat2(unix.AT_FDCWD, tree, unix.AT_FDCWD, spare, unix.RENAME_NOREPLACE); err != nil {
		return false, nil
	}
	if _, ok := reusable(spare); !ok {
		if err := unix.Renameat2(unix.AT_FDCWD, spare, unix.AT_FDCWD, tree, unix.RENAME_NOREPLACE); err != nil {
			return false, fmt.Errorf("%s changed while it was moved into the pool, and could not be moved back: left as %s: %w", tree, spare, err)
		}
		return false, nil
	}
	p.names = append(p.names, name)
	return true, nil
}

// Take moves a tree of the pool to tree, which must not exist (its parent
// must), and reports whether it did. A tree of the pool found unfit (a
// mount or a file appeared in it) is removed if it can be; err says which
// could not be (left in the pool's directory, never taken).
func (p *TreePool) Take(tree string) (taken bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.loadLocked()
	var errs []error
	for len(p.names) > 0 {
		name := p.names[len(p.names)-1]
		spare := filepath.Join(p.Dir, name)
		if _, ok := reusable(spare); !ok {
			p.names = p.names[:len(p.names)-1]
			if err := RemoveEmptyTree(spare); err != nil {
				errs = append(errs, fmt.Errorf("an unfit tree in the pool: %w", err))
			}
			continue
		}
		if err := unix.Renameat2(unix.AT_FDCWD, spare, unix.AT_FDCWD, tree, unix.RENAME_NOREPLACE); err != nil {
			// tree exists, or its parent does not: the spare stays.
			return false, errors.Join(append(errs, fmt.Errorf("taking %s: %w", spare, err))...)
		}
		p.names = p.names[:len(p.names)-1]
		return true, errors.Join(errs...)
	}
	return false, errors.Join(errs...)
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
// all of this process's user and group, writable by no one else, without
// set-id or sticky bits (as this process makes them: what someone else
// did to a tree is not handed to the next volume), and names them. A kernel without statx mount ids (before Linux 5.8)
// has none reusable.
func reusable(dir string) (names []string, ok bool) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, false
	}
	top := os.NewFile(uintptr(fd), dir)
	defer top.Close()
	var st unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, statxAsMade, &st); err != nil || !asMade(&st) ||
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
		if err := unix.Statx(fd, name, unix.AT_SYMLINK_NOFOLLOW, statxAsMade, &est); err != nil || !asMade(&est) ||
			est.Mnt_id != mnt || est.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0 {
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

// statxAsMade is what reusable asks statx for.
const statxAsMade = unix.STATX_TYPE | unix.STATX_MODE | unix.STATX_UID | unix.STATX_GID | unix.STATX_MNT_ID

// asMade reports whether st is a directory as this process makes them:
// its user and group, writable by no one else, no set-id or sticky bit.
func asMade(st *unix.Statx_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFDIR && int(st.Uid) == os.Geteuid() && int(st.Gid) == os.Getegid() &&
		st.Mode&(unix.S_ISUID|unix.S_ISGID|unix.S_ISVTX|0o022) == 0
}
