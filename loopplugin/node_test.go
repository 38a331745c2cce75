package loopplugin

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// TestMountLifecycle stages, publishes, writes, tears down and brings the
// volume back on real loop devices, per filesystem type: the data survives
// unstage (no reformat), read-only publishing refuses writes, incompatible
// re-stages and re-publishes are AlreadyExists, out-of-order calls are
// FailedPrecondition, and nothing stays mounted or attached.
func TestMountLifecycle(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, tc := range []struct {
		fsType string
		size   int64
	}{
		{"", 64 << 20}, // default: ext4
		{"ext4", 64 << 20},
		{"ext3", 64 << 20},
		{"xfs", 320 << 20}, // xfs needs 300 MiB
	} {
		name := tc.fsType
		if name == "" {
			name = "default"
		}
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, slog.LevelInfo)
			if tc.fsType == "xfs" && e.p.tools.mkfs["xfs"] == "" {
				t.Fatal("mkfs.xfs is not installed: make deps installs xfsprogs")
			}
			want := tc.fsType
			if want == "" {
				want = DefaultFSType
			}
			ctx := context.Background()
			id := e.createVolume(t, "vol-"+name, tc.size)
			staging, target := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "pods", "p1", "target")
			c := mountCap(tc.fsType, snw)

			e.stage(t, id, staging, c)
			e.stage(t, id, staging, c) // idempotent
			m, ok, err := mount.Lookup(staging)
			if err != nil || !ok || m.FSType != want {
				t.Fatalf("staging mount = %+v, %v, %v; want %s", m, ok, err, want)
			}
			e.publish(t, id, staging, target, c, false) // creates the parent
			e.publish(t, id, staging, target, c, false)
			payload := make([]byte, 1<<20)
			rand.Read(payload)
			if err := os.WriteFile(filepath.Join(target, "data"), payload, 0o644); err != nil {
				t.Fatal(err)
			}

			stats, err := e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
			if err != nil {
				t.Fatal(err)
			}
			var bytesUsage, inodes *csi.VolumeUsage
			for _, u := range stats.GetUsage() {
				switch u.GetUnit() {
				case csi.VolumeUsage_BYTES:
					bytesUsage = u
				case csi.VolumeUsage_INODES:
					inodes = u
				}
			}
			if bytesUsage == nil || inodes == nil || bytesUsage.GetUsed() < 1<<20 ||
				bytesUsage.GetTotal() > tc.size || inodes.GetUsed() < 2 {
				t.Errorf("stats = %v", stats)
			}

			// Read-only publish at a second target.
			roTarget := filepath.Join(e.dir, "pods", "p2", "target")
			e.publish(t, id, staging, roTarget, c, true)
			if err := os.WriteFile(filepath.Join(roTarget, "x"), nil, 0o644); !errors.Is(err, unix.EROFS) {
				t.Errorf("write to read-only publish: %v, want EROFS", err)
			}
			if b, err := os.ReadFile(filepath.Join(roTarget, "data")); err != nil || !bytes.Equal(b, payload) {
				t.Errorf("read through read-only publish: %v", err)
			}
			_, err = e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
				VolumeId: id, StagingTargetPath: staging, TargetPath: roTarget, VolumeCapability: c, Readonly: false,
			})
			wantCode(t, err, codes.AlreadyExists)

			// Incompatible re-stage.
			other := "ext4"
			if want == "ext4" {
				other = "ext3"
			}
			for _, bad := range []*csi.VolumeCapability{mountCap(other, snw), mountCap(tc.fsType, snw, "noexec"), blockCap(snw)} {
				_, err = e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: bad})
				wantCode(t, err, codes.AlreadyExists)
			}
			// Out of order.
			_, err = e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
			wantCode(t, err, codes.FailedPrecondition)
			_, err = e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
			wantCode(t, err, codes.FailedPrecondition)

			e.unpublish(t, id, roTarget)
			e.unpublish(t, id, target)
			e.unpublish(t, id, target) // idempotent
			if _, err := os.Stat(target); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("target not removed: %v", err)
			}
			e.unstage(t, id, staging)
			e.unstage(t, id, staging)
			if d, err := loopdev.Find(filepath.Join(e.pool, id+".img")); err == nil {
				t.Fatalf("still attached to %s after unstage", d.Path)
			}
			_, err = e.node.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
				VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: c,
			})
			wantCode(t, err, codes.FailedPrecondition)

			// Back again: same filesystem, same data.
			e.stage(t, id, staging, c)
			e.publish(t, id, staging, target, c, false)
			if b, err := os.ReadFile(filepath.Join(target, "data")); err != nil || !bytes.Equal(b, payload) {
				t.Errorf("data after restage: %v (equal=%v)", err, bytes.Equal(b, payload))
			}
			e.unpublish(t, id, target)
			e.unstage(t, id, staging)
			if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestBlockLifecycle publishes a volume as a raw block device: the target
