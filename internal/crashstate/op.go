package crashstate

import (
	"fmt"
	"io/fs"
	"sync"
)

// OpKind is the kind of an Op.
type OpKind int

// The kinds of operation the model replays.
const (
	// OpOpen opens Path for writing (or creates or truncates it) as Fd:
	// Create, Trunc, Append and Mode (already masked by the umask) apply.
	OpOpen OpKind = iota + 1
	// OpWrite writes Data at Offset, or at the fd's offset if Offset < 0.
	OpWrite
	// OpSeek sets the fd's offset to Offset.
	OpSeek
	// OpTruncate sets the size of the file to Size.
	OpTruncate
	// OpFallocate allocates [Offset, Offset+Size): it zero-fills when
	// ZeroRange is set and extends the file unless KeepSize is set.
	OpFallocate
	// OpFsync makes the content (file) or the entries (directory) durable.
	OpFsync
	// OpSync makes everything durable.
	OpSync
	// OpMkdir creates the directory Path with Mode.
	OpMkdir
	// OpRemove removes the entry Path (unlink or rmdir).
	OpRemove
	// OpRename moves the entry Path to NewPath, replacing NewPath; with
	// Exchange it swaps the two entries.
	OpRename
	// OpLink adds the entry NewPath for the inode of Path.
	OpLink
	// OpSymlink creates the symlink Path pointing to Target.
	OpSymlink
	// OpChmod sets the permission bits of Path to Mode.
	OpChmod
	// OpDup makes NewFd share the open file description of Fd.
	OpDup
)

var opKindNames = map[OpKind]string{
	OpOpen: "open", OpWrite: "write", OpSeek: "seek", OpTruncate: "truncate",
	OpFallocate: "fallocate", OpFsync: "fsync", OpSync: "sync", OpMkdir: "mkdir",
	OpRemove: "remove", OpRename: "rename", OpLink: "link", OpSymlink: "symlink",
	OpChmod: "chmod", OpDup: "dup",
}

func (k OpKind) String() string {
	if s, ok := opKindNames[k]; ok {
		return s
	}
	return fmt.Sprintf("OpKind(%d)", int(k))
}

// Op is one operation on the model. Paths are relative to the root of the
// trace ("." is the root itself) and use "/" as separator.
//
// An operation on a file descriptor has Fd >= 0 and Path set to the path
// strace printed for the descriptor (-y), with Deleted set if the kernel
// reported it as deleted; it is resolved in the model when it is replayed.
type Op struct {
	Kind    OpKind
	Line    int // line number in the strace log (1-based)
	Fd      int // -1 unless the operation goes through a file descriptor
	NewFd   int // OpDup
	Path    string
	Deleted bool
	NewPath string // OpRename, OpLink
	Target  string // OpSymlink
	Data    []byte // OpWrite
	Offset  int64  // OpWrite (-1: the fd's offset), OpSeek, OpFallocate
	Size    int64  // OpTruncate, OpFallocate
	Mode    fs.FileMode

	Create, Trunc, Append bool // OpOpen; Append also for OpWrite (RWF_APPEND)
	// ReadOnly: an OpOpen that changes nothing; it binds the descriptor
	// to the file or directory, so that an fsync through it after the
	// name is unlinked (strace prints "(deleted)") still reaches it.
	ReadOnly            bool
	KeepSize, ZeroRange bool // OpFallocate
	NoReplace, Exchange bool // OpRename
	Follow              bool // OpLink: follow a symlink at Path
}

func (o Op) String() string {
	s := fmt.Sprintf("line %d: %s", o.Line, o.Kind)
	if o.Fd >= 0 {
		s += fmt.Sprintf(" fd %d", o.Fd)
	}
	if o.Kind != OpSync {
		s += " " + o.Path
	}
	if o.Deleted {
		s += " (deleted)"
	}
	switch o.Kind {
	case OpRename, OpLink:
		s += " -> " + o.NewPath
	case OpSymlink:
		s += " -> " + o.Target
	case OpWrite:
		s += fmt.Sprintf(" %d bytes at %d", len(o.Data), o.Offset)
	case OpTruncate:
		s += fmt.Sprintf(" to %d", o.Size)
	case OpDup:
		s += fmt.Sprintf(" as fd %d", o.NewFd)
	}
	return s
}

// Marker is a point the traced workload announced with Mark. Op is the
// number of ops that completed before it, so States(init, m.Op, ...) are
// the crash states at the marker.
type Marker struct {
	Text string
	Op   int
}

// Trace is the sequence of operations under one root directory, as read by
// Parse. Its methods are safe for concurrent use; they share a replay
// cache, so asking for increasing k is fast.
type Trace struct {
	Root    string // the absolute root directory the paths are relative to
	Ops     []Op
	Markers []Marker

	mu    sync.Mutex
	cache *replayer
}
