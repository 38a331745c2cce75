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

// The statmount(2) request and answer, as include/uapi/linux/mount.h has
// them (the answer's fixed part; its strings follow at statmountStrings).
type mntIDReq struct {
	Size  uint32
	Spare uint32
	MntID uint64
	Param uint64
}

const (
	mntIDReqSizeVer0   = 24
	statmountSBBasic   = 0x1
	statmountMntBasic  = 0x2
	statmountMntRoot   = 0x8
	statmountStrings   = 512 // offsetof(struct statmount, str)
	offSBDevMajor      = 16
	offSBDevMinor      = 20
	offMntPropagation  = 72
	offMntPeerGroup    = 80
	offMntMaster       = 88
	offMntRoot         = 104
	statmountMaxBuffer = 1 << 16
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
	req := mntIDReq{Size: mntIDReqSizeVer0, MntID: stx.Mnt_id, Param: statmountSBBasic | statmountMntBasic | statmountMntRoot}
	for size := 4096; ; size *= 2 {
		buf := make([]byte, size)
		_, _, errno := unix.Syscall6(unix.SYS_STATMOUNT, uintptr(unsafe.Pointer(&req)), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), 0, 0, 0)
		switch {
		case errno == unix.EOVERFLOW && size < statmountMaxBuffer:
			continue
		case errno == unix.ENOSYS || errno == unix.EPERM:
			// No statmount, or a seccomp filter that refuses the
			// syscalls it does not know (EPERM): read the table.
			return nil, errNoStatmount
		case errno != 0:
			return nil, &os.PathError{Op: "statmount", Path: path, Err: errno}
		}
		return parseStatmount(buf)
	}
}

// parseStatmount reads the fields statmount asked for from the kernel's
// answer.
func parseStatmount(buf []byte) (*mountinfo.Info, error) {
	le := binary.NativeEndian
	mask := le.Uint64(buf[8:])
	const want = statmountSBBasic | statmountMntBasic | statmountMntRoot
	if mask&want != want {
		return nil, fmt.Errorf("statmount answered mask %#x, want %#x", mask, want)
	}
	root := buf[statmountStrings+int(le.Uint32(buf[offMntRoot:])):]
	end := 0
	for end < len(root) && root[end] != 0 {
		end++
	}
	if end == len(root) {
		return nil, errors.New("statmount: mount root not terminated")
	}
	m := &mountinfo.Info{
		Major: int(le.Uint32(buf[offSBDevMajor:])),
		Minor: int(le.Uint32(buf[offSBDevMinor:])),
		Root:  string(root[:end]),
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
