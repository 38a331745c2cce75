package mount

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strings"
	"unsafe"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// errNoStatmount: the kernel has no statmount(2) or no unique mount ids
// (both Linux 6.8); callers read the mount table instead.
var errNoStatmount = errors.New("no statmount")

// The statmount(2) and listmount(2) request and statmount's answer, as
// include/uapi/linux/mount.h has them (the answer's fixed part; its
// strings follow at statmountStrings). MntNsID (a request of size
// mntIDReqSizeVer1, Linux 6.11) names the mount namespace to look in; 0:
// the caller's.
type mntIDReq struct {
	Size    uint32
	Spare   uint32
	MntID   uint64
	Param   uint64
	MntNsID uint64
}

const (
	mntIDReqSizeVer0   = 24
	mntIDReqSizeVer1   = 32
	statmountSBBasic   = 0x1
	statmountMntBasic  = 0x2
	statmountMntRoot   = 0x8
	statmountMntPoint  = 0x10
	statmountStrings   = 512 // offsetof(struct statmount, str)
	offSBDevMajor      = 16
	offSBDevMinor      = 20
	offMntPropagation  = 72
	offMntPeerGroup    = 80
	offMntMaster       = 88
	offMntRoot         = 104
	offMntPoint        = 108
	statmountMaxBuffer = 1 << 16
	// lsmtRoot asks listmount for every mount of the namespace.
	lsmtRoot = ^uint64(0)
)

// statmount describes the top mount at path (a mount point; symlinks in
// its last component not followed) from statmount(2), one mount at a time,
// with no mount table read: its device (Major, Minor), its root within
// its filesystem (Root) and its propagation (Optional, as the mount table
// spells it: "shared:N", "master:N"). Kernels before 6.8: errNoStatmount.
func statmount(path string) (*mountinfo.Info, error) {
	var stx unix.Statx_t
	flags := unix.AT_SYMLINK_NOFOLLOW | unix.AT_STATX_DONT_SYNC | unix.AT_NO_AUTOMOUNT
	if err := unix.Statx(unix.AT_FDCWD, path, flags, unix.STATX_MNT_ID_UNIQUE, &stx); err != nil {
		return nil, &os.PathError{Op: "statx", Path: path, Err: err}
	}
	if stx.Mask&unix.STATX_MNT_ID_UNIQUE == 0 {
		return nil, errNoStatmount
	}
	m, err := statmountReq(mntIDReq{Size: mntIDReqSizeVer0, MntID: stx.Mnt_id, Param: statmountSBBasic | statmountMntBasic | statmountMntRoot})
	switch {
	case errors.Is(err, unix.ENOSYS), errors.Is(err, unix.EPERM):
		// No statmount, or a seccomp filter that refuses the syscalls
		// it does not know (EPERM): read the table.
		return nil, errNoStatmount
	case err != nil:
		return nil, &os.PathError{Op: "statmount", Path: path, Err: err}
	}
	return m, nil
}

// statmountReq calls statmount(2) for req (its Param: the fields wanted,
// of those parseStatmount reads) with a buffer grown until the answer
// fits; the kernel's errno is returned as is.
func statmountReq(req mntIDReq) (*mountinfo.Info, error) {
	for size := 4096; ; size *= 2 {
		buf := make([]byte, size)
		_, _, errno := unix.Syscall6(unix.SYS_STATMOUNT, uintptr(unsafe.Pointer(&req)), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), 0, 0, 0)
		switch {
		case errno == unix.EOVERFLOW && size < statmountMaxBuffer:
			continue
		case errno != 0:
			return nil, errno
		}
		return parseStatmount(buf, req.Param)
	}
}

