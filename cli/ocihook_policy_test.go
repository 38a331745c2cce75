package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/docker/go-plugins-helpers/volume"

	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// mountingBackend is an isolator whose prepares succeed: engine mounts
// through the plugin endpoint are recorded as they are in the agent.
type mountingBackend struct {
	mu         sync.Mutex
	containers map[string]bool
}

func (b *mountingBackend) Prepare(_ context.Context, r *agentv1.PrepareRequest) (*agentv1.PrepareResponse, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.containers[r.GetContainerId()] = true
	return &agentv1.PrepareResponse{Mounts: []*agentv1.ContainerMount{{MountPoint: filepath.Join(r.GetRootfs(), "data")}}}, nil
}

func (b *mountingBackend) Cleanup(_ context.Context, id string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.containers, id)
	return nil
}

func (b *mountingBackend) ListContainers() []*agentv1.ContainerStatus {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []*agentv1.ContainerStatus
	for id := range b.containers {
		out = append(out, &agentv1.ContainerStatus{ContainerId: id, Phase: agentv1.ContainerStatus_PREPARED})
	}
	return out
}

func (b *mountingBackend) ListVolumes() []*agentv1.VolumeStatus { return nil }
func (b *mountingBackend) CheckPlugin(string) error             { return nil }

// engineMount mounts a named volume as Docker does (VolumeDriver.Mount).
func engineMount(t *testing.T, socket, name, id string) {
	t.Helper()
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", socket)
	}}}
	body, _ := json.Marshal(&volume.MountRequest{Name: name, ID: id})
	resp, err := hc.Post("http://plugin/VolumeDriver.Mount", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var res volume.MountResponse
	if err := json.NewDecoder(resp.Body).Decode(&res); err != nil || resp.StatusCode != http.StatusOK || res.Mountpoint == "" {
		t.Fatalf("engine mount of %s: %s %v %+v", name, resp.Status, err, res)
	}
}

// runHook runs oci-hook create-runtime on a container with annotations,
// against the fake agent and the plugin socket; extra are more flags.
func runHook(t *testing.T, agentSocket, pluginSocket string, annotations map[string]string, extra ...string) (int, string) {
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
	args := append([]string{"oci-hook", "create-runtime", "--api-socket", agentSocket, "--docker-plugin-socket", pluginSocket, "--timeout", "20s"}, extra...)
	return e.run(context.Background(), args), errOut.String()
}

// preparedVolumes is what the fake agent was asked to prepare: the
// volumes of each Prepare.
func preparedVolumes(t *testing.T, h *hookAgent) [][]*agentv1.Volume {
	t.Helper()
	var out [][]*agentv1.Volume
	for _, r := range h.take() {
		p, ok := r.(*agentv1.PrepareRequest)
		if !ok {
			t.Fatalf("the agent got %T", r)
		}
		out = append(out, p.GetVolumes())
	}
	return out
}

