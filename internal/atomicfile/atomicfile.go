package atomicfile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/bootid"
)

// Write replaces path with data, durably: temp file, fsync, rename,
// directory fsync (what replacing a record whole costs; the benchmarks'
// floor for a durable checkpoint). The directory must exist.
func Write(path string, data []byte, perm os.FileMode) error {
	return write(path, data, perm, syncFile, 0)
}

func write(path string, data []byte, perm os.FileMode, fsync func(string) error, prealloc int64) error {
	tmp, err := writeTemp(path, data, perm, prealloc)
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

// MkdirAll is os.MkdirAll whose new directories are durable when it
// returns: the parent of each directory it makes is fsynced. For a
// Committer's root; below it, use the Committer's MkdirAll.
func MkdirAll(dir string, perm os.FileMode) error {
	made, err := mkdirs("", dir, perm)
	for _, d := range made {
		if serr := syncFile(filepath.Dir(d)); err == nil {
			err = serr
		}
	}
	return err
}

// SyncFS commits the filesystem holding dir (syncfs(2)), as a
// Committer's owner does before reading its records: a predecessor that
// crashed may have left changes visible but not yet durable. A missing
// dir is fs.ErrNotExist.
func SyncFS(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := unix.Syncfs(int(d.Fd())); err != nil {
		return fmt.Errorf("syncfs %s: %w", dir, err)
	}
	return nil
}

// mkdirs makes dir and its missing parents (below root, which must
// exist, when set) and returns the directories it made, top first.
func mkdirs(root, dir string, perm os.FileMode) ([]string, error) {
	var missing []string
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		if st, err := os.Stat(d); err == nil {
			if !st.IsDir() {
				return nil, fmt.Errorf("creating %s: %s is not a directory", dir, d)
			}
			break
		} else if !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("creating %s: %w", dir, err)
		}
		if d == root || d == filepath.Dir(d) {
			return nil, fmt.Errorf("creating %s: %w", dir, fs.ErrNotExist)
		}
		missing = append(missing, d)
	}
	var made []string
	for _, d := range slices.Backward(missing) {
		if err := os.Mkdir(d, perm); err != nil && !errors.Is(err, fs.ErrExist) {
			return made, fmt.Errorf("creating %s: %w", d, err)
		}
		made = append(made, d)
	}
	return made, nil
}

