package atomicfile

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
)

// A record file holds up to recordSlots framed versions of one record, at
// offsets 0, S and 2*S, where S, the file's slot size, is a power of two
// from pageSize to maxSlot chosen when the file is written whole: the
// smallest that holds its version (slotFor), so that a record of a few
// KiB (a container with ten volumes) takes new versions in place like a
// small one. A version larger than the file's slots replaces the file
// whole, with slots sized for it; one larger than maxSlot fills a file of
// its own (S 0: slot 0 only). Each frame is
//
//	magic "CSR3" | payload length u32 | generation u64 | CRC32C u32 |
//	identity length u16 | log2(S/pageSize)+1, or 0 for S 0, u8 |
//	identity | payload
//
// with the CRC over everything after the magic but the CRC itself (little
// endian). The identity is the record's path relative to the Committer's
// root (its kind and key: "csi/T/N/volumes/V/volume.state"): a frame is
// bound to its file, so a valid frame copied into another record file (a
// misdirected write, a restored backup, an operator's cp) is not taken as
// that file's version. Every frame of a file states the same S (a file's
// slot size changes only with a whole replacement). Frames of the
// previous formats are still read: "CSR2" (the same without S, whose
// files have 4 KiB slots but for a larger version filling the file) and
// "CSR1" (also without the identity).
//
// The reader looks for frames at every pageSize boundary, since a torn
// slot 0 hides S, and takes a frame only at a slot of the S it states:
// the valid one with the highest generation. A torn or half-written frame
// fails its CRC and is skipped, so what it returns is always a complete
// version that was written, never a mix.
//
// The Committer never writes into the slot holding the newest durable
// version, nor into one whose version a commit round is making durable:
// a power cut can damage only versions that nobody was told are durable.
const (
	// MagicPrefix begins every frame's magic. A frame at a page boundary
	// inside a larger version's payload (one a power cut tore at its
	// start) would be read as a version of the record: a caller whose
	// payloads may hold attacker-chosen bytes keeps this prefix out of
	// them (text payloads that escape control bytes, as JSON does, cannot
	// hold a frame's length field).
	MagicPrefix       = "CSR"
	recordMagic       = MagicPrefix + "3"
	csr2Magic         = MagicPrefix + "2"
	legacyRecordMagic = MagicPrefix + "1"
	legacyHeader      = 20
	// pageSize is the smallest slot, and the slot of "CSR2" files;
	// maxSlot the largest.
	pageSize    = 4096
	maxSlot     = 64 << 10
	recordSlots = 3
	// maxIdentity bounds a frame's identity (a path within the root).
	maxIdentity = 1024
)

