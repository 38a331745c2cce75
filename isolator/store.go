package isolator

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/csiagent/csiagent/internal/atomicfile"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// Checkpoint file names, in the Mesos layout.
const (
	volumeStateFile    = "volume.state"
	containerStateFile = "volumes.state"
)

// volume is one tracked volume: its checkpoint and where it lives.
type volume struct {
	key volumeKey
	dir string // holds volume.state
	cp  *statev1.VolumeCheckpoint
	// pending changes go out with the volume's next checkpoint write
	// (see acquire and release); the caller holds the volume's lock.
	pending []func(cp *statev1.VolumeCheckpoint)
	// written is the committer's number for the last write of cp.
	written uint64
	// publishContext is an attach's publish_context until the checkpoint
	// that records it (see controllerPublish); nil otherwise.
	publishContext map[string]string
}

// container is one container with volumes.
type container struct {
	id  string
	dir string
	cp  *statev1.ContainerCheckpoint
	// written is the committer's number for the last write of cp.
	written uint64
	// remount: the container paths of the mounts recovery could not
	// restore (a volume's plugin down); later passes retry those only.
	remount []string
}

func (iso *Isolator) containersRoot() string {
	return filepath.Join(iso.cfg.WorkDir, "isolators", "volume", "csi")
}

// pluginDir is <work>/csi/<type>/<name>.
func (iso *Isolator) pluginDir(p Plugin) string {
	return filepath.Join(iso.cfg.WorkDir, "csi", p.Type, p.Name)
}

// mountRoot is where a plugin's staging and target paths live.
func (iso *Isolator) mountRoot(p Plugin) string {
	if p.TargetPathRoot != "" {
		return p.TargetPathRoot
	}
	return filepath.Join(iso.pluginDir(p), "mounts")
}

// newVolume makes the in-memory record of a volume not yet checkpointed.
func (iso *Isolator) newVolume(key volumeKey, p Plugin, static *statev1.StaticProvisioning, readonly bool) *volume {
	enc := encodeVolumeID(key.id)
	mounts := filepath.Join(iso.mountRoot(p), enc)
	return &volume{
		key: key,
		dir: filepath.Join(iso.pluginDir(p), "volumes", enc),
		cp: &statev1.VolumeCheckpoint{
			State:              statev1.VolumeCheckpoint_CREATED,
			StateSince:         timestamppb.Now(),
			PluginName:         key.plugin,
			StaticProvisioning: static,
			Readonly:           readonly,
			StagingPath:        filepath.Join(mounts, "staging"),
			TargetPath:         filepath.Join(mounts, "target"),
			BootId:             iso.bootID,
		},
	}
}

// writeCheckpoint replaces a checkpoint file (0600, directory 0700):
// visible when it returns, durable with the committer's next round (see
// atomicfile.Committer). It returns the write's number for Wait.
//
// A checkpoint is binary protobuf, as Mesos checkpoints its own: a
// container with ten volumes takes 2.2 KB, a 4 KiB record slot (4.1 KB,
// an 8 KiB slot, with Docker's container ids and ceph-csi's volume ids;
// as multiline JSON, 9 KB), and encodes in a fifteenth of the time.
// Records of earlier releases, JSON, are still read (readCheckpoint).
//
// One that holds a record frame's magic anywhere ("CSR", from a string
// an API caller gave) is written as JSON instead: binary, such a string
// could carry a whole forged frame (a string may hold any valid UTF-8,
// NUL included), which a reader would find at a page boundary inside a
// larger version whose first bytes a power cut tore (atomicfile's
// versions). JSON escapes the bytes below 0x20 that every
// frame's length field holds, so no JSON record can carry one.
func (iso *Isolator) writeCheckpoint(dir, name string, m proto.Message) (uint64, error) {
	b, err := encodeCheckpoint(m)
	if err != nil {
		return 0, fmt.Errorf("checkpointing: %w", err)
	}
	iso.claimDir(dir)
	path := filepath.Join(dir, name)
	n, err := iso.commit.Put(path, b, 0o600)
	if errors.Is(err, fs.ErrNotExist) {
		// A new volume or container: its directory is made on the
		// first write only (no stat on every write).
		if err = iso.commit.MkdirAll(dir, 0o700); err == nil {
			n, err = iso.commit.Put(path, b, 0o600)
		}
	}
	if err != nil {
		return 0, fmt.Errorf("checkpointing: %w", err)
	}
	return n, nil
}

