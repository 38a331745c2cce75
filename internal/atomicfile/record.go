package atomicfile

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"slices"
)

// A record file holds up to recordSlots framed versions of one record, at
// offsets 0, slotSize, 2*slotSize; a version larger than a slot fills a
// file of its own (slot 0 only). Each frame is
//
//	magic "CSR1" | payload length u32 | generation u64 | CRC32C u32 | payload
//
// with the CRC over length, generation and payload (little endian). The
// reader takes the valid frame with the highest generation: a torn or
// half-written frame fails its CRC and is skipped, so what it returns is
// always a complete version that was written, never a mix.
//
// The Committer never writes into the slot holding the newest durable
// version, nor into one whose version a commit round is making durable:
// a power cut can damage only versions that nobody was told are durable.
const (
	recordMagic  = "CSR1"
	recordHeader = 20
	slotSize     = 4096
	recordSlots  = 3
)

// ErrCorrupt: no slot of a record file holds a valid version.
var ErrCorrupt = errors.New("no valid record version (torn or damaged)")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// frame encodes one version of a record.
func frame(gen uint64, payload []byte) []byte {
	b := make([]byte, recordHeader+len(payload))
	copy(b, recordMagic)
	binary.LittleEndian.PutUint32(b[4:], uint32(len(payload)))
	binary.LittleEndian.PutUint64(b[8:], gen)
	copy(b[recordHeader:], payload)
	binary.LittleEndian.PutUint32(b[16:], frameCRC(b))
	return b
}

func frameCRC(b []byte) uint32 {
	crc := crc32.Update(0, castagnoli, b[4:16])
	return crc32.Update(crc, castagnoli, b[recordHeader:])
}

// version is a valid frame found in a record file.
type version struct {
	slot    int
	gen     uint64
	payload []byte
}

// parseFrame decodes the frame at the start of b, if valid.
func parseFrame(b []byte) (gen uint64, payload []byte, ok bool) {
	if len(b) < recordHeader || string(b[:4]) != recordMagic {
		return 0, nil, false
	}
	n := int(binary.LittleEndian.Uint32(b[4:]))
	if n > len(b)-recordHeader {
		return 0, nil, false
	}
	b = b[:recordHeader+n]
	if binary.LittleEndian.Uint32(b[16:]) != frameCRC(b) {
		return 0, nil, false
	}
	return binary.LittleEndian.Uint64(b[8:]), b[recordHeader:], true
}

// versions lists the valid frames of a record file's content, newest
// first. framed reports whether the content is in the record format at
// all (false: a file of the previous release, plain content).
func versions(b []byte) (vs []version, framed bool) {
	for s := range recordSlots {
		off := s * slotSize
		if off >= len(b) {
			break
		}
		end := min(off+slotSize, len(b))
		if s == 0 {
			end = len(b) // a large version fills the file
		}
		if len(b[off:]) >= 4 && string(b[off:off+4]) == recordMagic {
			framed = true
		}
		if gen, p, ok := parseFrame(b[off:end]); ok {
			vs = append(vs, version{s, gen, p})
			if s == 0 && recordHeader+len(p) > slotSize {
				break // a large version: no other slots
			}
		}
	}
	slices.SortFunc(vs, func(a, b version) int { return cmp.Compare(b.gen, a.gen) })
	return vs, framed
}

// ReadRecord returns the newest valid version of a record file written by
// a Committer. A file not in the record format (the previous release's
// plain files) is returned whole with legacy set; the caller validates it.
// A record file with no valid version is ErrCorrupt.
func ReadRecord(path string) (payload []byte, legacy bool, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, false, err
	}
	vs, framed := versions(b)
	if !framed {
		return b, true, nil
	}
	if len(vs) == 0 {
		return nil, false, fmt.Errorf("%s: %w", path, ErrCorrupt)
	}
	return vs[0].payload, false, nil
}