// writeTemp writes data to a new temp file beside path and returns its
// name. prealloc > 0 reserves that many bytes of blocks without changing
// the size (a record file's slots: later versions then need no free
// space, and a cleanup works on a full disk), where the filesystem can.
func writeTemp(path string, data []byte, perm os.FileMode, prealloc int64) (string, error) {
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
	if err == nil && prealloc > 0 {
		// Best effort: without it a later version may need a block.
		_ = unix.Fallocate(int(tmp.Fd()), unix.FALLOC_FL_KEEP_SIZE, 0, prealloc)
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
// number; Wait(n) returns once change n is durable.
//
// A daemon has one Committer for its work dir (its root), shared by
// everything that writes there: a directory it makes is durable, with
// every directory above it up to the root, before any change made in it
// later counts as durable, whoever made the change. What existed when it
// was made counts as durable: the caller has synced the root's filesystem
// (syncfs) first. It checks at each round that its root is the directory
// it was made with (same device and inode): a root removed, renamed or
// replaced stops every later change with ErrRootReplaced, instead of
// acknowledging changes written into a tree nobody will read.
//
// Changes to one path must not race each other (the caller serialises
// them, as a checkpoint's lock does).
type Committer struct {
	// root is the directory the Committer owns ("" for none: no identity
	// check, records identified by their absolute paths).
	root    string
	rootDev uint64
	rootIno uint64

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
	rootErr  error         // the root is gone or replaced: every change fails
	writes   atomic.Uint64
	fsyncs   atomic.Uint64
	inflight atomic.Int64

	// slots tracks, per record file, which slots hold what (see
	// record.go); guarded by mu.
	slots map[string]*slotState

	// With a root, rounds append to the journal (journal.go) and the
	// files and directories they covered wait in ckFiles and ckDirs for
	// the next checkpoint; older holds the journal files a checkpoint
	// has not yet made redundant. removedGen is the last generation of
	// each record removed since the last checkpoint: a new record at
	// its path continues from it, so that a replay tells the two apart.
	// loopMu, held by a round and a checkpoint, guards jr, nextEpoch and
	// older.
	loopMu     sync.Mutex
	jr         *journal
	nextEpoch  uint64
	older      []string
	ckFiles    map[string]content
	ckDirs     map[string]bool
	removedGen map[string]uint64

	// image is the start image (image.go) until the loaders release it,
	// guarded by imageMu (a read holds it shared while it uses the
	// mapping); imageHits counts the reads it served.
	imageMu   sync.RWMutex
	image     *startImage
	imageHits atomic.Uint64
	// imageFileMu serialises the removal of the image's file, which
	// imageFileGone says is done (see dropImageFile).
	imageFileMu   sync.Mutex
	imageFileGone atomic.Bool
	imageSyncOwed bool // guarded by imageFileMu
	// kept, guarded by mu, is the records the next image holds.
	kept map[string]struct{}

	// Fsync, when set, replaces the fsync of a file or directory by name
	// (tests inject failures and delays).
	Fsync func(path string) error
	// CheckpointAt, when set, replaces journalLimit (tests checkpoint
	// after every round with 1).
	CheckpointAt int64
}

// ErrRootReplaced: the Committer's root is no longer the directory it was
// made with.
var ErrRootReplaced = errors.New("work directory removed or replaced while the agent runs")

// New is Open on this boot.
func New(root string) (*Committer, error) { return Open(root, "") }

// Open makes the Committer of root, an existing directory, after
// replaying what journals a predecessor left there (see journal.go), so
// that every record file holds its last acknowledged version when Open
// returns. boot is this boot's id ("": the kernel's; tests of a power cut
// give another); the journals' boot is recorded in root (bootFile) before
// any journal is made.
func Open(root, boot string) (*Committer, error) {
	var st unix.Stat_t
	if err := unix.Stat(root, &st); err != nil {
		return nil, fmt.Errorf("opening %s: %w", root, err)
	}
	if boot == "" {
		var err error
		if boot, err = bootid.Current(); err != nil {
			return nil, fmt.Errorf("opening %s: %w", root, err)
		}
	}
	root = filepath.Clean(root)
	epoch, replayed, err := replay(root, boot)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", root, err)
	}
	c := &Committer{root: root, rootDev: st.Dev, rootIno: st.Ino, nextEpoch: epoch}
	if !replayed {
		c.image = loadImage(root)
	} else if err := c.dropImageFile(); err != nil {
		return nil, fmt.Errorf("opening %s: %w", root, err)
	}
	return c, nil
}

// journaled reports whether rounds go to the journal (a Committer with
// a root).
func (c *Committer) journaled() bool { return c.root != "" }

// Root is the directory the Committer owns.
func (c *Committer) Root() string { return c.root }

// checkRoot fails, for good, once the root is not the directory the
// Committer was made with. The root is stat'ed without the lock (every
// Put and Remove checks it; a round checks again before it acknowledges
// anything).
func (c *Committer) checkRoot() error {
	var st unix.Stat_t
	var err error
	if c.root != "" {
		err = unix.Stat(c.root, &st)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rootCheckedLocked(&st, err)
}

func (c *Committer) checkRootLocked() error {
	var st unix.Stat_t
	var err error
	if c.rootErr == nil && c.root != "" {
		err = unix.Stat(c.root, &st)
	}
	return c.rootCheckedLocked(&st, err)
}

// rootCheckedLocked records what a stat of the root (st, err) says.
func (c *Committer) rootCheckedLocked(st *unix.Stat_t, err error) error {
	if c.rootErr != nil || c.root == "" {
		return c.rootErr
	}
	switch {
	case err != nil:
		c.rootErr = fmt.Errorf("%w: %s: %w; restart the agent once the work directory is back", ErrRootReplaced, c.root, err)
	case st.Dev != c.rootDev || st.Ino != c.rootIno:
		c.rootErr = fmt.Errorf("%w: %s is another directory now (device %d inode %d, was %d/%d); restart the agent", ErrRootReplaced, c.root, st.Dev, st.Ino, c.rootDev, c.rootIno)
	}
	return c.rootErr
}

// identity is a record's frame identity (see record.go).
func (c *Committer) identity(path string) string { return Identity(c.root, path) }

// slotState is what a Committer knows of one record file's slots (-1:
// none).
type slotState struct {
	gen uint64 // the newest version's generation
	// durable holds the newest durable version; flight the version a
	// commit round is making durable; pending the newest version, not yet
	// in a round.
	durable, flight, pending int
	// epoch counts whole-file replacements, which void the slots.
	epoch uint64
	// slotSize is the file's slot size (record.go); whole: the next
	// version replaces the file (a version larger than maxSlot fills it,
	// or the file is not in the record format).
	slotSize int
	whole    bool
	// fresh: the file does not exist under its name yet; its versions are
	// written to newName(path), which the round that makes them durable
	// renames into place.
	fresh bool
}

// newName is where a new record file is written until its first round
// renames it into place: a name of its own (not a random one), so that
// what a crash leaves there is overwritten by the next attempt and
// removed with the record.
func newName(path string) string {
	return filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".new")
}

// at is the file a record's versions are written to now.
func (st *slotState) at(path string) string {
	if st.fresh {
		return newName(path)
	}
	return path
}

// freeSlot is a slot holding nothing that may be needed after a crash.
func (st *slotState) freeSlot() int {
	for s := range recordSlots {
		if s != st.durable && s != st.flight {
			return s
		}
	}
	panic("atomicfile: no free record slot") // three slots; Put reuses pending, so at most two are taken
}

// loadSlots reads what a record file on disk holds: nil for a missing
// file. The newest valid version is taken as durable: the caller has made
// the file's filesystem durable (syncfs) before its first Put.
func (c *Committer) loadSlots(path string) (*slotState, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	st := &slotState{durable: -1, flight: -1, pending: -1}
	vs, _, foreign := versions(b, c.identity(path))
	if len(vs) == 0 || foreign != "" || vs[0].slotSize == 0 || len(b) > recordSlots*vs[0].slotSize ||
		slices.ContainsFunc(vs, func(v version) bool { return v.slotSize != vs[0].slotSize }) {
		st.whole = true
	}
	if len(vs) > 0 {
		st.gen, st.durable, st.slotSize = vs[0].gen, vs[0].slot, vs[0].slotSize
	}
	return st, nil
}

// content is a file's latest content, kept until it is durable, or
// (removed) its removal, or (dir) a directory made.
type content struct {
	data    []byte
	perm    os.FileMode
	removed bool
	dir     bool
	// gen is a removed record's last generation.
	gen uint64
	// slot is where this version was written, in the file's epoch.
	slot  int
	epoch uint64
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
// parents' entries) with the next round. dir must be below the root,
// which it never makes.
func (c *Committer) MkdirAll(dir string, perm os.FileMode) error {
	if err := c.checkRoot(); err != nil {
		return err
	}
	if err := c.dropImageFile(); err != nil {
		return err
	}
	if c.root != "" && !within(c.root, dir) {
		return fmt.Errorf("creating %s: outside %s", dir, c.root)
	}
	made, err := mkdirs(c.root, dir, perm)
	c.mu.Lock()
	for _, d := range made {
		c.noteLocked(d, filepath.Dir(d), content{dir: true, perm: perm})
	}
	c.mu.Unlock()
	return err
}

// within reports whether path is root or below it.
func within(root, path string) bool {
	rel, err := filepath.Rel(root, path)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// Put writes a new version of the record file path (see ReadRecord):
// visible on return, durable once Wait says so for the returned change.
// A new file is made in its directory, which must exist. Changes to one
// path are serialised by the caller.
//
// A path not written since the Committer was made is read, and a new
// record file written, without holding the Committer's lock, so that
// concurrent Puts of new records make their files at once: no round or
// checkpoint touches a path before its first change is noted. A version
// written into an existing file's slot is written under the lock, which a
// checkpoint holds to choose the slots it makes durable.
func (c *Committer) Put(path string, payload []byte, perm os.FileMode) (uint64, error) {
	c.changing.RLock()
	defer c.changing.RUnlock()
	id := c.identity(path)
	if len(id) > maxIdentity {
		return 0, fmt.Errorf("writing %s: path longer than %d bytes below %s", path, maxIdentity, c.root)
	}
	err := c.checkRoot()
	if err == nil {
		err = c.dropImageFile()
	}
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	st, gen := c.slots[path], c.removedGen[path]+1
	c.mu.Unlock()
	if st == nil {
		loaded, err := c.loadSlots(path)
		if err != nil {
			return 0, c.failed(err)
		}
		if loaded == nil {
			return c.putNew(path, id, gen, payload, perm)
		}
		c.mu.Lock()
		c.setSlotsLocked(path, loaded)
		c.mu.Unlock()
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	n, err := c.putLocked(path, id, payload, perm)
	if err != nil {
		return 0, c.failedLocked(err)
	}
	return n, nil
}

// failed is err, or the Committer's root error if the root is gone (a
// file or directory gone may be the root gone).
func (c *Committer) failed(err error) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failedLocked(err)
}

func (c *Committer) failedLocked(err error) error {
	if rerr := c.checkRootLocked(); rerr != nil {
		return rerr
	}
	return err
}

func (c *Committer) setSlotsLocked(path string, st *slotState) {
	if c.slots == nil {
		c.slots = map[string]*slotState{}
	}
	c.slots[path] = st
}

// putNew writes a new record file's first version, gen, under
// newName(path) (renamed into place by the round that makes it durable,
// once its content is: a name that survives a power cut always has a
// version, and versions put before that round share its one fsync), then
// notes it.
func (c *Committer) putNew(path, id string, gen uint64, payload []byte, perm os.FileMode) (uint64, error) {
	slot := slotFor(headerSize(id) + len(payload))
	data := frame(gen, id, payload, slot)
	if err := writeNew(newName(path), data, perm, reserved(slot, len(data))); err != nil {
		return 0, c.failed(fmt.Errorf("writing %s: %w", path, err))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.removedGen, path)
	c.setSlotsLocked(path, &slotState{gen: gen, durable: -1, flight: -1, pending: 0, slotSize: slot, whole: slot == 0, fresh: true})
	c.writes.Add(1)
	return c.noteLocked(path, filepath.Dir(path), content{data: data, perm: perm, slot: 0}), nil
}

// putLocked writes a new version into the existing record file of path
// (its slots known).
func (c *Committer) putLocked(path, id string, payload []byte, perm os.FileMode) (uint64, error) {
	st := c.slots[path]
	dir := ""
	var data []byte
	switch {
	case st.whole || headerSize(id)+len(payload) > st.slotSize:
		// Replaced whole, with slots that hold this version, durably at
		// once (temp file fsynced before the rename): the old file's
		// slots are not overwritten.
		size := slotFor(headerSize(id) + len(payload))
		data = frame(st.gen+1, id, payload, size)
		if err := write(path, data, perm, c.fsync(), int64(reserved(size, len(data)))); err != nil {
			return 0, err
		}
		if st.fresh {
			os.Remove(newName(path))
		}
		c.fsyncs.Add(2)
		st = &slotState{gen: st.gen + 1, durable: 0, flight: -1, pending: -1,
			epoch: st.epoch + 1, slotSize: size, whole: size == 0}
		dir = filepath.Dir(path)
	default:
		data = frame(st.gen+1, id, payload, st.slotSize)
		slot := st.pending
		if slot < 0 {
			slot = st.freeSlot()
		}
		if err := writeAt(st.at(path), data, int64(slot*st.slotSize)); err != nil {
			return 0, err
		}
		st.gen, st.pending = st.gen+1, slot
	}
	c.setSlotsLocked(path, st)
	c.writes.Add(1)
	slot := st.pending
	if slot < 0 {
		slot = st.durable
	}
	return c.noteLocked(path, dir, content{data: data, perm: perm, slot: slot, epoch: st.epoch}), nil
}

// writeNew writes a new record file's first version at name (replacing
// what a crash may have left there), its slots reserved.
func writeNew(name string, data []byte, perm os.FileMode, reserve int) error {
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_NOFOLLOW|unix.O_CLOEXEC, perm)
	if err != nil {
		return err
	}
	if _, err = f.Write(data); err == nil {
		// Best effort: without it a later version may need a block.
		_ = unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_KEEP_SIZE, 0, int64(reserve))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(name)
	}
	return err
}

// writeAt writes data into an existing file at off.
func writeAt(path string, data []byte, off int64) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	_, err = f.WriteAt(data, off)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

func (c *Committer) fsync() func(string) error {
	if c.Fsync != nil {
		return c.Fsync
	}
	return syncFile
}

// Remove removes a file or an empty directory; a missing one is not an
// error. The removal is committed with the next round. The file is
// forgotten under the Committer's lock (a round then renames nothing into
// place for it) and unlinked without it.
func (c *Committer) Remove(path string) (uint64, error) {
	c.changing.RLock()
	defer c.changing.RUnlock()
	err := c.checkRoot()
	if err == nil {
		err = c.dropImageFile()
	}
	if err != nil {
		return 0, err
	}
	c.mu.Lock()
	st := c.slots[path]
	delete(c.slots, path)
	c.mu.Unlock()
	known := st
	if st == nil && c.journaled() {
		// Its generation goes into the journal's entry.
		var err error
		if st, err = c.loadSlots(path); err != nil && !errors.Is(err, unix.EISDIR) {
			return 0, err
		}
	}
	if err := unlink(path); err != nil {
		if known != nil { // still there: as it was
			c.mu.Lock()
			c.setSlotsLocked(path, known)
			c.mu.Unlock()
		}
		return 0, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	gone := content{removed: true}
	if st != nil && c.journaled() {
		gone.gen = st.gen
		if c.removedGen == nil {
			c.removedGen = map[string]uint64{}
		}
		c.removedGen[path] = st.gen
	}
	return c.noteLocked(path, filepath.Dir(path), gone), nil
}

// unlink removes path (a file or an empty directory) and what a crash
// may have left under its new record's name; missing ones are not errors.
func unlink(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	// A new record not renamed into place yet, or what a crash left of
	// one.
	if err := os.Remove(newName(path)); err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, unix.EISDIR) {
		return err
	}
	return nil
}

// noteLocked records a change to commit (a file's new content, a
// directory's entries; "" for none) and starts a round if none runs.
func (c *Committer) noteLocked(file, dir string, data content) uint64 {
	if c.files == nil {
		c.files, c.dirs = map[string]content{}, map[string]bool{}
	}
	if file != "" {
		c.files[file] = data
		c.keepLocked(file, !data.removed && !data.dir)
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
	return c.seq
}

// commitLoop runs rounds while there are changes to commit: with a root,
// one journal append each (and a checkpoint once the journal is large),
// without, the files' and directories' own fsyncs.
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
		if !c.journaled() {
			c.flyLocked(files)
		}
		c.mu.Unlock()

		c.loopMu.Lock()
		var err error
		if c.journaled() {
			err = c.journalRound(files)
			if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
				// A full disk: the files' own slots are reserved, the
				// journal's next block is not. The round's changes are
				// made durable in their files, with everything the
				// journals held (a checkpoint frees them).
				c.mu.Lock()
				c.pendLocked(files, dirs)
				c.mu.Unlock()
				err = c.checkpoint()
			}
		} else {
			err = c.commit(files, dirs)
		}
		c.loopMu.Unlock()

		c.mu.Lock()
		done := c.round
		c.round = make(chan struct{})
		var pause time.Duration
		switch {
		case err != nil:
			// Commit them again with the next round (a file round writes
			// them afresh: after a failed fsync the kernel may have
			// dropped their dirty pages), unless newer content has been
			// put since.
			c.retryLocked(files, dirs, c.files, c.dirs, !c.journaled())
			c.lastErr, c.errUpTo = err, upTo
			c.retryIn = min(max(2*c.retryIn, retryMin), retryMax)
			pause = c.retryIn
		case c.journaled():
			// Durable in the journal; their files and directories wait
			// for the next checkpoint.
			c.pendLocked(files, dirs)
		default:
			c.landLocked(files)
		}
		if err == nil {
			c.inflight.Add(-int64(upTo - c.durable))
			c.durable, c.lastErr, c.retryIn = upTo, nil, 0
		}
		c.mu.Unlock()
		close(done)
		if pause > 0 {
			time.Sleep(pause)
		}
		if err == nil {
			c.loopMu.Lock()
			if c.jr != nil && c.jr.size >= cmp.Or(c.CheckpointAt, journalLimit) {
				c.checkpoint()
			}
			c.loopMu.Unlock()
		}
	}
}

