package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// hookAgent is the agent's Prepare and Cleanup for hook tests: it
// records each request.
type hookAgent struct {
	agentv1.UnimplementedAgentServer
	mu   sync.Mutex
	reqs []proto.Message
}

func (h *hookAgent) Prepare(_ context.Context, r *agentv1.PrepareRequest) (*agentv1.PrepareResponse, error) {
	h.record(r)
	return &agentv1.PrepareResponse{}, nil
}

func (h *hookAgent) Cleanup(_ context.Context, r *agentv1.CleanupRequest) (*agentv1.CleanupResponse, error) {
	h.record(r)
	return &agentv1.CleanupResponse{}, nil
}

func (h *hookAgent) record(m proto.Message) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.reqs = append(h.reqs, proto.Clone(m))
}

func (h *hookAgent) take() []proto.Message {
	h.mu.Lock()
	defer h.mu.Unlock()
	r := h.reqs
	h.reqs = nil
	return r
}

func startHookAgent(t *testing.T) (*hookAgent, string) {
	t.Helper()
	socket := hookSocketPath(t)
	return serveHookAgent(t, socket), socket
}

// hookSocketPath is a path for a hook agent's socket (short: a socket
// path has a limit), nothing there yet.
func hookSocketPath(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "csh")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "agent.sock")
}

// serveHookAgent serves a hookAgent on socket.
func serveHookAgent(t *testing.T, socket string) *hookAgent {
	t.Helper()
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	h := &hookAgent{}
	srv := grpc.NewServer()
	agentv1.RegisterAgentServer(srv, h)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return h
}

