package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// hostpathBuild builds bin/hostpathplugin (csi-driver-host-path, from its
// source in third_party/; make deps builds it ahead) once per test binary.
var hostpathBuild = sync.OnceValues(func() (string, error) {
	if out, err := exec.Command("bash", "../hack/build-hostpath.sh").CombinedOutput(); err != nil {
		return "", fmt.Errorf("%w\n%s", err, out)
	}
	return filepath.Abs("../bin/hostpathplugin")
})

// hostpathBin is bin/hostpathplugin, built if needed; failing names the
// build.
func hostpathBin(t *testing.T) string {
	t.Helper()
	bin, err := hostpathBuild()
	if err != nil {
		t.Fatalf("building csi-driver-host-path (hack/build-hostpath.sh, needs the Go module proxy): %v", err)
	}
	return bin
}

// hostpathArgs are csi-driver-host-path's flags but its endpoint.
func hostpathArgs(stateDir string) []string {
	return []string{"--nodeid", "node-1", "--drivername", "hostpath.csi.k8s.io", "--statedir", stateDir}
}

// startHostpath runs csi-driver-host-path, a third-party plugin, as an
// unmanaged plugin of type typ on a socket of its own (with its flags
// extra besides), and returns a client of its controller.
func (h *harness) startHostpath(typ string, extra ...string) csi.ControllerClient {
	t := h.t
	t.Helper()
	dir := h.dir("hostpath-" + typ)
	sock := filepath.Join(dir, "csi.sock")
	args := append([]string{"--endpoint", "unix://" + sock}, hostpathArgs(filepath.Join(dir, "state"))...)
	startUnmanaged(t, hostpathBin(t), append(args, extra...)...)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	if err := supervisor.WaitForSocket(ctx, sock, nil); err != nil {
		t.Fatalf("csi-driver-host-path did not listen on %s: %v", sock, err)
	}
	h.writeConfig(typ+".json", `{"type":"`+typ+`","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"},{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://`+sock+`"}]}`)
	return controllerAt(t, "unix://"+sock)
}

// managedHostpath configures csi-driver-host-path as a managed plugin of
// type typ (csiagent runs it, on the socket it names in CSI_ENDPOINT);
// call controllerOf once the agent runs it.
func (h *harness) managedHostpath(typ string) {
	h.t.Helper()
	args := append([]string{hostpathBin(h.t), "--endpoint=$CSI_ENDPOINT"}, hostpathArgs(filepath.Join(h.dir("hostpath-"+typ), "state"))...)
	h.writeConfig(typ+".json", managedConfig(typ, true, strings.Join(args, " ")))
}

// createHostpathVolume creates a SINGLE_NODE_MULTI_WRITER volume (block:
// 16 MiB, which the plugin needs for a block volume; else a mount volume)
// through csi-driver-host-path's controller and returns its id.
func createHostpathVolume(ctx context.Context, t *testing.T, ctrl csi.ControllerClient, name string, block bool) string {
	t.Helper()
	req := &csi.CreateVolumeRequest{Name: name, VolumeCapabilities: []*csi.VolumeCapability{{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER},
	}}}
	if block {
		req.CapacityRange = &csi.CapacityRange{RequiredBytes: 16 << 20}
		req.VolumeCapabilities[0].AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	}
	// The plugin's socket may exist before it listens (WaitForSocket
	// sees the bind): wait for the connection rather than fail on it.
	vol, err := ctrl.CreateVolume(ctx, req, grpc.WaitForReady(true))
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return vol.GetVolume().GetVolumeId()
}

