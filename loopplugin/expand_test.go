package loopplugin

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// TestExpandOnline grows a published volume while it is mounted and
// written: the image (ControllerExpandVolume), then the device and the
// filesystem (NodeExpandVolume); statfs at the target sees the new size,
// the data stays.
func TestExpandOnline(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, fsType := range []string{"ext4", "xfs"} {
		t.Run(fsType, func(t *testing.T) {
			e := newEnv(t, slog.LevelWarn)
			if e.p.tools.mkfs[fsType] == "" || e.p.tools.grow[fsType] == "" {
				t.Fatalf("mkfs.%s or its grow tool is missing: make deps installs them", fsType)
			}
			if fsType == "ext4" && !hasCapSysResource(t) {
				t.Skip("growing a mounted ext4 needs CAP_SYS_RESOURCE (EXT4_IOC_RESIZE_FS), which this process lacks")
			}
			ctx := context.Background()
			const small, big = 320 << 20, 640 << 20 // xfs wants 300 MiB at least
			id := e.createVolume(t, "grow-"+fsType, small)
			c := mountCap(fsType, snw)
			staging, target := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "target")
			e.stage(t, id, staging, c)
			e.publish(t, id, staging, target, c, false)
			defer func() {
				e.unpublish(t, id, target)
				e.unstage(t, id, staging)
			}()
			if err := os.WriteFile(filepath.Join(target, "data"), []byte("kept"), 0o644); err != nil {
				t.Fatal(err)
			}
			size := func() int64 {
				var st unix.Statfs_t
				if err := unix.Statfs(target, &st); err != nil {
					t.Fatal(err)
				}
				return int64(st.Blocks) * st.Bsize
			}
			before := size()

			_, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: target, CapacityRange: &csi.CapacityRange{RequiredBytes: big}})
			wantCode(t, err, codes.OutOfRange) // the image is not grown yet
			cr, err := e.ctrl.ControllerExpandVolume(ctx, &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: big}})
			if err != nil || cr.GetCapacityBytes() != big || !cr.GetNodeExpansionRequired() {
				t.Fatalf("ControllerExpandVolume = %v, %v", cr, err)
			}
			nr, err := e.node.NodeExpandVolume(ctx, &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: target, StagingTargetPath: staging,
				CapacityRange: &csi.CapacityRange{RequiredBytes: big}, VolumeCapability: c})
			if err != nil || nr.GetCapacityBytes() != big {
				t.Fatalf("NodeExpandVolume = %v, %v", nr, err)
			}
			if after := size(); after < before+(big-small)*9/10 {
				t.Errorf("filesystem %d bytes before, %d after growing the volume from %d to %d", before, after, small, big)
			}
			if b, err := os.ReadFile(filepath.Join(target, "data")); err != nil || string(b) != "kept" {
				t.Errorf("data after growing: %q, %v", b, err)
			}
		})
	}
}

// hasCapSysResource reports whether CAP_SYS_RESOURCE is in the effective
// set.
func hasCapSysResource(t *testing.T) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<unix.CAP_SYS_RESOURCE) != 0
		}
	}
	return false
}
