package loopplugin

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/testhelp"
	rs "github.com/csiagent/csiagent/proto/reclaimspace"
)

func reclaimNodeReq(id, path string) *rs.NodeReclaimSpaceRequest {
	return &rs.NodeReclaimSpaceRequest{VolumeId: id, VolumePath: path}
}

func reclaimCtrlReq(id string) *rs.ControllerReclaimSpaceRequest {
	return &rs.ControllerReclaimSpaceRequest{VolumeId: id}
}

// allocated is the image's st_blocks × 512, measured independently of the
// plugin.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// writeAndDelete writes n random bytes to a file in dir, makes sure they
// reach the image, and deletes the file again.
func writeAndDelete(t *testing.T, dir string, n int) {
	t.Helper()
	p := filepath.Join(dir, "junk")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for range n >> 20 {
		rand.Read(buf)
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	if err := errors.Join(f.Sync(), f.Close(), os.Remove(p)); err != nil {
		t.Fatal(err)
	}
	syncDirFS(t, dir)
}

func syncDirFS(t *testing.T, dir string) {
	t.Helper()
	if err := atomicfile.SyncFS(dir); err != nil {
		t.Fatal(err)
	}
}

// TestNodeReclaimSpace writes 64 MiB, deletes it and reclaims: the image
// gives back at least 48 MiB, and the usages the plugin reports match the
// allocation measured independently (st_blocks) to within 1 MiB. Both the
// published target path and the staging path work.
func TestNodeReclaimSpace(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, tc := range []struct {
		name       string
		fsType     string
		viaStaging bool
	}{
		{name: "ext4, volume path is the target", fsType: "ext4"},
		{name: "ext4, volume path is the staging path", fsType: "ext4", viaStaging: true},
		{name: "xfs, volume path is the target", fsType: "xfs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, slog.LevelInfo)
			if e.p.tools.mkfs[tc.fsType] == "" {
				t.Fatalf("mkfs.%s is not installed: make deps installs it", tc.fsType)
			}
			ctx := context.Background()
			id := e.createVolume(t, "reclaim", 384<<20)
			img := filepath.Join(e.pool, id+".img")
			staging, target := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "target")
			c := mountCap(tc.fsType, snw)
			e.stage(t, id, staging, c)
			e.publish(t, id, staging, target, c, false)
			defer func() {
				e.unpublish(t, id, target)
				e.unstage(t, id, staging)
			}()

			grown := allocated(t, img)
			writeAndDelete(t, target, 64<<20)
			before := allocated(t, img)
			if before-grown < 60<<20 {
				t.Fatalf("writing 64 MiB grew the image by only %d bytes", before-grown)
			}
			req := reclaimNodeReq(id, target)
			if tc.viaStaging {
				req = reclaimNodeReq(id, staging)
			} else {
				req.StagingTargetPath = staging
			}
			resp, err := e.rsNode.NodeReclaimSpace(ctx, req)
			if err != nil {
				t.Fatal(err)
			}
			after := allocated(t, img)
			pre, post := resp.GetPreUsage().GetUsageBytes(), resp.GetPostUsage().GetUsageBytes()
			drop, reported := before-after, pre-post
			t.Logf("image allocation: %d -> %d bytes (drop %.1f MiB); reported pre %d post %d (drop %.1f MiB)",
				before, after, mib(drop), pre, post, mib(reported))
			if drop < 48<<20 {
				t.Errorf("allocation dropped by %.1f MiB, want >= 48 MiB", mib(drop))
			}
			if d := reported - drop; d > 1<<20 || d < -(1<<20) {
				t.Errorf("reported drop %d differs from measured drop %d by more than 1 MiB", reported, drop)
			}
			// Not exact: the filesystem may still free a little in the
			// background after the call (xfs does).
			if d := post - after; d > 1<<20 || d < -(1<<20) {
				t.Errorf("post_usage %d, measured after %d: more than 1 MiB apart", post, after)
			}
		})
	}
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// TestNodeReclaimSpaceRightAfterDeletes reclaims at once after deleting
// every other one of 256 files on xfs, three times: the frees and the
// trim's discards, which xfs both finishes in the background, have reached
// the image when the call returns (its post_usage is the allocation
// measured right after it, and about half the data is given back).
func TestNodeReclaimSpaceRightAfterDeletes(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo)
	if e.p.tools.mkfs["xfs"] == "" {
		t.Fatal("mkfs.xfs is not installed: make deps installs it")
	}
	ctx := context.Background()
	id := e.createVolume(t, "settle", 384<<20)
	img := filepath.Join(e.pool, id+".img")
	staging, target := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "target")
	c := mountCap("xfs", snw)
	e.stage(t, id, staging, c)
	e.publish(t, id, staging, target, c, false)
	defer func() {
		e.unpublish(t, id, target)
		e.unstage(t, id, staging)
	}()
	const files, size = 256, 256 << 10
	buf := make([]byte, size)
	for round := range 3 {
		for i := range files {
			rand.Read(buf)
			p := filepath.Join(target, fmt.Sprintf("f%d", i))
			if err := os.WriteFile(p, buf, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		syncDirFS(t, target)
		for i := round % 2; i < files; i += 2 {
			if err := os.Remove(filepath.Join(target, fmt.Sprintf("f%d", i))); err != nil {
				t.Fatal(err)
			}
		}
		before := allocated(t, img)
		resp, err := e.rsNode.NodeReclaimSpace(ctx, reclaimNodeReq(id, target))
		if err != nil {
			t.Fatal(err)
		}
		after := allocated(t, img)
		post := resp.GetPostUsage().GetUsageBytes()
		t.Logf("round %d: image allocation %d -> %d bytes (drop %.1f MiB); reported post %d", round, before, after, mib(before-after), post)
		if want := int64(files / 2 * size * 3 / 4); before-after < want {
			t.Errorf("round %d: allocation dropped by %.1f MiB, want >= %.1f MiB", round, mib(before-after), mib(want))
		}
		if post != after {
			t.Errorf("round %d: post_usage %d, but the image's allocation right after the call is %d", round, post, after)
		}
	}
}

// TestReclaimSpaceErrors covers the csi-addons error table and the block and
// offline paths.
func TestReclaimSpaceErrors(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo)
	ctx := context.Background()
	id := e.createVolume(t, "rvol", 64<<20)
	staging, target := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "target")

	t.Run("missing fields", func(t *testing.T) {
		_, err := e.rsNode.NodeReclaimSpace(ctx, reclaimNodeReq("", target))
		wantCode(t, err, codes.InvalidArgument)
		_, err = e.rsNode.NodeReclaimSpace(ctx, reclaimNodeReq(id, ""))
		wantCode(t, err, codes.InvalidArgument)
		_, err = e.rsCtrl.ControllerReclaimSpace(ctx, reclaimCtrlReq(""))
		wantCode(t, err, codes.InvalidArgument)
	})
	t.Run("unknown volume", func(t *testing.T) {
		_, err := e.rsNode.NodeReclaimSpace(ctx, reclaimNodeReq("nope", target))
		wantCode(t, err, codes.NotFound)
		_, err = e.rsCtrl.ControllerReclaimSpace(ctx, reclaimCtrlReq("nope"))
		wantCode(t, err, codes.NotFound)
	})
	t.Run("not staged", func(t *testing.T) {
		_, err := e.rsNode.NodeReclaimSpace(ctx, reclaimNodeReq(id, target))
		wantCode(t, err, codes.NotFound)
	})

	t.Run("block volume reports usage and trims nothing", func(t *testing.T) {
		bid := e.createVolume(t, "rblock", 16<<20)
		c := blockCap(snw)
		e.stage(t, bid, staging, c)
		e.publish(t, bid, staging, target, c, false)
		defer func() {
			e.unpublish(t, bid, target)
			e.unstage(t, bid, staging)
		}()
		resp, err := e.rsNode.NodeReclaimSpace(ctx, &rs.NodeReclaimSpaceRequest{
			VolumeId: bid, VolumePath: target, StagingTargetPath: staging, VolumeCapability: c,
		})
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetPreUsage().GetUsageBytes() != resp.GetPostUsage().GetUsageBytes() {
			t.Errorf("block reclaim changed usage: %v", resp)
		}
	})

	t.Run("block volume whose device cannot discard is Unimplemented", func(t *testing.T) {
		bid := e.createVolume(t, "rnodiscard", 16<<20)
		c := blockCap(snw)
		e.stage(t, bid, staging, c)
		e.publish(t, bid, staging, target, c, false)
		var st unix.Stat_t
		if err := unix.Stat(target, &st); err != nil {
			t.Fatal(err)
		}
		// Once discard_max_bytes is 0 the kernel refuses any other value
		// (the discard granularity drops to 0), so the device is removed
		// and made anew after the volume is unstaged: the next user gets
		// a device that discards.
		defer func() {
			e.unpublish(t, bid, target)
			e.unstage(t, bid, staging)
			renewLoopDevice(t, int(unix.Minor(st.Rdev)))
		}()
		knob := fmt.Sprintf("/sys/dev/block/%d:%d/queue/discard_max_bytes", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		if err := os.WriteFile(knob, []byte("0"), 0o644); errors.Is(err, fs.ErrNotExist) {
			t.Skipf("this kernel cannot turn discard off on a loop device (%s)", knob)
		} else if err != nil {
			t.Fatalf("turning discard off on the loop device: %v", err)
		}
		_, err := e.rsNode.NodeReclaimSpace(ctx, &rs.NodeReclaimSpaceRequest{
			VolumeId: bid, VolumePath: target, StagingTargetPath: staging, VolumeCapability: c,
		})
		wantCode(t, err, codes.Unimplemented)
		if !strings.Contains(status.Convert(err).Message(), "cannot discard") {
			t.Errorf("message %q does not say why", status.Convert(err).Message())
		}
	})

	t.Run("wrong path", func(t *testing.T) {
		c := mountCap("", snw)
		e.stage(t, id, staging, c)
		defer e.unstage(t, id, staging)
		_, err := e.rsNode.NodeReclaimSpace(ctx, reclaimNodeReq(id, e.dir))
		wantCode(t, err, codes.NotFound)
	})
}

