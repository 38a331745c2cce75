package mount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/cyphar/filepath-securejoin/pathrs-lite/procfs"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// ErrCovered is returned (wrapped) by UnmountOwn when the recorded mount is
// still there but another mount, not ours, sits on top of it: unmounting
// ours would take that one too, so neither is touched.
var ErrCovered = errors.New("covered by a mount that is not ours")

// ID returns the id of the mount that f (a handle, O_PATH is enough) is
// on: statx STATX_MNT_ID, the id mountinfo lists. On the handle of a
// directory before something is mounted on it, that is the mount the new
// one will sit on; on a CloneTree descriptor, the id of the new mount.
func ID(f *os.File) (uint64, error) {
	id, err := mountIDAt(int(f.Fd()), "")
	if err != nil {
		return 0, fmt.Errorf("mount id of %s: %w", f.Name(), err)
	}
	return id, nil
}

// Identity is what identifies one mount the agent made.
type Identity struct {
	// ID is the mount's id; 0 when it was never read (the agent stopped
	// between the mount and its record).
	ID uint64
	// Parent is the id of the mount it was put on (what was at the mount
	// point before): when ID is 0 and that mount is still on top, ours was
	// never made.
	Parent uint64
	// Source is the host path that was bound. When ID is 0, a mount on top
	// of the mount point whose root is Source's inode is taken to be ours.
	Source string
	// RootDev and RootIno are the device and inode of the mount's root,
	// read from the clone when it was made (0: not recorded). Recorded,
	// they decide whether a mount is ours: Source is not looked up, for
	// it resolves in the calling thread's namespace, which may be a
	// container's (where the container can make that path anything).
	RootDev, RootIno uint64
	// UniqueID is the mount's unique id (statx STATX_MNT_ID_UNIQUE, Linux
	// 6.8: never reused), read from the clone when it was made; 0 when
	// not recorded. ID is reused once a mount is gone, and a later mount of
	// the same filesystem and root (the volume's staging mount, or a
	// filesystem on a loop device of the same number) cannot be told apart
	// from ours by it; with UniqueID, a mount of ours that is gone is Gone.
	UniqueID uint64
}

// ErrUnverified is returned (wrapped) by UnmountOwn when a mount with the
// recorded id is there but its root cannot be checked (no root recorded,
// and Source cannot be seen): it is not touched, and not reported Gone
// either.
var ErrUnverified = errors.New("has the recorded mount id but its root cannot be verified")

// Root is what RootOf reads of a mount tree's root.
type Root struct {
	Dev, Ino uint64 // for Identity
	// UniqueID is the mount's unique id, 0 where the kernel has none.
	UniqueID uint64
	// BlockDevice is the device number (st_rdev) of a root that is a
	// block device node (a block volume's), else 0.
	BlockDevice uint64
}

// RootOf reads the root of the mount tree f (a CloneTree descriptor).
func RootOf(f *os.File) (Root, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return Root{}, fmt.Errorf("root of mount tree %s: %w", f.Name(), err)
	}
	r := Root{Dev: st.Dev, Ino: st.Ino}
	if st.Mode&unix.S_IFMT == unix.S_IFBLK {
		r.BlockDevice = st.Rdev
	}
	var stx unix.Statx_t
	if err := unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_MNT_ID_UNIQUE, &stx); err == nil && stx.Mask&unix.STATX_MNT_ID_UNIQUE != 0 {
		r.UniqueID = stx.Mnt_id
	}
	return r, nil
}

// uniqueGone reports whether the mount's recorded unique id names no
// mount in the calling thread's mount namespace (statmount ENOENT): ours
// is gone, whoever has its reusable id now. False when not recorded or
// when the kernel cannot say.
func (id Identity) uniqueGone() bool {
	if id.UniqueID == 0 {
		return false
	}
	_, err := statmountReq(mntIDReq{Size: mntIDReqSizeVer0, MntID: id.UniqueID, Param: statmountSBBasic})
	return errors.Is(err, unix.ENOENT)
}

// root is the inode a mount of id must have at its root, and whether it
// was recorded (verified) or looked up by Source (nil if that fails).
func (id Identity) root() (src *unix.Stat_t, recorded bool) {
	if id.RootIno != 0 {
		return &unix.Stat_t{Dev: id.RootDev, Ino: id.RootIno}, true
	}
	var st unix.Stat_t
	if id.Source != "" && unix.Stat(id.Source, &st) == nil {
		return &st, false
	}
	return nil, false
}

// Where says where UnmountOwn found the mount it removed.
type Where int