// is a usable block device node whose writes land in the image and survive
// unstage and restage.
func TestBlockLifecycle(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo)
	ctx := context.Background()
	id := e.createVolume(t, "blockvol", 32<<20)
	img := filepath.Join(e.pool, id+".img")
	staging, target := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "pods", "p1", "dev")
	c := blockCap(snw)

	e.stage(t, id, staging, c)
	e.stage(t, id, staging, c)
	e.publish(t, id, staging, target, c, false)
	e.publish(t, id, staging, target, c, false)

	var st unix.Stat_t
	if err := unix.Stat(target, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFBLK {
		t.Fatalf("target is not a block device: %v, mode %o", err, st.Mode)
	}
	pattern := bytes.Repeat([]byte("csiagent"), 512) // 4 KiB
	const off = 5 << 20
	f, err := os.OpenFile(target, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(pattern, off); err != nil {
		t.Fatal(err)
	}
	if err := errors.Join(f.Sync(), f.Close()); err != nil {
		t.Fatal(err)
	}
	if size, err := blockSize(target); err != nil || size != 32<<20 {
		t.Errorf("device size = %d, %v; want %d", size, err, 32<<20)
	}
	stats, err := e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
	if err != nil || len(stats.GetUsage()) != 1 || stats.GetUsage()[0].GetTotal() != 32<<20 {
		t.Errorf("stats = %v, %v", stats, err)
	}
	// Mount access on a block-staged volume is incompatible.
	_, err = e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap("", snw)})
	wantCode(t, err, codes.AlreadyExists)

	e.unpublish(t, id, target)
	e.unstage(t, id, staging)
	if _, err := os.Stat(filepath.Join(staging, BlockStagingFile)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("staging device file left: %v", err)
	}
	if got := readAt(t, img, off, len(pattern)); !bytes.Equal(got, pattern) {
		t.Fatal("write through the block device did not reach the image")
	}

	e.stage(t, id, staging, c)
	e.publish(t, id, staging, target, c, true)
	if got := readAt(t, target, off, len(pattern)); !bytes.Equal(got, pattern) {
		t.Fatal("data lost across unstage/stage")
	}
	// A read-only device may open for writing, but no write gets through.
	if f, err := os.OpenFile(target, os.O_WRONLY, 0); err == nil {
		_, err = f.WriteAt(make([]byte, 4096), off)
		f.Close()
		if err == nil {
			t.Error("write through a read-only block publish succeeded")
		}
	}
	if got := readAt(t, img, off, len(pattern)); !bytes.Equal(got, pattern) {
		t.Fatal("read-only block publish let a write through")
	}
	// A blank-looking mount stage must refuse to format a volume with data.
	e.unpublish(t, id, target)
	e.unstage(t, id, staging)
	_, err = e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap("", snw)})
	wantCode(t, err, codes.FailedPrecondition)
}

