package loopplugin

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csiagent/csiagent/internal/testhelp"
	rep "github.com/csiagent/csiagent/proto/replication"
)

func sha(t *testing.T, path string) [32]byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return [32]byte(h.Sum(nil))
}

// writeOn stages and publishes the volume on e, writes data to name in it,
// and unpublishes and unstages it again.
func writeOn(t *testing.T, e *testEnv, id, name string, data []byte) {
	t.Helper()
	staging, target := filepath.Join(e.dir, "w-staging"), filepath.Join(e.dir, "w-target")
	c := mountCap("ext4", snw)
	e.stage(t, id, staging, c)
	e.publish(t, id, staging, target, c, false)
	if err := os.WriteFile(filepath.Join(target, name), data, 0o644); err != nil {
		t.Fatal(err)
	}
	e.unpublish(t, id, target)
	e.unstage(t, id, staging)
}

// readOn stages the volume on e and returns the file's content.
func readOn(t *testing.T, e *testEnv, id, name string) []byte {
	t.Helper()
	staging := filepath.Join(e.dir, "r-staging")
	e.stage(t, id, staging, mountCap("ext4", snw))
	defer e.unstage(t, id, staging)
	b, err := os.ReadFile(filepath.Join(staging, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func info(t *testing.T, e *testEnv, id string) *rep.GetVolumeReplicationInfoResponse {
	t.Helper()
	r, err := e.rep.GetVolumeReplicationInfo(context.Background(), &rep.GetVolumeReplicationInfoRequest{ReplicationSource: volumeSource(id)})
	if err != nil {
		t.Fatalf("GetVolumeReplicationInfo on %s: %v", filepath.Base(e.pool), err)
	}
	return r
}

func randomData(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// TestReplicationFailover replicates a volume from pool a to pool b and
// fails over and back: enable (initial copy of a staged, written
// volume), write more, demote a (final sync), promote b: the images are
// identical and b serves the data; b writes, demotes, a resyncs and is
// promoted again. The error table is checked on the way, and
// GetVolumeReplicationInfo reports real syncs: bytes > 0 after writes,
// the sync time moves.
func TestReplicationFailover(t *testing.T) {
	testhelp.NeedRoot(t)
	a, b := newReplicaPair(t, slog.LevelInfo)
	ctx := context.Background()
	id := a.createVolume(t, "rv", 64<<20)
	imgA, imgB := filepath.Join(a.pool, id+".img"), filepath.Join(b.pool, id+".img")
	first := randomData(1 << 20)

	// Enable while the volume is staged and published (frozen for the
	// initial copy).
	c := mountCap("ext4", snw)
	staging, target := filepath.Join(a.dir, "staging"), filepath.Join(a.dir, "target")
	a.stage(t, id, staging, c)
	a.publish(t, id, staging, target, c, false)
	if err := os.WriteFile(filepath.Join(target, "first"), first, 0o644); err != nil {
		t.Fatal(err)
	}
	enable := &rep.EnableVolumeReplicationRequest{ReplicationSource: volumeSource(id), ReplicationId: "r1"}
	if _, err := a.rep.EnableVolumeReplication(ctx, enable); err != nil {
		t.Fatalf("enable: %v", err)
	}
	if _, err := a.rep.EnableVolumeReplication(ctx, enable); err != nil {
		t.Fatalf("enable again: %v", err)
	}
	i1 := info(t, a, id)
	if i1.GetLastSyncBytes() < 1<<20 || i1.GetLastSyncTime() == nil || i1.GetLastSyncDuration().AsDuration() <= 0 {
		t.Errorf("info after enable = %v", i1)
	}
	if i1.GetStatus() != rep.GetVolumeReplicationInfoResponse_HEALTHY {
		t.Errorf("status after enable = %v (%q), want HEALTHY", i1.GetStatus(), i1.GetStatusMessage())
	}
	dest, err := a.rep.GetReplicationDestinationInfo(ctx, &rep.GetReplicationDestinationInfoRequest{ReplicationSource: volumeSource(id)})
	if err != nil || dest.GetReplicationDestination().GetVolume().GetVolumeId() != id {
		t.Fatalf("GetReplicationDestinationInfo = %v, %v; want volume %s", dest, err, id)
	}

	// The error table while a is primary.
	other := a.createVolume(t, "other", 8<<20)
	for _, tc := range []struct {
		name string
		call func() error
		code codes.Code
	}{
		{"info on the secondary", func() error {
			_, err := b.rep.GetVolumeReplicationInfo(ctx, &rep.GetVolumeReplicationInfoRequest{ReplicationSource: volumeSource(id)})
			return err
		}, codes.FailedPrecondition},
		{"resync the primary", func() error {
			_, err := a.rep.ResyncVolume(ctx, &rep.ResyncVolumeRequest{ReplicationSource: volumeSource(id)})
			return err
		}, codes.FailedPrecondition},
		{"promote the secondary while the primary is primary", func() error {
			_, err := b.rep.PromoteVolume(ctx, &rep.PromoteVolumeRequest{ReplicationSource: volumeSource(id)})
			return err
		}, codes.FailedPrecondition},
		{"demote a staged primary", func() error {
			_, err := a.rep.DemoteVolume(ctx, &rep.DemoteVolumeRequest{ReplicationSource: volumeSource(id)})
			return err
		}, codes.FailedPrecondition},
		{"stage the secondary", func() error {
			_, err := b.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: filepath.Join(b.dir, "x"), VolumeCapability: c})
			return err
		}, codes.FailedPrecondition},
		{"delete a replicated volume", func() error {
			_, err := b.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
			return err
		}, codes.FailedPrecondition},
		{"enable without volume id", func() error {
			_, err := a.rep.EnableVolumeReplication(ctx, &rep.EnableVolumeReplicationRequest{})
			return err
		}, codes.InvalidArgument},
		{"enable with an empty source volume id", func() error {
			_, err := a.rep.EnableVolumeReplication(ctx, &rep.EnableVolumeReplicationRequest{ReplicationSource: volumeSource("")})
			return err
		}, codes.InvalidArgument},
		{"destination of a volume not replicated", func() error {
			_, err := a.rep.GetReplicationDestinationInfo(ctx, &rep.GetReplicationDestinationInfoRequest{ReplicationSource: volumeSource(other)})
			return err
		}, codes.FailedPrecondition},
		{"enable an unknown volume", func() error {
			_, err := a.rep.EnableVolumeReplication(ctx, &rep.EnableVolumeReplicationRequest{ReplicationSource: volumeSource("ghost")})
			return err
		}, codes.NotFound},
		{"enable a group", func() error {
			_, err := a.rep.EnableVolumeReplication(ctx, &rep.EnableVolumeReplicationRequest{ReplicationSource: &rep.ReplicationSource{
				Type: &rep.ReplicationSource_Volumegroup{Volumegroup: &rep.ReplicationSource_VolumeGroupSource{VolumeGroupId: "g"}}}})
			return err
		}, codes.InvalidArgument},
		{"operation pending", func() error {
			unlock, err := a.p.locks.tryLock(id)
			if err != nil {
				return err
			}
			defer unlock()
			_, err = a.rep.PromoteVolume(ctx, &rep.PromoteVolumeRequest{ReplicationSource: volumeSource(id)})
			return err
		}, codes.Aborted},
		{"operation pending on the other side", func() error {
			unlock, err := flockFile(b.p.pool.lockFile(id))
			if err != nil {
				return err
			}
			defer unlock()
			_, err = a.rep.ResyncVolume(ctx, &rep.ResyncVolumeRequest{ReplicationSource: volumeSource(id)})
			return err
		}, codes.Aborted},
	} {
		t.Run(tc.name, func(t *testing.T) { wantCode(t, tc.call(), tc.code) })
	}

	// More data, then a clean failover to b.
	second := randomData(2 << 20)
	if err := os.WriteFile(filepath.Join(target, "second"), second, 0o644); err != nil {
		t.Fatal(err)
	}
	a.unpublish(t, id, target)
	a.unstage(t, id, staging)
	time.Sleep(10 * time.Millisecond) // sync times must differ visibly
	if _, err := a.rep.DemoteVolume(ctx, &rep.DemoteVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatalf("demote a: %v", err)
	}
	if _, err := a.rep.DemoteVolume(ctx, &rep.DemoteVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatalf("demote a again: %v", err)
	}
	if _, err := b.rep.PromoteVolume(ctx, &rep.PromoteVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatalf("promote b: %v", err)
	}
	if sha(t, imgA) != sha(t, imgB) {
		t.Fatal("after demote and promote the two images differ")
	}
	i2 := info(t, b, id)
	if !i2.GetLastSyncTime().AsTime().After(i1.GetLastSyncTime().AsTime()) || i2.GetLastSyncBytes() < 2<<20 {
		t.Errorf("info after the failover sync = %v, before %v", i2, i1)
	}
	_, err = a.rep.GetVolumeReplicationInfo(ctx, &rep.GetVolumeReplicationInfoRequest{ReplicationSource: volumeSource(id)})
	wantCode(t, err, codes.FailedPrecondition)
	if got := readOn(t, b, id, "second"); !bytes.Equal(got, second) {
		t.Error("b does not serve the data written on a")
	}

	// a, demoted, resyncs from b; b, primary, cannot.
	third := randomData(512 << 10)
	writeOn(t, b, id, "third", third)
	r, err := a.rep.ResyncVolume(ctx, &rep.ResyncVolumeRequest{ReplicationSource: volumeSource(id)})
	if err != nil || !r.GetReady() {
		t.Fatalf("resync a = %v, %v", r, err)
	}
	_, err = b.rep.ResyncVolume(ctx, &rep.ResyncVolumeRequest{ReplicationSource: volumeSource(id)})
	wantCode(t, err, codes.FailedPrecondition)
	i3 := info(t, b, id)
	if !i3.GetLastSyncTime().AsTime().After(i2.GetLastSyncTime().AsTime()) || i3.GetLastSyncBytes() < 512<<10 {
		t.Errorf("info after resync = %v", i3)
	}
	if sha(t, imgA) != sha(t, imgB) {
		t.Fatal("after resync the two images differ")
	}
	// A forced full resync rewrites the same content.
	r, err = a.rep.ResyncVolume(ctx, &rep.ResyncVolumeRequest{ReplicationSource: volumeSource(id), Force: true})
	if err != nil || !r.GetReady() || sha(t, imgA) != sha(t, imgB) {
		t.Fatalf("forced resync = %v, %v", r, err)
	}
	if i := info(t, b, id); i.GetLastSyncBytes() < 3<<20 {
		t.Errorf("a full resync reports %d bytes", i.GetLastSyncBytes())
	}

	// Fail back: b demotes (nothing new to sync), a is promoted.
	if _, err := b.rep.DemoteVolume(ctx, &rep.DemoteVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatal(err)
	}
	_, err = a.rep.GetVolumeReplicationInfo(ctx, &rep.GetVolumeReplicationInfoRequest{ReplicationSource: volumeSource(id)})
	wantCode(t, err, codes.FailedPrecondition) // both demoted
	if _, err := a.rep.PromoteVolume(ctx, &rep.PromoteVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatal(err)
	}
	if got := readOn(t, a, id, "third"); !bytes.Equal(got, third) {
		t.Error("a does not serve the data written on b")
	}
	if i := info(t, a, id); i.GetLastSyncBytes() != 0 {
		t.Errorf("demote of an unchanged copy synced %d bytes", i.GetLastSyncBytes())
	}

	// Disable on either side removes both states; both copies stay.
	if _, err := b.rep.DisableVolumeReplication(ctx, &rep.DisableVolumeReplicationRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.rep.DisableVolumeReplication(ctx, &rep.DisableVolumeReplicationRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatal(err)
	}
	_, err = a.rep.PromoteVolume(ctx, &rep.PromoteVolumeRequest{ReplicationSource: volumeSource(id)})
	wantCode(t, err, codes.FailedPrecondition) // not enabled
	_, err = a.rep.EnableVolumeReplication(ctx, enable)
	wantCode(t, err, codes.FailedPrecondition) // the stale copy in b
	for _, e := range []*testEnv{a, b} {
		if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("delete on %s after disable: %v", filepath.Base(e.pool), err)
		}
	}
}

// TestReplicationScheduled: with schedulingInterval the primary syncs by
// itself, frozen, while it is staged and written to; each sync moves the
// last sync time and reports the bytes the writes changed.
func TestReplicationScheduled(t *testing.T) {
	testhelp.NeedRoot(t)
	a, b := newReplicaPair(t, slog.LevelInfo)
	a.p.replicationTick = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); a.p.runReplication(ctx) }()
	t.Cleanup(func() { cancel(); <-done })

	id := a.createVolume(t, "sv", 32<<20)
	c := mountCap("ext4", snw)
	staging := filepath.Join(a.dir, "staging")
	a.stage(t, id, staging, c)
	t.Cleanup(func() { cancel(); <-done; a.unstage(t, id, staging) })
	if _, err := a.rep.EnableVolumeReplication(context.Background(), &rep.EnableVolumeReplicationRequest{
		ReplicationSource: volumeSource(id), Parameters: map[string]string{"schedulingInterval": "1s", "freezeTimeout": "10s"},
	}); err != nil {
		t.Fatal(err)
	}
	prev := info(t, a, id)
	data := randomData(1 << 20)
	if err := os.WriteFile(filepath.Join(staging, "data"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		i := info(t, a, id)
		if i.GetLastSyncTime().AsTime().After(prev.GetLastSyncTime().AsTime()) {
			if i.GetLastSyncBytes() < 1<<20 {
				t.Errorf("scheduled sync after a 1 MiB write changed %d bytes", i.GetLastSyncBytes())
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no scheduled sync within 10s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The replica holds the data: read it from a private copy of b's
	// image (b's own copy is a secondary and cannot be staged).
	cancel()
	<-done
	cp, err := b.ctrl.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name: "copy", VolumeCapabilities: []*csi.VolumeCapability{c},
		VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: id}}},
	})
	if err != nil {
		t.Fatalf("clone the replica: %v", err)
	}
	if got := readOn(t, b, cp.GetVolume().GetVolumeId(), "data"); !bytes.Equal(got, data) {
		t.Error("the scheduled sync did not carry the data")
	}
}