// pendLocked adds changes to those the next checkpoint fsyncs.
func (c *Committer) pendLocked(files map[string]content, dirs map[string]bool) {
	if c.ckFiles == nil {
		c.ckFiles, c.ckDirs = map[string]content{}, map[string]bool{}
	}
	maps.Copy(c.ckFiles, files)
	maps.Copy(c.ckDirs, dirs)
}

// flyLocked marks the slots of the versions a commit is about to fsync
// as in flight: no Put writes into them meanwhile.
func (c *Committer) flyLocked(files map[string]content) {
	for f, d := range files {
		if st := c.slots[f]; st != nil && st.epoch == d.epoch && st.pending == d.slot && !d.removed && !d.dir {
			st.flight, st.pending = d.slot, -1
		}
	}
}

// landLocked marks the versions a commit made durable as the files'
// durable ones.
func (c *Committer) landLocked(files map[string]content) {
	for f, d := range files {
		if st := c.slots[f]; st != nil && st.epoch == d.epoch && st.flight == d.slot && !d.removed && !d.dir {
			st.durable, st.flight = d.slot, -1
		}
	}
}

// retryLocked puts a failed commit's changes back into intoFiles and
// intoDirs, unless newer content has been noted there since (rewrite:
// write the files afresh).
func (c *Committer) retryLocked(files map[string]content, dirs map[string]bool, intoFiles map[string]content, intoDirs map[string]bool, rewrite bool) {
	for f, d := range files {
		if _, newer := intoFiles[f]; !newer {
			d.rewrite = rewrite && !d.removed && !d.dir
			intoFiles[f] = d
		}
	}
	maps.Copy(intoDirs, dirs)
}

