// Package atomicfile writes the records a daemon needs after a crash or a
// power cut, so that a reader (or the same daemon after a restart) sees a
// complete version of each, never a torn mix and never another record's.
//
// A Committer owns one directory, its root (the daemon's work dir; New).
// Each Put writes a new version of a record, framed with the record's
// identity (its path below the root), a generation and a CRC32C, into a
// slot of the record's file that holds nothing a crash may still need
// (see record.go), so the write is visible at once and made durable by a
// background group commit shortly after: one round of fsyncs for every
// write made meanwhile. A new record is written under a name of its own
// and renamed into place by the round that fsyncs it, so its content is
// durable before its name appears (ReadRecord reads it there meanwhile);
// the directories the Committer makes are committed with their parents,
// up to the root.
// Wait blocks until a given write is durable (what must hold across a
// power loss). A root removed or replaced stops every later change
// (ErrRootReplaced). ReadRecord returns a record's newest valid version;
// a file holding another record's frame is corrupt (ErrForeign).
//
// MkdirAll makes a directory durably, for the root itself.
//
// Do not use it for data that may be lost on a crash (logs, caches).
package atomicfile