const (
	// AtRecorded: the mount was at its recorded path and is unmounted.
	AtRecorded Where = iota
	// Moved: the mount had moved (a parent directory was renamed) and is
	// unmounted at the path Result.Path, inside the root.
	Moved
	// Gone: no mount with the recorded identity exists in this mount
	// namespace (someone else unmounted it, or it was never made).
	Gone
)

// Result is what UnmountOwn did.
type Result struct {
	Where Where
	// Path is where the mount was unmounted (empty when Gone).
	Path string
}

// UnmountOwn removes exactly the mount id recorded at mountPoint (a path
// at or below root; root is trusted, everything below it is not) and
// nothing else:
//
//   - The mount point's parent directory is reached through a handle
//     resolved inside root with openat2 RESOLVE_IN_ROOT|RESOLVE_NO_SYMLINKS
//     (the recorded path is canonical, so a link on the way was planted
//     and is refused, never followed). statx of the last name through that
//     handle (AT_SYMLINK_NOFOLLOW) must show the recorded mount id; then
//     umount2 of that name through the handle (UMOUNT_NOFOLLOW) removes
//     just the top mount there: a mount that was underneath before ours
//     (a runtime's tmpfs) stays.
//   - Mounts inside ours (the submounts a recursive bind brought, mounts
//     made inside the volume) are removed first, each by id the same way,
//     when the unmount is busy. A mount on top of ours (a bind or tmpfs
//     put over the mount point) is not ours: nothing is touched and the
//     error wraps ErrCovered.
//   - If the mount is not at mountPoint, it is looked up by id in the
//     calling thread's mountinfo: found elsewhere below root (a parent
//     was renamed), it is unmounted there after the same checks (Moved);
//     found outside root, nothing is touched (error, ErrOutsideRoot);
//     not found, it is Gone and nothing is touched.
//   - Mount ids are reused: the mount's root must also be the recorded
//     root (id.RootDev, id.RootIno), so a mount the container made after
//     ours went is never taken for ours. Without a recorded root (records
//     of earlier releases) it is id.Source's inode, looked up in the
//     calling thread's namespace: the caller must not leave that lookup
//     to a namespace a container controls (it resolves id.Source in its
//     own and records the result). A mount with the recorded id whose
//     root cannot be checked at all (no root recorded, Source not seen)
//     is not touched and not Gone either (ErrUnverified).
//   - With id.ID 0 the mount at mountPoint is ours only if it is not the
//     recorded parent and its root is id.Source's inode; otherwise ours
//     was never made (Gone).
//   - A root that does not exist (a container's rootfs removed) holds no
//     mount: Gone, unless the recorded id is still in mountinfo (of
//     id.Source's filesystem, when that can be seen): the root was moved
//     with the mount, which is not touched (error, ErrOutsideRoot).
//
// EBUSY is retried with bounded backoff while ctx lasts. It works the same
// inside InNamespace (the thread's namespace and root). Needs statx mount
// ids (Linux 5.8).
func UnmountOwn(ctx context.Context, root, mountPoint string, id Identity) (Result, error) {
	r, err := unmountOwn(ctx, root, mountPoint, id)
	if err != nil {
		return r, fmt.Errorf("unmount mount %d at %s: %w", id.ID, mountPoint, err)
	}
	return r, nil
}

func unmountOwn(ctx context.Context, root, mountPoint string, id Identity) (Result, error) {
	rootDir, err := os.OpenFile(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return rootGone(root, id)
	}
	if err != nil {
		return Result{}, err
	}
	defer rootDir.Close()
	// The recorded mount point is canonical: a root string it starts with
	// is canonical too (the root is trusted). Only another spelling of
	// the root needs the kernel's name for it.
	rootPath := filepath.Clean(root)
	if !within(rootPath, filepath.Clean(mountPoint)) {
		if rootPath, err = procfs.ProcSelfFdReadlink(rootDir); err != nil {
			return Result{}, fmt.Errorf("read path of root %s: %w", root, err)
		}
	}
	in := inRoot{dir: rootDir, path: rootPath}
	rel, ok := in.rel(mountPoint)
	if !ok {
		return Result{}, fmt.Errorf("%w: %s is not below %s", ErrOutsideRoot, mountPoint, rootPath)
	}
	if id.uniqueGone() {
		return Result{Where: Gone}, nil
	}
	if id.ID == 0 {
		if id.ID, err = in.madeAt(rel, id); err != nil || id.ID == 0 {
			return Result{Where: Gone}, err
		}
	}
	// Mount ids are reused once a mount is gone: the mount's root must
	// also be the recorded root (or, not recorded, the source's inode).
	src, recorded := id.root()
	done, err := in.unmountIfAt(ctx, rel, id.ID, src, recorded)
	if err != nil || done {
		return Result{Where: AtRecorded, Path: mountPoint}, err
	}
	info, err := mountByID(id.ID)
	if err != nil {
		return Result{}, err
	}
	if info == nil {
		return Result{Where: Gone}, nil
	}
	if src == nil && !recorded {
		return Result{}, fmt.Errorf("%w: mount %d at %s", ErrUnverified, id.ID, info.Mountpoint)
	}
	if src != nil && (uint32(info.Major) != unix.Major(src.Dev) || uint32(info.Minor) != unix.Minor(src.Dev)) {
		return Result{Where: Gone}, nil // that id now names a mount of another filesystem
	}
	rel, ok = in.rel(info.Mountpoint)
	if !ok {
		return Result{}, fmt.Errorf("%w: it moved to %s, not below %s: not touched", ErrOutsideRoot, info.Mountpoint, rootPath)
	}
	done, err = in.unmountIfAt(ctx, rel, id.ID, src, recorded)
	if err != nil {
		return Result{}, err
	}
	if !done {
		return Result{}, fmt.Errorf("%w: mount %d at %s", ErrCovered, id.ID, info.Mountpoint)
	}
	where := Moved
	if info.Mountpoint == filepath.Clean(mountPoint) {
		where = AtRecorded
	}
	return Result{Where: where, Path: info.Mountpoint}, nil
}