// TestHookMountsAnnotationPolicy: the mounts annotation reaches a named
// volume only if its definition allows annotations (a definition without
// the option, as every one made before it, does not), and one an engine
// mount holds only if it also allows sharing; the refusal names the
// volume and how to allow it, and reaches no agent. An allowed volume's
// secret references are its definition's (the operator's), not the
// annotation's: no --allow-reference-secrets needed. prepare --mounts, an
// API caller's, is not the annotation's policy.
func TestHookMountsAnnotationPolicy(t *testing.T) {
	h, agentSocket := startHookAgent(t)
	plugin := policyPlugin(t)
	c := dockerplugin.NewClient(plugin)
	ctx := context.Background()
	create := func(name string, opts map[string]string) {
		t.Helper()
		all := map[string]string{namedvol.KeyPlugin: "loop", namedvol.KeyVolumeID: name}
		for k, v := range opts {
			all[k] = v
		}
		if err := c.Create(ctx, name, all); err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
	}
	create("closed", nil)
	create("explicit-false", map[string]string{namedvol.KeyAllowAnnotations: "false"})
	// Its secret reference is the operator's, who allowed annotations.
	create("open", map[string]string{namedvol.KeyAllowAnnotations: "true", namedvol.KeyStageSecret: "ops/token"})
	create("held", map[string]string{namedvol.KeyAllowAnnotations: "true"})
	create("shared", map[string]string{namedvol.KeyAllowAnnotations: "true", namedvol.KeyShareEngineMounts: "true"})
	engineMount(t, plugin, "held", "docker-mount-1")
	engineMount(t, plugin, "shared", "docker-mount-2")

	for _, name := range []string{"closed", "explicit-false"} {
		code, stderr := runHook(t, agentSocket, plugin, map[string]string{MountsAnnotation: "open:/a;" + name + ":/data"})
		if code != ExitProblem {
			t.Errorf("%s: exit %d, want %d (refused)", name, code, ExitProblem)
		}
		for _, want := range []string{MountsAnnotation, "mount 2", "named volume " + name + " may not be named in an annotation", "allow_annotations=true", "csi-agent volume create " + name + " ... --allow-annotations", "csi-agent volume rm " + name} {
			if !strings.Contains(stderr, want) {
				t.Errorf("%s: the hook's error %q lacks %q", name, stderr, want)
			}
		}
		if got := preparedVolumes(t, h); len(got) != 0 {
			t.Errorf("%s: a refused annotation reached the agent: %v", name, got)
		}
	}

	code, stderr := runHook(t, agentSocket, plugin, map[string]string{MountsAnnotation: "held:/data"})
	if code != ExitProblem || !strings.Contains(stderr, "named volume held is held by 1 engine mount(s)") || !strings.Contains(stderr, "--share-engine-mounts") {
		t.Errorf("a volume an engine mount holds: exit %d, %q; want refused, naming --share-engine-mounts", code, stderr)
	}
	if got := preparedVolumes(t, h); len(got) != 0 {
		t.Errorf("a refused annotation reached the agent: %v", got)
	}

	code, stderr = runHook(t, agentSocket, plugin, map[string]string{MountsAnnotation: "open:/data;shared:/shared:ro"})
	if code != ExitOK {
		t.Fatalf("allowed volumes: exit %d, %s", code, stderr)
	}
	got := preparedVolumes(t, h)
	if len(got) != 1 || len(got[0]) != 2 || got[0][0].GetSource().GetCsiVolume().GetStaticProvisioning().GetVolumeId() != "open" ||
		got[0][0].GetSource().GetCsiVolume().GetStaticProvisioning().GetNodeStageSecrets()["token"].GetReference().GetName() != "ops" ||
		got[0][1].GetContainerPath() != "/shared" || got[0][1].GetMode() != agentv1.Volume_RO {
		t.Errorf("allowed volumes: prepared %v", got)
	}

	// The policy is the annotation's: an API caller's prepare --mounts
	// names any volume.
	vols, err := namedVolumes(ctx, plugin, "closed:/data;held:/held")
	if err != nil || len(vols) != 2 {
		t.Errorf("prepare --mounts: %v %v", vols, err)
	}
	if _, err := annotationVolumes(ctx, plugin, "closed:/data"); !errors.Is(err, ErrAnnotationRefused) {
		t.Errorf("annotationVolumes of a closed volume: %v, want ErrAnnotationRefused", err)
	}
}

// referenceVolume is a volumes annotation entry with a secret of the
// given type in field (node_stage_secrets or node_publish_secrets).
func referenceVolume(id, field, secret string) string {
	return `{"container_path":"/` + id + `","mode":"RW","source":{"type":"CSI_VOLUME","csi_volume":{"plugin_name":"loop","static_provisioning":{"volume_id":"` + id +
		`","volume_capability":{"mount":{},"access_mode":{"mode":"SINGLE_NODE_WRITER"}},"` + field + `":{"token":` + secret + `}}}}}`
}

const (
	refSecret   = `{"type":"REFERENCE","reference":{"name":"tenant-b","key":"password"}}`
	valueSecret = `{"type":"VALUE","value":{"data":"c2VjcmV0"}}`
)