// Errors of ReadRecord.
var (
	// ErrCorrupt: no slot of a record file holds a valid version, or one
	// holds another file's.
	ErrCorrupt = errors.New("no valid record version (torn or damaged)")
	// ErrForeign: a slot holds a valid frame of another record file.
	ErrForeign = errors.New("record file holds a frame of another record")
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// headerSize is the size of a frame's header for identity id.
func headerSize(id string) int { return legacyHeader + 3 + len(id) }

// slotFor is the slot size of a file written whole with a frame of n
// bytes: the smallest power of two from pageSize that holds it, or 0 (the
// frame fills the file) above maxSlot.
func slotFor(n int) int {
	for s := pageSize; s <= maxSlot; s *= 2 {
		if n <= s {
			return s
		}
	}
	return 0
}

// reserved is what a file of slot size slot, written whole with a frame
// of n bytes, may grow to: the space reserved for it.
func reserved(slot, n int) int {
	if slot == 0 {
		return n
	}
	return recordSlots * slot
}

// frame encodes one version of the record identified by id, in a file
// whose slot size is slot.
func frame(gen uint64, id string, payload []byte, slot int) []byte {
	h := headerSize(id)
	b := make([]byte, h+len(payload))
	copy(b, recordMagic)
	binary.LittleEndian.PutUint32(b[4:], uint32(len(payload)))
	binary.LittleEndian.PutUint64(b[8:], gen)
	binary.LittleEndian.PutUint16(b[20:], uint16(len(id)))
	for s := slot; s >= pageSize; s /= 2 {
		b[22]++
	}
	copy(b[23:], id)
	copy(b[h:], payload)
	binary.LittleEndian.PutUint32(b[16:], frameCRC(b))
	return b
}

// slotOf is the slot size a frame this package made states.
func slotOf(frame []byte) int {
	v, _ := parseFrame(frame)
	return v.slotSize
}

// frameCRC is the CRC of a frame: everything after the magic but the CRC.
func frameCRC(b []byte) uint32 {
	crc := crc32.Update(0, castagnoli, b[4:16])
	return crc32.Update(crc, castagnoli, b[legacyHeader:])
}

// version is a valid frame found in a record file.
type version struct {
	slot    int
	gen     uint64
	payload []byte
	// id is the frame's identity; legacy frames have none.
	id     string
	legacy bool
	// header is the frame's header size; slotSize the slot size it
	// states (pageSize for the previous formats, see versions).
	header, slotSize int
}

// parseFrame decodes the frame at the start of b, if valid.
func parseFrame(b []byte) (v version, ok bool) {
	if len(b) < legacyHeader {
		return v, false
	}
	v.header, v.slotSize = legacyHeader, pageSize
	switch string(b[:4]) {
	case legacyRecordMagic:
		v.legacy = true
	case csr2Magic:
		if len(b) < legacyHeader+2 {
			return v, false
		}
		v.header = legacyHeader + 2 + int(binary.LittleEndian.Uint16(b[20:]))
	case recordMagic:
		if len(b) < legacyHeader+3 || b[22] > 5 {
			return v, false
		}
		v.header = headerSize("") + int(binary.LittleEndian.Uint16(b[20:]))
		v.slotSize = 0
		if b[22] > 0 {
			v.slotSize = pageSize << (b[22] - 1)
		}
	default:
		return v, false
	}
	h := v.header
	n := int(binary.LittleEndian.Uint32(b[4:]))
	if h > len(b) || n > len(b)-h {
		return v, false
	}
	b = b[:h+n]
	if binary.LittleEndian.Uint32(b[16:]) != frameCRC(b) {
		return v, false
	}
	if !v.legacy {
		v.id = string(b[h-int(binary.LittleEndian.Uint16(b[20:])) : h])
	}
	v.gen, v.payload = binary.LittleEndian.Uint64(b[8:]), b[h:]
	return v, true
}

// size is the frame's size on disk.
func (v version) size() int { return v.header + len(v.payload) }

// versions lists the valid frames of a record file's content, newest
// first. framed reports whether the content is in the record format at
// all (false: a file of the previous release, plain content); foreign
// names the identity of a valid frame that is not id's ("" if none).
func versions(b []byte, id string) (vs []version, framed bool, foreign string) {
	for off := 0; off+4 <= len(b); off += pageSize {
		switch string(b[off : off+4]) {
		case recordMagic, csr2Magic, legacyRecordMagic:
			framed = true
		default:
			continue
		}
		v, ok := parseFrame(b[off:])
		if !ok {
			continue
		}
		if !v.legacy && v.id != id {
			foreign = v.id
			continue
		}
		if off == 0 && v.slotSize == pageSize && v.size() > pageSize && string(b[:4]) != recordMagic {
			v.slotSize = 0 // a large version of the previous formats
		}
		if v.slotSize == 0 {
			if off == 0 {
				return []version{v}, framed, foreign // it fills the file
			}
			continue
		}
		if off%v.slotSize != 0 || off/v.slotSize >= recordSlots || v.size() > v.slotSize {
			continue // not where a file of its slot size has a slot
		}
		v.slot = off / v.slotSize
		vs = append(vs, v)
	}
	slices.SortFunc(vs, func(a, b version) int { return cmp.Compare(b.gen, a.gen) })
	return vs, framed, foreign
}

// Identity is the identity a record at path has under root: the path
// relative to root, or path itself when root is "" (a Committer without
// a root).
func Identity(root, path string) string {
	if root == "" {
		return filepath.Clean(path)
	}
	rel, err := filepath.Rel(root, path)
	if err != nil {
		return filepath.Clean(path)
	}
	return filepath.ToSlash(rel)
}

// ReadRecord returns the newest valid version of the record file at path
// written by a Committer whose root is root. A file not in the record
// format (the previous release's plain files) is returned whole with
// legacy set; the caller validates it. A record file with no valid
// version, or holding a frame of another record (ErrForeign), is
// ErrCorrupt.
//
// A new record that no commit round has renamed into place yet is read
// from where Put wrote it (newName): it is visible, as Put promises, to a
// process that restarts after a crash of the writer; one with no valid
// version there was never durable, so never acknowledged, and is reported
// as not existing (fs.ErrNotExist), never as corrupt.
func ReadRecord(root, path string) (payload []byte, legacy bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return readNew(root, path, err)
	}
	if err != nil {
		return nil, false, err
	}
	vs, framed, foreign := versions(b, Identity(root, path))
	switch {
	case !framed:
		return b, true, nil
	case foreign != "":
		return nil, false, fmt.Errorf("%s: %w: %w %q", path, ErrCorrupt, ErrForeign, foreign)
	case len(vs) == 0:
		return nil, false, fmt.Errorf("%s: %w", path, ErrCorrupt)
	}
	return vs[0].payload, false, nil
}

// readNew is ReadRecord of a new record not renamed into place; missing
// is the error of reading path.
func readNew(root, path string, missing error) ([]byte, bool, error) {
	b, err := os.ReadFile(newName(path))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, missing
	}
	if err != nil {
		return nil, false, err
	}
	vs, _, foreign := versions(b, Identity(root, path))
	if len(vs) == 0 || foreign != "" {
		return nil, false, fmt.Errorf("%s: a new record never made durable: %w", path, fs.ErrNotExist)
	}
	return vs[0].payload, false, nil
}
