package isolator

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csiagent/csiagent/internal/atomicfile"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// A Cleanup is acknowledged only once its intent (the CLEANING record, or
// the record's removal that supersedes it) is durable: it does not return
// while the first commit round is held back.
func TestCleanupWaitsForItsIntentToBeDurable(t *testing.T) {
	work := seedPrepared(t)
	cdir := filepath.Join(work, "isolators", "volume", "csi", "c1")

	// The first commit round's first fsync waits for Cleanup to return,
	// up to a bound: Cleanup returning meanwhile is the failure.
	returned := make(chan struct{})
	var first sync.Once
	var early atomic.Bool
	iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b", Logger: slog.New(slog.DiscardHandler),
		Fsync: func(path string) error {
			first.Do(func() {
				select {
				case <-returned:
					early.Store(true)
				case <-time.After(500 * time.Millisecond):
				}
			})
			return fsyncPath(path)
		}})
	if err != nil {
		t.Fatal(err)
	}
	err = iso.Cleanup(context.Background(), "c1", false)
	close(returned)
	if err != nil {
		t.Fatal(err)
	}
	if err := iso.commit.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if early.Load() {
		t.Fatal("Cleanup returned while its CLEANING record was not yet durable")
	}
	if _, err := os.Stat(filepath.Join(cdir, containerStateFile)); !os.IsNotExist(err) {
		t.Errorf("container record still on disk after Cleanup: %v", err)
	}
	if len(iso.ListVolumes()) != 0 || len(iso.ListContainers()) != 0 {
		t.Errorf("still tracked after Cleanup: %v %v", iso.ListVolumes(), iso.ListContainers())
	}
}

// Checkpoints the previous release wrote (plain JSON overwritten in place,
// padded with spaces; testdata/legacy-checkpoints, made by that code) load
// as they were, and the first update of each turns it into a record.
func TestLoadsPreviousReleaseCheckpoints(t *testing.T) {
	work := t.TempDir()
	if err := os.CopyFS(work, os.DirFS("testdata/legacy-checkpoints")); err != nil {
		t.Fatal(err)
	}
	iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "legacy-boot"})
	if err != nil {
		t.Fatal(err)
	}
	c := iso.containers["c1"]
	if c == nil || c.cp.GetPhase() != statev1.ContainerCheckpoint_PREPARED || len(c.cp.GetMounts()) != 1 || c.cp.GetMounts()[0].GetMountPoint() != "/sandbox/data" {
		t.Fatalf("container c1 not loaded as written: %v", c)
	}
	v := iso.volumes[volumeKey{"loop", "vol-1"}]
	if v == nil || v.cp.GetState() != stPublished || !slices.Equal(v.cp.GetUsers(), []string{"c1"}) || v.cp.GetBootId() != "legacy-boot" {
		t.Fatalf("volume vol-1 not loaded as written: %v", v)
	}
	if err := iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.LastError = "x" }); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(v.dir, volumeStateFile)
	b, legacy, err := atomicfile.ReadRecord(iso.commit.Root(), path)
	if err != nil || legacy {
		t.Fatalf("after an update: legacy=%v err=%v", legacy, err)
	}
	got := &statev1.VolumeCheckpoint{}
	if err := readCheckpoint(iso.commit, path, got); err != nil || got.GetLastError() != "x" || !slices.Equal(got.GetUsers(), []string{"c1"}) {
		t.Fatalf("updated record %s: %v", b, err)
	}
}