// updateVolume checkpoints a changed copy of a volume's checkpoint (with
// the volume's pending changes), then makes it the one in memory. The
// caller holds the volume's lock (the only writer); readers of the memory
// copy hold iso.mu.
func (iso *Isolator) updateVolume(v *volume, mutate func(cp *statev1.VolumeCheckpoint)) error {
	cp := proto.Clone(v.cp).(*statev1.VolumeCheckpoint)
	before := cp.State
	for _, p := range v.pending {
		p(cp)
	}
	mutate(cp)
	if cp.State != before {
		cp.StateSince = timestamppb.Now()
	}
	n, err := iso.writeCheckpoint(v.dir, volumeStateFile, cp)
	if err != nil {
		return fmt.Errorf("volume %s: %w", v.key, err)
	}
	v.pending, v.written = nil, n
	iso.mu.Lock()
	v.cp = cp
	iso.volumes[v.key] = v
	iso.mu.Unlock()
	iso.cfg.OnChange()
	iso.cfg.CrashPoint("checkpoint volume " + cp.State.String())
	return nil
}

// setState checkpoints a volume in a new state.
func (iso *Isolator) setState(v *volume, state vstate) error {
	return iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.State = state })
}

// forgetVolume removes a torn-down volume's checkpoint and directory now
// (with claims: see teardownDirs).
func (iso *Isolator) forgetVolume(v *volume) error {
	return iso.forget("volume", v.key.String(), v.dir, volumeStateFile, func() { delete(iso.volumes, v.key) })
}

// forget removes the checkpoint file of a volume or container (kind) and
// its directory, then drops it from memory (drop runs under iso.mu).
func (iso *Isolator) forget(kind, name, dir, file string, drop func()) error {
	if _, err := iso.commit.Remove(filepath.Join(dir, file)); err != nil {
		return fmt.Errorf("%s %s: removing checkpoint: %w", kind, name, err)
	}
	if _, err := iso.commit.Remove(dir); err != nil {
		iso.log.Warn("removing "+kind+" checkpoint directory", kind, name, "error", err)
	}
	iso.mu.Lock()
	drop()
	iso.mu.Unlock()
	iso.cfg.OnChange()
	iso.cfg.CrashPoint("checkpoint " + kind + " removed")
	return nil
}

// updateContainer is updateVolume for container checkpoints; the caller
// holds the container's lock.
func (iso *Isolator) updateContainer(c *container, mutate func(cp *statev1.ContainerCheckpoint)) error {
	cp := proto.Clone(c.cp).(*statev1.ContainerCheckpoint)
	mutate(cp)
	n, err := iso.writeCheckpoint(c.dir, containerStateFile, cp)
	if err != nil {
		return fmt.Errorf("container %s: %w", c.id, err)
	}
	iso.mu.Lock()
	c.cp, c.written = cp, n
	iso.containers[c.id] = c
	iso.mu.Unlock()
	iso.cfg.OnChange()
	iso.cfg.CrashPoint("checkpoint container " + cp.Phase.String())
	return nil
}

func (iso *Isolator) setPhase(c *container, phase statev1.ContainerCheckpoint_Phase) error {
	return iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) { cp.Phase = phase })
}

// forgetContainer forgets a cleaned-up container; its checkpoint and
// directory are removed after the answer (removeLater).
func (iso *Isolator) forgetContainer(c *container) {
	iso.removeLater(&removal{kind: "container", name: c.id, dir: c.dir, file: containerStateFile}, func() { delete(iso.containers, c.id) })
}

// load reads every checkpoint. A corrupt file is moved aside and
// reported; its volume is reconstructed (see reconstruct), its container
// quarantined (see quarantine).
func (iso *Isolator) load() error {
	files, err := checkpointFiles([]string{iso.containersRoot()}, containerStateFile)
	if err != nil {
		return fmt.Errorf("loading container checkpoints: %w", err)
	}
	cps, errs := readCheckpoints(iso.commit, files, func() *statev1.ContainerCheckpoint { return &statev1.ContainerCheckpoint{} })
	type corruptRecord struct {
		id, dir, aside string
		cause          error
	}
	var corrupt []corruptRecord
	for i, f := range files {
		if errors.Is(errs[i], fs.ErrNotExist) {
			continue // a directory without its checkpoint
		}
		id := filepath.Base(filepath.Dir(f))
		if errs[i] != nil {
			corrupt = append(corrupt, corruptRecord{id, filepath.Dir(f), iso.moveAside(f, errs[i]), errs[i]})
			continue
		}
		iso.containers[id] = &container{id: id, dir: filepath.Dir(f), cp: cps[i]}
	}
	roots, err := filepath.Glob(filepath.Join(iso.cfg.WorkDir, "csi", "*", "*", "volumes"))
	if err == nil {
		files, err = checkpointFiles(roots, volumeStateFile)
	}
	if err != nil {
		return fmt.Errorf("loading volume checkpoints: %w", err)
	}
	vcps, errs := readCheckpoints(iso.commit, files, func() *statev1.VolumeCheckpoint { return &statev1.VolumeCheckpoint{} })
	for i, f := range files {
		if errors.Is(errs[i], fs.ErrNotExist) {
			continue
		}
		dir := filepath.Dir(f)
		id, err := decodeVolumeID(filepath.Base(dir))
		if err != nil {
			iso.log.Error("ignoring volume checkpoint with a bad directory name", "file", f, "error", err)
			continue
		}
		pluginType := filepath.Base(filepath.Dir(filepath.Dir(filepath.Dir(dir))))
		key := volumeKey{pluginType, id}
		cp := vcps[i]
		if errs[i] != nil {
			aside := iso.moveAside(f, errs[i])
			cp = iso.reconstruct(key, dir, aside)
		}
		iso.volumes[key] = &volume{key: key, dir: dir, cp: cp}
	}
	for _, c := range corrupt {
		iso.quarantine(c.id, c.dir, c.aside, c.cause)
	}
	return nil
}

