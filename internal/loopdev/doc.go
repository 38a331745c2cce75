// Package loopdev attaches regular files to Linux loop devices and finds and
// detaches them again, through the loop ioctls (no losetup).
//
// It keeps no state: the kernel is the record. Find answers "which loop
// device is backed by this file" from /sys/block/loop*/loop/backing_file,
// comparing the backing file's device and inode numbers rather than its path,
// so it keeps working after a restart and is not fooled by a file replaced at
// the same path. Detach checks the same identity through LOOP_GET_STATUS64
// right before LOOP_CLR_FD, so it never detaches a device that was reused for
// another file in between. A read-only device (Options.ReadOnly, a
// read-only policy, BLKROSET) gets its policy lifted once it is unbound,
// by Detach or, for one the kernel detaches by itself (AutoClear), by
// ReleaseReadOnly after its last user is gone: the policy outlives the
// binding, and the host's next attacher would get a device that refuses
// writes. A device unbound with nobody calling either (its holder killed)
// keeps the policy until Attach, which sets it either way, reuses it.
//
// Use AutoClear for devices that a mounted filesystem keeps open: the kernel
// then detaches the device by itself once the last user (the mount) goes
// away, and a process that dies between attaching and mounting leaks nothing.
// Do not use AutoClear for a device that nobody holds open (a bind-mounted
// device node does not count): it would be detached as soon as Attach's
// caller closes it.
//
// Needs CAP_SYS_ADMIN.
package loopdev
