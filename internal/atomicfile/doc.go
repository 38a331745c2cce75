// Package atomicfile writes files so that a reader, or the same process
// after a crash or a power cut, sees a complete version, never a torn mix.
//
// Write replaces a whole file durably before it returns: temp file in the
// same directory, fsync, rename over the old one, fsync the directory
// (about a millisecond).
//
// A Committer keeps records (checkpoints): each Put writes a new version,
// framed with a generation and a CRC32C, into a slot of the record's file
// that holds nothing a crash may still need (see record.go), so the write
// is visible at once (what a restarted process needs) and made durable by
// a background group commit shortly after, one round of fsyncs for every
// write made meanwhile; Wait blocks until a given write is durable (what
// must hold across a power loss). ReadRecord returns the newest valid
// version.
//
// Do not use it for data that may be lost on a crash (logs, caches).
package atomicfile