// Recovery rebuilds a volume's users from the container records in both
// directions, and a volume record that is missing altogether: the disk
// states a power cut leaves when a container's record reached the disk
// and its volume's did not (or an older version did).
func TestRecoveryRebuildsVolumesFromContainerRecords(t *testing.T) {
	req := func(id, vol string) *statev1.PrepareRequest {
		r := &statev1.PrepareRequest{}
		if err := proto.Unmarshal(seedRequest(func(r *statev1.PrepareRequest) {
			r.ContainerId = id
			r.Volumes[0].GetSource().GetCsiVolume().GetStaticProvisioning().VolumeId = vol
		}), r); err != nil {
			t.Fatal(err)
		}
		return r
	}
	work := t.TempDir()
	seed := seedIsolator(t, work)
	for _, c := range []struct{ id, vol string }{{"c1", "vol-1"}, {"c2", "vol-1"}, {"c3", "vol-2"}} {
		dir := filepath.Join(work, "isolators", "volume", "csi", c.id)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if _, err := seed.writeCheckpoint(dir, containerStateFile, &statev1.ContainerCheckpoint{ContainerId: c.id, Request: req(c.id, c.vol), Phase: statev1.ContainerCheckpoint_PREPARED}); err != nil {
			t.Fatal(err)
		}
	}
	// vol-1's record is older than c1's (lists c2, a user long gone, and
	// c3, whose record names vol-2 only: newer than c3's); vol-2 has none.
	vdir := filepath.Join(work, "csi", "loop", "default", "volumes", "vol-1")
	if err := os.MkdirAll(vdir, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := seed.writeCheckpoint(vdir, volumeStateFile, &statev1.VolumeCheckpoint{
		State: stPublished, PluginName: "loop", Users: []string{"c2", "c-gone", "c3"}, BootId: "b",
		StaticProvisioning: req("c1", "vol-1").GetVolumes()[0].GetSource().GetCsiVolume().GetStaticProvisioning(),
	}); err != nil {
		t.Fatal(err)
	}
	// The seed's commit rounds end before the isolator starts, as a
	// previous process's did: else they rename its new records under
	// the new Committer's feet.
	if err := seed.commit.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b"})
	if err != nil {
		t.Fatal(err)
	}
	iso.rebuildMissingVolumes() // as each resync pass does, first
	iso.recoverVolumes()
	if err := iso.commit.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		vol   string
		users []string
	}{{"vol-1", []string{"c1", "c2"}}, {"vol-2", []string{"c3"}}} {
		v := iso.volumes[volumeKey{"loop", tc.vol}]
		if v == nil {
			t.Errorf("%s: no record after recovery; want one used by %v", tc.vol, tc.users)
			continue
		}
		users := slices.Sorted(slices.Values(v.cp.GetUsers()))
		if !slices.Equal(users, tc.users) {
			t.Errorf("%s: users %v, want %v", tc.vol, users, tc.users)
		}
		// On disk too, for the next start.
		onDisk := &statev1.VolumeCheckpoint{}
		if err := readCheckpoint(iso.commit, filepath.Join(v.dir, volumeStateFile), onDisk); err != nil || !slices.Equal(slices.Sorted(slices.Values(onDisk.GetUsers())), tc.users) {
			t.Errorf("%s on disk: %v, %v", tc.vol, onDisk.GetUsers(), err)
		}
	}
	if got := iso.volumes[volumeKey{"loop", "vol-2"}]; got != nil && got.cp.GetStaticProvisioning().GetVolumeId() != "vol-2" {
		t.Errorf("rebuilt vol-2 lacks its static provisioning: %v", got.cp)
	}
}

