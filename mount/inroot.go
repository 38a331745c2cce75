package mount

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"

	pathrs "github.com/cyphar/filepath-securejoin/pathrs-lite"
	"github.com/cyphar/filepath-securejoin/pathrs-lite/procfs"
	"golang.org/x/sys/unix"
)

// ErrKind is returned (wrapped) when a path resolves to the wrong type of
// file: a directory where a file was wanted or the other way round, or a bind
// of a directory onto a file.
var ErrKind = errors.New("wrong file type")

// ErrOutsideRoot is returned (wrapped) by ResolveInRoot when the handle it
// got is not below the root any more. Resolution itself cannot escape the
// root; this only happens when a directory on the path was moved out of the
// root while it was being walked.
var ErrOutsideRoot = errors.New("resolved outside the root")

// TargetKind says what ResolveInRoot must find or create at the end of the
// path.
type TargetKind int

const (
	// Directory is a directory, the mount point of a filesystem volume.
	// Missing directories are created.
	Directory TargetKind = iota
	// File is any non-directory, the mount point of a block volume (a
	// device node is bind-mounted onto it). A missing one is created as an
	// empty regular file.
	File
)

func (k TargetKind) String() string {
	switch k {
	case Directory:
		return "directory"
	case File:
		return "file"
	}
	return fmt.Sprintf("TargetKind(%d)", int(k))
}

// Modes of what ResolveInRoot creates. They are set with fchmod after
// creation, so the process umask does not matter.
const (
	targetDirMode  = 0o755
	targetFileMode = 0o644
)

// ResolveInRoot resolves unsafePath inside root as if root were "/" (a
// chroot), creates what is missing, and returns an O_PATH handle of the
// target and the target's real path on the host (read back from the handle
// through procfs; also the handle's Name). Pass the handle to BindInto and
// record the host path for the later unmount (UnmountOwn) and cleanup.
//
// Resolution uses openat2(RESOLVE_IN_ROOT) through pathrs-lite, so no
// symlink, absolute or relative, and no ".." can leave root: "..", at the
// root stays at the root, and a symlink to "/etc" means <root>/etc. Parent
// directories are followed, symlinks included, the same way.
//
// Missing directories are created one by one with mkdirat on the handle of
// their parent (never by path), opened without following symlinks, set to
// mode 0755 and, when uid or gid is >= 0, chowned to them (a negative one is
// left unchanged). Ownership is changed through the handles after the whole
// chain exists, deepest first, so no directory being worked on is writable
// by uid/gid before its children exist. Existing directories are never
// chowned. Components still missing may not contain "..": that fails with
// ENOENT (what ".." means there depends on what the missing components would
// have been).
//
// kind says what the final component must be:
//
//   - Directory: a directory (ErrKind otherwise); created when missing.
//     An empty unsafePath (or "/") is the root itself.
//   - File: any non-directory (ErrKind for a directory), typically an
//     empty regular file or a device node. When missing it is created, with
//     its parents, as an empty regular file (mode 0644, chowned as above)
//     with openat(O_CREAT|O_EXCL|O_NOFOLLOW) on the parent's handle, so a
//     symlink planted there is never followed.
//
// A final component that is a symlink is resolved inside root like every
// other: "/data -> /etc" gives <root>/etc, which then must be of the wanted
// kind. A dangling one (its target does not exist inside root) is an error
// for both kinds: nothing is created through it.
//
// Defence in depth: the host path of the result must be root or below it
// (ErrOutsideRoot otherwise), and must not have been deleted.
//
// root itself is trusted (it is the caller's rootfs path): symlinks in it are
// followed. The caller closes the handle.
func ResolveInRoot(root, unsafePath string, kind TargetKind, uid, gid int) (*os.File, string, error) {
	h, hostPath, err := resolveInRoot(root, unsafePath, kind, owner{uid, gid})
	if err != nil {
		return nil, "", fmt.Errorf("resolve %q in root %s as %s: %w", unsafePath, root, kind, err)
	}
	return h, hostPath, nil
}

type owner struct{ uid, gid int }

