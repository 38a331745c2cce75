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

	"github.com/csiagent/csiagent/internal/atomicfile"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
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
	iso, err := New(Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b", Logger: slog.New(slog.DiscardHandler),
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
	iso, err := New(Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "legacy-boot"})
	if err != nil {
		t.Fatal(err)
	}
	c := iso.containers["c1"]
	if c == nil || c.cp.GetPhase() != agentv1.ContainerStatus_PREPARED || len(c.cp.GetMounts()) != 1 || c.cp.GetMounts()[0].GetMountPoint() != "/sandbox/data" {
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
	b, legacy, err := atomicfile.ReadRecord(path)
	if err != nil || legacy {
		t.Fatalf("after an update: legacy=%v err=%v", legacy, err)
	}
	got := &statev1.VolumeCheckpoint{}
	if err := readCheckpoint(path, got); err != nil || got.GetLastError() != "x" || !slices.Equal(got.GetUsers(), []string{"c1"}) {
		t.Fatalf("updated record %s: %v", b, err)
	}
}

// Recovery rebuilds a volume's users from the container records in both
// directions, and a volume record that is missing altogether: the disk
// states a power cut leaves when a container's record reached the disk
// and its volume's did not (or an older version did).
func TestRecoveryRebuildsVolumesFromContainerRecords(t *testing.T) {
	req := func(id, vol string) *agentv1.PrepareRequest {
		r := &agentv1.PrepareRequest{}
		if err := proto.Unmarshal(seedRequest(func(r *agentv1.PrepareRequest) {
			r.ContainerId = id
			r.Volumes[0].GetSource().GetCsiVolume().GetStaticProvisioning().VolumeId = vol
		}), r); err != nil {
			t.Fatal(err)
		}
		return r
	}
	work := t.TempDir()
	seed := &Isolator{}
	for _, c := range []struct{ id, vol string }{{"c1", "vol-1"}, {"c2", "vol-1"}, {"c3", "vol-2"}} {
		dir := filepath.Join(work, "isolators", "volume", "csi", c.id)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if _, err := seed.writeCheckpoint(dir, containerStateFile, &statev1.ContainerCheckpoint{ContainerId: c.id, Request: req(c.id, c.vol), Phase: agentv1.ContainerStatus_PREPARED}); err != nil {
			t.Fatal(err)
		}
	}
	// vol-1's record is older than c1's (lists c2 and a user long gone);
	// vol-2 has none.
	vdir := filepath.Join(work, "csi", "loop", "default", "volumes", "vol-1")
	if err := os.MkdirAll(vdir, 0o700); err != nil {
		t.Fatal(err)
	}
	if _, err := seed.writeCheckpoint(vdir, volumeStateFile, &statev1.VolumeCheckpoint{
		State: stPublished, PluginName: "loop", Users: []string{"c2", "c-gone"}, BootId: "b",
		StaticProvisioning: req("c1", "vol-1").GetVolumes()[0].GetSource().GetCsiVolume().GetStaticProvisioning(),
	}); err != nil {
		t.Fatal(err)
	}
	iso, err := New(Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b"})
	if err != nil {
		t.Fatal(err)
	}
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
		if err := readCheckpoint(filepath.Join(v.dir, volumeStateFile), onDisk); err != nil || !slices.Equal(slices.Sorted(slices.Values(onDisk.GetUsers())), tc.users) {
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
	req := &agentv1.PrepareRequest{}
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
	seed := &Isolator{}
	if _, err := seed.writeCheckpoint(cdir, containerStateFile, &statev1.ContainerCheckpoint{ContainerId: "c1", Request: req, Phase: agentv1.ContainerStatus_PREPARED}); err != nil {
		t.Fatal(err)
	}
	if _, err := seed.writeCheckpoint(vdir, volumeStateFile, &statev1.VolumeCheckpoint{
		State: stNodeReady, PluginName: "loop", Users: []string{"c1"}, BootId: "b",
		StaticProvisioning: req.GetVolumes()[0].GetSource().GetCsiVolume().GetStaticProvisioning(),
		StagingPath:        filepath.Join(mounts, "staging"), TargetPath: filepath.Join(mounts, "target"),
	}); err != nil {
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
	iso, err := New(Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b",
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