// rebuildMissingVolumes recreates the record of every volume a container
// record names but no volume record holds (a power cut can leave a
// container's record durable and its volume's lost, or every record
// below a directory whose entry was lost): rebuilt as reconstruct does,
// UNKNOWN until converged from the mount table. It runs at the start of
// the recovery pass, once the plugin configs are read (the volume's paths
// depend on its plugin's), and of each later pass while one is left (a
// volume of a plugin not configured yet is rebuilt by the first pass
// after its config is back). It reports whether none is left.
func (iso *Isolator) rebuildMissingVolumes() bool {
	// Containers an operation holds are skipped: a Prepare writes its
	// container record before its volumes' (the next pass sees them).
	missing := map[volumeKey]string{} // a container naming it
	for _, id := range iso.containerIDs() {
		iso.withContainerIfFree(id, func(c *container) {
			iso.mu.Lock()
			defer iso.mu.Unlock()
			for _, rv := range c.cp.GetRequest().GetVolumes() {
				csiVol := rv.GetSource().GetCsiVolume()
				key := volumeKey{csiVol.GetPluginName(), csiVol.GetStaticProvisioning().GetVolumeId()}
				if iso.volumes[key] == nil {
					missing[key] = c.id
				}
			}
		})
	}
	left := false
	for key, cid := range missing {
		p, err := iso.cfg.Plugins.Lookup(key.plugin)
		if err != nil {
			left = true
			iso.log.Error("volume record missing; it is rebuilt once its plugin is configured", "volume", key.String(), "container", cid, "error", err)
			continue
		}
		err = iso.tryVolume(key, func(v *volume) error {
			if v != nil {
				return nil // made meanwhile (a Prepare)
			}
			v = iso.newVolume(key, p, nil, false)
			iso.mu.Lock()
			v.cp = iso.reconstruct(key, v.dir, "")
			iso.mu.Unlock()
			v.cp.LastError = "volume record missing; rebuilt from container records and the mount table"
			if _, err := iso.writeCheckpoint(v.dir, volumeStateFile, v.cp); err != nil {
				return err
			}
			iso.mu.Lock()
			iso.volumes[key] = v
			iso.mu.Unlock()
			iso.cfg.OnChange()
			iso.log.Error("volume record missing: rebuilt from container records", "volume", key.String(), "users", v.cp.GetUsers())
			return nil
		})
		if err != nil {
			left = true
			iso.log.Error("rebuilding a missing volume record; retrying next pass", "volume", key.String(), "error", err)
		}
	}
	return !left
}

// checkpointFiles lists root/*/name for each root (a missing root holds
// none): one directory read per root, no stat per entry (the reads find
// out which exist).
func checkpointFiles(roots []string, name string) ([]string, error) {
	var files []string
	for _, root := range roots {
		entries, err := os.ReadDir(root)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range entries {
			if e.IsDir() {
				files = append(files, filepath.Join(root, e.Name(), name))
			}
		}
	}
	return files, nil
}

// loadWorkers read checkpoints at once: at start, after a reboot, the
// files are cold and reading them is disk latency, which concurrent reads
// overlap.
const loadWorkers = 64

// readCheckpoints reads and decodes files in parallel.
func readCheckpoints[T proto.Message](commit *atomicfile.Committer, files []string, mk func() T) ([]T, []error) {
	out, errs := make([]T, len(files)), make([]error, len(files))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(loadWorkers, len(files)) {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < len(files); i = int(next.Add(1) - 1) {
				out[i] = mk()
				errs[i] = readCheckpoint(commit, files[i], out[i])
			}
		})
	}
	wg.Wait()
	return out, errs
}

