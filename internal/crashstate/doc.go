// Package crashstate generates the disk states a power cut may leave behind
// a traced program, in the manner of ALICE (Pillai et al., "All File Systems
// Are Not Created Equal", OSDI 2014), so that a test can check that a daemon
// recovers from every one of them.
//
// A test records a workload with strace (StraceArgs; the workload may mark
// points with Mark), reads the log with Parse, keeping the operations on
// paths under one root directory, takes the tree under the root before the
// workload with Snapshot, and for an operation boundary k asks States for
// the crash states after the first k operations. Each State can be written
// into an empty directory with Materialize, to be the work directory of a
// fresh daemon.
//
// # Model
//
// Operations are replayed on inodes. A regular file has a current content
// and a durable content (its content at its last fsync or fdatasync, or in
// the initial tree; empty for a file created during the trace). A directory
// has current entries and durable entries (at its last fsync, or in the
// initial tree; none for a directory created during the trace). sync(2) and
// a syncfs(2) through a descriptor under the root make everything durable.
// The root directory always exists. Writes go to the offset of the open file
// description (set by open, O_APPEND, write and lseek) or to pwrite's
// offset; dup(2) shares the description. Descriptors are resolved by the
// path strace -y prints, which is the inode's current name.
//
// A crash state chooses, for each item (a directory whose current entries
// differ from its durable ones, or a file whose current content differs
// from its durable one), the durable or the current state, or for a file a
// torn content: blocks of 512 or 4096 bytes taken from either, with either
// size. The tree is built from the root down following the chosen entries,
// so a file whose entry is not durable is absent unless its directory is
// taken current, and a directory whose entry is lost takes everything below
// it along. This is what POSIX guarantees, no more: fsync of a file does not
// make its name durable, and a rename is only as durable as the two
// directories it changed.
//
// # Not modeled
//
//   - Ordering guarantees of particular file systems beyond POSIX (such as
//     ext4 data=ordered or the rename-over heuristics of ext4 and xfs): the
//     states are a superset of what they leave.
//   - Data written through mmap, extended attributes, ownership, times,
//     O_TMPFILE, fallocate's collapse and insert ranges, sync_file_range.
//   - Mode changes are applied at once and taken as durable; creation modes
//     are masked with the umask the trace shows (022 before its first
//     umask(2) call).
//   - Hard-link counts beyond the entries: an inode is present wherever a
//     chosen entry names it. A directory reached twice in a mix of renames
//     of directories is kept at its first path only.
//   - Offsets moved by read(2); descriptors opened before the trace (taken
//     to be at the end of their file); processes that use the same
//     descriptor number for one file at once (the model keys open files by
//     number and inode, across processes). The working directory for
//     relative paths is followed per thread (chdir, fchdir, and the
//     directory strace prints for AT_FDCWD).
//   - Paths that go through a symlink in a syscall's argument (paths the
//     kernel printed, as for the descriptor an open returns, are resolved).
//   - Failed syscalls, and syscalls cut short by the death of their process
//     (strace prints "= ?"), are dropped.
//   - Renames or links into the root of files from outside it, and
//     in-kernel copies into it (copy_file_range, sendfile, splice): Parse
//     rejects them, since the data is not in the log. Reflinks (the FICLONE
//     ioctl) are not traced. A rename out of the root is a removal.
package crashstate