// newerLocked is the content noted for path and not yet in its file's
// fsync: waiting for a round, or (with a journal) for a checkpoint.
func (c *Committer) newerLocked(path string) (content, bool) {
	if d, ok := c.files[path]; ok {
		return d, true
	}
	d, ok := c.ckFiles[path]
	return d, ok
}

// journalRound appends a round's changes to the journal, made durable
// by one fdatasync. A journal whose append failed is left for the next
// checkpoint to remove; the retry goes to a new one.
func (c *Committer) journalRound(files map[string]content) error {
	if err := c.checkRoot(); err != nil {
		return err
	}
	if c.jr == nil {
		j, err := createJournal(c.root, c.nextEpoch, c.fsync())
		if err != nil {
			return err
		}
		c.fsyncs.Add(1)
		c.jr, c.nextEpoch = j, c.nextEpoch+1
	}
	c.fsyncs.Add(1)
	if err := c.jr.append(c.journalEntries(files), c.Fsync); err != nil {
		c.retire()
		return err
	}
	return c.renameFresh(files)
}

// renameFresh renames the new record files of a round into place once
// the journal holds their versions durably: a power cut may keep the name
// and lose the content, which the replay rewrites. Their directories'
// fsyncs wait for the checkpoint.
func (c *Committer) renameFresh(files map[string]content) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for f, d := range files {
		if d.removed || d.dir {
			continue
		}
		if st := c.slots[f]; st != nil && st.fresh {
			if err := os.Rename(newName(f), f); err != nil {
				return fmt.Errorf("renaming %s into place: %w", f, err)
			}
			st.fresh = false
		}
	}
	return nil
}