// nsMounts lists the mounts of the mount namespace nsID (its unique id,
// as the nsfs ioctls give it) whose device keep accepts, from
// listmount(2) and statmount(2) (Linux 6.11): no process of the namespace
// is needed. Mount points are as the namespace's root sees them. A mount
// unmounted meanwhile is skipped; the namespace gone is fs.ErrNotExist.
func nsMounts(nsID uint64, keep func(*mountinfo.Info) bool) ([]*mountinfo.Info, error) {
	ids, err := nsMountIDs(nsID)
	if err != nil {
		return nil, err
	}
	return statmountIDs(nsID, ids, keep)
}

// statmountIDs reads the mounts ids of mount namespace nsID (statmount(2))
// that keep keeps; one gone meanwhile is skipped.
func statmountIDs(nsID uint64, ids []uint64, keep func(*mountinfo.Info) bool) ([]*mountinfo.Info, error) {
	var out []*mountinfo.Info
	for _, id := range ids {
		m, err := statmountReq(mntIDReq{Size: mntIDReqSizeVer1, MntID: id, MntNsID: nsID,
			Param: statmountSBBasic | statmountMntBasic | statmountMntRoot | statmountMntPoint})
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("statmount of mount %d in mount namespace %d: %w", id, nsID, err)
		}
		if keep(m) {
			out = append(out, m)
		}
	}
	return out, nil
}

// nsMountIDs lists the ids of the mounts of mount namespace nsID
// (listmount(2), Linux 6.11), whoever sees them.
func nsMountIDs(nsID uint64) ([]uint64, error) {
	var ids []uint64
	req := mntIDReq{Size: mntIDReqSizeVer1, MntID: lsmtRoot, MntNsID: nsID}
	page := make([]uint64, 256)
	for {
		n, _, errno := unix.Syscall6(unix.SYS_LISTMOUNT, uintptr(unsafe.Pointer(&req)), uintptr(unsafe.Pointer(&page[0])), uintptr(len(page)), 0, 0, 0)
		if errno != 0 {
			return nil, fmt.Errorf("listmount of mount namespace %d: %w", nsID, errno)
		}
		ids = append(ids, page[:n]...)
		if int(n) < len(page) {
			return ids, nil
		}
		req.Param = page[n-1] // the next page starts after it
	}
}

// parseStatmount reads the fields asked for (want: the device, the
// propagation and the root, and the mount point if asked) from the
// kernel's answer.
func parseStatmount(buf []byte, want uint64) (*mountinfo.Info, error) {
	le := binary.NativeEndian
	if mask := le.Uint64(buf[8:]); mask&want != want {
		return nil, fmt.Errorf("statmount answered mask %#x, want %#x", mask, want)
	}
	root, err := statmountString(buf, offMntRoot, "mount root")
	if err != nil {
		return nil, err
	}
	m := &mountinfo.Info{
		Major: int(le.Uint32(buf[offSBDevMajor:])),
		Minor: int(le.Uint32(buf[offSBDevMinor:])),
		Root:  root,
	}
	if want&statmountMntPoint != 0 {
		if m.Mountpoint, err = statmountString(buf, offMntPoint, "mount point"); err != nil {
			return nil, err
		}
	}
	var optional []string
	if le.Uint64(buf[offMntPropagation:])&unix.MS_SHARED != 0 {
		optional = append(optional, fmt.Sprintf("shared:%d", le.Uint64(buf[offMntPeerGroup:])))
	}
	if master := le.Uint64(buf[offMntMaster:]); master != 0 {
		optional = append(optional, fmt.Sprintf("master:%d", master))
	}
	m.Optional = strings.Join(optional, " ")
	return m, nil
}

// statmountString is the string of the answer whose offset is at off.
func statmountString(buf []byte, off int, what string) (string, error) {
	str := buf[statmountStrings+int(binary.NativeEndian.Uint32(buf[off:])):]
	end := 0
	for end < len(str) && str[end] != 0 {
		end++
	}
	if end == len(str) {
		return "", fmt.Errorf("statmount: %s not terminated", what)
	}
	return string(str[:end]), nil
}
