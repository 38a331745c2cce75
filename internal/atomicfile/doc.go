// Package atomicfile writes the records a daemon needs after a crash or a
// power cut, so that a reader (or the same daemon after a restart) sees a
// complete version of each, never a torn mix and never another record's.
//
// A Committer owns one directory, its root (the daemon's work dir; New).
// Each Put writes a new version of a record, framed with the record's
// identity (its path below the root), a generation and a CRC32C, into a
// slot of the record's file that holds nothing a crash may still need
// (see record.go), so the write is visible at once and made durable by a
// background group commit shortly after: one append to the root's
// journal and one fdatasync for every write, removal and directory made
// meanwhile, whatever the number of files they touch (journal.go). The
// record files and their directories are fsynced by a checkpoint, once
// the journal has grown large, at a clean stop (Checkpoint), or at once
// when the disk is full (the journal cannot grow; the files' slots are
// reserved). Open (New: on this boot) replays the journals a predecessor
// left before anything reads a record, so that every record file holds
// its last acknowledged version: after a power cut (journals of another
// boot) the journals are applied; after the process alone died (this
// boot) the files, which hold every change it made, are kept as they
// are. A new record is written under a name of its own and renamed into
// place once the journal holds it (ReadRecord reads it there meanwhile).
// A Committer without a root has no journal: each round fsyncs the files
// and directories it changed.
//
// At a clean stop, WriteImage copies every record read or written into
// one file, the start image (image.go), so that the next start reads one
// file rather than one per record; Committer.ReadRecord serves a record
// from it while a stat of the record's file says it is unchanged, and
// the image's file is removed before the next change.
//
// Wait blocks until a given write is durable (what must hold across a
// power loss). A root removed or replaced stops every later change
// (ErrRootReplaced). ReadRecord returns a record's newest valid version;
// a file holding another record's frame is corrupt (ErrForeign).
//
// MkdirAll makes a directory durably, for the root itself.
//
// Do not use it for data that may be lost on a crash (logs, caches).
package atomicfile
