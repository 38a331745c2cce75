package integration

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// mountsBundle is a bundle whose container runs script with the mounts
// annotation (and no volumes annotation), its hooks looking the names up
// at the agent's plugin socket.
func (h *harness) mountsBundle(busybox, name, script, mounts string) string {
	h.t.Helper()
	dir := h.bundle(busybox, name, script)
	cfgPath := filepath.Join(dir, "config.json")
	b, err := os.ReadFile(cfgPath)
	if err != nil {
		h.t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(b, &spec); err != nil {
		h.t.Fatal(err)
	}
	spec["annotations"] = map[string]string{"csi.csiagent.io/mounts": mounts}
	hook := func(stage string) map[string]any {
		return map[string]any{"path": bins.agent, "args": []string{"csi-agent", "oci-hook", stage, "--api-socket", h.cfg.APISocket}, "timeout": 60}
	}
	spec["hooks"] = map[string]any{"createRuntime": []any{hook("create-runtime")}, "poststop": []any{hook("poststop")}}
	out, _ := json.MarshalIndent(spec, "", "  ")
	if err := os.WriteFile(cfgPath, out, 0o644); err != nil {
		h.t.Fatal(err)
	}
	return dir
}

// TestAnnotationPolicyWithRunc: through real runc, a container naming in
// the mounts annotation a named volume created without --allow-annotations
// does not start (its createRuntime hook fails, saying how to allow it),
// and nothing is mounted, published or tracked; one created with
// --allow-annotations starts and writes, and the next container reads what
// it wrote.
func TestAnnotationPolicyWithRunc(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "vol1")
	createVolume(t, pool, "vol2")
	cfg := fastConfig(h)
	cfg.DockerPluginSocket = filepath.Join(h.run, "docker-plugin.sock")
	h.start(cfg)
	h.waitPlugin("loop", "ready", ready)
	volume := func(args ...string) {
		t.Helper()
		out, err := exec.Command(bins.agent, append([]string{"volume", "create", "--api-socket", h.cfg.APISocket, "--plugin", "loop", "--fs-type", "ext4"}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("csi-agent volume create %q: %v\n%s", args, err, out)
		}
	}
	volume("closed", "--volume-id", "vol1")

	refused := h.mountsBundle(busybox, "refused", "echo SHOULD-NOT-RUN; echo x > /data/f", "closed:/data")
	out, errOut, err := runContainer(t, runc, refused, "refused")
	if err == nil || strings.Contains(out, "SHOULD-NOT-RUN") {
		t.Fatalf("the container ran with a volume that does not allow annotations: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	for _, want := range []string{"csi-agent oci-hook create-runtime: PermissionDenied: annotation csi.csiagent.io/mounts: mount 1: named volume closed may not be named in an annotation", "--allow-annotations"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("runc's error should carry the hook's reason %q:\n%s", want, errOut)
		}
	}
	h.assertClean(pool)
	if ms := mountsUnder(t, refused); len(ms) > 0 {
		t.Errorf("mounts on the host under the refused bundle: %v", ms)
	}

	volume("open", "--volume-id", "vol2", "--allow-annotations")
	writer := h.mountsBundle(busybox, "writer", "echo written-through-annotation > /data/f && ls /data", "open:/data")
	out, errOut, err = runContainer(t, runc, writer, "writer")
	if err != nil || !strings.Contains(out, "lost+found") {
		t.Fatalf("writer: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	h.assertClean(pool)
	reader := h.mountsBundle(busybox, "reader", "cat /v/f", "open:/v:ro")
	out, errOut, err = runContainer(t, runc, reader, "reader")
	if err != nil || !strings.Contains(out, "written-through-annotation") {
		t.Fatalf("reader: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	h.assertClean(pool)
}
