package mount

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// BlockReadOnly reports whether the block device node at path refuses
// writes (BLKROGET): what a block volume's read-only publish must give,
// since a read-only bind of a device node does not stop writes. A plugin
// that ignores CSI readonly for block (csi-driver-host-path does) publishes
// its writable device there.
//
// Do not paper over a writable one with a read-only loop device of one's
// own: any process that can open a loop device, read-only and without a
// capability, can detach it (LOOP_CLR_FD) or, read-only loop devices only,
// swap its backing file (LOOP_CHANGE_FD); a container given one could then
// reach whatever device takes its number next, or change what the other
// readers read.
func BlockReadOnly(path string) (bool, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return false, err
	}
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return false, &os.PathError{Op: "fstat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return false, fmt.Errorf("%s is not a block device", path)
	}
	ro, err := unix.IoctlGetInt(int(f.Fd()), unix.BLKROGET)
	if err != nil {
		return false, &os.PathError{Op: "BLKROGET", Path: path, Err: err}
	}
	return ro != 0, nil
}
