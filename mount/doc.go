// Package mount is a small Linux layer over mount(2), umount2(2), the mount
// table and the filesystem ioctls that csiagent needs: mounting a block device,
// bind mounts (optionally read-only), idempotent unmounts, mount-table
// lookups, FITRIM and FIFREEZE/FITHAW.
//
// The package holds no state: every function acts on the kernel directly and
// is safe for concurrent use. Callers serialize operations on the same path
// themselves (csiagent locks per volume).
//
// # Contract
//
//   - [Mount] and [Bind] fail if the kernel refuses; they never check the mount
//     table first. A caller that must not stack mounts looks the target up with
//     [Lookup] before calling them.
//   - [Unmount] is idempotent: a missing path or a path that is not a mount
//     point counts as done (ENOENT, EINVAL). EBUSY is retried a bounded
//     number of times, then reported with [ErrBusy]. It never detaches lazily.
//   - [Lookup], [IsMountPoint] and [List] read /proc/self/mountinfo through a
//     filter, in one pass. Paths are resolved (symlinks, "..") first, because
//     the mount table only holds canonical paths.
//   - [Trim], [Freeze] and [Thaw] act on the whole filesystem that holds the
//     path: FITRIM on a bind mount of a subdirectory trims the entire
//     filesystem.
//
// # When not to call it
//
// Do not query the mount table before a mount or an unmount just to decide
// whether to call it: mount, then handle the error; unmount, and let
// [Unmount] treat "not mounted" as done. Do not check the table after a
// successful mount or unmount either: the syscall's result is the answer.
// Do not call [Lookup] in a loop over many paths: call [List] once with a
// filter. Never call [Freeze] without arranging the [Thaw] on a separate
// goroutine with a deadline: a writer blocked on a frozen filesystem cannot be
// killed, so [WhileFrozen] is the safe form.
//
// Everything here needs CAP_SYS_ADMIN except the read-only lookups.
package mount