// Checkpoint makes every change durable in its own file and directory
// and removes the journal (see journal.go): what a clean stop does, so
// that the record files alone hold the state. It waits for the changes
// made so far first.
func (c *Committer) Checkpoint(ctx context.Context) error {
	if err := c.Sync(ctx); err != nil {
		return err
	}
	if !c.journaled() {
		return nil
	}
	c.loopMu.Lock()
	defer c.loopMu.Unlock()
	if c.jr == nil && len(c.older) == 0 {
		return nil
	}
	return c.checkpoint()
}

// retire closes the current journal; it stays on disk until a checkpoint
// has made what it holds redundant.
func (c *Committer) retire() {
	c.jr.f.Close()
	c.older = append(c.older, c.jr.path)
	c.jr = nil
}

// checkpoint fsyncs every record file and directory changed since the
// last checkpoint and removes the journals that held their changes: the
// current one is retired first, so that rounds meanwhile go to the next.
// A failure keeps them (and the journals) for the next checkpoint. The
// caller holds loopMu.
func (c *Committer) checkpoint() error {
	if c.jr != nil {
		c.retire()
	}
	c.mu.Lock()
	files, dirs := c.ckFiles, c.ckDirs
	c.ckFiles, c.ckDirs = map[string]content{}, map[string]bool{}
	c.flyLocked(files)
	c.mu.Unlock()
	err := c.commit(files, dirs)
	c.mu.Lock()
	if err != nil {
		c.retryLocked(files, dirs, c.ckFiles, c.ckDirs, true)
		c.mu.Unlock()
		return fmt.Errorf("checkpoint: %w", err)
	}
	c.landLocked(files)
	for f, d := range files {
		// Durable now, its removal keeps the old file from coming back:
		// a record made there again may start afresh. (A removal made
		// since the checkpoint began is not this one.)
		if g, ok := c.removedGen[f]; ok && d.removed && g == d.gen {
			delete(c.removedGen, f)
		}
	}
	c.mu.Unlock()
	for _, j := range c.older {
		os.Remove(j) // one left by a crash is replayed harmlessly
	}
	c.older = nil
	return nil
}