func readAt(t *testing.T, path string, off int64, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestParallelVolumes stages and publishes several volumes at once: loop
// attach races are retried and different volumes do not wait for each
// other.
func TestParallelVolumes(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelWarn)
	const n = 6
	var wg sync.WaitGroup
	for i := range n {
		id := e.createVolume(t, fmt.Sprintf("par-%d", i), 32<<20)
		staging, target := filepath.Join(e.dir, id, "staging"), filepath.Join(e.dir, id, "target")
		c := mountCap("", snw)
		if i%2 == 1 {
			c = blockCap(snw)
		}
		wg.Go(func() {
			e.stage(t, id, staging, c)
			e.publish(t, id, staging, target, c, false)
			e.unpublish(t, id, target)
			e.unstage(t, id, staging)
		})
	}
	wg.Wait()
}

// TestVolumeLockSerializes holds one volume's lock: a CSI call on it waits
// and ends with its deadline, a reclaim call is Aborted at once, and a call
// on another volume goes through.
func TestVolumeLockSerializes(t *testing.T) {
	e := newEnv(t, slog.LevelWarn)
	a := e.createVolume(t, "locked", 16<<20)
	b := e.createVolume(t, "free", 16<<20)
	unlock, err := e.p.locks.tryLock(a)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err = e.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: a, TargetPath: "/nonexistent"})
	wantCode(t, err, codes.DeadlineExceeded)
	_, err = e.rsNode.NodeReclaimSpace(context.Background(), reclaimNodeReq(a, "/nonexistent"))
	wantCode(t, err, codes.Aborted)
	_, err = e.rsCtrl.ControllerReclaimSpace(context.Background(), reclaimCtrlReq(a))
	wantCode(t, err, codes.Aborted)
	if _, err := e.node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{VolumeId: b, TargetPath: "/nonexistent"}); err != nil {
		t.Fatalf("other volume blocked: %v", err)
	}
}

// TestReaderOnlyStage: a SINGLE_NODE_READER_ONLY volume is staged and
// published read-only; a blank one is not formatted for it.
func TestReaderOnlyStage(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo)
	ctx := context.Background()
	ro := mountCap("", csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY)
	id := e.createVolume(t, "rovol", 32<<20)
	staging, target := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "target")

	_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: ro})
	wantCode(t, err, codes.FailedPrecondition) // blank: nothing to mount

	e.stage(t, id, staging, mountCap("", snw))
	if err := os.WriteFile(filepath.Join(staging, "f"), []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	e.unstage(t, id, staging)

	e.stage(t, id, staging, ro)
	_, err = e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap("", snw)})
	wantCode(t, err, codes.AlreadyExists) // staged read-only, asked read-write
	e.publish(t, id, staging, target, ro, false)
	if b, err := os.ReadFile(filepath.Join(target, "f")); err != nil || string(b) != "hello" {
		t.Errorf("read = %q, %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(target, "g"), nil, 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write to reader-only volume: %v, want EROFS", err)
	}
	e.unpublish(t, id, target)
	e.unstage(t, id, staging)
}

// TestInterruptedFormat: a volume whose first mkfs was killed half-way
// holds data that is no filesystem. With the plugin's format record (left
// by the killed mkfs) the next stage formats it again; without one, the
// data is someone else's and the stage refuses to touch it.
func TestInterruptedFormat(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo)
	ctx := context.Background()
	snw := csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	for _, tc := range []struct {
		name       string
		withRecord bool
		want       codes.Code
	}{
		{"our interrupted mkfs", true, codes.OK},
		{"foreign data", false, codes.FailedPrecondition},
	} {
		t.Run(tc.name, func(t *testing.T) {
			id := e.createVolume(t, "fmt-"+strings.ReplaceAll(tc.name, " ", "-"), 32<<20)
			// What a killed mkfs leaves: some blocks written, no superblock.
			img := filepath.Join(e.pool, id+".img")
			f, err := os.OpenFile(img, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := f.WriteAt(bytes.Repeat([]byte{0xa5}, 64<<10), 8<<20); err != nil {
				t.Fatal(err)
			}
			f.Close()
			if tc.withRecord {
				if err := e.p.pool.writeRecord(formattingKind, id, formatRecord{FSType: "ext4"}); err != nil {
					t.Fatal(err)
				}
			}
			staging := filepath.Join(e.dir, "staging-"+id)
			_, err = e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: mountCap("", snw)})
			wantCode(t, err, tc.want)
			if tc.want != codes.OK {
				return
			}
			if err := e.p.pool.readRecord(formattingKind, id, &formatRecord{}); !errors.Is(err, ErrNotFound) {
				t.Errorf("format record left after a finished mkfs: %v", err)
			}
			e.unstage(t, id, staging)
		})
	}
}