// rootGone is UnmountOwn for a root that does not exist: see there.
func rootGone(root string, id Identity) (Result, error) {
	if id.ID == 0 || id.uniqueGone() {
		return Result{Where: Gone}, nil
	}
	info, err := mountByID(id.ID)
	if err != nil {
		return Result{}, err
	}
	src, _ := id.root()
	if info == nil || (src != nil && (uint32(info.Major) != unix.Major(src.Dev) || uint32(info.Minor) != unix.Minor(src.Dev))) {
		return Result{Where: Gone}, nil
	}
	return Result{}, fmt.Errorf("%w: root %s is gone and the mount is at %s: not touched", ErrOutsideRoot, root, info.Mountpoint)
}

// inRoot is a trusted root directory: a handle and its path.
type inRoot struct {
	dir  *os.File
	path string
}

// rel returns p relative to the root, if p is at or below it.
func (in inRoot) rel(p string) (string, bool) {
	p = filepath.Clean(p)
	if in.path == "/" {
		return strings.TrimPrefix(p, "/"), filepath.IsAbs(p)
	}
	if !within(in.path, p) {
		return "", false
	}
	return strings.TrimPrefix(strings.TrimPrefix(p, in.path), "/"), true
}

// parent opens the parent directory of rel inside the root, following no
// symlink; ok=false when the path is not there as recorded any more.
func (in inRoot) parent(rel string) (dir *os.File, name string, ok bool, err error) {
	dirRel, name := filepath.Split(rel)
	if name == "" {
		return nil, "", false, errors.New("the root itself is not a mount this can remove")
	}
	if dirRel == "" {
		dirRel = "."
	}
	fd, err := unix.Openat2(int(in.dir.Fd()), dirRel, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	switch {
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR), errors.Is(err, unix.ELOOP):
		return nil, "", false, nil
	case err != nil:
		return nil, "", false, &os.PathError{Op: "openat2", Path: filepath.Join(in.path, dirRel), Err: err}
	}
	return os.NewFile(uintptr(fd), filepath.Join(in.path, dirRel)), name, true, nil
}

// madeAt identifies, for a record without a mount id, the mount at rel
// that is ours: on top there, not the recorded parent, its root the
// source's inode. 0 when there is none.
func (in inRoot) madeAt(rel string, id Identity) (uint64, error) {
	dir, name, ok, err := in.parent(rel)
	if err != nil || !ok {
		return 0, err
	}
	defer dir.Close()
	top, err := mountIDAt(int(dir.Fd()), name)
	if errors.Is(err, unix.ENOENT) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	if top == id.Parent {
		return 0, nil
	}
	if src, _ := id.root(); src == nil || !sameInode(dir, name, src) {
		return 0, nil
	}
	return top, nil
}

// sameInode reports whether name in dir (not followed) is the inode src;
// true when src is nil.
func sameInode(dir *os.File, name string, src *unix.Stat_t) bool {
	if src == nil {
		return true
	}
	var got unix.Stat_t
	if err := unix.Fstatat(int(dir.Fd()), name, &got, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return false
	}
	return got.Dev == src.Dev && got.Ino == src.Ino
}