// chown changes the owner of fd when uid or gid is set (>= 0).
func (o owner) chown(f *os.File) error {
	if o.uid < 0 && o.gid < 0 {
		return nil
	}
	uid, gid := max(o.uid, -1), max(o.gid, -1)
	if err := unix.Fchownat(int(f.Fd()), "", uid, gid, unix.AT_EMPTY_PATH); err != nil {
		return &os.PathError{Op: "chown", Path: f.Name(), Err: err}
	}
	return nil
}

func resolveInRoot(root, unsafePath string, kind TargetKind, own owner) (*os.File, string, error) {
	if kind != Directory && kind != File {
		return nil, "", fmt.Errorf("%w: unknown kind", ErrKind)
	}
	rootDir, err := openRoot(root)
	if err != nil {
		return nil, "", err
	}
	defer rootDir.Close()
	rootPath, err := procfs.ProcSelfFdReadlink(rootDir)
	if err != nil {
		return nil, "", fmt.Errorf("read path of root: %w", err)
	}
	parts := splitPath(unsafePath)
	var h *os.File
	if kind == Directory {
		h, err = mkdirAllInRoot(rootDir, parts, own)
	} else {
		h, err = createFileInRoot(rootDir, parts, own)
	}
	if err != nil {
		return nil, "", err
	}
	hostPath, err := checkTarget(h, kind, rootPath)
	if err != nil {
		h.Close()
		return nil, "", err
	}
	if h.Name() != hostPath {
		return renamed(h, hostPath)
	}
	return h, hostPath, nil
}

// PinRoot opens dir with no symlink anywhere on the way (openat2
// RESOLVE_NO_SYMLINKS) and returns a root for ResolveInRoot that names
// that directory whatever dir leads to later ("/proc/self/fd/N": taken
// as the descriptor itself, never resolved again, so that it also holds
// on a thread in another mount namespace, whose /proc is not the
// agent's), and the func that closes it. For a root its owner could swap
// for a symlink between a check of it and its use.
func PinRoot(dir string) (string, func(), error) {
	fd, err := unix.Openat2(unix.AT_FDCWD, dir, &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_NO_SYMLINKS,
	})
	if err != nil {
		return "", nil, fmt.Errorf("open %s with no symlink on the way: %w", dir, err)
	}
	return pinnedPrefix + strconv.Itoa(fd), func() { unix.Close(fd) }, nil
}

// pinnedPrefix starts the roots PinRoot returns.
const pinnedPrefix = "/proc/self/fd/"

