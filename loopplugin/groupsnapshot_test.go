package loopplugin

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// recordSize is the size of one record the writer appends: "seq NNNNNNNNNN"
// padded with dots to a fixed width, newline-terminated.
const recordSize = 64

func record(k int) []byte {
	b := []byte(fmt.Sprintf("seq %010d ", k))
	for len(b) < recordSize-1 {
		b = append(b, '.')
	}
	return append(b, '\n')
}

// countRecords returns how many records the log at path holds, failing the
// test if any is not the expected one (torn, garbage, out of order).
func countRecords(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	n := 0
	for sc.Scan() {
		if got, want := sc.Text()+"\n", string(record(n)); got != want {
			t.Fatalf("%s: record %d = %q, want %q", path, n, got, want)
		}
		n++
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return n
}

// e2fsckClean runs e2fsck -fn on an image and fails the test unless it
// finds nothing to fix.
func e2fsckClean(t *testing.T, e *testEnv, img string) {
	t.Helper()
	if e.p.tools.e2fsck == "" {
		t.Fatal("e2fsck is not installed: make deps installs e2fsprogs")
	}
	out, err := exec.Command(e.p.tools.e2fsck, "-fn", img).CombinedOutput()
	if err != nil {
		t.Errorf("e2fsck -fn %s: %v\n%s", img, err, out)
	}
}

// writable writes a file in dir and fails the test if that does not finish
// within a few seconds (the filesystem stayed frozen); it then thaws it so
// the test can clean up.
func writable(t *testing.T, dir string) {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		f, err := os.Create(filepath.Join(dir, "probe"))
		if err == nil {
			_, err = f.Write([]byte("still writable"))
			err = errors.Join(err, f.Sync(), f.Close())
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("write to %s: %v", dir, err)
		}
	case <-time.After(5 * time.Second):
		t.Errorf("%s is still frozen: a write did not finish in 5s", dir)
		_ = mount.Thaw(dir)
		<-done
	}
}

