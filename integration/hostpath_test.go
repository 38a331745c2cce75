package integration

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// hostpathBuild builds bin/hostpathplugin (csi-driver-host-path, from its
// source in third_party/; make deps builds it ahead) once per test binary.
var hostpathBuild = sync.OnceValues(func() (string, error) {
	if out, err := exec.Command("bash", "../hack/build-hostpath.sh").CombinedOutput(); err != nil {
		return "", fmt.Errorf("%w\n%s", err, out)
	}
	return filepath.Abs("../bin/hostpathplugin")
})

// startHostpath runs csi-driver-host-path, a third-party plugin, as an
// unmanaged plugin of type typ on a socket of its own, and returns a client
// of its controller.
func (h *harness) startHostpath(typ string) csi.ControllerClient {
	t := h.t
	t.Helper()
	bin, err := hostpathBuild()
	if err != nil {
		t.Fatalf("building csi-driver-host-path (hack/build-hostpath.sh, needs the Go module proxy): %v", err)
	}
	dir := h.dir("hostpath-" + typ)
	sock := filepath.Join(dir, "csi.sock")
	cmd := exec.Command(bin, "--endpoint", "unix://"+sock, "--nodeid", "node-1", "--drivername", "hostpath.csi.k8s.io", "--statedir", filepath.Join(dir, "state"))
	cmd.Stderr = testWriter{t}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	deadline := time.Now().Add(waitTimeout)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("csi-driver-host-path did not listen on %s", sock)
		}
		time.Sleep(10 * time.Millisecond)
	}
	h.writeConfig(typ+".json", `{"type":"`+typ+`","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"},{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://`+sock+`"}]}`)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return csi.NewControllerClient(conn)
}

// TestBlockReadOnlyThirdPartyPlugin (issue 24, finding 5): csi-driver-host-path
// ignores readonly for block volumes (its read-only publish binds the same
// writable loop device). The agent finds the device writable (BLKROGET)
// and gives the RO user a read-only loop device of its own over it: the
// RO user's write fails while the RW user's succeeds, and the agent's
// device goes with the volume (the plugin's unpublish and delete succeed).
// Before, the RO user wrote the volume.
func TestBlockReadOnlyThirdPartyPlugin(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	ctrl := h.startHostpath("hostpath")
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	vol, err := ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{
		Name:          "blk",
		CapacityRange: &csi.CapacityRange{RequiredBytes: 16 << 20},
		VolumeCapabilities: []*csi.VolumeCapability{{
			AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER},
		}},
	})
	if err != nil {
		t.Fatalf("CreateVolume: %v", err)
	}
	id := vol.GetVolume().GetVolumeId()
	h.start(fastConfig(h))
	h.waitPlugin("hostpath", "ready", ready)
	h.blockReadOnly("hostpath", id)
	if ms := mountsUnder(t, h.work); len(ms) > 0 {
		t.Errorf("leaked mounts: %v", ms)
	}
	if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Errorf("DeleteVolume after the last cleanup: %v", err)
	}
	out, _ := exec.Command("losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE").CombinedOutput()
	if strings.Contains(string(out), h.work) || strings.Contains(string(out), id) {
		t.Errorf("loop devices left:\n%s", out)
	}
}
