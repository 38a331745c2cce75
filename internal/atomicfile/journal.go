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
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// The journal makes a round's changes durable with one append and one
// fdatasync, whatever the number of records and directories they touch:
// a Committer with a root writes each change to its record file as before
// (visible at once, into a slot no crash may still need) and, at its
// round, appends an entry per change to the root's current journal file.
// A new record is renamed into place by the round that journals it. The
// record files and directories are fsynced only by a checkpoint: once the
// journal has grown past journalLimit, at a clean stop (Checkpoint), or
// when a round finds the disk full. It closes the current journal (the
// next round starts a new one, its name made durable before any entry in
// it can be acknowledged), fsyncs every file and directory changed since
// the previous checkpoint, as a round did before, and removes the older
// journal files. A power cut in between leaves several journals, replayed
// in order.
//
// Journal files are named .journal-<epoch> in the root. Each entry is
//
//	magic "CSJ1" | kind u8 | 3 zero bytes | mode u32 | body length u32 |
//	CRC32C u32 | body
//
// with the CRC over everything after the magic but the CRC itself. The
// body is a record frame (record.go): for a put, the version written (its
// identity, generation and payload); for a removal, the identity and the
// last generation with no payload; for a directory made, the identity.
// A journal is only ever appended to; its first invalid entry ends it (a
// torn append was never acknowledged, and nothing after it was either).
//
// Open replays the journals before anything reads a record: for every
// path their entries name, the last entry wins. A put whose record file
// holds no version as new (none, an older one, or a torn one) is written
// to the file afresh, durably (one kept under the new record's name is
// renamed into place); a removal removes the file or directory if a power
// cut brought it back; a directory made is made. Then the journals are
// removed: every record file holds what they held. Journals of the boot
// Open runs in (bootFile) were left by a process that died, with the page
// cache intact: the files hold every change, the journal's and later ones
// (a record removed after its last entry must stay removed, one made
// again after its removal must stay), so only lost renames are redone.
const (
	journalMagic  = "CSJ1"
	journalHeader = 20
	journalPrefix = ".journal-"
	// journalLimit is the journal's size at which a checkpoint starts the
	// next one. The checkpoint's fsyncs are one per record file and
	// directory changed since the last: rare, and records created and
	// removed in between (a short container's) need none.
	journalLimit = 16 << 20
)

// Kinds of journal entries.
const (
	entryPut    = 1
	entryRemove = 2
	entryMkdir  = 3
)

// entry is one journal entry, decoded.
type entry struct {
	kind byte
	mode os.FileMode
	// body is a record frame (see the kinds above).
	body []byte
	v    version
}

// encodeEntry appends an entry to b.
func encodeEntry(b []byte, kind byte, mode os.FileMode, body []byte) []byte {
	off := len(b)
	b = append(b, journalMagic...)
	b = append(b, kind, 0, 0, 0)
	b = binary.LittleEndian.AppendUint32(b, uint32(mode.Perm()))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(body)))
	b = binary.LittleEndian.AppendUint32(b, 0)
	b = append(b, body...)
	binary.LittleEndian.PutUint32(b[off+16:], entryCRC(b[off:]))
	return b
}

func entryCRC(e []byte) uint32 {
	crc := crc32.Update(0, castagnoli, e[4:16])
	return crc32.Update(crc, castagnoli, e[journalHeader:])
}

// decodeEntries decodes a journal's entries up to its first invalid one.
func decodeEntries(b []byte) []entry {
	var out []entry
	for len(b) >= journalHeader && string(b[:4]) == journalMagic {
		n := int(binary.LittleEndian.Uint32(b[12:]))
		if n > len(b)-journalHeader {
			break
		}
		e := b[:journalHeader+n]
		if binary.LittleEndian.Uint32(e[16:]) != entryCRC(e) {
			break
		}
		v, ok := parseFrame(e[journalHeader:])
		if !ok || v.legacy || v.id == "" || e[4] < entryPut || e[4] > entryMkdir {
			break
		}
		out = append(out, entry{kind: e[4], mode: os.FileMode(binary.LittleEndian.Uint32(e[8:])), body: e[journalHeader:], v: v})
		b = b[len(e):]
	}
	return out
}

// journal is the journal file rounds append to.
type journal struct {
	f     *os.File
	path  string
	epoch uint64
	size  int64
}

func journalName(root string, epoch uint64) string {
	return filepath.Join(root, fmt.Sprintf("%s%016d", journalPrefix, epoch))
}