// TestGroupSnapshotWhileWriting takes a group snapshot of two staged and
// published ext4 volumes while a goroutine appends numbered records to a
// log on each, always first to a then to b. The snapshots are restored
// with CreateVolume: both images pass e2fsck -fn as they are (the freeze
// left them clean, no journal replay needed), mount, and hold record
// prefixes that a write-order consistent cut allows: b has the same number
// of records as a, or one fewer (b's record k is written only after a's
// record k completed).
func TestGroupSnapshotWhileWriting(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo)
	ctx := context.Background()
	c := mountCap("ext4", snw)
	vols := []string{e.createVolume(t, "gs-a", 64<<20), e.createVolume(t, "gs-b", 64<<20)}
	var targets []string
	for _, v := range vols {
		staging, target := filepath.Join(e.dir, v, "staging"), filepath.Join(e.dir, v, "target")
		e.stage(t, v, staging, c)
		e.publish(t, v, staging, target, c, false)
		targets = append(targets, target)
		t.Cleanup(func() { e.unpublish(t, v, target); e.unstage(t, v, staging) })
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	var written int
	var writeErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		var logs []*os.File
		for _, tg := range targets {
			f, err := os.OpenFile(filepath.Join(tg, "log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
			if err != nil {
				writeErr = err
				return
			}
			defer f.Close()
			logs = append(logs, f)
		}
		for k := 0; ; k++ {
			select {
			case <-stop:
				written = k
				return
			default:
			}
			for _, f := range logs {
				if _, err := f.Write(record(k)); err != nil {
					writeErr = err
					return
				}
			}
			if k%64 == 0 {
				time.Sleep(time.Millisecond) // keep the logs small
			}
		}
	}()
	time.Sleep(300 * time.Millisecond)
	req := &csi.CreateVolumeGroupSnapshotRequest{Name: "gs1", SourceVolumeIds: []string{vols[1], vols[0]}}
	resp, err := e.group.CreateVolumeGroupSnapshot(ctx, req)
	time.Sleep(100 * time.Millisecond) // the writer carries on after the thaw
	close(stop)
	wg.Wait()
	if err != nil {
		t.Fatalf("CreateVolumeGroupSnapshot: %v", err)
	}
	if writeErr != nil {
		t.Fatalf("writer: %v", writeErr)
	}
	gs := resp.GetGroupSnapshot()
	if gs.GetGroupSnapshotId() != "gs1" || !gs.GetReadyToUse() || len(gs.GetSnapshots()) != 2 || gs.GetCreationTime() == nil {
		t.Fatalf("group snapshot = %v", gs)
	}
	snapOf := map[string]string{}
	var snapIDs []string
	for _, s := range gs.GetSnapshots() {
		if s.GetGroupSnapshotId() != "gs1" || !s.GetReadyToUse() || s.GetSizeBytes() != 64<<20 {
			t.Errorf("member snapshot = %v", s)
		}
		snapOf[s.GetSourceVolumeId()] = s.GetSnapshotId()
		snapIDs = append(snapIDs, s.GetSnapshotId())
	}

	// Idempotent; incompatible; get; member deletion refused.
	again, err := e.group.CreateVolumeGroupSnapshot(ctx, req)
	if err != nil || !slices.Equal(snapshotIDs(again.GetGroupSnapshot()), snapIDs) {
		t.Errorf("create again = %v, %v", again, err)
	}
	_, err = e.group.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "gs1", SourceVolumeIds: vols[:1]})
	wantCode(t, err, codes.AlreadyExists)
	got, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "gs1", SnapshotIds: []string{snapIDs[1], snapIDs[0]}})
	if err != nil || !slices.Equal(snapshotIDs(got.GetGroupSnapshot()), snapIDs) {
		t.Errorf("get = %v, %v", got, err)
	}
	_, err = e.ctrl.DeleteSnapshot(ctx, &csi.DeleteSnapshotRequest{SnapshotId: snapIDs[0]})
	wantCode(t, err, codes.InvalidArgument)
	ls, err := e.ctrl.ListSnapshots(ctx, &csi.ListSnapshotsRequest{SourceVolumeId: vols[0]})
	if err != nil || len(ls.GetEntries()) != 1 || ls.GetEntries()[0].GetSnapshot().GetGroupSnapshotId() != "gs1" {
		t.Errorf("ListSnapshots = %v, %v", ls, err)
	}

	// Restore both and check them.
	var counts []int
	for _, v := range vols {
		r := "restored-" + v
		cv, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
			Name: r, VolumeCapabilities: []*csi.VolumeCapability{c},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: snapOf[v]}}},
		})
		if err != nil {
			t.Fatalf("restore %s: %v", v, err)
		}
		if cv.GetVolume().GetContentSource().GetSnapshot().GetSnapshotId() != snapOf[v] || cv.GetVolume().GetCapacityBytes() != 64<<20 {
			t.Errorf("restored volume = %v", cv.GetVolume())
		}
		img := filepath.Join(e.pool, r+".img")
		e2fsckClean(t, e, img)
		staging := filepath.Join(e.dir, r)
		e.stage(t, r, staging, c)
		counts = append(counts, countRecords(t, filepath.Join(staging, "log")))
		e.unstage(t, r, staging)
		e2fsckClean(t, e, img)
	}
	t.Logf("records: %d in a, %d in b of %d written", counts[0], counts[1], written)
	if counts[0] == 0 || counts[0] >= written {
		t.Errorf("snapshot of a holds %d of %d records: not taken while writing", counts[0], written)
	}
	if counts[1] != counts[0] && counts[1] != counts[0]-1 {
		t.Errorf("snapshots not write-order consistent: a has %d records, b %d (want %d or %d)", counts[0], counts[1], counts[0], counts[0]-1)
	}

	// Delete: ids must match; then the snapshots are gone, the restored
	// volumes stay.
	_, err = e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "gs1", SnapshotIds: snapIDs[:1]})
	wantCode(t, err, codes.InvalidArgument)
	if _, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "gs1", SnapshotIds: snapIDs}); err != nil {
		t.Fatal(err)
	}
	_, err = e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "gs1", SnapshotIds: snapIDs})
	wantCode(t, err, codes.NotFound)
	if left, _ := os.ReadDir(e.p.pool.metaDir(metaSnapshots)); len(left) != 0 {
		t.Errorf("left in the snapshot directory: %v", left)
	}
}

func snapshotIDs(g *csi.VolumeGroupSnapshot) []string {
	var ids []string
	for _, s := range g.GetSnapshots() {
		ids = append(ids, s.GetSnapshotId())
	}
	return ids
}