// commit makes files and directories durable: each file by fsync, or by
// a full durable rewrite if that fails; then each directory. A file
// removed since is committed by its directory's fsync, a directory
// removed since by its parent's.
func (c *Committer) commit(files map[string]content, dirs map[string]bool) error {
	if err := c.checkRoot(); err != nil {
		return err
	}
	var errs []error
	fsync := c.fsync()
	for f, data := range files {
		if data.removed || data.dir {
			continue // its directory's fsync commits it
		}
		var err error
		if !data.rewrite {
			c.fsyncs.Add(1)
			if err = c.commitFile(f, fsync); err == nil {
				continue
			}
			if errors.Is(err, fs.ErrNotExist) {
				// Removed since: what this round commits for it is its
				// removal, durable with its directory's fsync below.
				dirs[filepath.Dir(f)] = true
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
	// A directory removed since the round began is committed by its
	// parent's fsync (the removal of its entry takes what was inside with
	// it), up to one that exists: ignoring it would count as durable a
	// removal, or a version, that nothing made durable. (One whose
	// removal is in this round has its parent in dirs already.) Each
	// parent is fsynced after every removal found in the pass before, so
	// once per pass is enough.
	for todo := maps.Clone(dirs); len(todo) > 0; {
		parents := map[string]bool{}
		for d := range todo {
			c.fsyncs.Add(1)
			err := fsync(d)
			if errors.Is(err, fs.ErrNotExist) {
				if parent := filepath.Dir(d); parent != d && !files[d].removed {
					parents[parent] = true
				}
				continue
			}
			if err != nil {
				errs = append(errs, err)
			}
		}
		maps.Copy(dirs, parents) // retried with the files if the round fails
		todo = parents
	}
	return errors.Join(errs...)
}

// commitFile makes a record file's content durable: fsync, and for a new
// file (not under its name yet) the rename into place after it, whose
// directory the round fsyncs next.
func (c *Committer) commitFile(path string, fsync func(string) error) error {
	c.mu.Lock()
	st := c.slots[path]
	fresh := st != nil && st.fresh
	c.mu.Unlock()
	if !fresh {
		return fsync(path)
	}
	if err := fsync(newName(path)); err != nil {
		return err
	}
	// Under mu: no Put writes to the new name meanwhile; what one wrote
	// since the fsync goes with the next round, into a slot not flying.
	c.mu.Lock()
	defer c.mu.Unlock()
	if st := c.slots[path]; st == nil || !st.fresh {
		return nil // removed or replaced whole meanwhile
	}
	if err := os.Rename(newName(path), path); err != nil {
		return fmt.Errorf("renaming %s into place: %w", path, err)
	}
	st.fresh = false
	return nil
}

// rewrite writes a file afresh, durably, from the content a round had for
// it, unless newer content (or its removal) has been noted since, and
// reports whether it did.
func (c *Committer) rewrite(path string, data content, fsync func(string) error) (bool, error) {
	c.changing.Lock()
	defer c.changing.Unlock()
	c.mu.Lock()
	_, newer := c.newerLocked(path)
	c.mu.Unlock()
	if newer {
		return false, nil
	}
	c.fsyncs.Add(2)
	size := slotOf(data.data)
	if err := write(path, data.data, data.perm, fsync, int64(reserved(size, len(data.data)))); err != nil {
		return true, err
	}
	// The file now holds this one version, durable, in slot 0.
	c.mu.Lock()
	if st := c.slots[path]; st != nil {
		if st.fresh {
			os.Remove(newName(path))
		}
		*st = slotState{gen: st.gen, durable: 0, flight: -1, pending: -1,
			epoch: st.epoch + 1, slotSize: size, whole: size == 0}
	}
	c.mu.Unlock()
	return true, nil
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