// TestControllerReclaimSpace reclaims unstaged volumes offline (e2fsck -E
// discard for ext4, a private mount and FITRIM for xfs) and refuses staged
// ones.
func TestControllerReclaimSpace(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			e := newEnv(t, slog.LevelInfo)
			if e.p.tools.mkfs[fsType] == "" {
				t.Fatalf("mkfs.%s is not installed: make deps installs it", fsType)
			}
			ctx := context.Background()
			id := e.createVolume(t, "offline", 384<<20)
			img := filepath.Join(e.pool, id+".img")
			staging := filepath.Join(e.dir, "staging")
			e.stage(t, id, staging, mountCap(fsType, snw))
			writeAndDelete(t, staging, 32<<20)
			_, err := e.rsCtrl.ControllerReclaimSpace(ctx, reclaimCtrlReq(id))
			wantCode(t, err, codes.FailedPrecondition) // staged
			e.unstage(t, id, staging)

			before := allocated(t, img)
			resp, err := e.rsCtrl.ControllerReclaimSpace(ctx, reclaimCtrlReq(id))
			if err != nil {
				t.Fatal(err)
			}
			after := allocated(t, img)
			pre, post := resp.GetPreUsage().GetUsageBytes(), resp.GetPostUsage().GetUsageBytes()
			t.Logf("offline %s: allocation %d -> %d (drop %.1f MiB); reported %d -> %d", fsType, before, after, mib(before-after), pre, post)
			if before-after < 24<<20 || pre != before || post != after {
				t.Errorf("offline reclaim: measured %d -> %d, reported %d -> %d; want >= 24 MiB back, reported = measured", before, after, pre, post)
			}
			// Blank volumes have nothing to reclaim and are left alone.
			blank := e.createVolume(t, "blank", 16<<20)
			resp, err = e.rsCtrl.ControllerReclaimSpace(ctx, reclaimCtrlReq(blank))
			if err != nil || resp.GetPreUsage().GetUsageBytes() != 0 || resp.GetPostUsage().GetUsageBytes() != 0 {
				t.Errorf("blank volume: %v, %v", resp, err)
			}
		})
	}
}

// renewLoopDevice removes the detached loop device n and adds it again,
// with the kernel's default queue limits.
func renewLoopDevice(t *testing.T, n int) {
	t.Helper()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Errorf("renew loop%d: %v", n, err)
		return
	}
	defer ctl.Close()
	if err := unix.IoctlSetInt(int(ctl.Fd()), unix.LOOP_CTL_REMOVE, n); err != nil {
		t.Errorf("renew loop%d: LOOP_CTL_REMOVE: %v (its discard stays off)", n, err)
		return
	}
	if err := unix.IoctlSetInt(int(ctl.Fd()), unix.LOOP_CTL_ADD, n); err != nil && !errors.Is(err, unix.EEXIST) {
		t.Errorf("renew loop%d: LOOP_CTL_ADD: %v", n, err)
	}
}