// readCheckpoint reads a checkpoint record's newest valid version (see
// atomicfile.Committer.ReadRecord: from the start image while it is
// right), or a plain JSON file of the previous release: binary protobuf
// (writeCheckpoint), or JSON as earlier releases wrote it. A JSON
// object starts with '{', which no binary encoding of these messages
// does (0x7b would open a group, field 15, which proto3 never writes).
func readCheckpoint(commit *atomicfile.Committer, path string, m proto.Message) error {
	b, _, err := commit.ReadRecord(path)
	if err != nil {
		return err
	}
	return decodeCheckpoint(b, m)
}

// encodeCheckpoint is a checkpoint's content (see writeCheckpoint).
func encodeCheckpoint(m proto.Message) ([]byte, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil || !bytes.Contains(b, []byte(atomicfile.MagicPrefix)) {
		return b, err
	}
	return protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
}

// decodeCheckpoint decodes a checkpoint's content (see readCheckpoint).
func decodeCheckpoint(b []byte, m proto.Message) error {
	if len(b) == 0 {
		return errors.New("empty file")
	}
	// b[0] itself, never after trimming: a binary record starts with a
	// tag and a length, and 0x0a (field 1) followed by a length of 123
	// (0x7b, '{') read as JSON once the "newline" was trimmed.
	if b[0] == '{' {
		if protojson.Unmarshal(b, m) != nil {
			// The parser's message quotes what it refused, which may be
			// a secret: the record is moved aside, for whoever may read
			// it (see moveAside).
			return errors.New("not a valid JSON record (the parser's message is not shown: a record holds the volumes' secrets)")
		}
		return nil
	}
	return proto.Unmarshal(b, m)
}

// moveAside moves a corrupt checkpoint out of the way, into
// <work>/corrupt/, keeping it for inspection, and returns its new name.
// Out of the checkpoint directories, it does not keep them from being
// removed.
func (iso *Isolator) moveAside(path string, cause error) string {
	iso.corrupt.Add(1)
	dir := filepath.Join(iso.cfg.WorkDir, "corrupt")
	rel, err := filepath.Rel(iso.cfg.WorkDir, path)
	if err != nil {
		rel = filepath.Base(path)
	}
	aside := filepath.Join(dir, fmt.Sprintf("%s.%d", strings.ReplaceAll(rel, string(filepath.Separator), "_"), time.Now().UnixNano()))
	err = os.MkdirAll(dir, 0o700)
	if err == nil {
		err = os.Rename(path, aside)
	}
	if err != nil {
		iso.log.Error("corrupt checkpoint; cannot move it aside", "file", path, "error", err, "cause", cause)
		return path
	}
	iso.log.Error("corrupt checkpoint moved aside", "file", path, "moved_to", aside, "error", cause)
	return aside
}

// reconstruct rebuilds a volume whose checkpoint was corrupt: its static
// provisioning and users from the containers that use it, its paths from
// the default layout; its state is UNKNOWN until resync reads the mount
// table.
func (iso *Isolator) reconstruct(key volumeKey, dir, aside string) *statev1.VolumeCheckpoint {
	mounts := filepath.Join(filepath.Dir(filepath.Dir(dir)), "mounts", filepath.Base(dir))
	if p, err := iso.cfg.Plugins.Lookup(key.plugin); err == nil {
		mounts = filepath.Join(iso.mountRoot(p), filepath.Base(dir))
	}
	cp := &statev1.VolumeCheckpoint{
		State:       statev1.VolumeCheckpoint_UNKNOWN,
		StateSince:  timestamppb.Now(),
		PluginName:  key.plugin,
		StagingPath: filepath.Join(mounts, "staging"),
		TargetPath:  filepath.Join(mounts, "target"),
		BootId:      iso.bootID,
		LastError:   "checkpoint was corrupt (kept as " + aside + "); reconstructed from container records and the mount table",
	}
	for _, c := range iso.containers {
		csiVol := requestVolume(c.cp, key)
		if csiVol == nil {
			continue
		}
		if cp.StaticProvisioning == nil {
			cp.StaticProvisioning = csiVol.GetStaticProvisioning()
			cp.Readonly = readOnlyAccess(cp.StaticProvisioning.GetVolumeCapability()) || cp.StaticProvisioning.GetReadonly()
		}
		cp.Users = append(cp.Users, c.id)
	}
	slices.Sort(cp.Users)
	return cp
}

// CorruptRecords counts the record files found corrupt (torn, damaged or
// holding another record's frame) since start: each moved aside, its
// container quarantined or its volume rebuilt.
func (iso *Isolator) CorruptRecords() uint64 { return iso.corrupt.Load() }

// CheckpointStats reports the checkpoint writes made since start, the
// fsyncs that made them durable, and the changes not yet durable: those
// made and not yet in a commit round, and the removals not yet made
// (removeLater).
func (iso *Isolator) CheckpointStats() (writes, fsyncs uint64, pending int64) {
	writes, fsyncs, pending = iso.commit.Stats()
	return writes, fsyncs, pending + int64(iso.RemovalsPending())
}
