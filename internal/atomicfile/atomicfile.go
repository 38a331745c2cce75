// Package atomicfile writes files so that a reader, or the same process
// after a crash or power loss, sees either the old content or the new, never
// a torn mix: temp file in the same directory, fsync, rename, fsync the
// directory.
//
// Do not use it for data that may be lost on a crash (logs, caches): the two
// fsyncs cost about a millisecond.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
)

// Write replaces path with data, durably. The directory must exist.
func Write(path string, data []byte, perm os.FileMode) error {
	var c Committer
	return c.Write(path, data, perm)
}

// Committer writes files like Write and shares directory fsyncs between
// concurrent writes (group commit): a write whose rename lands while its
// directory is being synced joins the next sync of that directory, which
// starts as soon as the running one ends and serves every write that
// joined it. Every Write still returns only once its own rename is durable
// (a sync that started after it). The zero value is ready to use; it also
// counts writes and fsyncs (Stats).
type Committer struct {
	mu   sync.Mutex
	dirs map[string]*dirSync

	writes, fsyncs atomic.Uint64
}

// dirSync is one directory's running sync and the one waiting to start.
type dirSync struct{ running, next *batch }

type batch struct {
	done chan struct{}
	err  error
}

// Stats reports the writes made and the fsyncs (files and directories)
// they cost.
func (c *Committer) Stats() (writes, fsyncs uint64) {
	return c.writes.Load(), c.fsyncs.Load()
}

// Write replaces path with data, durably. The directory must exist.
func (c *Committer) Write(path string, data []byte, perm os.FileMode) error {
	c.writes.Add(1)
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	ok := false
	defer func() {
		if !ok {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if err := tmp.Chmod(perm); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if _, err := tmp.Write(data); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	c.fsyncs.Add(1)
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("replacing %s: %w", path, err)
	}
	ok = true
	return c.syncDir(dir)
}

// syncDir makes dir's entries durable, sharing the fsync with concurrent
// callers: a caller arriving while a sync runs joins (or starts) the batch
// after it, since the running one may have begun before its rename.
func (c *Committer) syncDir(dir string) error {
	c.mu.Lock()
	if c.dirs == nil {
		c.dirs = map[string]*dirSync{}
	}
	d := c.dirs[dir]
	if d == nil {
		d = &dirSync{}
		c.dirs[dir] = d
	}
	b := d.next
	switch {
	case d.running == nil:
		b = &batch{done: make(chan struct{})}
		d.running = b
	case b != nil:
		// Joins the waiting batch, whose leader runs it.
		c.mu.Unlock()
		<-b.done
		return b.err
	default:
		// Leads the next batch once the running one ends.
		b = &batch{done: make(chan struct{})}
		d.next = b
		prev := d.running
		c.mu.Unlock()
		<-prev.done
		c.mu.Lock()
		d.next = nil
		d.running = b
	}
	c.mu.Unlock()
	c.fsyncs.Add(1)
	b.err = SyncDir(dir)
	c.mu.Lock()
	if d.running == b {
		d.running = nil
	}
	if d.running == nil && d.next == nil && c.dirs[dir] == d {
		delete(c.dirs, dir)
	}
	c.mu.Unlock()
	close(b.done)
	return b.err
}

// SyncDir makes a directory's entries (a rename, a removal) durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("syncing directory %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("syncing directory %s: %w", dir, err)
	}
	return nil
}
