package atomicfile

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"
)

// The start image: a copy of the record files' newest versions, written
// at a clean stop into one file of the root (imageFile), so that the next
// start reads one file instead of one per record (after a reboot, each a
// random read of a directory block, an inode and the file: most of a cold
// start's time).
//
// It is a cache, never the truth:
//   - Its file is removed, durably, before the first change a Committer
//     makes after its start (dropImageFile): an image on disk was written
//     after the last change this release made.
//   - Each entry keeps what a stat of its file returned when the image was
//     written (device, inode, size, mtime, ctime, in nanoseconds).
//     ReadRecord returns an entry only while a stat of the file still says
//     so, and reads the file otherwise: a file written since, by this
//     release or any other (a slot write, a rename over it), has another
//     ctime, which no caller can set back.
//   - It is loaded only when the start found no journal. Then every change
//     made after the image was either made durable by a checkpoint, its
//     inode with it (a stat sees its ctime), or never acknowledged, and a
//     change never acknowledged may be lost (the image's older version is
//     read, as if the change had been lost with the power). With a journal
//     left (a crash), the replay may leave a file whose data is newer than
//     its inode.
//
// The stat is taken through the file's handle (name_to_handle_at(2)) when
// the filesystem and the caller's capabilities allow: an inode read, not
// the lookup of the record's directory too (after a reboot a random read
// each; a quarter of a cold start's reads). The ctime moves when the
// inode is linked, unlinked or renamed, so a handle whose inode's stamp
// is unchanged still has the name it had in its directory; a directory
// above it renamed (an operator's restore: mv d d.old; mkdir d; cp ...)
// is not seen. Whoever changes the work dir by hand removes the image.
//
// Format (little endian): magic "CSIMG001" | entry count u32 | entries |
// CRC32C u32 of everything before it. An entry: identity length u16 |
// identity | device u64 | inode u64 | size i64 | mtime ns i64 | ctime ns
// i64 | handle type i32 | handle length u16 (0: none) | handle | payload
// length u32 | payload. An image that is torn, truncated or damaged fails
// its CRC and is ignored whole. It is written without an fsync: one lost
// or torn by a power cut is ignored the same way.
const (
	imageFile  = ".records.image"
	imageMagic = "CSIMG001"
	// maxHandle is MAX_HANDLE_SZ.
	maxHandle = 128
	// maxImage bounds the image a start maps (about a million records).
	maxImage = 4 << 30
)

// fileStamp is what a stat says of a record file, enough to tell that it
// was not written since.
type fileStamp struct {
	dev, ino     uint64
	size         int64
	mtime, ctime int64
}

func stampOf(st *unix.Stat_t) fileStamp {
	return fileStamp{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim.Nano(), ctime: st.Ctim.Nano()}
}

// imageEntry is one record of a loaded image.
type imageEntry struct {
	stamp   fileStamp
	handle  *unix.FileHandle // nil: none
	payload []byte
}

// startImage is a loaded image: its entries by identity, in its file
// mapped (read-only; unmapped by close, so the image costs no memory once
// released), and the root opened to resolve their handles (-1: stat their
// paths).
type startImage struct {
	entries map[string]imageEntry
	mapped  []byte
	mountFD int
}

// stamp stats the file of an entry at path: through its handle while
// that works, else by path. ok is false for a file that is missing or
// not a regular file.
func (img *startImage) stamp(e imageEntry, path string) (fileStamp, bool) {
	var st unix.Stat_t
	if e.handle != nil && img.mountFD >= 0 {
		fd, err := unix.OpenByHandleAt(img.mountFD, *e.handle, unix.O_PATH|unix.O_CLOEXEC)
		if err == nil {
			err = unix.Fstat(fd, &st)
			unix.Close(fd)
			return stampOf(&st), err == nil && st.Mode&unix.S_IFMT == unix.S_IFREG
		}
		if !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EINVAL) {
			return fileStamp{}, false // ESTALE: the inode is gone
		}
	}
	if unix.Lstat(path, &st) != nil {
		return fileStamp{}, false
	}
	return stampOf(&st), st.Mode&unix.S_IFMT == unix.S_IFREG
}

// close unmaps the image and closes its root.
func (img *startImage) close() {
	if img == nil {
		return
	}
	unix.Munmap(img.mapped)
	if img.mountFD >= 0 {
		unix.Close(img.mountFD)
	}
}