// openRoot opens root: a root PinRoot pinned is a copy of its descriptor.
func openRoot(root string) (*os.File, error) {
	if n, ok := strings.CutPrefix(root, pinnedPrefix); ok {
		if fd, err := strconv.Atoi(n); err == nil && strconv.Itoa(fd) == n {
			dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
			if err != nil {
				return nil, fmt.Errorf("pinned root %s: %w", root, err)
			}
			return os.NewFile(uintptr(dup), root), nil
		}
	}
	return os.OpenFile(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
}

// checkTarget checks the final handle: its kind, that it is still linked,
// and that it is below rootPath. It returns its host path.
func checkTarget(h *os.File, kind TargetKind, rootPath string) (string, error) {
	var st unix.Stat_t
	if err := unix.Fstat(int(h.Fd()), &st); err != nil {
		return "", &os.PathError{Op: "fstat", Path: h.Name(), Err: err}
	}
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	switch {
	case kind == Directory && !isDir:
		return "", fmt.Errorf("%w: %s is a %s, not a directory", ErrKind, h.Name(), fileType(st.Mode))
	case kind == File && isDir:
		return "", fmt.Errorf("%w: %s is a directory, want a file", ErrKind, h.Name())
	case st.Nlink == 0:
		return "", fmt.Errorf("%s: removed while being resolved: %w", h.Name(), unix.ENOENT)
	}
	hostPath, err := procfs.ProcSelfFdReadlink(h)
	if err != nil {
		return "", fmt.Errorf("read path of %s: %w", h.Name(), err)
	}
	if !within(rootPath, hostPath) {
		return "", fmt.Errorf("%w: %s is not below %s", ErrOutsideRoot, hostPath, rootPath)
	}
	return hostPath, nil
}

// renamed returns a handle of the same file named path, closing h.
func renamed(h *os.File, path string) (*os.File, string, error) {
	defer h.Close()
	fd, err := unix.FcntlInt(h.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, "", fmt.Errorf("dup handle of %s: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), path, nil
}

// mkdirAllInRoot returns an O_PATH handle of the directory at parts inside
// root, creating the missing ones.
func mkdirAllInRoot(root *os.File, parts []string, own owner) (*os.File, error) {
	start, missing, err := lookupPartial(root, parts)
	if err != nil {
		return nil, err
	}
	handles := []*os.File{start}
	defer func() {
		for _, h := range handles {
			h.Close()
		}
	}()
	if slices.Contains(missing, "..") {
		return nil, fmt.Errorf("missing part %q of the path contains \"..\": %w", strings.Join(missing, "/"), unix.ENOENT)
	}

	var made []*os.File // the directories created here, top down
	for _, name := range missing {
		dir := handles[len(handles)-1]
		path := dir.Name() + "/" + name
		// mkdirat never follows a symlink in its last component. EEXIST:
		// someone else made it meanwhile; use it if it is a real
		// directory, but do not chown it.
		mkErr := unix.Mkdirat(int(dir.Fd()), name, 0o700)
		if mkErr != nil && !errors.Is(mkErr, unix.EEXIST) {
			return nil, &os.PathError{Op: "mkdirat", Path: path, Err: mkErr}
		}
		fd, err := unix.Openat2(int(dir.Fd()), name, &unix.OpenHow{
			Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_XDEV,
		})
		if err != nil {
			if link, lerr := readlinkat(dir, name); lerr == nil {
				return nil, fmt.Errorf("%s: symlink to %q, which does not exist inside the root: %w", path, link, unix.ENOENT)
			}
			return nil, &os.PathError{Op: "openat2", Path: path, Err: err}
		}
		next := os.NewFile(uintptr(fd), path)
		handles = append(handles, next)
		if mkErr == nil {
			made = append(made, next)
		}
	}
	for i := len(made) - 1; i >= 0; i-- {
		if err := unix.Fchmod(int(made[i].Fd()), targetDirMode); err != nil {
			return nil, &os.PathError{Op: "chmod", Path: made[i].Name(), Err: err}
		}
		if err := own.chown(made[i]); err != nil {
			return nil, err
		}
	}

	last := handles[len(handles)-1]
	var st unix.Stat_t
	if err := unix.Fstat(int(last.Fd()), &st); err != nil {
		return nil, &os.PathError{Op: "fstat", Path: last.Name(), Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, fmt.Errorf("%w: %s is a %s, not a directory", ErrKind, last.Name(), fileType(st.Mode))
	}
	// "." of a directory handle is that same directory: no name lookup.
	fd, err := unix.Openat(int(last.Fd()), ".", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "openat", Path: last.Name(), Err: err}
	}
	return os.NewFile(uintptr(fd), last.Name()), nil
}

// createFileInRoot returns an O_PATH handle of the non-directory at parts
// inside root, creating it (and its parents) when missing.
func createFileInRoot(root *os.File, parts []string, own owner) (*os.File, error) {
	if len(parts) == 0 {
		return nil, fmt.Errorf("%w: the root is a directory, want a file", ErrKind)
	}
	joined := strings.Join(parts, "/")
	h, err := pathrs.OpenatInRoot(root, joined)
	if err == nil || !errors.Is(err, unix.ENOENT) {
		return h, err
	}
	name := parts[len(parts)-1]
	if name == ".." {
		return nil, fmt.Errorf("missing path %q ends in \"..\": %w", joined, unix.ENOENT)
	}
	parent, err := mkdirAllInRoot(root, parts[:len(parts)-1], own)
	if err != nil {
		return nil, err
	}
	defer parent.Close()
	path := parent.Name() + "/" + name
	fd, err := unix.Openat(int(parent.Fd()), name, unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if errors.Is(err, unix.EEXIST) {
		// Created by someone else since the lookup, or a dangling
		// symlink: O_CREAT|O_EXCL never follows one. Look again, inside
		// the root.
		h, err := pathrs.OpenatInRoot(root, joined)
		if err == nil {
			return h, nil
		}
		if link, lerr := readlinkat(parent, name); lerr == nil {
			return nil, fmt.Errorf("%s: symlink to %q, which does not exist inside the root: %w", path, link, err)
		}
		return nil, err
	}
	if err != nil {
		return nil, &os.PathError{Op: "create", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	if err := unix.Fchmod(fd, targetFileMode); err != nil {
		return nil, &os.PathError{Op: "chmod", Path: path, Err: err}
	}
	if err := own.chown(f); err != nil {
		return nil, err
	}
	// Through /proc/thread-self/fd: the same inode, no name lookup.
	h, err = pathrs.Reopen(f, unix.O_PATH|unix.O_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("reopen %s as O_PATH: %w", path, err)
	}
	return h, nil
}

// lookupPartial opens the deepest existing prefix of parts inside root and
// returns it with the components that do not exist.
func lookupPartial(root *os.File, parts []string) (*os.File, []string, error) {
	for i := len(parts); i > 0; i-- {
		h, err := pathrs.OpenatInRoot(root, strings.Join(parts[:i], "/"))
		if err == nil {
			return h, parts[i:], nil
		}
		if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENOTDIR) {
			return nil, nil, err
		}
	}
	h, err := pathrs.OpenatInRoot(root, ".")
	return h, parts, err
}

// readlinkat reads the symlink name in dir.
func readlinkat(dir *os.File, name string) (string, error) {
	buf := make([]byte, unix.PathMax)
	n, err := unix.Readlinkat(int(dir.Fd()), name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// splitPath splits a slash-separated path into its components, dropping
// empty ones and "." (which mean nothing) but keeping ".." (whose meaning
// depends on symlinks, so the kernel resolves it).
func splitPath(p string) []string {
	var parts []string
	for c := range strings.SplitSeq(p, "/") {
		if c != "" && c != "." {
			parts = append(parts, c)
		}
	}
	return parts
}

// within reports whether path is root or below it; both are clean absolute
// paths.
func within(root, path string) bool {
	return root == "/" || path == root || strings.HasPrefix(path, root+"/")
}

func fileType(mode uint32) string {
	switch mode & unix.S_IFMT {
	case unix.S_IFDIR:
		return "directory"
	case unix.S_IFREG:
		return "regular file"
	case unix.S_IFLNK:
		return "symlink"
	case unix.S_IFCHR:
		return "character device"
	case unix.S_IFBLK:
		return "block device"
	case unix.S_IFIFO:
		return "fifo"
	case unix.S_IFSOCK:
		return "socket"
	}
	return fmt.Sprintf("file of mode %#o", mode)
}

// BindInto bind-mounts source onto the file or directory that target (a
// handle from ResolveInRoot) refers to, with the new mount API, so nothing is
// looked up by name between the resolution and the mount. It is CloneTree
// then MoveTree:
//
//  1. open_tree(source, OPEN_TREE_CLONE|AT_RECURSIVE) makes a detached copy
//     of the mount tree at source, submounts included (like mount --rbind;
//     unlike Bind). source is a trusted host path: symlinks in it are
//     followed.
//  2. With readOnly, mount_setattr(MOUNT_ATTR_RDONLY, AT_RECURSIVE) makes the
//     whole copy read-only while it is still detached, so it is never
//     writable at the target, not even for an instant. Other flags (nosuid,
//     nodev, ...) are kept as they are on source.
//  3. move_mount attaches the copy onto the inode target refers to, wherever
//     that is now: renaming or replacing the path after ResolveInRoot does not
//     redirect the mount.
//
// Directories bind onto directories and anything else onto non-directories
// (ErrKind otherwise). Stacking on an existing mount is allowed, as with
// mount(2). On any error nothing is left mounted: the detached copy is
// dropped when its descriptor is closed.
//
// source and target must be in the caller's mount namespace. To bind into
// another one (a container's), call CloneTree here and MoveTree inside
// InNamespace.
func BindInto(source string, target *os.File, readOnly bool) error {
	if err := bindInto(source, target, readOnly); err != nil {
		return fmt.Errorf("bind %s into %s: %w", source, target.Name(), err)
	}
	return nil
}

func bindInto(source string, target *os.File, readOnly bool) error {
	tree, err := cloneTree(source, readOnly)
	if err != nil {
		return err
	}
	// After a successful move closing the descriptor leaves the mount
	// alone; before, it unmounts the detached copy.
	defer tree.Close()
	return moveTree(tree, target, 0)
}
