package isolator

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// powercutMixes is how many random disk states are tried per cut point,
// besides the systematic ones (make powercut CUTS=N raises it).
var powercutMixes = flag.Int("powercut.mixes", 2, "random disk states per cut point in TestPowerCut")

// tmpfsNode is a CSI node service that stages a small tmpfs and publishes
// it by a bind mount: real mounts, no devices. With a controller, its
// volumes must be attached by it (node calls check the publish_context).
type tmpfsNode struct{ ctrl *tmpfsController }

// tmpfsController attaches volumes: a token per volume, named in the
// publish_context. Its attachments are outside the host (a cloud disk's):
// they survive a power cut.
type tmpfsController struct {
	mu       sync.Mutex
	attached map[string]string
	next     int
}

func (c *tmpfsController) ControllerPublishVolume(_ context.Context, in *csi.ControllerPublishVolumeRequest, _ ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	tok, ok := c.attached[in.GetVolumeId()]
	if !ok {
		c.next++
		tok = fmt.Sprint(c.next)
		c.attached[in.GetVolumeId()] = tok
	}
	return &csi.ControllerPublishVolumeResponse{PublishContext: map[string]string{"token": tok}}, nil
}

func (c *tmpfsController) ControllerUnpublishVolume(_ context.Context, in *csi.ControllerUnpublishVolumeRequest, _ ...grpc.CallOption) (*csi.ControllerUnpublishVolumeResponse, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.attached, in.GetVolumeId())
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// check refuses a node call without the volume's current attachment.
func (c *tmpfsController) check(volumeID string, pc map[string]string) error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if tok, ok := c.attached[volumeID]; !ok || pc["token"] != tok {
		return status.Errorf(codes.FailedPrecondition, "volume %s: publish_context %v, attached %q", volumeID, pc, tok)
	}
	return nil
}

// attachedIDs are the volumes attached now, sorted.
func (c *tmpfsController) attachedIDs() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Sorted(maps.Keys(c.attached))
}

func mountedAt(p string) bool { ok, _ := mount.IsMountPoint(p); return ok }