// TestGroupSnapshotThaws: whatever happens to the copy, the filesystems
// are thawed and nothing of the snapshot is left: a copy that fails, a
// copy that outlives the freeze deadline. A member staged for block access
// cannot be frozen: FailedPrecondition.
func TestGroupSnapshotThaws(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo)
	ctx := context.Background()
	vols := []string{e.createVolume(t, "th-a", 32<<20), e.createVolume(t, "th-b", 32<<20)}
	var stagings []string
	for _, v := range vols {
		staging := filepath.Join(e.dir, v)
		e.stage(t, v, staging, mountCap("ext4", snw))
		stagings = append(stagings, staging)
		t.Cleanup(func() { e.unstage(t, v, staging) })
	}
	for _, tc := range []struct {
		name   string
		params map[string]string
		hook   func(ctx context.Context, volumeID string) error
		code   codes.Code
		maxDur time.Duration
	}{
		{
			name: "copy fails",
			hook: func(ctx context.Context, id string) error {
				if id == vols[1] {
					return errors.New("injected copy failure")
				}
				return nil
			},
			code: codes.Internal,
		},
		{
			name:   "copy outlives the freeze deadline",
			params: map[string]string{"freezeTimeout": "500ms"},
			hook: func(ctx context.Context, id string) error {
				<-ctx.Done() // a copy stuck until the deadline
				return ctx.Err()
			},
			code:   codes.DeadlineExceeded,
			maxDur: 3 * time.Second,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e.p.hooks.beforeSnapshotCopy.Store(&tc.hook)
			defer e.p.hooks.beforeSnapshotCopy.Store(nil)
			start := time.Now()
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{
				Name: "fails", SourceVolumeIds: vols, Parameters: tc.params,
			})
			wantCode(t, err, tc.code)
			if tc.maxDur > 0 && time.Since(start) > tc.maxDur {
				t.Errorf("took %v", time.Since(start))
			}
			for _, s := range stagings {
				writable(t, s)
			}
			if left, _ := os.ReadDir(e.p.pool.metaDir(metaSnapshots)); len(left) != 0 {
				t.Errorf("left in the snapshot directory: %v", left)
			}
			if _, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "fails", SnapshotIds: []string{"x"}}); err == nil {
				t.Error("a failed group snapshot exists")
			}
		})
	}

	t.Run("block member", func(t *testing.T) {
		blk := e.createVolume(t, "th-block", 16<<20)
		staging := filepath.Join(e.dir, "blk")
		e.stage(t, blk, staging, blockCap(snw))
		defer e.unstage(t, blk, staging)
		_, err := e.group.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{
			Name: "with-block", SourceVolumeIds: []string{vols[0], blk},
		})
		wantCode(t, err, codes.FailedPrecondition)
		writable(t, stagings[0])
	})
}