// loadImage reads root's image, if it holds one whose CRC is right. Any
// other image is ignored (nil).
func loadImage(root string) *startImage {
	// What an interrupted WriteImage left.
	if left, err := filepath.Glob(filepath.Join(root, imageFile+".tmp-*")); err == nil {
		for _, p := range left {
			os.Remove(p)
		}
	}
	b, err := mapFile(filepath.Join(root, imageFile))
	if err != nil {
		return nil
	}
	img := &startImage{mapped: b, mountFD: -1}
	if img.entries = parseImage(b); img.entries == nil {
		img.close()
		return nil
	}
	if fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err == nil {
		img.mountFD = fd
	}
	return img
}

// mapFile maps a whole file read-only.
func mapFile(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() || st.Size() < int64(len(imageMagic)+8) || st.Size() > maxImage {
		return nil, fmt.Errorf("%s: not an image", path)
	}
	return unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
}

// parseImage decodes a mapped image's entries (nil: not a valid image).
func parseImage(b []byte) map[string]imageEntry {
	if string(b[:len(imageMagic)]) != imageMagic {
		return nil
	}
	body, sum := b[:len(b)-4], binary.LittleEndian.Uint32(b[len(b)-4:])
	if crc32.Checksum(body, castagnoli) != sum {
		return nil
	}
	r := body[len(imageMagic):]
	n := binary.LittleEndian.Uint32(r)
	r = r[4:]
	out := make(map[string]imageEntry, n)
	for range n {
		if len(r) < 2 {
			return nil
		}
		idLen := int(binary.LittleEndian.Uint16(r))
		if len(r) < 2+idLen+40+6 {
			return nil
		}
		id := string(r[2 : 2+idLen])
		r = r[2+idLen:]
		e := imageEntry{stamp: fileStamp{
			dev: binary.LittleEndian.Uint64(r), ino: binary.LittleEndian.Uint64(r[8:]),
			size: int64(binary.LittleEndian.Uint64(r[16:])), mtime: int64(binary.LittleEndian.Uint64(r[24:])),
			ctime: int64(binary.LittleEndian.Uint64(r[32:])),
		}}
		hType, hLen := int32(binary.LittleEndian.Uint32(r[40:])), int(binary.LittleEndian.Uint16(r[44:]))
		r = r[46:]
		if len(r) < hLen+4 {
			return nil
		}
		if hLen > 0 {
			h := unix.NewFileHandle(hType, r[:hLen])
			e.handle = &h
		}
		pLen := int(binary.LittleEndian.Uint32(r[hLen:]))
		r = r[hLen+4:]
		if len(r) < pLen {
			return nil
		}
		e.payload, r = r[:pLen:pLen], r[pLen:]
		out[id] = e
	}
	if len(r) != 0 {
		return nil
	}
	return out
}

// ReadRecord is the package's ReadRecord of a record below the
// Committer's root, served from the start image while its file is as the
// image saw it (see the top of this file). A record read is one the
// next image holds.
func (c *Committer) ReadRecord(path string) (payload []byte, legacy bool, err error) {
	id := c.identity(path)
	c.imageMu.RLock()
	defer c.imageMu.RUnlock()
	if img := c.image; img != nil {
		if e, ok := img.entries[id]; ok {
			if st, ok := img.stamp(e, path); ok && st == e.stamp {
				c.imageHits.Add(1)
				c.keep(path)
				// A copy: the mapping goes with the image.
				return bytes.Clone(e.payload), false, nil
			}
		}
	}
	payload, legacy, err = ReadRecord(c.root, path)
	if err == nil && !legacy {
		c.keep(path)
	}
	return payload, legacy, err
}

// dropImageFile removes the image's file, durably, once: before the
// Committer's first change (the image in memory stays, each entry checked
// against its file's stamp), and at an Open that replays journals (an
// image beside journals predates their changes: a later start without
// journals must not load it). A change fails if it cannot be removed.
func (c *Committer) dropImageFile() error {
	if !c.journaled() || c.imageFileGone.Load() {
		return nil
	}
	c.imageFileMu.Lock()
	defer c.imageFileMu.Unlock()
	if c.imageFileGone.Load() {
		return nil
	}
	err := os.Remove(filepath.Join(c.root, imageFile))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing the start image: %w", err)
	}
	// A removal whose fsync failed is owed one still (the file is gone
	// from the next attempt's view, not from the disk's).
	if err == nil || c.imageSyncOwed {
		c.imageSyncOwed = true
		if err := c.fsync()(c.root); err != nil {
			return fmt.Errorf("removing the start image: %w", err)
		}
		c.imageSyncOwed = false
	}
	c.imageFileGone.Store(true)
	return nil
}

// ImageReads is how many ReadRecord calls the start image served.
func (c *Committer) ImageReads() uint64 { return c.imageHits.Load() }

// keep adds path to the records the next image holds.
func (c *Committer) keep(path string) {
	c.mu.Lock()
	c.keepLocked(path, true)
	c.mu.Unlock()
}

