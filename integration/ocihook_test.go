package integration

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// needRunc finds the real runc and busybox-static the OCI tests run
// containers with (make deps installs both).
func needRunc(t *testing.T) (runc, busybox string) {
	t.Helper()
	testhelp.NeedRoot(t)
	var err error
	if runc, err = exec.LookPath("runc"); err != nil {
		t.Fatalf("runc is not installed (make deps installs Debian's runc): %v", err)
	}
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		if _, err := os.Stat(p); err == nil {
			return runc, p
		}
	}
	t.Fatal("busybox is not installed (make deps installs busybox-static)")
	return "", ""
}

// bundle makes an OCI bundle whose container runs script in a busybox
// rootfs, with the csi-agent hooks and the volumes annotation.
func (h *harness) bundle(busybox, name, script string, vols ...volumeSpec) string {
	h.t.Helper()
	var list []json.RawMessage
	for _, v := range vols {
		b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(v.volume())
		if err != nil {
			h.t.Fatal(err)
		}
		list = append(list, b)
	}
	annotation, _ := json.Marshal(list)
	// As the README writes it: the stage, then the flags.
	hook := func(stage string) map[string]any {
		return map[string]any{"path": bins.agent, "args": []string{"csi-agent", "oci-hook", stage, "--api-socket", h.cfg.APISocket}, "timeout": 60}
	}
	return h.busyboxBundle(busybox, name, "", script, func(spec map[string]any) {
		spec["annotations"] = map[string]string{"csi.csiagent.io/volumes": string(annotation)}
		spec["hooks"] = map[string]any{"createRuntime": []any{hook("create-runtime")}, "poststop": []any{hook("poststop")}}
	})
}

// busyboxBundle makes an OCI bundle whose container runs script as root
// with busybox (and its sh, cat, ls, echo) in rootfs ("": the bundle's
// own rootfs directory), a /proc and a tmpfs /dev, in its own pid, ipc,
// uts and mount namespaces; edits change its config.json before it is
// written.
func (h *harness) busyboxBundle(busybox, name, rootfs, script string, edits ...func(spec map[string]any)) string {
	h.t.Helper()
	dir := h.dir("bundle-" + name)
	root := rootfs
	if rootfs == "" {
		root, rootfs = "rootfs", filepath.Join(dir, "rootfs")
	}
	bin := filepath.Join(rootfs, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		h.t.Fatal(err)
	}
	b, err := os.ReadFile(busybox)
	if err != nil {
		h.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bin, "busybox"), b, 0o755); err != nil {
		h.t.Fatal(err)
	}
	for _, applet := range []string{"sh", "cat", "ls", "echo"} {
		if err := os.Symlink("busybox", filepath.Join(bin, applet)); err != nil {
			h.t.Fatal(err)
		}
	}
	spec := map[string]any{
		"ociVersion": "1.0.2",
		"process": map[string]any{
			"terminal": false, "user": map[string]int{"uid": 0, "gid": 0},
			"args": []string{"sh", "-c", script}, "env": []string{"PATH=/bin"}, "cwd": "/",
		},
		"root":     map[string]any{"path": root},
		"hostname": "csiagent-test",
		"mounts": []any{
			map[string]any{"destination": "/proc", "type": "proc", "source": "proc"},
			map[string]any{"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
		},
		"linux": map[string]any{
			"namespaces": []any{map[string]string{"type": "pid"}, map[string]string{"type": "ipc"}, map[string]string{"type": "uts"}, map[string]string{"type": "mount"}},
		},
	}
	for _, edit := range edits {
		edit(spec)
	}
	out, _ := json.MarshalIndent(spec, "", "  ")
	if err := os.WriteFile(filepath.Join(dir, "config.json"), out, 0o644); err != nil {
		h.t.Fatal(err)
	}
	return dir
}

