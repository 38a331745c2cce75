// Package atomicfile replaces files so that a reader, or the same process
// after a crash, sees either the old content or the new, never a torn mix:
// temp file in the same directory, rename over the old one.
//
// Write also makes the new content durable before it returns (fsync the
// file, rename, fsync the directory: about a millisecond). A Committer
// separates the two: its Put is visible at once (what a restarted process
// needs) and made durable by a background group commit shortly after, one
// round of fsyncs for every write made meanwhile; Wait blocks until a given
// write is durable (what must hold across a power loss).
//
// Do not use it for data that may be lost on a crash (logs, caches).
package atomicfile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Write replaces path with data, durably. The directory must exist.
func Write(path string, data []byte, perm os.FileMode) error {
	return write(path, data, perm, syncFile)
}

func write(path string, data []byte, perm os.FileMode, fsync func(string) error) error {
	tmp, err := writeTemp(path, data, perm)
	if err != nil {
		return err
	}
	if err := fsync(tmp); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("replacing %s: %w", path, err)
	}
	return fsync(filepath.Dir(path))
}

// writeTemp writes data to a new temp file beside path and returns its
// name.
func writeTemp(path string, data []byte, perm os.FileMode) (string, error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return "", fmt.Errorf("writing %s: %w", path, err)
	}
	err = nil
	if perm != 0o600 { // CreateTemp's mode
		err = tmp.Chmod(perm)
	}
	if err == nil {
		_, err = tmp.Write(data)
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp.Name())
		return "", fmt.Errorf("writing %s: %w", path, err)
	}
	return tmp.Name(), nil
}

// syncFile fsyncs a file or a directory (its entries: a rename, a
// removal) by name.
func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("syncing %s: %w", path, err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", path, err)
	}
	return nil
}

// Committer writes and removes files so that each change is visible when
// the call returns and durable soon after: a background commit fsyncs
// every file written and every directory changed since the previous
// commit, in one round that serves all of them (group commit), and starts
// again at once while changes keep coming. Each change gets a sequence
// number; Wait(n) returns once change n is durable. The zero value is
// ready to use.
//
// Changes to one path must not race each other (the caller serialises
// them, as a checkpoint's lock does).
type Committer struct {
	// changing is held shared by Put and Remove while they change a
	// file, exclusively by a round rewriting one whose fsync failed.
	changing sync.RWMutex
	mu       sync.Mutex
	seq      uint64 // changes made
	durable  uint64 // every change up to this one is durable
	files    map[string]content
	dirs     map[string]bool
	running  bool          // a commit goroutine runs
	round    chan struct{} // closed when the current round ends
	lastErr  error         // the last round's error, if it failed
	errUpTo  uint64        // the changes that round covered
	retryIn  time.Duration // pause before retrying a failed round
	writes   atomic.Uint64
	fsyncs   atomic.Uint64
	inflight atomic.Int64

	// InPlace has Put replace a file of at most one page in place: one
	// write at offset 0 of the new content padded with spaces to the old
	// length, which a crash cannot tear (the kernel copies a one-page
	// write whole or not at all), and which costs a tenth of a temp file
	// and a rename. Only for formats that ignore trailing whitespace
	// (JSON). A power loss while the page is being written back may tear
	// it at a sector boundary: the reader must treat a file it cannot
	// parse as lost.
	InPlace bool
	// Fsync, when set, replaces the fsync of a file or directory by name
	// (tests inject failures and delays).
	Fsync func(path string) error
}

// pageSize bounds what InPlace overwrites: a write of at most one page at
// offset 0 is copied by one iteration of the kernel's write loop.
const pageSize = 4096

// overwrite replaces path's content in place as InPlace says, and reports
// false (nothing done) for a missing file or one larger than a page.
func overwrite(path string, data []byte) (bool, error) {
	if len(data) > pageSize {
		return false, nil
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("writing %s: %w", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return false, fmt.Errorf("writing %s: %w", path, err)
	}
	if st.Size() > pageSize || !st.Mode().IsRegular() {
		return false, nil
	}
	if pad := int(st.Size()) - len(data); pad > 0 {
		data = append(slices.Clip(data), bytes.Repeat([]byte{' '}, pad)...)
	}
	if _, err := f.WriteAt(data, 0); err != nil {
		return false, fmt.Errorf("writing %s: %w", path, err)
	}
	return true, nil
}

// content is a file's latest content, kept until it is durable, or
// (removed) its removal.
type content struct {
	data    []byte
	perm    os.FileMode
	removed bool
	// rewrite: an earlier round failed to fsync it; write it afresh.
	rewrite bool
}

// retry pauses after a failed commit round: doubling from retryMin.
const (
	retryMin = 10 * time.Millisecond
	retryMax = 5 * time.Second
)

// Stats reports the writes made, the fsyncs (files and directories) they
// cost, and the changes not yet durable.
func (c *Committer) Stats() (writes, fsyncs uint64, pending int64) {
	return c.writes.Load(), c.fsyncs.Load(), c.inflight.Load()
}

// MkdirAll is os.MkdirAll whose new directories are committed (their
// parents' entries) with the next round.
func (c *Committer) MkdirAll(dir string, perm os.FileMode) error {
	if st, err := os.Stat(dir); err == nil && st.IsDir() {
		return nil
	}
	parent := filepath.Dir(dir)
	if parent != dir {
		if err := c.MkdirAll(parent, perm); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, perm); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	_, err := c.note("", parent, content{})
	return err
}

// Put replaces path with data (its directory must exist). The new content
// is visible on return; the returned change is durable once Wait says so.
func (c *Committer) Put(path string, data []byte, perm os.FileMode) (uint64, error) {
	c.changing.RLock()
	defer c.changing.RUnlock()
	done := false
	if c.InPlace {
		var err error
		if done, err = overwrite(path, data); err != nil {
			return 0, err
		}
	}
	dir := "" // an overwrite changes no directory entry
	if !done {
		tmp, err := writeTemp(path, data, perm)
		if err != nil {
			return 0, err
		}
		if err := os.Rename(tmp, path); err != nil {
			os.Remove(tmp)
			return 0, fmt.Errorf("replacing %s: %w", path, err)
		}
		dir = filepath.Dir(path)
	}
	c.writes.Add(1)
	return c.note(path, dir, content{data: data, perm: perm})
}

// Remove removes a file or an empty directory; a missing one is not an
// error. The removal is committed with the next round.
func (c *Committer) Remove(path string) (uint64, error) {
	c.changing.RLock()
	defer c.changing.RUnlock()
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return 0, err
	}
	return c.note(path, filepath.Dir(path), content{removed: true})
}