// TestGroupSnapshotErrors: the GroupController's validation and the CSI
// snapshot calls' codes (no root: unstaged volumes are copied as they are).
func TestGroupSnapshotErrors(t *testing.T) {
	e := newEnv(t, slog.LevelWarn)
	ctx := context.Background()
	a, b := e.createVolume(t, "ea", 8<<20), e.createVolume(t, "eb", 8<<20)
	caps, err := e.group.GroupControllerGetCapabilities(ctx, &csi.GroupControllerGetCapabilitiesRequest{})
	if err != nil || len(caps.GetCapabilities()) != 1 ||
		caps.GetCapabilities()[0].GetRpc().GetType() != csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT {
		t.Errorf("GroupControllerGetCapabilities = %v, %v", caps, err)
	}
	for _, tc := range []struct {
		name string
		req  *csi.CreateVolumeGroupSnapshotRequest
		code codes.Code
	}{
		{"no name", &csi.CreateVolumeGroupSnapshotRequest{SourceVolumeIds: []string{a}}, codes.InvalidArgument},
		{"no volumes", &csi.CreateVolumeGroupSnapshotRequest{Name: "x"}, codes.InvalidArgument},
		{"volume twice", &csi.CreateVolumeGroupSnapshotRequest{Name: "x", SourceVolumeIds: []string{a, a}}, codes.InvalidArgument},
		{"unknown parameter", &csi.CreateVolumeGroupSnapshotRequest{Name: "x", SourceVolumeIds: []string{a}, Parameters: map[string]string{"colour": "red"}}, codes.InvalidArgument},
		{"bad freeze timeout", &csi.CreateVolumeGroupSnapshotRequest{Name: "x", SourceVolumeIds: []string{a}, Parameters: map[string]string{"freezeTimeout": "forever"}}, codes.InvalidArgument},
		{"unknown volume", &csi.CreateVolumeGroupSnapshotRequest{Name: "x", SourceVolumeIds: []string{a, "ghost"}}, codes.NotFound},
		{"ok", &csi.CreateVolumeGroupSnapshotRequest{Name: "x", SourceVolumeIds: []string{a, b}, Parameters: map[string]string{"csi.storage.k8s.io/volumegroupsnapshot/name": "n"}}, codes.OK},
		{"same name, other volumes", &csi.CreateVolumeGroupSnapshotRequest{Name: "x", SourceVolumeIds: []string{a}}, codes.AlreadyExists},
	} {
		t.Run("create "+tc.name, func(t *testing.T) {
			_, err := e.group.CreateVolumeGroupSnapshot(ctx, tc.req)
			wantCode(t, err, tc.code)
		})
	}
	ids := []string{memberSnapshotID("x", a), memberSnapshotID("x", b)}
	for _, tc := range []struct {
		name string
		call func() error
		code codes.Code
	}{
		{"get no id", func() error {
			_, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"get unknown", func() error {
			_, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "nope", SnapshotIds: ids})
			return err
		}, codes.NotFound},
		{"get without snapshot ids", func() error {
			_, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "x"})
			return err
		}, codes.InvalidArgument},
		{"get", func() error {
			_, err := e.group.GetVolumeGroupSnapshot(ctx, &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: "x", SnapshotIds: ids})
			return err
		}, codes.OK},
		{"get snapshot of a member", func() error {
			_, err := e.ctrl.GetSnapshot(ctx, &csi.GetSnapshotRequest{SnapshotId: ids[0]})
			return err
		}, codes.OK},
		{"delete no id", func() error {
			_, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{})
			return err
		}, codes.InvalidArgument},
		{"delete unknown", func() error {
			_, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "nope"})
			return err
		}, codes.OK},
		{"delete with wrong ids", func() error {
			_, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "x", SnapshotIds: []string{ids[0], "other"}})
			return err
		}, codes.InvalidArgument},
		{"restore too small", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: "small", VolumeCapabilities: []*csi.VolumeCapability{mountCap("", snw)},
				CapacityRange: &csi.CapacityRange{LimitBytes: 4 << 20},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
					Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: ids[0]}}},
			})
			return err
		}, codes.OutOfRange},
		{"restore larger", func() error {
			resp, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: "large", VolumeCapabilities: []*csi.VolumeCapability{mountCap("", snw)},
				CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
					Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: ids[0]}}},
			})
			if err == nil && resp.GetVolume().GetCapacityBytes() != 16<<20 {
				return fmt.Errorf("capacity %d", resp.GetVolume().GetCapacityBytes())
			}
			return err
		}, codes.OK},
		{"recreate with another source", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: "large", VolumeCapabilities: []*csi.VolumeCapability{mountCap("", snw)},
				CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
					Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: ids[1]}}},
			})
			return err
		}, codes.AlreadyExists},
		{"delete", func() error {
			_, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: "x", SnapshotIds: ids})
			return err
		}, codes.OK},
		{"restore from deleted", func() error {
			_, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
				Name: "late", VolumeCapabilities: []*csi.VolumeCapability{mountCap("", snw)},
				VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
					Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: ids[0]}}},
			})
			return err
		}, codes.NotFound},
	} {
		t.Run(tc.name, func(t *testing.T) { wantCode(t, tc.call(), tc.code) })
	}
}

func TestMemberSnapshotID(t *testing.T) {
	long := strings.Repeat("é", MaxVolumeIDLength/2) // 2 bytes each
	for _, g := range []string{"gs", long, strings.Repeat("x", MaxVolumeIDLength)} {
		id := memberSnapshotID(g, "vol")
		if err := validateID("snapshot id", id); err != nil || !utf8.ValidString(id) {
			t.Errorf("memberSnapshotID(%q) = %q: %v", g, id, err)
		}
		if id == memberSnapshotID(g, "vol2") {
			t.Errorf("two volumes share snapshot id %q", id)
		}
	}
}