// controllerAt is a controller client of the CSI endpoint.
func controllerAt(t *testing.T, endpoint string) csi.ControllerClient {
	t.Helper()
	conn, err := grpc.NewClient(endpoint, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return csi.NewControllerClient(conn)
}

// TestBlockReadOnlyThirdPartyPlugin (issue 24, finding 5): csi-driver-host-path
// ignores readonly for block volumes (its read-only publish binds the same
// writable loop device). The agent finds the device writable (BLKROGET) and
// refuses the read-only user, naming the plugin, while the read-write user
// goes on writing; the teardown unpublishes both targets (the plugin's
// unpublish and delete succeed, no loop device is left). Before, the
// read-only user wrote the volume.
func TestBlockReadOnlyThirdPartyPlugin(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	ctrl := h.startHostpath("hostpath")
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	id := createHostpathVolume(ctx, t, ctrl, "blk", true)
	h.start(fastConfig(h))
	h.waitPlugin("hostpath", "ready", ready)
	rw, ro := h.dir("sb-rw"), h.dir("sb-ro")
	h.mustPrepare("writer", rw, "", volumeSpec{plugin: "hostpath", id: id, path: "disk", block: true})
	_, err := h.prepare("reader", ro, "", volumeSpec{plugin: "hostpath", id: id, path: "disk", block: true, ro: true})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "plugin hostpath") || !strings.Contains(err.Error(), "ignores readonly") {
		t.Fatalf("read-only user of a block volume whose plugin ignores readonly: %v; want FailedPrecondition naming the plugin", err)
	}
	if _, err := os.Stat(filepath.Join(ro, "disk")); err == nil {
		if ms := mountsUnder(t, ro); len(ms) > 0 {
			t.Errorf("the refused reader got mounts: %v", ms)
		}
	}
	dev, err := os.OpenFile(filepath.Join(rw, "disk"), os.O_WRONLY, 0)
	if err == nil {
		_, err = dev.WriteAt([]byte("csiagent"), 4096)
		dev.Close()
	}
	if err != nil {
		t.Errorf("the read-write user cannot write: %v", err)
	}
	h.mustCleanup("writer")
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

// TestThirdPartyPluginFlow (issue 25): csi-driver-host-path, built on CSI
// 1.12, unmanaged and managed, with its default target_path_exists (it
// makes its targets): a mount volume is prepared into a sandbox, written,
// its health read the CSI 1.12 way (VOLUME_CONDITION in
// NodeGetVolumeStats) and shown, abnormal once its backing directory is
// removed, and cleaned up. Before, the capability showed as "4" and the
// health as unknown.
func TestThirdPartyPluginFlow(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, managed := range []bool{false, true} {
		t.Run(map[bool]string{false: "unmanaged", true: "managed"}[managed], func(t *testing.T) {
			h := newHarness(t)
			var ctrl csi.ControllerClient
			if managed {
				h.managedHostpath("hostpath")
			} else {
				ctrl = h.startHostpath("hostpath")
			}
			h.start(fastConfig(h))
			p := h.waitPlugin("hostpath", "ready", ready)
			inst := p.GetInstances()[0]
			if !slices.Contains(inst.GetNodeCapabilities(), "VOLUME_CONDITION") {
				t.Errorf("node capabilities %v: want VOLUME_CONDITION named", inst.GetNodeCapabilities())
			}
			if managed {
				ctrl = controllerAt(t, inst.GetEndpoint())
			}
			ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
			defer cancel()
			id := createHostpathVolume(ctx, t, ctrl, "data", false)
			sb := h.dir("sandbox")
			h.mustPrepare("c1", sb, "", volumeSpec{plugin: "hostpath", id: id, path: "data"})
			if err := os.WriteFile(filepath.Join(sb, "data", "file"), []byte("hello"), 0o644); err != nil {
				t.Fatal(err)
			}
			health := func() *agentv1.VolumeStats {
				t.Helper()
				list, err := h.api().ListVolumes(ctx, &agentv1.ListVolumesRequest{RefreshStats: true})
				if err != nil || len(list.GetVolumes()) != 1 {
					t.Fatalf("ListVolumes: %v, %v", list, err)
				}
				return list.GetVolumes()[0].GetStats()
			}
			// Its node-side check is kubelet's: it looks for the volume's
			// mounts under /var/lib/kubelet/pods, so outside Kubernetes it
			// calls every volume "not mounted". Shown as it says it.
			if s := health(); !s.GetHealthKnown() || !s.GetBytesKnown() || s.GetAbnormal() != (s.GetCondition() != "") {
				t.Errorf("stats of the volume: %v; want health and bytes known, the plugin's condition", s)
			}
			// Its backing directory goes (the bind keeps the files).
			state := filepath.Join(h.extra, "hostpath-hostpath", "state", id)
			if err := os.RemoveAll(state); err != nil {
				t.Fatal(err)
			}
			if s := health(); !s.GetHealthKnown() || !s.GetAbnormal() || s.GetCondition() == "" {
				t.Errorf("stats once the backing directory is gone: %v; want abnormal with the plugin's message", s)
			}
			h.mustCleanup("c1")
			if ms := mountsUnder(t, h.work, sb); len(ms) > 0 {
				t.Errorf("leaked mounts: %v", ms)
			}
			if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
				t.Errorf("DeleteVolume: %v", err)
			}
		})
	}
}