// TestReplicationUnconfigured: without a replica pool the calls are
// Unimplemented.
func TestReplicationUnconfigured(t *testing.T) {
	e := newEnv(t, slog.LevelWarn)
	id := e.createVolume(t, "v", 8<<20)
	_, err := e.rep.EnableVolumeReplication(context.Background(), &rep.EnableVolumeReplicationRequest{ReplicationSource: volumeSource(id)})
	wantCode(t, err, codes.Unimplemented)
	_, err = e.rep.GetVolumeReplicationInfo(context.Background(), &rep.GetVolumeReplicationInfoRequest{ReplicationSource: volumeSource(id)})
	wantCode(t, err, codes.Unimplemented)
	if _, err := New(Config{Pool: e.pool, ReplicaPool: e.pool, NodeID: "n"}); err == nil {
		t.Error("the pool as its own replica was accepted")
	}
}

// TestReplicationStates covers the state machine's edges on unstaged
// volumes (no root needed: images are written as plain files): an enable
// interrupted between the two records resumes with a sync; with both
// sides demoted a resync has nothing to sync from; a copy an interrupted
// sync left inconsistent is promoted only with force; a forced promotion
// while the other side is still primary makes that side's demote skip
// its sync (the promoted side keeps its data).
func TestReplicationStates(t *testing.T) {
	a, b := newReplicaPair(t, slog.LevelWarn)
	ctx := context.Background()
	id := a.createVolume(t, "st", 8<<20)
	imgA, imgB := filepath.Join(a.pool, id+".img"), filepath.Join(b.pool, id+".img")
	writeImage := func(path string, off int64, n int) {
		t.Helper()
		f, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if _, err := f.WriteAt(randomData(n), off); err != nil {
			t.Fatal(err)
		}
	}
	writeImage(imgA, 1<<20, 64<<10)
	if _, err := a.rep.EnableVolumeReplication(ctx, &rep.EnableVolumeReplicationRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatal(err)
	}

	// Interrupted enable: a's record lost, a changed meanwhile.
	if err := a.p.pool.removeRecord(metaReplication, id); err != nil {
		t.Fatal(err)
	}
	writeImage(imgA, 2<<20, 8<<10)
	if _, err := a.rep.EnableVolumeReplication(ctx, &rep.EnableVolumeReplicationRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatalf("resumed enable: %v", err)
	}
	if i := info(t, a, id); i.GetLastSyncBytes() != 8<<10 {
		t.Errorf("resumed enable synced %d bytes, want %d", i.GetLastSyncBytes(), 8<<10)
	}
	if sha(t, imgA) != sha(t, imgB) {
		t.Fatal("images differ after the resumed enable")
	}

	// Both demoted: nothing to resync from.
	if _, err := a.rep.DemoteVolume(ctx, &rep.DemoteVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatal(err)
	}
	if r, err := a.rep.ResyncVolume(ctx, &rep.ResyncVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil || r.GetReady() {
		t.Errorf("resync without a primary = %v, %v; want not ready", r, err)
	}

	// b's copy marked inconsistent (as an interrupted sync leaves it).
	r, err := b.p.pool.replication(id)
	if err != nil || r == nil {
		t.Fatal(r, err)
	}
	r.Consistent = false
	if err := b.p.pool.writeRecord(metaReplication, id, r); err != nil {
		t.Fatal(err)
	}
	_, err = b.rep.PromoteVolume(ctx, &rep.PromoteVolumeRequest{ReplicationSource: volumeSource(id)})
	wantCode(t, err, codes.FailedPrecondition)
	if _, err := b.rep.PromoteVolume(ctx, &rep.PromoteVolumeRequest{ReplicationSource: volumeSource(id), Force: true}); err != nil {
		t.Fatalf("forced promote: %v", err)
	}

	// Split brain by force: a promoted too, b writes, a demotes without
	// overwriting b, then resyncs from it.
	if _, err := a.rep.PromoteVolume(ctx, &rep.PromoteVolumeRequest{ReplicationSource: volumeSource(id), Force: true}); err != nil {
		t.Fatal(err)
	}
	writeImage(imgB, 3<<20, 4<<10)
	bBefore := sha(t, imgB)
	if _, err := a.rep.DemoteVolume(ctx, &rep.DemoteVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil {
		t.Fatal(err)
	}
	if sha(t, imgB) != bBefore {
		t.Fatal("demoting the old primary overwrote the promoted copy")
	}
	if r, err := a.rep.ResyncVolume(ctx, &rep.ResyncVolumeRequest{ReplicationSource: volumeSource(id)}); err != nil || !r.GetReady() {
		t.Fatalf("resync = %v, %v", r, err)
	}
	if sha(t, imgA) != sha(t, imgB) {
		t.Fatal("images differ after the resync")
	}
}
