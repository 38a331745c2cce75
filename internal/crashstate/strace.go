package crashstate

import (
	"net/url"
	"strings"

	"golang.org/x/sys/unix"
)

// MarkerDir is the directory under which a traced workload marks points in
// its execution. A marker is an access(2) of MarkerDir+"/"+url.PathEscape(text);
// the directory does not exist, so the call fails with ENOENT and has no
// effect, but strace records it.
const MarkerDir = "/csiagent-crash-marker"

// tracedSyscalls are the syscalls StraceArgs asks strace to record: every
// syscall that changes a file or a directory or makes it durable; lseek,
// the dup family, umask, chdir and fchdir (for offsets, descriptors, modes
// and relative paths); and the access family (for markers). The
// in-kernel copies (copy_file_range, sendfile, splice) are recorded only
// so that Parse can reject a copy into the root, whose data it cannot know.
var tracedSyscalls = []string{
	"open", "openat", "openat2", "creat",
	"write", "pwrite64", "writev", "pwritev", "pwritev2", "lseek",
	"dup", "dup2", "dup3", "fcntl", "chdir", "fchdir",
	"copy_file_range", "sendfile", "splice",
	"ftruncate", "truncate", "fallocate",
	"fsync", "fdatasync", "sync", "syncfs",
	"mkdir", "mkdirat", "rmdir", "unlink", "unlinkat",
	"rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat",
	"chmod", "fchmod", "fchmodat", "umask",
	"access", "faccessat", "faccessat2",
}

// StraceArgs returns the strace arguments (without the command to trace)
// that record, into the file out, what Parse reads.
//
// Without --seccomp-bpf: with it, strace 6.1 on Linux 6.18 stopped at
// syscalls it has no name for (statmount, as syscall_0x1c9) and, under
// load, logged a syscall_0x189 (no x86-64 syscall) with an unterminated
// argument list; in the next such run (unnamed calls skipped) the log
// had the removal of a record file it never showed made. Stopping at
// every syscall costs the recording no measurable time here.
func StraceArgs(out string) []string {
	return []string{
		"-f", "-qq", "-e", "signal=none",
		"-y", "-s", "1048576", "-xx",
		"-e", "trace=" + strings.Join(tracedSyscalls, ","),
		"-o", out,
	}
}

// Mark announces the point text to a tracer: Parse turns it into a Marker.
// The access fails with ENOENT, which is expected and ignored.
func Mark(text string) {
	_ = unix.Faccessat(unix.AT_FDCWD, MarkerDir+"/"+url.PathEscape(text), unix.F_OK, 0)
}