// TestTargetPathExists (issue 25): target_path_exists as Mesos defines it,
// against a plugin that expects its target to exist (the test plugin with
// --target-must-exist). With the field set the agent makes the target and
// the prepare works; without it (CSI: the plugin makes its target) that
// plugin refuses, and the refusal reaches the caller. Before, the meaning
// was the other way round.
func TestTargetPathExists(t *testing.T) {
	testhelp.NeedRoot(t)
	for _, set := range []bool{true, false} {
		t.Run(fmt.Sprint("target_path_exists=", set), func(t *testing.T) {
			h := newHarness(t)
			cfg := testPluginConfig("t", "--data-dir="+h.dir("data"), "--target-must-exist")
			if set {
				cfg = strings.Replace(cfg, "{", `{"target_path_exists":true,`, 1)
			}
			h.writeConfig("t.json", cfg)
			h.start(fastConfig(h))
			h.waitPlugin("t", "ready", ready)
			sb := h.dir("sb")
			_, err := h.prepare("c1", sb, "", volumeSpec{plugin: "t", id: "v", path: "d"})
			if set {
				if err != nil {
					t.Fatalf("Prepare with target_path_exists: %v", err)
				}
				h.mustCleanup("c1")
				return
			}
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "expects the CO to make it") {
				t.Fatalf("Prepare without target_path_exists against a plugin that needs it: %v; want its FailedPrecondition", err)
			}
		})
	}
}

// hostpathAttached reads csi-driver-host-path's state file (the plugin of
// type typ started by startHostpath) and reports which volumes it holds
// attached.
func (h *harness) hostpathAttached(typ string) map[string]bool {
	h.t.Helper()
	b, err := os.ReadFile(filepath.Join(h.extra, "hostpath-"+typ, "state", "state.json"))
	if err != nil {
		h.t.Fatal(err)
	}
	var st struct {
		Volumes []struct {
			VolID    string
			Attached bool
		}
	}
	if err := json.Unmarshal(b, &st); err != nil {
		h.t.Fatalf("csi-driver-host-path's state file: %v", err)
	}
	out := map[string]bool{}
	for _, v := range st.Volumes {
		out[v.VolID] = v.Attached
	}
	return out
}

// TestThirdPartyPluginAttach (issue 28): csi-driver-host-path with
// --enable-attach refuses to stage a volume not attached first
// ("ControllerPublishVolume must be called ... before staging on node").
// Through the agent, a container's volume is attached (ControllerPublishVolume
// to the plugin's node id), staged, published and written; a second volume
// beyond the plugin's attach limit (--attach-limit 1, which it also reports
// as NodeGetInfo max_volumes_per_node) is refused, ResourceExhausted,
// naming the volume, before any call; the last user's cleanup
// detaches, and the second volume then gets its place.
func TestThirdPartyPluginAttach(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	ctrl := h.startHostpath("hostpath", "--enable-attach", "--attach-limit", "1")
	h.start(fastConfig(h))
	p := h.waitPlugin("hostpath", "ready", ready)
	if caps := p.GetInstances()[0].GetControllerCapabilities(); !slices.Contains(caps, "PUBLISH_UNPUBLISH_VOLUME") {
		t.Fatalf("controller capabilities %v: want PUBLISH_UNPUBLISH_VOLUME", caps)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	a, b := createHostpathVolume(ctx, t, ctrl, "a", false), createHostpathVolume(ctx, t, ctrl, "b", false)
	sb := h.dir("sandbox")
	h.mustPrepare("c1", sb, "", volumeSpec{plugin: "hostpath", id: a, path: "data"})
	if err := os.WriteFile(filepath.Join(sb, "data", "file"), []byte("hello"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := h.hostpathAttached("hostpath"); !got[a] || got[b] {
		t.Errorf("attached after the first prepare: %v; want %s only", got, a)
	}
	sb2 := h.dir("sandbox2")
	_, err := h.prepare("c2", sb2, "", volumeSpec{plugin: "hostpath", id: b, path: "data"})
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), b) {
		t.Errorf("a second volume beyond --attach-limit 1: %v; want ResourceExhausted naming %s", err, b)
	}
	h.mustCleanup("c1")
	if got := h.hostpathAttached("hostpath"); got[a] {
		t.Errorf("still attached after the last user's cleanup: %v", got)
	}
	h.mustPrepare("c2", sb2, "", volumeSpec{plugin: "hostpath", id: b, path: "data"})
	h.mustCleanup("c2")
	for _, sandbox := range []string{sb, sb2} {
		if ms := mountsUnder(t, h.work, sandbox); len(ms) > 0 {
			t.Errorf("leaked mounts: %v", ms)
		}
	}
	for _, id := range []string{a, b} {
		if _, err := ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
			t.Errorf("DeleteVolume %s: %v", id, err)
		}
	}
}