// TestVolumeStatsAndHealth: NodeGetVolumeStats reports what statfs says of
// the published filesystem; NodeGetVolumeHealth reports nothing for a
// healthy volume, DEGRADED once ext4 counted an error, INACCESSIBLE once
// the backing image is removed.
func TestVolumeStatsAndHealth(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelWarn)
	ctx := context.Background()
	id := e.createVolume(t, "health", 64<<20)
	c := mountCap("ext4", snw)
	staging, target := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "target")
	e.stage(t, id, staging, c)
	e.publish(t, id, staging, target, c, false)
	image := filepath.Join(e.pool, id+imageSuffix)
	keep := filepath.Join(e.dir, "keep.img")
	defer func() {
		// Put the image back (same inode) so that unstage finds its device.
		if _, err := os.Stat(image); errors.Is(err, os.ErrNotExist) {
			if err := os.Link(keep, image); err != nil {
				t.Error(err)
			}
		}
		e.unpublish(t, id, target)
		e.unstage(t, id, staging)
	}()
	if err := os.WriteFile(filepath.Join(target, "fill"), make([]byte, 8<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()
	stats, err := e.node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: id, VolumePath: target})
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(target, &st); err != nil {
		t.Fatal(err)
	}
	bs := st.Bsize
	b, i := stats.GetUsage()[0], stats.GetUsage()[1]
	if b.GetTotal() != int64(st.Blocks)*bs || b.GetUsed() != int64(st.Blocks-st.Bfree)*bs || b.GetAvailable() != int64(st.Bavail)*bs ||
		i.GetTotal() != int64(st.Files) || i.GetAvailable() != int64(st.Ffree) || b.GetUsed() < 8<<20 {
		t.Errorf("stats %v; statfs blocks %d free %d avail %d bsize %d files %d ffree %d", stats, st.Blocks, st.Bfree, st.Bavail, bs, st.Files, st.Ffree)
	}

	health := func() []*csi.VolumeHealth_VolumeHealthEntry {
		t.Helper()
		r, err := e.node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: id, VolumePublishPath: target, StagingTargetPath: staging})
		if err != nil {
			t.Fatal(err)
		}
		if r.GetVolumeHealth().GetVolumeId() != id {
			t.Errorf("health of %q", r.GetVolumeHealth().GetVolumeId())
		}
		return r.GetVolumeHealth().GetHealthStatuses()
	}
	if h := health(); len(h) != 0 {
		t.Fatalf("a healthy volume reports %v", h)
	}

	// An ext4 error, as the kernel records one.
	var dev unix.Stat_t
	if err := unix.Stat(target, &dev); err != nil {
		t.Fatal(err)
	}
	link, err := os.Readlink(fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(dev.Dev), unix.Minor(dev.Dev)))
	if err != nil {
		t.Fatal(err)
	}
	trigger := filepath.Join("/sys/fs/ext4", filepath.Base(link), "trigger_fs_error")
	if err := os.WriteFile(trigger, []byte("injected by a test"), 0o200); errors.Is(err, fs.ErrNotExist) {
		t.Skipf("this kernel has no ext4 error injection (%s)", trigger)
	} else if err != nil {
		t.Fatalf("injecting an ext4 error through %s: %v", trigger, err)
	}
	// ext4 counts the error in a work item: it shows within moments.
	deadline := time.Now().Add(10 * time.Second)
	h := health()
	for len(h) == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // polling the kernel's counter, which has no event to wait on
		h = health()
	}
	if len(h) != 1 || h[0].GetStatus() != csi.VolumeHealthErrorType_DEGRADED || h[0].GetReason() != "FilesystemErrors" {
		t.Errorf("after an ext4 error: %v", h)
	}

	if err := os.Link(image, keep); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	h = health()
	if len(h) != 2 || h[0].GetStatus() != csi.VolumeHealthErrorType_INACCESSIBLE || h[0].GetReason() != "BackingImageRemoved" {
		t.Errorf("after the image was removed: %v", h)
	}
}