// keepLocked adds path to the records the next image holds (record), or
// takes it out (a removal, a directory).
func (c *Committer) keepLocked(path string, record bool) {
	switch {
	case !c.journaled():
	case !record:
		delete(c.kept, path)
	case c.kept == nil:
		c.kept = map[string]struct{}{path: {}}
	default:
		c.kept[path] = struct{}{}
	}
}

// ReleaseImage drops the start image: the records it held are read from
// their files from now on. Loaders call it once they have read what they
// need.
func (c *Committer) ReleaseImage() {
	c.imageMu.Lock()
	defer c.imageMu.Unlock()
	c.image.close()
	c.image = nil
}

// WriteImage writes the start image of every record read or written
// through the Committer and still there, for the next start (see the top
// of this file). It is for a clean stop, after Checkpoint, once nothing
// writes records any more; a record that changed since its last
// checkpoint, or that cannot be read whole, is left out (read from its
// file at the next start), and a failure leaves no image. It returns how
// many records the image holds.
func (c *Committer) WriteImage(ctx context.Context) (int, error) {
	if !c.journaled() {
		return 0, nil
	}
	c.mu.Lock()
	paths := make([]string, 0, len(c.kept))
	for p := range c.kept {
		paths = append(paths, p)
	}
	c.mu.Unlock()
	slices.Sort(paths)
	img := []byte(imageMagic)
	img = binary.LittleEndian.AppendUint32(img, 0)
	n := 0
	for _, p := range paths {
		if err := ctx.Err(); err != nil {
			return 0, fmt.Errorf("writing the start image: %w", err)
		}
		id, st, payload, ok := c.imageRecord(p)
		if !ok {
			continue
		}
		img = binary.LittleEndian.AppendUint16(img, uint16(len(id)))
		img = append(img, id...)
		for _, v := range []uint64{st.dev, st.ino, uint64(st.size), uint64(st.mtime), uint64(st.ctime)} {
			img = binary.LittleEndian.AppendUint64(img, v)
		}
		// A handle only for a file on the root's filesystem (the one the
		// next start resolves handles on).
		var hType int32
		var handle []byte
		if h, _, err := unix.NameToHandleAt(unix.AT_FDCWD, p, 0); err == nil && st.dev == c.rootDev && h.Size() <= maxHandle {
			hType, handle = h.Type(), h.Bytes()
		}
		img = binary.LittleEndian.AppendUint32(img, uint32(hType))
		img = binary.LittleEndian.AppendUint16(img, uint16(len(handle)))
		img = append(img, handle...)
		img = binary.LittleEndian.AppendUint32(img, uint32(len(payload)))
		img = append(img, payload...)
		n++
	}
	binary.LittleEndian.PutUint32(img[len(imageMagic):], uint32(n))
	img = binary.LittleEndian.AppendUint32(img, crc32.Checksum(img, castagnoli))
	dst := filepath.Join(c.root, imageFile)
	tmp, err := writeTemp(dst, img, 0o600, 0)
	if err == nil {
		c.imageFileMu.Lock()
		if err = os.Rename(tmp, dst); err != nil {
			os.Remove(tmp)
		} else {
			c.imageFileGone.Store(false) // a change after this one removes it
		}
		c.imageFileMu.Unlock()
	}
	if err != nil {
		return 0, fmt.Errorf("writing the start image: %w", err)
	}
	return n, nil
}

// imageRecord reads one record file for the image: its identity, its
// stamp and newest version, if it is a framed record whose version the
// Committer has nothing newer of waiting for a round.
func (c *Committer) imageRecord(path string) (string, fileStamp, []byte, bool) {
	id := c.identity(path)
	c.mu.Lock()
	_, busy := c.files[path]
	if _, ck := c.ckFiles[path]; ck {
		busy = true
	}
	c.mu.Unlock()
	if busy || len(id) > maxIdentity {
		return "", fileStamp{}, nil, false
	}
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fileStamp{}, nil, false
	}
	defer f.Close()
	var before, after unix.Stat_t
	if unix.Fstat(int(f.Fd()), &before) != nil || before.Mode&unix.S_IFMT != unix.S_IFREG {
		return "", fileStamp{}, nil, false
	}
	b := make([]byte, before.Size)
	if _, err := f.ReadAt(b, 0); err != nil {
		return "", fileStamp{}, nil, false
	}
	vs, framed, foreign := versions(b, id)
	if !framed || foreign != "" || len(vs) == 0 || unix.Fstat(int(f.Fd()), &after) != nil || stampOf(&after) != stampOf(&before) {
		return "", fileStamp{}, nil, false
	}
	return id, stampOf(&before), vs[0].payload, true
}