// seedPrepared writes the records of a container c1 PREPARED with volume
// vol-1 of plugin loop (staged, its user c1) into a new work dir.
func seedPrepared(t *testing.T) string {
	t.Helper()
	work := t.TempDir()
	req := &statev1.PrepareRequest{}
	if err := proto.Unmarshal(seedRequest(nil), req); err != nil {
		t.Fatal(err)
	}
	cdir := filepath.Join(work, "isolators", "volume", "csi", "c1")
	vdir := filepath.Join(work, "csi", "loop", "default", "volumes", "vol-1")
	mounts := filepath.Join(work, "csi", "loop", "default", "mounts", "vol-1")
	for _, d := range []string{cdir, vdir, filepath.Join(mounts, "staging")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	seed := seedIsolator(t, work)
	if _, err := seed.writeCheckpoint(cdir, containerStateFile, &statev1.ContainerCheckpoint{ContainerId: "c1", Request: req, Phase: statev1.ContainerCheckpoint_PREPARED}); err != nil {
		t.Fatal(err)
	}
	if _, err := seed.writeCheckpoint(vdir, volumeStateFile, &statev1.VolumeCheckpoint{
		State: stNodeReady, PluginName: "loop", Users: []string{"c1"}, BootId: "b",
		StaticProvisioning: req.GetVolumes()[0].GetSource().GetCsiVolume().GetStaticProvisioning(),
		StagingPath:        filepath.Join(mounts, "staging"), TargetPath: filepath.Join(mounts, "target"),
	}); err != nil {
		t.Fatal(err)
	}
	// The seed's commit round (which renames new records into place) ends
	// before the test's isolator loads the work dir: under load it could
	// still be under way, and the test's isolator then found no container
	// (TestCleanupWaitsForItsIntentToBeDurable failed once so in CI).
	if err := seed.commit.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	return work
}

// While fsync fails (EIO), no Cleanup is acknowledged: not the first,
// whose changes cannot be made durable, nor a repeated one, which finds
// the container already gone from memory; once the disk heals, it is.
func TestRepeatedCleanupWaitsForDurability(t *testing.T) {
	work := seedPrepared(t)
	var failing atomic.Bool
	failing.Store(true)
	iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b",
		Fsync: func(path string) error {
			if failing.Load() {
				return syscall.EIO
			}
			return fsyncPath(path)
		}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i := range 2 {
		if err := iso.Cleanup(ctx, "c1", false); !errors.Is(err, syscall.EIO) {
			t.Fatalf("Cleanup %d while every fsync fails: %v; want the EIO", i+1, err)
		}
	}
	failing.Store(false)
	// Until the committer's next retry round, Cleanup reports the last
	// round's failure; then it is acknowledged.
	for err := iso.Cleanup(ctx, "c1", false); err != nil; err = iso.Cleanup(ctx, "c1", false) {
		if ctx.Err() != nil {
			t.Fatalf("Cleanup after the disk healed: %v", err)
		}
	}
}

func fsyncPath(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// Checkpoints written by the release whose checkpoint schema was made of
// the agent API's messages (testdata/record-checkpoints, made by that
// code, every field set) load into the isolator's own schema unchanged:
// field names, numbers and enum value names are the same.
func TestLoadsCheckpointsOfTheAPISchemaRelease(t *testing.T) {
	work := t.TempDir()
	if err := os.CopyFS(work, os.DirFS("testdata/record-checkpoints")); err != nil {
		t.Fatal(err)
	}
	iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "boot-a"})
	if err != nil {
		t.Fatal(err)
	}
	ts := func(s string) *timestamppb.Timestamp {
		x, err := time.Parse(time.RFC3339Nano, s)
		if err != nil {
			t.Fatal(err)
		}
		return timestamppb.New(x)
	}
	capMount := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4", MountFlags: []string{"noatime"}, VolumeMountGroup: "1000"}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER},
	}
	capBlock := &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY},
	}
	static1 := &statev1.StaticProvisioning{
		VolumeId: "vol-1", VolumeCapability: capMount, VolumeContext: map[string]string{"pool": "fast", "size": "1Gi"},
		NodeStageSecrets: map[string]*statev1.Secret{
			"key": {Type: statev1.Secret_VALUE, Value: &statev1.Secret_Value{Data: []byte("s3cret")}},
			"ref": {Type: statev1.Secret_REFERENCE, Reference: &statev1.Secret_Reference{Name: "creds", Key: "password"}},
		},
		NodePublishSecrets: map[string]*statev1.Secret{"pub": {Type: statev1.Secret_VALUE, Value: &statev1.Secret_Value{Data: []byte("p")}}},
	}
	static2 := &statev1.StaticProvisioning{VolumeId: "blk/2", VolumeCapability: capBlock}
	vol := func(sp *statev1.StaticProvisioning, path string, mode statev1.Volume_Mode) *statev1.Volume {
		return &statev1.Volume{ContainerPath: path, Mode: mode, Source: &statev1.Volume_Source{Type: statev1.Volume_Source_CSI_VOLUME,
			CsiVolume: &statev1.CSIVolume{PluginName: "loop", StaticProvisioning: sp}}}
	}
	const mounts = "/var/lib/csi-agent/csi/loop/default/mounts/"
	wantVolumes := map[volumeKey]*statev1.VolumeCheckpoint{
		{"loop", "vol-1"}: {
			State: statev1.VolumeCheckpoint_PUBLISHED, StateSince: ts("2026-11-20T10:00:00.5Z"), PluginName: "loop",
			StaticProvisioning: static1, StagingPath: mounts + "vol-1/staging", TargetPath: mounts + "vol-1/target",
			BootId: "boot-a", Users: []string{"c1", "c2"}, NextReclaim: ts("2026-11-27T03:04:05Z"),
			LastReclaim: &statev1.ReclaimResult{Start: ts("2026-11-20T03:04:05Z"), Duration: durationpb.New(1500 * time.Millisecond), Outcome: "ok",
				PreUsage: 1000, PostUsage: 400, BytesReclaimed: 600},
			NextKeyRotation: ts("2026-12-01T00:00:00Z"), LastRepair: "2026-11-21T08:00:00Z: republished; re-bound 2 container mounts",
		},
		{"loop", "blk/2"}: {
			State: statev1.VolumeCheckpoint_NODE_UNPUBLISH, StateSince: ts("2026-11-21T00:00:00Z"), PluginName: "loop",
			StaticProvisioning: static2, Readonly: true, StagingPath: mounts + "blk%2F2/staging", TargetPath: mounts + "blk%2F2/target",
			BootId: "boot-a", Users: []string{"c2"}, LastError: "NodeUnpublishVolume: rpc error: code = Unavailable desc = plugin down",
			LastReclaim:  &statev1.ReclaimResult{Start: ts("2026-11-20T03:04:05Z"), Outcome: "plugin refused", PreUsage: -1, PostUsage: -1, Code: "Aborted"},
			RoTargetPath: mounts + "blk%2F2/target-ro",
		},
	}
	wantContainers := map[string]*statev1.ContainerCheckpoint{
		"c1": {
			ContainerId: "c1", Phase: statev1.ContainerCheckpoint_PREPARED,
			Request: &statev1.PrepareRequest{ContainerId: "c1", Volumes: []*statev1.Volume{vol(static1, "/data", statev1.Volume_RW)},
				Rootfs: "/run/c1/rootfs", Sandbox: "/run/c1/sandbox", User: "1000:1000", Pid: 4242},
			Mounts: []*statev1.ContainerMount{{PluginName: "loop", VolumeId: "vol-1", ContainerPath: "/data", HostPath: mounts + "vol-1/target",
				MountPoint: "/run/c1/rootfs/data", MountId: 812, ParentMountId: 640, MountNamespace: 4026532201}},
			MountNamespace: 4026532201, BootId: "boot-a",
		},
		"c2": {
			ContainerId: "c2", Phase: statev1.ContainerCheckpoint_CLEANING,
			Request: &statev1.PrepareRequest{ContainerId: "c2", Sandbox: "/run/c2/sandbox",
				Volumes: []*statev1.Volume{vol(static1, "/data", statev1.Volume_RO), vol(static2, "/dev/xvdb", statev1.Volume_RO)}},
			Mounts: []*statev1.ContainerMount{
				{PluginName: "loop", VolumeId: "vol-1", ContainerPath: "/data", HostPath: mounts + "vol-1/target",
					MountPoint: "/run/c2/sandbox/data", Readonly: true, MountId: 900, ParentMountId: 30},
				{PluginName: "loop", VolumeId: "blk/2", ContainerPath: "/dev/xvdb", HostPath: mounts + "blk%2F2/target-ro",
					MountPoint: "/run/c2/sandbox/dev/xvdb", Readonly: true},
			},
			LastError: "unmounting /run/c2/sandbox/data: covered by a mount that is not ours", BootId: "boot-a",
		},
	}
	if len(iso.volumes) != len(wantVolumes) || len(iso.containers) != len(wantContainers) {
		t.Fatalf("loaded %d volumes and %d containers, want %d and %d", len(iso.volumes), len(iso.containers), len(wantVolumes), len(wantContainers))
	}
	for k, want := range wantVolumes {
		if v := iso.volumes[k]; v == nil || !proto.Equal(v.cp, want) {
			t.Errorf("volume %v loaded as %v, want %v", k, v, want)
		}
	}
	for id, want := range wantContainers {
		if c := iso.containers[id]; c == nil || !proto.Equal(c.cp, want) {
			t.Errorf("container %s loaded as %v, want %v", id, c, want)
		}
	}
}

// seedIsolator writes records into work as an isolator would, without
// loading anything.
func seedIsolator(t *testing.T, work string) *Isolator {
	t.Helper()
	c, err := atomicfile.New(work)
	if err != nil {
		t.Fatal(err)
	}
	return &Isolator{commit: c}
}