// note records a change to commit (a file's new content, a directory's
// entries; "" for none) and starts a round if none runs.
func (c *Committer) note(file, dir string, data content) (uint64, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.files == nil {
		c.files, c.dirs = map[string]content{}, map[string]bool{}
	}
	if file != "" {
		c.files[file] = data
	}
	if dir != "" {
		c.dirs[dir] = true
	}
	c.seq++
	c.inflight.Add(1)
	if !c.running {
		c.running = true
		c.round = make(chan struct{})
		go c.commitLoop()
	}
	return c.seq, nil
}

// commitLoop runs rounds while there are changes to commit.
func (c *Committer) commitLoop() {
	for {
		c.mu.Lock()
		if len(c.files) == 0 && len(c.dirs) == 0 {
			c.running = false
			close(c.round)
			c.mu.Unlock()
			return
		}
		files, dirs, upTo := c.files, c.dirs, c.seq
		c.files, c.dirs = map[string]content{}, map[string]bool{}
		c.mu.Unlock()

		err := c.commit(files, dirs)

		c.mu.Lock()
		done := c.round
		c.round = make(chan struct{})
		var pause time.Duration
		if err != nil {
			// Commit them again with the next round, writing the files
			// afresh (after a failed fsync the kernel may have dropped
			// their dirty pages), unless newer content has been put since.
			for f, d := range files {
				if _, newer := c.files[f]; !newer && !d.removed {
					d.rewrite = true
					c.files[f] = d
				}
			}
			for d := range dirs {
				c.dirs[d] = true
			}
			c.lastErr, c.errUpTo = err, upTo
			c.retryIn = min(max(2*c.retryIn, retryMin), retryMax)
			pause = c.retryIn
		} else {
			c.inflight.Add(-int64(upTo - c.durable))
			c.durable, c.lastErr, c.retryIn = upTo, nil, 0
		}
		c.mu.Unlock()
		close(done)
		if pause > 0 {
			time.Sleep(pause)
		}
	}
}

// commit makes files and directories durable: each file by fsync, or by
// a full durable rewrite if that fails; then each directory. A file or
// directory removed since is skipped (its parent's entry is in dirs).
func (c *Committer) commit(files map[string]content, dirs map[string]bool) error {
	var errs []error
	fsync := c.Fsync
	if fsync == nil {
		fsync = syncFile
	}
	for f, data := range files {
		if data.removed {
			continue // its directory's fsync commits it
		}
		var err error
		if !data.rewrite {
			c.fsyncs.Add(1)
			err = fsync(f)
			if err == nil || errors.Is(err, fs.ErrNotExist) {
				continue
			}
		}
		// After a failed fsync the kernel may have dropped the file's
		// dirty pages: write it afresh. If newer content (or a removal)
		// has been noted since, that goes with the next round, and this
		// one fails: what it was to commit is not durable.
		switch rewritten, werr := c.rewrite(f, data, fsync); {
		case werr != nil:
			errs = append(errs, errors.Join(err, fmt.Errorf("rewriting it: %w", werr)))
		case !rewritten:
			errs = append(errs, err)
		}
	}
	for d := range dirs {
		c.fsyncs.Add(1)
		if err := fsync(d); err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// rewrite writes a file afresh, durably, from the content a round had for
// it, unless newer content (or its removal) has been noted since, and
// reports whether it did.
func (c *Committer) rewrite(path string, data content, fsync func(string) error) (bool, error) {
	c.changing.Lock()
	defer c.changing.Unlock()
	c.mu.Lock()
	_, newer := c.files[path]
	c.mu.Unlock()
	if newer {
		return false, nil
	}
	c.fsyncs.Add(2)
	return true, write(path, data.data, data.perm, fsync)
}

// Wait returns once change n is durable, or with the error of the commit
// round that failed to make it so (later rounds retry it), or ctx's.
func (c *Committer) Wait(ctx context.Context, n uint64) error {
	for {
		c.mu.Lock()
		if c.durable >= n {
			c.mu.Unlock()
			return nil
		}
		if c.lastErr != nil && c.errUpTo >= n {
			err := c.lastErr
			c.mu.Unlock()
			return fmt.Errorf("committing checkpoints: %w", err)
		}
		round := c.round
		c.mu.Unlock()
		select {
		case <-round:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Sync waits until every change made so far is durable.
func (c *Committer) Sync(ctx context.Context) error {
	c.mu.Lock()
	n := c.seq
	c.mu.Unlock()
	return c.Wait(ctx, n)
}