// runContainer runs a bundle to completion with the real runc.
func runContainer(t *testing.T, runc, bundle, id string) (stdout, stderr string, err error) {
	t.Helper()
	var out, errb bytes.Buffer
	cmd := exec.Command(runc, "run", "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = &out, &errb
	err = cmd.Run()
	t.Cleanup(func() { _ = exec.Command(runc, "delete", "--force", id).Run() })
	return out.String(), errb.String(), err
}

// runDetached starts a bundle's container with runc run --detach (its
// stdio a log file, not a pipe nobody would close), deleted when the test
// ends, and waits until ready says it is where the test wants it; the
// log is shown if it never gets there.
func runDetached(t *testing.T, runc, bundle, id, waitingFor string, ready func() bool) {
	t.Helper()
	logPath := filepath.Join(filepath.Dir(bundle), id+".log")
	log, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(runc, "run", "--detach", "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = log, log
	err = cmd.Run()
	log.Close()
	if err != nil {
		out, _ := os.ReadFile(logPath)
		t.Fatalf("runc run %s: %v\n%s", id, err, out)
	}
	t.Cleanup(func() { _ = exec.Command(runc, "delete", "--force", id).Run() })
	deadline := time.Now().Add(waitTimeout)
	for !ready() {
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(logPath)
			t.Fatalf("container %s: %s did not happen\n%s", id, waitingFor, out)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestOCIHookWithRunc runs real containers whose CSI volume is prepared
// by the createRuntime hook inside their mount namespace: the first writes
// a file, the volume is unpublished when it exits, and the second reads
// the file.
func TestOCIHookWithRunc(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "shared")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	vol := volumeSpec{plugin: "loop", id: "shared", path: "/data"}

	writer := h.bundle(busybox, "writer", "echo written-in-container > /data/hello && ls /data", vol)
	out, errOut, err := runContainer(t, runc, writer, "writer")
	if err != nil || !strings.Contains(out, "hello") || !strings.Contains(out, "lost+found") {
		t.Fatalf("writer: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	// poststop has cleaned up: nothing published, nothing mounted.
	h.assertClean(pool)
	if ms := mountsUnder(t, writer); len(ms) > 0 {
		t.Errorf("mounts on the host under the bundle: %v", ms)
	}

	// Another container, another path, read-only.
	reader := h.bundle(busybox, "reader", "cat /mnt/vol/hello && (echo x > /mnt/vol/ro-test && echo WRITABLE || echo READ-ONLY)",
		volumeSpec{plugin: "loop", id: "shared", path: "/mnt/vol", ro: true})
	out, errOut, err = runContainer(t, runc, reader, "reader")
	if err != nil || !strings.Contains(out, "written-in-container") || !strings.Contains(out, "READ-ONLY") {
		t.Fatalf("reader: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	h.assertClean(pool)
}

// TestOCIHookSymlinkEscape: an image whose /data is a symlink to /etc gets
// the volume inside its own rootfs (at its /etc), never on the host's.
func TestOCIHookSymlinkEscape(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	bundle := h.bundle(busybox, "escape", "ls /etc", volumeSpec{plugin: "loop", id: "v", path: "/data"})
	if err := os.Symlink("/etc", filepath.Join(bundle, "rootfs", "data")); err != nil {
		t.Fatal(err)
	}
	// With no /etc in the image, the link dangles inside the root and
	// Prepare fails; with one, the volume lands there.
	if err := os.Mkdir(filepath.Join(bundle, "rootfs", "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	hostEtc := mountsUnder(t, "/etc")
	out, errOut, err := runContainer(t, runc, bundle, "escape")
	if err != nil || !strings.Contains(out, "lost+found") {
		t.Fatalf("the volume should be the container's /etc: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	if got := mountsUnder(t, "/etc"); !slices.Equal(got, hostEtc) {
		t.Errorf("host /etc mounts changed: %v -> %v", hostEtc, got)
	}
	if _, err := os.Stat("/etc/lost+found"); err == nil {
		t.Error("the volume appeared at the host's /etc")
	}
	h.assertClean(pool)
}

// TestOCIHookFailureStopsContainer: a volume the agent cannot prepare
// fails the container's start cleanly, with the reason on one line.
func TestOCIHookFailureStopsContainer(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	bundle := h.bundle(busybox, "bad", "echo SHOULD-NOT-RUN", volumeSpec{plugin: "loop", id: "no-such-volume", path: "/data"})
	out, errOut, err := runContainer(t, runc, bundle, "bad")
	if err == nil || strings.Contains(out, "SHOULD-NOT-RUN") {
		t.Fatalf("the container ran although its volume could not be prepared: %v\n%s", err, out)
	}
	if !strings.Contains(errOut, "csi-agent oci-hook create-runtime: NotFound") || !strings.Contains(errOut, "no-such-volume") {
		t.Errorf("runc's error should carry the hook's reason:\n%s", errOut)
	}
	h.assertClean(pool)
}

// TestOCIHookPoststopIdempotent: poststop for a container the agent does
// not know (already cleaned up) succeeds; a state without the annotation
// needs no agent at all.
func TestOCIHookPoststopIdempotent(t *testing.T) {
	h := newHarness(t)
	h.start(fastConfig(h))
	for _, state := range []string{
		`{"ociVersion":"1.0.2","id":"gone","status":"stopped","pid":0,"bundle":"/nonexistent","annotations":{"csi.csiagent.io/volumes":"[]"}}`,
		`{"ociVersion":"1.0.2","id":"plain","status":"stopped","bundle":"/nonexistent"}`,
	} {
		for range 2 {
			cmd := exec.Command(bins.agent, "oci-hook", "--api-socket", h.cfg.APISocket, "poststop")
			cmd.Stdin = strings.NewReader(state)
			cmd.Env = []string{} // hooks get no PATH
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("poststop %s: %v\n%s", state, err, out)
			}
		}
	}
}