// createJournal makes journal file epoch, its name durable (the root's
// fsync) before any entry in it can be acknowledged.
func createJournal(root string, epoch uint64, fsync func(string) error) (*journal, error) {
	p := journalName(root, epoch)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL|os.O_APPEND|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, fmt.Errorf("creating the journal: %w", err)
	}
	if err := fsync(root); err != nil {
		f.Close()
		os.Remove(p)
		return nil, fmt.Errorf("creating the journal: %w", err)
	}
	return &journal{f: f, path: p, epoch: epoch}, nil
}

// append writes entries at the journal's end and makes them durable.
func (j *journal) append(b []byte, fsync func(string) error) error {
	if _, err := j.f.Write(b); err != nil {
		return fmt.Errorf("appending to %s: %w", j.path, err)
	}
	j.size += int64(len(b))
	if fsync != nil {
		return fsync(j.path)
	}
	if err := unix.Fdatasync(int(j.f.Fd())); err != nil {
		return fmt.Errorf("syncing %s: %w", j.path, err)
	}
	return nil
}

// journalEntries encodes a round's changes (see Committer.files), in an
// order a replay of them alone could follow: directories made, top first;
// versions; removals, deepest first.
func (c *Committer) journalEntries(files map[string]content) []byte {
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	rank := func(d content) int {
		switch {
		case d.dir:
			return 0
		case d.removed:
			return 2
		}
		return 1
	}
	slices.SortFunc(paths, func(a, b string) int {
		da, db := files[a], files[b]
		if r := cmp.Compare(rank(da), rank(db)); r != 0 {
			return r
		}
		if da.removed {
			return cmp.Compare(len(b), len(a))
		}
		return cmp.Compare(len(a), len(b))
	})
	var b []byte
	for _, p := range paths {
		d := files[p]
		switch {
		case d.dir:
			b = encodeEntry(b, entryMkdir, d.perm, frame(0, c.identity(p), nil, 0))
		case d.removed:
			b = encodeEntry(b, entryRemove, 0, frame(d.gen, c.identity(p), nil, 0))
		default:
			b = encodeEntry(b, entryPut, d.perm, d.data)
		}
	}
	return b
}

// journals lists the journal files in root, oldest first, with their
// epochs.
func journals(root string) ([]string, []uint64, error) {
	des, err := os.ReadDir(root)
	if err != nil {
		return nil, nil, fmt.Errorf("reading %s: %w", root, err)
	}
	var names []string
	var epochs []uint64
	for _, de := range des {
		s, ok := strings.CutPrefix(de.Name(), journalPrefix)
		if !ok {
			continue
		}
		e, err := strconv.ParseUint(s, 10, 64)
		if err != nil || !de.Type().IsRegular() {
			continue
		}
		names, epochs = append(names, filepath.Join(root, de.Name())), append(epochs, e)
	}
	// ReadDir sorts by name; the epochs are zero-padded.
	return names, epochs, nil
}

// bootFile, in the root, holds the id of the boot the journals there were
// written in: made durable by Open, before any journal.
const bootFile = ".journal.boot"

// replay brings the record files up to the journals in root (see the
// comment at the top), removes them, records boot as the journals' boot
// in bootFile, and returns the next epoch and whether there were
// journals. The root's filesystem is synced first: what a crashed
// predecessor left visible is then durable, and a record file holding a
// newer version than the journal's keeps it.
//
// Journals of this very boot (bootFile says so) were left by a process
// that died, not by the host: every change it made is in the files, and
// a change it made after its last journal entry (a record removed, or
// made again after a removal) is newer than the entry. The files are
// then the truth: the replay only puts into place the new records whose
// rename was lost. Journals of an earlier boot, or of a release without
// bootFile, are applied.
func replay(root, boot string) (uint64, bool, error) {
	names, epochs, err := journals(root)
	if err != nil {
		return 0, false, err
	}
	same := sameBoot(root, boot)
	if len(names) > 0 {
		if err := applyJournals(root, names, same); err != nil {
			return 0, true, err
		}
	}
	if !same {
		recordBoot(root, boot)
	}
	if len(names) == 0 {
		return 0, false, nil
	}
	return epochs[len(epochs)-1] + 1, true, nil
}

// sameBoot reports whether root's journals were written in boot.
func sameBoot(root, boot string) bool {
	b, err := os.ReadFile(filepath.Join(root, bootFile))
	return err == nil && strings.TrimSpace(string(b)) == boot
}

// recordBoot makes boot the journals' boot, durably. The
// file is rewritten in place (a boot id fits in the block it has: a full
// disk does not stop it); one that cannot be written is removed. Either
// way a start never fails on it: without a file naming this boot, a later
// start in this boot replays the journals as after a power cut, as before
// the file existed (a file left naming an earlier boot can never name a
// later one).
func recordBoot(root, boot string) {
	p := filepath.Join(root, bootFile)
	if err := rewriteInPlace(p, []byte(boot+"\n")); err != nil {
		os.Remove(p)
	}
}