// unmountIfAt unmounts mount id if it is the top mount at rel and its
// root is the inode src (any root when src is nil and recorded: the
// mounts inside ours), first clearing the mounts inside it when it is
// busy. false when it is not there, or its id names a mount with another
// root now. With its id there and no root to check it by (src nil, not
// recorded): ErrUnverified, never "not there".
func (in inRoot) unmountIfAt(ctx context.Context, rel string, id uint64, src *unix.Stat_t, recorded bool) (bool, error) {
	dir, name, ok, err := in.parent(rel)
	if err != nil || !ok {
		return false, err
	}
	defer dir.Close()
	gone := false // the mount is not (or no more) at rel
	err = retryBusy(ctx, func() error {
		top, err := mountIDAt(int(dir.Fd()), name)
		if errors.Is(err, unix.ENOENT) {
			gone = true
			return nil
		}
		if err != nil {
			return &os.PathError{Op: "statx", Path: filepath.Join(dir.Name(), name), Err: err}
		}
		if top != id {
			gone = true
			return nil
		}
		if src == nil && !recorded {
			return fmt.Errorf("%w: mount %d at %s", ErrUnverified, id, filepath.Join(dir.Name(), name))
		}
		if !sameInode(dir, name, src) {
			gone = true // that id names another mount now
			return nil
		}
		err = unmountAt(dir, name)
		if errors.Is(err, unix.EINVAL) {
			gone = true
			return nil
		}
		return err
	}, func() (bool, error) { return in.unmountChildren(ctx, id, filepath.Join(in.path, rel)) })
	if err != nil {
		return false, err
	}
	return !gone, nil
}

// unmountChildren unmounts, by id, the mounts whose parent is mount id
// (last mounted first) and reports whether it unmounted any. A child on
// top of id's own mount point covers it: ErrCovered, nothing touched.
func (in inRoot) unmountChildren(ctx context.Context, id uint64, at string) (bool, error) {
	children, err := List(func(m *mountinfo.Info) (bool, bool) { return m.Parent != int(id), false })
	if err != nil {
		return false, err
	}
	for _, c := range children {
		if c.Mountpoint == at {
			return false, fmt.Errorf("%w: mount %d (%s) is on top of it", ErrCovered, c.ID, c.FSType)
		}
	}
	cleared := false
	for i := len(children) - 1; i >= 0; i-- {
		rel, ok := in.rel(children[i].Mountpoint)
		if !ok {
			continue
		}
		done, err := in.unmountIfAt(ctx, rel, uint64(children[i].ID), nil, true)
		if err != nil {
			return false, err
		}
		cleared = cleared || done
	}
	return cleared, nil
}

// Locate returns where the mount of identity id is in the calling
// thread's mount namespace, wherever it was moved to (a parent directory
// renamed): its mount point, or "" when it is gone or no id was recorded.
// A mount with the recorded id but another unique id, or of another
// filesystem than the recorded root's, is not it; without a unique id
// (Linux before 6.8) a reused id of the same filesystem is taken for it,
// so a caller that would make the mount again when it is gone makes none.
func Locate(id Identity) (string, error) {
	if id.ID == 0 || id.uniqueGone() {
		return "", nil
	}
	info, err := mountByID(id.ID)
	if err != nil || info == nil {
		return "", err
	}
	if src, _ := id.root(); src != nil && (uint32(info.Major) != unix.Major(src.Dev) || uint32(info.Minor) != unix.Minor(src.Dev)) {
		return "", nil
	}
	return info.Mountpoint, nil
}

// mountByID returns the calling thread's mountinfo entry of mount id, or
// nil.
func mountByID(id uint64) (*mountinfo.Info, error) {
	ms, err := List(func(m *mountinfo.Info) (bool, bool) {
		hit := m.ID == int(id)
		return !hit, hit
	})
	if err != nil || len(ms) == 0 {
		return nil, err
	}
	return ms[0], nil
}

// unmountAt unmounts the top mount at name in dir, through the handle:
// never by a path looked up again from a root. On a thread in the
// process's own mount namespace the handle is reached as
// /proc/self/fd/<fd>; on an InNamespace thread (whose /proc belongs to the
// container) through the thread's own working directory, which
// InNamespace has unshared.
func unmountAt(dir *os.File, name string) error {
	if _, other := nsThreads.Load(unix.Gettid()); !other {
		return unix.Unmount("/proc/self/fd/"+strconv.Itoa(int(dir.Fd()))+"/"+name, unix.UMOUNT_NOFOLLOW)
	}
	if err := unix.Fchdir(int(dir.Fd())); err != nil {
		return fmt.Errorf("fchdir %s: %w", dir.Name(), err)
	}
	err := unix.Unmount(name, unix.UMOUNT_NOFOLLOW)
	// A working directory inside a mount would keep it busy.
	if cerr := unix.Chdir("/"); cerr != nil && err == nil {
		err = fmt.Errorf("chdir /: %w", cerr)
	}
	return err
}
