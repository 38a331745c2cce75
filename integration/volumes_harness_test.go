package integration

import (
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// loopPlugin writes the config of a managed csi-loop-plugin of type typ
// and returns its pool directory.
func (h *harness) loopPlugin(typ string) string {
	h.t.Helper()
	pool := mkPool(h.t, filepath.Join(h.extra, "pool-"+typ))
	h.writeConfig(typ+".json", managedConfig(typ, false, bins.loop, "csi-loop-plugin", "--pool="+pool))
	return pool
}

// createVolume pre-provisions a sparse 64 MiB volume with the real CLI.
func createVolume(t *testing.T, pool, name string) {
	t.Helper()
	createVolumeSize(t, pool, name, "64MiB")
}

func createVolumeSize(t *testing.T, pool, name, size string) {
	t.Helper()
	out, err := exec.Command(bins.loop, "create-volume", "--pool", pool, "--name", name, "--size", size).CombinedOutput()
	if err != nil {
		t.Fatalf("create-volume %s: %v\n%s", name, err, out)
	}
}

// volumeSpec builds a Mesos Volume.
type volumeSpec struct {
	plugin, id, path string
	ro               bool
	access           csi.VolumeCapability_AccessMode_Mode
	block            bool
	fsType           string
	stageSecrets     map[string]*agentv1.Secret
}

func (s volumeSpec) volume() *agentv1.Volume {
	mode := agentv1.Volume_RW
	if s.ro {
		mode = agentv1.Volume_RO
	}
	access := s.access
	if access == csi.VolumeCapability_AccessMode_UNKNOWN {
		access = csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER
	}
	capability := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: access}}
	if s.block {
		capability.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		capability.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: s.fsType}}
	}
	return &agentv1.Volume{
		ContainerPath: s.path,
		Mode:          mode,
		Source: &agentv1.Volume_Source{
			Type: agentv1.Volume_Source_CSI_VOLUME,
			CsiVolume: &agentv1.CSIVolume{
				PluginName: s.plugin,
				StaticProvisioning: &agentv1.StaticProvisioning{
					VolumeId: s.id, VolumeCapability: capability, NodeStageSecrets: s.stageSecrets,
				},
			},
		},
	}
}

// api is a client of the running agent's API, on a connection closed
// when the test ends.
func (h *harness) api() agentv1.AgentClient {
	return apiClient(h.t, h.cfg.APISocket)
}

// prepare calls Prepare over the real API socket.
func (h *harness) prepare(id, sandbox, rootfs string, specs ...volumeSpec) (*agentv1.PrepareResponse, error) {
	req := &agentv1.PrepareRequest{ContainerId: id, Sandbox: sandbox, Rootfs: rootfs}
	for _, s := range specs {
		req.Volumes = append(req.Volumes, s.volume())
	}
	return h.api().Prepare(context.Background(), req)
}

func (h *harness) mustPrepare(id, sandbox, rootfs string, specs ...volumeSpec) *agentv1.PrepareResponse {
	h.t.Helper()
	resp, err := h.prepare(id, sandbox, rootfs, specs...)
	if err != nil {
		h.t.Fatalf("Prepare %s: %v", id, err)
	}
	return resp
}

func (h *harness) mustCleanup(id string) {
	h.t.Helper()
	if _, err := h.api().Cleanup(context.Background(), &agentv1.CleanupRequest{ContainerId: id}); err != nil {
		h.t.Fatalf("Cleanup %s: %v", id, err)
	}
}

// volumes is the agent API's ListVolumes.
func (h *harness) volumes() []*agentv1.VolumeStatus {
	h.t.Helper()
	conn := dial(h.t, h.cfg.APISocket)
	defer conn.Close()
	resp, err := agentv1.NewAgentClient(conn).ListVolumes(context.Background(), &agentv1.ListVolumesRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	return resp.Volumes
}

// containers is the agent API's ListContainers.
func (h *harness) containers() []*agentv1.ContainerStatus {
	h.t.Helper()
	conn := dial(h.t, h.cfg.APISocket)
	defer conn.Close()
	resp, err := agentv1.NewAgentClient(conn).ListContainers(context.Background(), &agentv1.ListContainersRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	return resp.Containers
}

// mountsUnder lists the mount points at or below any of dirs.
func mountsUnder(t *testing.T, dirs ...string) []string {
	t.Helper()
	var out []string
	for _, d := range dirs {
		ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(d))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ms {
			out = append(out, m.Mountpoint)
		}
	}
	return out
}

// loopDevicesFor lists loop devices whose backing file is in pool.
func loopDevicesFor(t *testing.T, pool string) []string {
	t.Helper()
	files, _ := filepath.Glob("/sys/block/loop*/loop/backing_file")
	var out []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(b)), pool+"/") {
			out = append(out, f)
		}
	}
	return out
}

// assertClean checks that nothing is left: no mount under the harness's
// directories, no loop device on the pools, no tracked volume or
// container.
func (h *harness) assertClean(pools ...string) {
	h.t.Helper()
	if ms := mountsUnder(h.t, h.work, h.extra); len(ms) > 0 {
		h.t.Errorf("leaked mounts: %v", ms)
	}
	for _, p := range pools {
		if devs := loopDevicesFor(h.t, p); len(devs) > 0 {
			h.t.Errorf("leaked loop devices on %s: %v", p, devs)
		}
	}
	if vs := h.volumes(); len(vs) > 0 {
		h.t.Errorf("volumes still tracked: %v", vs)
	}
	resp, err := h.api().ListContainers(context.Background(), &agentv1.ListContainersRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	if len(resp.Containers) > 0 {
		h.t.Errorf("containers still tracked: %v", resp.Containers)
	}
}

// dir makes a directory under the harness's extra dir.
func (h *harness) dir(name string) string {
	h.t.Helper()
	d := filepath.Join(h.extra, name)
	if err := os.MkdirAll(d, 0o755); err != nil {
		h.t.Fatal(err)
	}
	return d
}

// slogTo is a debug logger writing to w.
func slogTo(w io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}