// TestHookReferenceSecretPolicy: a REFERENCE secret anywhere in the
// volumes annotation (the agent would resolve it from its --secrets-dir)
// is refused unless the hook runs with --allow-reference-secrets, with an
// error naming the annotation, the volume's index and the secret; VALUE
// secrets, the annotation writer's own, are allowed.
func TestHookReferenceSecretPolicy(t *testing.T) {
	h, agentSocket := startHookAgent(t)
	plugin := filepath.Join(t.TempDir(), "none.sock") // not needed without the mounts annotation
	for _, field := range []string{"node_stage_secrets", "node_publish_secrets"} {
		ann := "[" + referenceVolume("v0", field, valueSecret) + "," + referenceVolume("v1", field, refSecret) + "]"
		code, stderr := runHook(t, agentSocket, plugin, map[string]string{VolumesAnnotation: ann})
		if code != ExitProblem {
			t.Errorf("%s: a REFERENCE secret: exit %d, want %d", field, code, ExitProblem)
		}
		for _, want := range []string{VolumesAnnotation, "volumes[1]", field + `["token"]`, "tenant-b/password", "REFERENCE", "--allow-reference-secrets"} {
			if !strings.Contains(stderr, want) {
				t.Errorf("%s: the hook's error %q lacks %q", field, stderr, want)
			}
		}
		if got := preparedVolumes(t, h); len(got) != 0 {
			t.Errorf("%s: a refused annotation reached the agent: %v", field, got)
		}

		code, stderr = runHook(t, agentSocket, plugin, map[string]string{VolumesAnnotation: ann}, "--allow-reference-secrets")
		if got := preparedVolumes(t, h); code != ExitOK || len(got) != 1 || len(got[0]) != 2 {
			t.Errorf("%s: with --allow-reference-secrets: exit %d (%s), prepared %v", field, code, stderr, got)
		}

		code, stderr = runHook(t, agentSocket, plugin, map[string]string{VolumesAnnotation: "[" + referenceVolume("v0", field, valueSecret) + "]"})
		got := preparedVolumes(t, h)
		if code != ExitOK || len(got) != 1 || len(got[0]) != 1 {
			t.Fatalf("%s: a VALUE secret: exit %d (%s), prepared %v", field, code, stderr, got)
		}
		static := got[0][0].GetSource().GetCsiVolume().GetStaticProvisioning()
		secrets := static.GetNodeStageSecrets()
		if field == "node_publish_secrets" {
			secrets = static.GetNodePublishSecrets()
		}
		if s := secrets["token"]; s.GetType() != agentv1.Secret_VALUE || string(s.GetValue().GetData()) != "secret" {
			t.Errorf("%s: the VALUE secret reached the agent as %v", field, s)
		}
	}
	// An explicit false is the default.
	code, _ := runHook(t, agentSocket, plugin, map[string]string{VolumesAnnotation: "[" + referenceVolume("v1", "node_stage_secrets", refSecret) + "]"}, "--allow-reference-secrets=false")
	if code != ExitProblem {
		t.Errorf("--allow-reference-secrets=false: exit %d, want refused", code)
	}
	if got := preparedVolumes(t, h); len(got) != 0 {
		t.Errorf("a refused annotation reached the agent: %v", got)
	}
}

// csi-agent volume create --allow-annotations [--share-engine-mounts]
// stores the options; without them a definition allows neither, and
// --share-engine-mounts alone is refused, naming the option it needs.
func TestVolumeCreateAnnotationFlags(t *testing.T) {
	plugin := policyPlugin(t)
	create := func(name string, flags ...string) (int, string) {
		var errOut bytes.Buffer
		e := &env{stdin: strings.NewReader(""), stdout: &bytes.Buffer{}, stderr: &errOut}
		args := append([]string{"volume", "create", name, "--plugin", "loop", "--volume-id", name, "--docker-plugin-socket", plugin}, flags...)
		return e.run(context.Background(), args), errOut.String()
	}
	for _, tc := range []struct {
		name         string
		flags        []string
		allow, share bool
	}{
		{"none", nil, false, false},
		{"allowed", []string{"--allow-annotations"}, true, false},
		{"shared", []string{"--allow-annotations", "--share-engine-mounts"}, true, true},
	} {
		if code, stderr := create(tc.name, tc.flags...); code != ExitOK {
			t.Fatalf("%s: exit %d: %s", tc.name, code, stderr)
		}
		d, err := dockerplugin.NewClient(plugin).Definition(context.Background(), tc.name)
		if err != nil || d.AllowAnnotations != tc.allow || d.ShareEngineMounts != tc.share {
			t.Errorf("%s: definition %+v, %v; want allow %v, share %v", tc.name, d, err, tc.allow, tc.share)
		}
	}
	if code, stderr := create("bad", "--share-engine-mounts"); code == ExitOK || !strings.Contains(stderr, "option share_engine_mounts needs allow_annotations=true") {
		t.Errorf("--share-engine-mounts alone: exit %d, %q", code, stderr)
	}
}

// policyPlugin serves the real volume plugin endpoint with a backend whose
// engine mounts succeed.
func policyPlugin(t *testing.T) string {
	sock, _ := servePlugin(t, &mountingBackend{containers: map[string]bool{}})
	return sock
}