// TestOCIHookFlagsAnywhere: the hook runs as the README writes it
// (oci-hook STAGE --api-socket PATH) and with the flags first; both
// stages reach the agent with the container's id, create-runtime with its
// rootfs, pid and volumes.
func TestOCIHookFlagsAnywhere(t *testing.T) {
	h, socket := startHookAgent(t)
	bundle := t.TempDir()
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), []byte(`{"root":{"path":"rootfs"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	vols := `[{"container_path":"/data","mode":"RW","source":{"type":"CSI_VOLUME","csi_volume":{"plugin_name":"loop","static_provisioning":{"volume_id":"v1","volume_capability":{"mount":{},"access_mode":{"mode":"SINGLE_NODE_WRITER"}}}}}}]`
	state, err := json.Marshal(ociState{ID: "c1", Pid: 4242, Bundle: bundle, Annotations: map[string]string{VolumesAnnotation: vols}})
	if err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"oci-hook", "create-runtime", "--api-socket", socket},
		{"oci-hook", "poststop", "--api-socket", socket},
		{"oci-hook", "--api-socket", socket, "--timeout", "10s", "create-runtime"},
		{"oci-hook", "--api-socket=" + socket, "poststop", "--timeout=10s"},
	} {
		var out, errOut bytes.Buffer
		e := &env{stdin: bytes.NewReader(state), stdout: &out, stderr: &errOut}
		if code := e.run(context.Background(), args); code != ExitOK {
			t.Fatalf("%q: exit %d, stderr %q", args, code, errOut.String())
		}
		reqs := h.take()
		if len(reqs) != 1 {
			t.Fatalf("%q: the agent got %d requests, want 1", args, len(reqs))
		}
		switch r := reqs[0].(type) {
		case *agentv1.PrepareRequest:
			if args[1] == "poststop" || args[len(args)-1] == "poststop" {
				t.Fatalf("%q: prepared", args)
			}
			if r.GetContainerId() != "c1" || r.GetPid() != 4242 || r.GetRootfs() != filepath.Join(bundle, "rootfs") || len(r.GetVolumes()) != 1 {
				t.Errorf("%q: prepare request %v", args, r)
			}
		case *agentv1.CleanupRequest:
			if args[1] == "create-runtime" || args[len(args)-1] == "create-runtime" {
				t.Fatalf("%q: cleaned up", args)
			}
			if r.GetContainerId() != "c1" {
				t.Errorf("%q: cleanup request %v", args, r)
			}
		}
	}
	for _, args := range [][]string{
		{"oci-hook", "prestart", "--api-socket", socket},
		{"oci-hook", "create-runtime", "poststop"},
		{"oci-hook", "poststop", "--no-such-flag"},
	} {
		var errOut bytes.Buffer
		e := &env{stdin: bytes.NewReader(state), stdout: &bytes.Buffer{}, stderr: &errOut}
		if code := e.run(context.Background(), args); code != ExitUsage || !strings.Contains(errOut.String(), "csi-agent oci-hook") {
			t.Errorf("%q: exit %d, stderr %q; want %d", args, code, errOut.String(), ExitUsage)
		}
	}
	if reqs := h.take(); len(reqs) != 0 {
		t.Errorf("usage errors reached the agent: %v", reqs)
	}
}

// TestOCIHookStageFromStatus: without a stage argument (one hooks.d file
// for both stages) the container's status says which: creating prepares,
// stopped cleans up, anything else is an error that reaches no agent.
func TestOCIHookStageFromStatus(t *testing.T) {
	h, socket := startHookAgent(t)
	bundle := t.TempDir()
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), []byte(`{"root":{"path":"rootfs"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	vols := `[{"container_path":"/data","mode":"RW","source":{"type":"CSI_VOLUME","csi_volume":{"plugin_name":"loop","static_provisioning":{"volume_id":"v1","volume_capability":{"mount":{},"access_mode":{"mode":"SINGLE_NODE_WRITER"}}}}}}]`
	for _, tc := range []struct {
		status string
		code   int
		want   string
	}{{"creating", ExitOK, "prepare"}, {"stopped", ExitOK, "cleanup"}, {"running", ExitProblem, ""}, {"", ExitProblem, ""}} {
		state, err := json.Marshal(ociState{ID: "c1", Status: tc.status, Pid: 4242, Bundle: bundle, Annotations: map[string]string{VolumesAnnotation: vols}})
		if err != nil {
			t.Fatal(err)
		}
		var errOut bytes.Buffer
		e := &env{stdin: bytes.NewReader(state), stdout: &bytes.Buffer{}, stderr: &errOut}
		if code := e.run(context.Background(), []string{"oci-hook", "--api-socket", socket}); code != tc.code {
			t.Errorf("status %q: exit %d (%s), want %d", tc.status, code, errOut.String(), tc.code)
		}
		reqs := h.take()
		got := ""
		if len(reqs) == 1 {
			switch reqs[0].(type) {
			case *agentv1.PrepareRequest:
				got = "prepare"
			case *agentv1.CleanupRequest:
				got = "cleanup"
			}
		}
		if got != tc.want || len(reqs) > 1 {
			t.Errorf("status %q: the agent got %v, want %q", tc.status, reqs, tc.want)
		}
	}
}

// A malformed entry of the mounts annotation is named, not echoed whole.
func TestMountsAnnotationErrorIsShort(t *testing.T) {
	_, err := parseNamedMounts(strings.Repeat("x", 10000))
	if err == nil || !strings.Contains(err.Error(), "expected NAME:PATH") || len(err.Error()) > 200 {
		t.Fatalf("error %d bytes: %.120v; want a short error naming the expected form", len(fmt.Sprint(err)), err)
	}
}

// runHookStage runs oci-hook STAGE for container c1 (pid 4242, a bundle
// of its own) with annotations against socket.
func runHookStage(t *testing.T, stage, socket string, annotations map[string]string, extra ...string) (int, string) {
	t.Helper()
	bundle := t.TempDir()
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), []byte(`{"root":{"path":"rootfs"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	state, err := json.Marshal(ociState{ID: "c1", Status: "creating", Pid: 4242, Bundle: bundle, Annotations: annotations})
	if err != nil {
		t.Fatal(err)
	}
	var errOut bytes.Buffer
	e := &env{stdin: bytes.NewReader(state), stdout: &bytes.Buffer{}, stderr: &errOut}
	return e.run(context.Background(), append([]string{"oci-hook", stage, "--api-socket", socket}, extra...)), errOut.String()
}

// A create-runtime hook that runs while the agent (re)starts waits for it,
// for the mounts annotation as for the volumes one (before, the mounts
// annotation failed at once: its names were looked up on the plugin socket
// first, without waiting).
func TestHookWaitsForAgentStart(t *testing.T) {
	socket := hookSocketPath(t)
	done := make(chan struct{})
	var code int
	var stderr string
	go func() {
		defer close(done)
		code, stderr = runHookStage(t, "create-runtime", socket, map[string]string{MountsAnnotation: "data:/data"}, "--timeout", "20s")
	}()
	// No agent yet: the hook must still be waiting a while later (before,
	// it had failed at once).
	select {
	case <-done:
		t.Fatalf("create-runtime with no agent returned at once: exit %d, %s", code, stderr)
	case <-time.After(300 * time.Millisecond):
	}
	h := serveHookAgent(t, socket)
	<-done
	if reqs := h.take(); code != ExitOK || len(reqs) != 1 {
		t.Fatalf("create-runtime while the agent started: exit %d (%s), the agent got %v", code, stderr, reqs)
	}
}

// poststop with no agent answering does not hold the runtime up: the
// agent cleans the container up itself once back (its processes are
// gone); the hook says so and succeeds within its wait.
func TestPoststopWithAgentDown(t *testing.T) {
	socket := hookSocketPath(t)
	start := time.Now()
	code, stderr := runHookStage(t, "poststop", socket, map[string]string{MountsAnnotation: "data:/data"}, "--timeout", "1s")
	if code != ExitOK || !strings.Contains(stderr, "does not answer; it cleans container c1 up itself once it is back") {
		t.Errorf("poststop with the agent down: exit %d, %q", code, stderr)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("poststop with the agent down took %v", took)
	}
}