// rewriteInPlace replaces path's content with data, durably (the file,
// and the root's entry when it is new).
func rewriteInPlace(path string, data []byte) error {
	_, statErr := os.Stat(path)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	_, err = f.WriteAt(data, 0)
	if err == nil {
		err = f.Truncate(int64(len(data)))
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && statErr != nil {
		err = syncFile(filepath.Dir(path))
	}
	return err
}

// applyJournals replays the journals names (oldest first) and removes
// them; sameBoot: only lost renames (see replay).
func applyJournals(root string, names []string, sameBoot bool) error {
	if err := SyncFS(root); err != nil {
		return err
	}
	last := map[string]entry{}
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			return fmt.Errorf("reading the journal: %w", err)
		}
		for _, e := range decodeEntries(b) {
			last[e.v.id] = e
		}
	}
	ids := make([]string, 0, len(last))
	for id := range last {
		ids = append(ids, id)
	}
	// Directories top first, removals deepest first.
	slices.SortFunc(ids, func(a, b string) int { return cmp.Compare(len(a), len(b)) })
	var errs []error
	for _, id := range ids {
		switch e := last[id]; {
		case sameBoot && e.kind == entryPut:
			_, err := renameLost(root, e)
			errs = append(errs, err)
		case !sameBoot && e.kind != entryRemove:
			errs = append(errs, applyEntry(root, e))
		}
	}
	for _, id := range slices.Backward(ids) {
		if e := last[id]; !sameBoot && e.kind == entryRemove {
			errs = append(errs, applyEntry(root, e))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("replaying the journal: %w", err)
	}
	for _, n := range names {
		if err := os.Remove(n); err != nil {
			return fmt.Errorf("removing the replayed journal: %w", err)
		}
	}
	return nil
}

// applyEntry makes what one entry says of its path durably true.
func applyEntry(root string, e entry) error {
	p := filepath.Join(root, filepath.FromSlash(e.v.id))
	if !within(root, p) || p == root {
		return fmt.Errorf("journal entry for %q: outside %s", e.v.id, root)
	}
	switch e.kind {
	case entryMkdir:
		return MkdirAll(p, e.mode.Perm())
	case entryRemove:
		gone := false
		for _, q := range []string{p, newName(p)} {
			err := os.Remove(q)
			switch {
			case err == nil:
				gone = true
			case errors.Is(err, fs.ErrNotExist), errors.Is(err, unix.ENOTEMPTY), errors.Is(err, unix.EEXIST), errors.Is(err, unix.EISDIR):
			default:
				return fmt.Errorf("removing %s: %w", q, err)
			}
		}
		if gone {
			return syncFile(filepath.Dir(p))
		}
		return nil
	}
	if kept, err := renameLost(root, e); kept || err != nil {
		return err
	}
	if err := MkdirAll(filepath.Dir(p), 0o700); err != nil {
		return err
	}
	if err := write(p, e.body, e.mode.Perm(), syncFile, int64(reserved(e.v.slotSize, len(e.body)))); err != nil {
		return err
	}
	if err := os.Remove(newName(p)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// renameLost reports whether the record file of put entry e holds its
// version or a newer one, under its name or, when its rename was lost,
// under its new record's name, which it then renames into place.
func renameLost(root string, e entry) (bool, error) {
	p := filepath.Join(root, filepath.FromSlash(e.v.id))
	if !within(root, p) || p == root {
		return false, fmt.Errorf("journal entry for %q: outside %s", e.v.id, root)
	}
	gen, at, ok := newestGen(root, p)
	if !ok || gen < e.v.gen {
		return false, nil
	}
	if at == p {
		return true, nil
	}
	if err := os.Rename(at, p); err != nil {
		return true, fmt.Errorf("renaming %s into place: %w", at, err)
	}
	return true, syncFile(filepath.Dir(p))
}

// newestGen is the generation of the version ReadRecord would return for
// path, if it holds a valid framed one, and the file it is in (path, or
// a new record's name before its rename).
func newestGen(root, path string) (uint64, string, bool) {
	for _, q := range []string{path, newName(path)} {
		b, err := os.ReadFile(q)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return 0, "", false
		}
		if vs, _, _ := versions(b, Identity(root, path)); len(vs) > 0 {
			return vs[0].gen, q, true
		}
		return 0, "", false
	}
	return 0, "", false
}