// A container given a block volume's device node opens it and detaches it
// (LOOP_CLR_FD needs no capability, only an open descriptor): the device must
// stay this volume's while it is published, and after a plugin restart. If
// it was detached while no plugin ran to hold it, its number is not handed
// to another volume while its node is still bound, and unstage still
// cleans up.
func TestBlockDeviceDetachByContainer(t *testing.T) {
	testhelp.NeedRoot(t)
	c := blockCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER)
	e, id, img, staging := stagedVolume(t, "victim", 16<<20, c)
	rw, ro := filepath.Join(e.dir, "pods", "rw", "dev"), filepath.Join(e.dir, "pods", "ro", "dev")
	e.publish(t, id, staging, rw, c, false)
	e.publish(t, id, staging, ro, c, true)
	before, err := loopdev.FindAll(img)
	if err != nil || len(before) != 2 {
		t.Fatalf("devices = %+v, %v; want a read-write and a read-only one", before, err)
	}
	detach := func(target string) *os.File {
		t.Helper()
		f, err := os.Open(target)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil {
			t.Fatalf("LOOP_CLR_FD through %s: %v", target, err)
		}
		return f
	}
	attached := func(when string) {
		t.Helper()
		if got, err := loopdev.FindAll(img); err != nil || len(got) != len(before) {
			t.Fatalf("%s: devices = %+v, %v; want %+v", when, got, err, before)
		}
	}
	detach(rw).Close()
	detach(ro).Close()
	attached("after a container's LOOP_CLR_FD")
	// A writer moves the window onto the image for every user of the
	// device (LOOP_SET_STATUS64 needs only write access).
	wf, err := os.OpenFile(rw, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	info, err := unix.IoctlLoopGetStatus64(int(wf.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	info.Offset = 4096
	if err := unix.IoctlLoopSetStatus64(int(wf.Fd()), info); err != nil {
		t.Fatal(err)
	}
	// The sweep clears the marks, so the plugin's exit detaches nothing,
	// and puts the window back.
	e.p.held.sweep(e.p.log)
	if info, err := unix.IoctlLoopGetStatus64(int(wf.Fd())); err != nil || info.Offset != 0 {
		t.Errorf("after the sweep: offset %d, %v; want 0", info.Offset, err)
	}
	wf.Close()
	e.p.held.release(before[0].Name)
	e.p.held.release(before[1].Name)
	attached("after the plugin's exit")
	if err := e.p.holdAttached(); err != nil {
		t.Fatal(err)
	}

	// The plugin dies (its descriptors close) while a container holds the
	// device marked for clearing; the next plugin holds it again.
	held := detach(rw)
	e.p.held.release(before[0].Name)
	e.p.held.release(before[1].Name)
	if err := e.p.holdAttached(); err != nil {
		t.Fatal(err)
	}
	held.Close()
	attached("after a plugin restart")

	// With no plugin holding it, the container can detach it: its number
	// stays out of use while its node is bound, and unstage cleans up.
	e.p.held.release(before[0].Name)
	detach(rw).Close()
	if got, err := loopdev.FindAll(img); err != nil || len(got) != 1 {
		t.Fatalf("devices = %+v, %v; want the read-write one detached", got, err)
	}
	other := e.createVolume(t, "other", 16<<20)
	otherStaging := filepath.Join(e.dir, "staging-other")
	e.stage(t, other, otherStaging, c)
	if got, err := loopdev.Find(filepath.Join(e.pool, other+".img")); err != nil || got.Name == before[0].Name {
		t.Fatalf("the other volume got %+v, %v: the detached device, still bound at %s", got, err, rw)
	}
	e.unstage(t, other, otherStaging)
	e.unpublish(t, id, rw)
	e.unpublish(t, id, ro)
	e.unstage(t, id, staging)
	if got, err := loopdev.FindAll(img); err != nil || len(got) != 0 {
		t.Fatalf("after unstage: devices = %+v, %v", got, err)
	}
}

// TestUnstageKeepsADeviceMountedElsewhere: a mount namespace made while
// the volume was staged keeps a private copy of the staging mount, which
// the unstage's unmount does not reach: the filesystem lives on there, so
// its device stays attached (FailedPrecondition saying why) instead of
// being detached and attached again for the next stage, a second instance
// of the filesystem beside the first. Once that namespace is gone the
// unstage detaches it.
func TestUnstageKeepsADeviceMountedElsewhere(t *testing.T) {
	testhelp.NeedRoot(t)
	e, id, img, staging := stagedVolume(t, "held", 64<<20, mountCap("", snw))

	// A process that made itself a mount namespace meanwhile (its copies
	// of the host's mounts private).
	child := exec.Command("/bin/sh", "-c", "echo ready && exec sleep 60")
	child.SysProcAttr = &syscall.SysProcAttr{Unshareflags: syscall.CLONE_NEWNS}
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			_ = child.Process.Kill()
			_ = child.Wait()
		}
	}
	t.Cleanup(stop)
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("child: %q, %v", line, err)
	}

	ctx := context.Background()
	_, err = e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "still mounted outside this mount namespace") {
		t.Fatalf("unstage with the filesystem mounted in another namespace: %v; want FailedPrecondition saying so", err)
	}
	if devs, err := loopdev.FindAll(img); err != nil || len(devs) != 1 {
		t.Fatalf("devices of the image: %v, %v; want it still attached", devs, err)
	}
	stop()
	if _, err := e.node.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: id, StagingTargetPath: staging}); err != nil {
		t.Fatalf("unstage once the other namespace is gone: %v", err)
	}
	if devs, err := loopdev.FindAll(img); err != nil || len(devs) != 0 {
		t.Fatalf("devices of the image after the unstage: %v, %v; want none", devs, err)
	}
}

