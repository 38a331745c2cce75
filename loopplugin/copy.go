package loopplugin

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"golang.org/x/sys/unix"
)

// Image copies. Snapshots, restores and clones copy a whole image:
// reflink (FICLONE) when the pool's filesystem shares extents (xfs with
// reflink, btrfs), else a sparse copy that reads only the data extents
// (SEEK_DATA/SEEK_HOLE) and writes only the blocks that are not zero.
// Replication syncs update an existing copy in place and write only the
// blocks whose content differs.

const (
	// copyBlock is the unit in which contents are compared and zero
	// blocks skipped.
	copyBlock = 4096
	// copyChunk is how much is read at a time; the context is checked
	// between chunks, so a cancelled copy stops within one chunk.
	copyChunk = 1 << 20
)

// copyStats says what a copy or sync did.
type copyStats struct {
	reflinked bool  // the whole file was cloned (no bytes copied)
	written   int64 // bytes written to the target (including zeroed ranges)
	punched   int64 // bytes of the target turned into holes
}

// copyImage makes dst (an empty file) a copy of src: a reflink if
// allowReflink and the filesystem supports it, else a sparse copy.
func copyImage(ctx context.Context, src, dst *os.File, allowReflink bool) (copyStats, error) {
	if allowReflink {
		err := unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
		if err == nil {
			return copyStats{reflinked: true}, nil
		}
		// EOPNOTSUPP (ext4, tmpfs), EXDEV (other filesystem), EINVAL
		// and ENOTTY: no reflink here; copy. Anything else is real.
		if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EXDEV) &&
			!errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOTTY) {
			return copyStats{}, fmt.Errorf("FICLONE %s: %w", dst.Name(), err)
		}
	}
	return syncImage(ctx, src, dst, true)
}

// syncImage makes dst's content equal to src's, in place. It walks src's
// data extents (SEEK_DATA/SEEK_HOLE): inside them it compares src with dst
// block by block and writes only differing blocks (all non-zero blocks if
// blind: dst is known to be empty, so it is not read); where src has a
// hole, or a zero block, dst gets a hole if it has data there. dst gets
// src's size; the caller fsyncs it (after thawing what it froze).
func syncImage(ctx context.Context, src, dst *os.File, blind bool) (copyStats, error) {
	var st copyStats
	fi, err := src.Stat()
	if err != nil {
		return st, err
	}
	size := fi.Size()
	if dfi, err := dst.Stat(); err != nil {
		return st, err
	} else if dfi.Size() != size {
		if err := dst.Truncate(size); err != nil {
			return st, fmt.Errorf("truncate %s: %w", dst.Name(), err)
		}
	}
	sbuf, dbuf := make([]byte, copyChunk), make([]byte, copyChunk)
	zero := make([]byte, copyBlock)
	off := int64(0)
	for off < size {
		if err := ctx.Err(); err != nil {
			return st, fmt.Errorf("copy %s: %w", src.Name(), err)
		}
		start, end, err := nextData(src, off, size)
		if err != nil {
			return st, err
		}
		if !blind && start > off {
			if err := punchData(dst, off, start, &st); err != nil {
				return st, err
			}
		}
		for pos := start; pos < end; {
			if err := ctx.Err(); err != nil {
				return st, fmt.Errorf("copy %s: %w", src.Name(), err)
			}
			n := int(min(int64(copyChunk), end-pos))
			if _, err := src.ReadAt(sbuf[:n], pos); err != nil && !errors.Is(err, io.EOF) {
				return st, fmt.Errorf("read %s: %w", src.Name(), err)
			}
			if !blind {
				if _, err := dst.ReadAt(dbuf[:n], pos); err != nil && !errors.Is(err, io.EOF) {
					return st, fmt.Errorf("read %s: %w", dst.Name(), err)
				}
			}
			if err := syncChunk(dst, pos, sbuf[:n], dbuf[:n], zero, blind, &st); err != nil {
				return st, err
			}
			pos += int64(n)
		}
		off = end
	}
	return st, nil
}

// syncChunk writes the runs of blocks of s that differ from d (or, blind,
// that are not zero) to dst at off. Blocks zero in s but not in d are
// punched out.
func syncChunk(dst *os.File, off int64, s, d, zero []byte, blind bool, st *copyStats) error {
	runStart := -1
	flush := func(end int) error {
		if runStart < 0 {
			return nil
		}
		if _, err := dst.WriteAt(s[runStart:end], off+int64(runStart)); err != nil {
			return fmt.Errorf("write %s: %w", dst.Name(), err)
		}
		st.written += int64(end - runStart)
		runStart = -1
		return nil
	}
	for i := 0; i < len(s); i += copyBlock {
		j := min(i+copyBlock, len(s))
		sb := s[i:j]
		sZero := bytes.Equal(sb, zero[:j-i])
		var write bool
		switch {
		case blind:
			write = !sZero
		case bytes.Equal(sb, d[i:j]):
			write = false
		case sZero:
			// dst has data where src has zeros: a hole is cheaper
			// than writing zeros.
			if err := flush(i); err != nil {
				return err
			}
			if err := punch(dst, off+int64(i), int64(j-i), st); err != nil {
				return err
			}
			continue
		default:
			write = true
		}
		if write {
			if runStart < 0 {
				runStart = i
			}
		} else if err := flush(i); err != nil {
			return err
		}
	}
	return flush(len(s))
}

// nextData returns the next data extent of f at or after off, clipped to
// size; [size, size) if there is none. A filesystem without SEEK_DATA
// reports everything as data.
func nextData(f *os.File, off, size int64) (start, end int64, err error) {
	fd := int(f.Fd())
	start, err = unix.Seek(fd, off, unix.SEEK_DATA)
	switch {
	case errors.Is(err, unix.ENXIO):
		return size, size, nil
	case errors.Is(err, unix.EINVAL):
		return off, size, nil
	case err != nil:
		return 0, 0, fmt.Errorf("SEEK_DATA %s: %w", f.Name(), err)
	}
	if start >= size {
		return size, size, nil
	}
	end, err = unix.Seek(fd, start, unix.SEEK_HOLE)
	if err != nil {
		return 0, 0, fmt.Errorf("SEEK_HOLE %s: %w", f.Name(), err)
	}
	return start, min(end, size), nil
}

// punchData turns every data extent of f within [from, to) into a hole.
func punchData(f *os.File, from, to int64, st *copyStats) error {
	for off := from; off < to; {
		start, end, err := nextData(f, off, to)
		if err != nil {
			return err
		}
		if start >= to {
			return nil
		}
		if err := punch(f, start, end-start, st); err != nil {
			return err
		}
		off = end
	}
	return nil
}

// punch deallocates [off, off+n) of f (reads return zeros), or writes
// zeros where the filesystem cannot punch holes.
func punch(f *os.File, off, n int64, st *copyStats) error {
	err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, off, n)
	if errors.Is(err, unix.EOPNOTSUPP) {
		zeros := make([]byte, min(n, copyChunk))
		for done := int64(0); done < n; {
			k := min(n-done, int64(len(zeros)))
			if _, err := f.WriteAt(zeros[:k], off+done); err != nil {
				return fmt.Errorf("zero %s: %w", f.Name(), err)
			}
			done += k
		}
		st.written += n
		return nil
	}
	if err != nil {
		return fmt.Errorf("punch hole in %s: %w", f.Name(), err)
	}
	st.punched += n
	return nil
}