func (n tmpfsNode) NodeStageVolume(_ context.Context, in *csi.NodeStageVolumeRequest, _ ...grpc.CallOption) (*csi.NodeStageVolumeResponse, error) {
	if err := n.ctrl.check(in.GetVolumeId(), in.GetPublishContext()); err != nil {
		return nil, err
	}
	if !mountedAt(in.StagingTargetPath) {
		if err := unix.Mount("tmpfs", in.StagingTargetPath, "tmpfs", 0, "size=64k"); err != nil {
			return nil, err
		}
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (tmpfsNode) NodeUnstageVolume(_ context.Context, in *csi.NodeUnstageVolumeRequest, _ ...grpc.CallOption) (*csi.NodeUnstageVolumeResponse, error) {
	if mountedAt(in.StagingTargetPath) {
		if err := unix.Unmount(in.StagingTargetPath, 0); err != nil {
			return nil, err
		}
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (n tmpfsNode) NodePublishVolume(_ context.Context, in *csi.NodePublishVolumeRequest, _ ...grpc.CallOption) (*csi.NodePublishVolumeResponse, error) {
	if err := n.ctrl.check(in.GetVolumeId(), in.GetPublishContext()); err != nil {
		return nil, err
	}
	if !mountedAt(in.TargetPath) {
		// The target is the plugin's to make (CSI).
		if err := os.Mkdir(in.TargetPath, 0o750); err != nil && !errors.Is(err, os.ErrExist) {
			return nil, err
		}
		if err := unix.Mount(in.StagingTargetPath, in.TargetPath, "", unix.MS_BIND, ""); err != nil {
			return nil, err
		}
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (tmpfsNode) NodeUnpublishVolume(_ context.Context, in *csi.NodeUnpublishVolumeRequest, _ ...grpc.CallOption) (*csi.NodeUnpublishVolumeResponse, error) {
	if mountedAt(in.TargetPath) {
		if err := unix.Unmount(in.TargetPath, 0); err != nil {
			return nil, err
		}
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// tmpfsPlugins has plugin "loop" of tmpfsNode; with ctrl, its
// controller attaches volumes.
type tmpfsPlugins struct{ ctrl *tmpfsController }

func (tmpfsPlugins) Lookup(typ string) (Plugin, error) {
	if typ != "loop" {
		return Plugin{}, ErrUnknownPlugin
	}
	return Plugin{Type: "loop", Name: "default"}, nil
}

func (p tmpfsPlugins) Node(context.Context, string) (Node, error) {
	n := Node{Client: tmpfsNode(p), StageUnstage: true, NodeID: "node-1"}
	if p.ctrl != nil {
		n.Controller = p.ctrl
	}
	return n, nil
}

// fileState is a record file as a power cut may leave it.
type fileState struct {
	exists  bool
	content []byte
}

// diskModel tracks what a power cut keeps of the work dir: each record
// file's content at its last fsync, and which directory entries (files
// and directories) were present at their directory's last fsync. A record
// survives a cut only if its own entry and every directory's on its path
// below the work dir survive: the durable removal of a directory's entry
// takes what was inside with it.
type diskModel struct {
	mu      sync.Mutex
	work    string
	entries map[string]bool   // paths below work whose entry is durable
	data    map[string][]byte // a record file's content at its last fsync
	whole   map[string][]byte // a whole-file replacement's fsynced temp file
}

func newDiskModel(work string) *diskModel {
	return &diskModel{work: work, entries: map[string]bool{}, data: map[string][]byte{}, whole: map[string][]byte{}}
}

// isRecord reports whether p is a file whose content recovery reads: a
// record file or a journal (see atomicfile).
func isRecord(p string) bool {
	b := filepath.Base(p)
	return b == volumeStateFile || b == containerStateFile || strings.HasPrefix(b, ".journal-")
}

// fsync fsyncs p and records what that made durable. What p holds is read
// before the fsync, under the model's lock: a change racing the fsync may
// or may not be durable, and the model takes the older state, as a
// commit round may only count what was noted before it began.
func (d *diskModel) fsync(p string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	b, rerr := os.ReadFile(p)
	entries, derr := os.ReadDir(p)
	if err := fsyncPath(p); err != nil {
		return err
	}
	base := filepath.Base(p)
	switch {
	case isRecord(p) && rerr == nil:
		// The file's own fsync supersedes the temp file it was renamed
		// from (a new record's first version, fsynced before its name
		// appeared), whose entry its directory's fsync makes durable.
		d.data[p] = b
		delete(d.whole, p)
	case strings.HasPrefix(base, ".volume.state.tmp-") || strings.HasPrefix(base, ".volumes.state.tmp-"):
		d.whole[filepath.Join(filepath.Dir(p), strings.SplitN(base[1:], ".tmp-", 2)[0])] = b
	case base == ".volume.state.new" || base == ".volumes.state.new": // a new record, renamed after this
		d.whole[filepath.Join(filepath.Dir(p), strings.TrimSuffix(base[1:], ".new"))] = b
	case derr == nil: // a directory: its entries are durable
		present := map[string]bool{}
		for _, e := range entries {
			f := filepath.Join(p, e.Name())
			present[f] = true
			d.entries[f] = true
			if b, ok := d.whole[f]; ok {
				d.data[f] = b
				delete(d.whole, f)
			}
		}
		for f := range d.entries {
			if filepath.Dir(f) == p && !present[f] {
				d.forget(f)
			}
		}
	}
	return nil
}

// forget drops a durably removed entry and everything below it.
func (d *diskModel) forget(f string) {
	under := func(k string) bool { return k == f || strings.HasPrefix(k, f+"/") }
	maps.DeleteFunc(d.entries, func(k string, _ bool) bool { return under(k) })
	maps.DeleteFunc(d.data, func(k string, _ []byte) bool { return under(k) })
}

// durable is what a power cut now leaves of record file f.
func (d *diskModel) durable(f string) fileState {
	b, ok := d.data[f]
	if !ok {
		return fileState{}
	}
	for p := f; p != d.work && p != filepath.Dir(p); p = filepath.Dir(p) {
		if !d.entries[p] {
			return fileState{}
		}
	}
	return fileState{true, b}
}

// cut lists disk states a power cut at this moment can leave, as maps of
// record file to state: every file durable, every file as visible, each
// file alone as visible (or alone durable: write-back in any order), and
// random mixes with the visible content torn at 512-byte sectors over the
// durable one.
func (d *diskModel) cut(work string, rng *rand.Rand, mixes int) []map[string]fileState {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := map[string]fileState{}
	filepath.WalkDir(work, func(p string, e fs.DirEntry, err error) error { //nolint:errcheck // a vanished entry is skipped
		if err == nil && !e.IsDir() && isRecord(p) {
			if b, err := os.ReadFile(p); err == nil {
				now[p] = fileState{true, b}
			}
		}
		return nil
	})
	var files []string
	for f := range now {
		files = append(files, f)
	}
	for f := range d.data {
		if _, ok := now[f]; !ok {
			files = append(files, f)
		}
	}
	sort.Strings(files)
	durable := d.durable
	state := func(pick func(i int, f string) fileState) map[string]fileState {
		m := map[string]fileState{}
		for i, f := range files {
			m[f] = pick(i, f)
		}
		return m
	}
	out := []map[string]fileState{
		state(func(_ int, f string) fileState { return durable(f) }),
		state(func(_ int, f string) fileState { return now[f] }),
	}
	for k := range files {
		out = append(out,
			state(func(i int, f string) fileState { return map[bool]fileState{true: now[f], false: durable(f)}[i == k] }),
			state(func(i int, f string) fileState { return map[bool]fileState{true: durable(f), false: now[f]}[i == k] }))
	}
	for range mixes {
		out = append(out, state(func(_ int, f string) fileState {
			cur, dur := now[f], durable(f)
			if rng.IntN(2) == 0 || !cur.exists {
				return dur
			}
			b := bytes.Clone(cur.content)
			for s := 0; s*512 < len(b); s++ {
				if rng.IntN(2) == 0 {
					old := make([]byte, 512)
					if s*512 < len(dur.content) {
						copy(old, dur.content[s*512:])
					}
					copy(b[s*512:min(len(b), (s+1)*512)], old)
				}
			}
			return fileState{true, b}
		}))
	}
	return out
}

// TestPowerCut cuts power (simulated: see diskModel.cut) at every
// checkpoint write and plugin call of a scripted sequence (containers c1
// and c2 share vol-1, c1 is cleaned up, then c2), reboots (mounts gone,
// new boot id), recovers on what survived and checks: every container
// acknowledged prepared (and not being cleaned up) is PREPARED with its
// mount back; every one acknowledged cleaned up is gone; each volume's
// users are exactly the containers whose records name it, and it is
// published iff it has users; nothing is mounted that no record claims; a
// quarantined record is never one of an acknowledged container. It runs
// with a plugin that stages only, and with one whose controller attaches
// (its attachments survive the cut, as a cloud disk's do: after recovery
// exactly the published volumes are attached); each with the work dir's
// journal checkpointed only when large (never here: the journal holds
// every change) and after every round (the record files and directories
// fsynced, the journals removed, between any two steps).
func TestPowerCut(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, attach := range []bool{false, true} {
		for _, every := range []bool{false, true} {
			name := map[bool]string{false: "stage", true: "attach"}[attach] + map[bool]string{false: "", true: ", checkpoint every round"}[every]
			t.Run(name, func(t *testing.T) { powerCut(t, attach, every) })
		}
	}
}

func powerCut(t *testing.T, attach, checkpointEvery bool) {
	rng := rand.New(rand.NewPCG(7, 11))
	ids := []string{"c1", "c2"}
	// The sequence's steps: prepare c1, prepare c2, cleanup c1, cleanup c2.
	type step struct {
		id      string
		prepare bool
	}
	steps := []step{{"c1", true}, {"c2", true}, {"c1", false}, {"c2", false}}
	points, recovered, violations := 0, 0, 0
	for at := 1; ; at++ {
		root := t.TempDir()
		work := filepath.Join(root, "work")
		model := newDiskModel(work)
		plugins := tmpfsPlugins{}
		if attach {
			plugins.ctrl = &tmpfsController{attached: map[string]string{}}
		}
		var (
			n       int
			states  []map[string]fileState
			ackedAt []string // what was acknowledged (or started) when the power went
			acked   []string
			cutName string
		)
		var cutAttached map[string]string
		if err := atomicfile.MkdirAll(work, 0o755); err != nil {
			t.Fatal(err)
		}
		commit, err := atomicfile.New(work)
		if err != nil {
			t.Fatal(err)
		}
		commit.Fsync = model.fsync
		if checkpointEvery {
			commit.CheckpointAt = 1
		}
		iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: plugins, BootID: "boot-1", Commit: commit,
			CrashPoint: func(point string) {
				n++
				if n == at {
					states = model.cut(work, rng, *powercutMixes)
					ackedAt, cutName = slices.Clone(acked), point
					if attach {
						plugins.ctrl.mu.Lock()
						cutAttached = maps.Clone(plugins.ctrl.attached)
						plugins.ctrl.mu.Unlock()
					}
				}
			}})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		for _, s := range steps {
			if s.prepare {
				if _, err := iso.Prepare(ctx, powercutRequest(t, s.id, root)); err != nil {
					t.Fatalf("prepare %s: %v", s.id, err)
				}
				acked = append(acked, "prepared "+s.id)
			} else {
				acked = append(acked, "cleaning "+s.id) // started, not acknowledged
				if err := iso.Cleanup(ctx, s.id, false); err != nil {
					t.Fatalf("cleanup %s: %v", s.id, err)
				}
				acked = append(acked, "cleaned "+s.id)
			}
		}
		if err := iso.commit.Sync(ctx); err != nil {
			t.Fatal(err)
		}
		unmountUnder(t, root)
		if states == nil {
			break // past the last point
		}
		points++
		for si, st := range states {
			if attach {
				// The controller as the cut left it.
				plugins.ctrl = &tmpfsController{attached: maps.Clone(cutAttached), next: 1000}
			}
			if msg := recoverFrom(t, root, work, plugins, st, ackedAt, ids); msg != "" {
				violations++
				t.Errorf("cut %d (%s), disk state %d: %s", at, cutName, si, msg)
			} else {
				recovered++
			}
		}
	}
	t.Logf("power cut (attach %v, checkpoint every round %v): %d cut points, %d disk states recovered, %d violations", attach, checkpointEvery, points, recovered, violations)
}

func powercutRequest(t *testing.T, id, root string) *statev1.PrepareRequest {
	t.Helper()
	sandbox := filepath.Join(root, "sandbox-"+id)
	if err := os.MkdirAll(sandbox, 0o755); err != nil {
		t.Fatal(err)
	}
	r := &statev1.PrepareRequest{}
	if err := proto.Unmarshal(seedRequest(func(r *statev1.PrepareRequest) { r.ContainerId, r.Sandbox = id, sandbox }), r); err != nil {
		t.Fatal(err)
	}
	return r
}

// unmountUnder unmounts every mount below root, innermost first (a
// reboot, for the test's mounts).
func unmountUnder(t *testing.T, root string) {
	t.Helper()
	ms, err := mount.List(nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := len(ms) - 1; i >= 0; i-- {
		if strings.HasPrefix(ms[i].Mountpoint, root+"/") {
			if err := unix.Unmount(ms[i].Mountpoint, unix.MNT_DETACH); err != nil {
				t.Fatalf("unmounting %s: %v", ms[i].Mountpoint, err)
			}
		}
	}
}

// recoverFrom puts a disk state in place after a reboot, recovers, checks
// the invariants (returning what broke), then cleans everything up.
func recoverFrom(t *testing.T, root, work string, plugins tmpfsPlugins, st map[string]fileState, acked, ids []string) string {
	t.Helper()
	// The work dir holds exactly this state: nothing left by the
	// previous state's recovery (rebuilt or moved records).
	if err := os.RemoveAll(work); err != nil {
		t.Fatal(err)
	}
	for f, s := range st {
		if s.exists {
			if err := os.MkdirAll(filepath.Dir(f), 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(f, s.content, 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
	defer unmountUnder(t, root)
	iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: plugins, BootID: "boot-2"})
	if err != nil {
		return "start: " + err.Error()
	}
	ctx := context.Background()
	iso.resync(ctx, true)
	defer func() {
		for _, id := range iso.containerIDs() {
			iso.Cleanup(ctx, id, false) //nolint:errcheck // best effort; unmountUnder follows
		}
		// Its rounds end before the next state replaces the work dir.
		iso.commit.Sync(ctx) //nolint:errcheck // best effort
	}()
	var problems []string
	claimed := map[string]bool{}
	for _, id := range ids {
		c := iso.containers[id]
		wantPrepared := slices.Contains(acked, "prepared "+id) && !slices.Contains(acked, "cleaning "+id)
		cleaned := slices.Contains(acked, "cleaned "+id)
		switch {
		case cleaned && c != nil:
			problems = append(problems, id+" was acknowledged cleaned up but is back: "+c.cp.GetPhase().String())
		case wantPrepared && (c == nil || c.cp.GetPhase() != statev1.ContainerCheckpoint_PREPARED):
			problems = append(problems, id+" was acknowledged prepared but is "+map[bool]string{true: "gone", false: "not PREPARED"}[c == nil])
		case c != nil && quarantined(c.cp) && (wantPrepared || cleaned):
			problems = append(problems, id+" acknowledged but quarantined: "+c.cp.GetLastError())
		}
		if c == nil {
			continue
		}
		for _, m := range c.cp.GetMounts() {
			claimed[m.GetMountPoint()] = true
			if c.cp.GetPhase() == statev1.ContainerCheckpoint_PREPARED && !mountedAt(m.GetMountPoint()) {
				problems = append(problems, id+": "+m.GetMountPoint()+" not mounted after recovery")
			}
		}
	}
	for k, v := range iso.volumes {
		var want []string
		for id, c := range iso.containers {
			if requestVolume(c.cp, k) != nil {
				want = append(want, id)
			}
		}
		slices.Sort(want)
		if got := slices.Sorted(slices.Values(v.cp.GetUsers())); !slices.Equal(got, want) {
			problems = append(problems, fmt.Sprintf("%s: users %v, container records name %v", k, got, want))
		}
		if published := v.cp.GetState() == stPublished; published != (len(want) > 0) {
			problems = append(problems, fmt.Sprintf("%s: state %v with users %v", k, v.cp.GetState(), want))
		}
		claimed[v.cp.GetStagingPath()], claimed[v.cp.GetTargetPath()] = true, true
	}
	if plugins.ctrl != nil {
		var published []string
		for k, v := range iso.volumes {
			if v.cp.GetState() == stPublished {
				published = append(published, k.id)
			}
		}
		slices.Sort(published)
		if got := plugins.ctrl.attachedIDs(); !slices.Equal(got, published) {
			problems = append(problems, fmt.Sprintf("attached %v, published %v (volumes %v)", got, published, iso.ListVolumes()))
		}
	}
	ms, err := mount.List(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if strings.HasPrefix(m.Mountpoint, root+"/") && !claimed[m.Mountpoint] {
			problems = append(problems, m.Mountpoint+" is mounted but no record claims it")
		}
	}
	return strings.Join(problems, "; ")
}

// A Prepare whose checkpoints cannot be made durable (every fsync fails
// with EIO) is not acknowledged and is rolled back: no mount stays, the
// container is not PREPARED.
func TestPrepareNotDurableIsRolledBack(t *testing.T) {
	testhelp.NeedRoot(t)
	root := t.TempDir()
	defer unmountUnder(t, root)
	iso, err := newTestIsolator(t, Config{WorkDir: filepath.Join(root, "work"), Plugins: tmpfsPlugins{}, BootID: "b",
		Fsync: func(string) error { return unix.EIO }})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := powercutRequest(t, "c1", root)
	if _, err := iso.Prepare(ctx, req); !errors.Is(err, unix.EIO) {
		t.Fatalf("Prepare while every fsync fails: %v; want the EIO", err)
	}
	if c := iso.containers["c1"]; c != nil && c.cp.GetPhase() == statev1.ContainerCheckpoint_PREPARED {
		t.Errorf("c1 is PREPARED after a Prepare that was not durable")
	}
	if mp := filepath.Join(req.GetSandbox(), "data"); mountedAt(mp) {
		t.Errorf("%s still mounted after the failed Prepare", mp)
	}
}

// A repeated Prepare of a prepared container finds its mount gone,
// restores it, and only then answers.
func TestRepeatedPrepareRestoresMissingMounts(t *testing.T) {
	testhelp.NeedRoot(t)
	root := t.TempDir()
	defer unmountUnder(t, root)
	iso, err := newTestIsolator(t, Config{WorkDir: filepath.Join(root, "work"), Plugins: tmpfsPlugins{}, BootID: "b"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	req := powercutRequest(t, "c1", root)
	resp, err := iso.Prepare(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	mp := resp[0].GetMountPoint()
	if err := unix.Unmount(mp, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := iso.Prepare(ctx, req); err != nil {
		t.Fatalf("repeated Prepare: %v", err)
	}
	if !mountedAt(mp) {
		t.Fatalf("repeated Prepare answered with %s not mounted", mp)
	}
	if err := iso.Cleanup(ctx, "c1", false); err != nil {
		t.Fatal(err)
	}
}