// stagedVolume starts a plugin, creates a volume of size and stages it
// with c; it returns the plugin, the volume's id, its image and its
// staging path.
func stagedVolume(t *testing.T, name string, size int64, c *csi.VolumeCapability) (e *testEnv, id, img, staging string) {
	t.Helper()
	e = newEnv(t, slog.LevelInfo)
	id = e.createVolume(t, name, size)
	img, staging = filepath.Join(e.pool, id+".img"), filepath.Join(e.dir, "staging")
	e.stage(t, id, staging, c)
	return e, id, img, staging
}

// TestSharedReaderLeavesNoReadOnlyDevice: a shared reader's read-only loop
// device, which the kernel unbinds by itself once its filesystem is
// unmounted (AutoClear), does not stay read-only for the host's next
// attacher (csi-driver-host-path's losetup got one: its writable block
// volume refused writes).
func TestSharedReaderLeavesNoReadOnlyDevice(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo, func(c *Config) { c.SharedPool = true })
	id := e.createVolume(t, "shared", 32<<20)
	staging := filepath.Join(e.dir, "staging")
	e.stage(t, id, staging, mountCap("ext4", snw)) // its filesystem made
	e.unstage(t, id, staging)
	e.stage(t, id, staging, mountCap("ext4", csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY))
	m, ok, err := mount.Lookup(staging)
	if err != nil || !ok {
		t.Fatalf("the reader's staging: %v, %v", ok, err)
	}
	dev := filepath.Base(m.Source)
	if ro, _ := os.ReadFile(filepath.Join("/sys/block", dev, "ro")); strings.TrimSpace(string(ro)) != "1" {
		t.Fatalf("the reader's device %s is not read-only (ro %q)", dev, ro)
	}
	e.unstage(t, id, staging)
	ro, err := os.ReadFile(filepath.Join("/sys/block", dev, "ro"))
	if err != nil {
		t.Fatal(err)
	}
	if strings.TrimSpace(string(ro)) != "0" {
		t.Errorf("%s is read-only (ro %s) after the reader's unstage", dev, strings.TrimSpace(string(ro)))
	}
}
