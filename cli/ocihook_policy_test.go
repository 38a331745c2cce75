package cli

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// runHook runs oci-hook create-runtime on a container with annotations,
// against the fake agent; extra are more flags.
func runHook(t *testing.T, agentSocket string, annotations map[string]string, extra ...string) (int, string) {
	t.Helper()
	return runHookStage(t, "create-runtime", agentSocket, annotations, append([]string{"--timeout", "20s"}, extra...)...)
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

// TestHookMountsAnnotation: the hook sends the mounts annotation's names
// to the agent as named mounts marked as an annotation's (the agent
// resolves them and applies the annotation policy:
// dockerplugin.TestResolveAnnotationPolicy), next to the volumes
// annotation's volumes; a malformed entry is refused before the agent,
// naming it.
func TestHookMountsAnnotation(t *testing.T) {
	h, agentSocket := startHookAgent(t)
	code, stderr := runHook(t, agentSocket, map[string]string{MountsAnnotation: "open:/data;shared:/shared:ro",
		VolumesAnnotation: "[" + referenceVolume("v0", "node_stage_secrets", valueSecret) + "]"})
	if code != ExitOK {
		t.Fatalf("exit %d, %s", code, stderr)
	}
	reqs := h.take()
	if len(reqs) != 1 {
		t.Fatalf("the agent got %v", reqs)
	}
	req := reqs[0].(*agentv1.PrepareRequest)
	want := []*agentv1.NamedMount{{Name: "open", ContainerPath: "/data"}, {Name: "shared", ContainerPath: "/shared", Readonly: true}}
	if !req.GetNamedMountsFromAnnotation() || len(req.GetVolumes()) != 1 || fmt.Sprint(req.GetNamedMounts()) != fmt.Sprint(want) {
		t.Errorf("prepare request %v; want the two named mounts, from an annotation, and one volume", req)
	}

	code, stderr = runHook(t, agentSocket, map[string]string{MountsAnnotation: "open:/data;nopath"})
	if code != ExitProblem || !strings.Contains(stderr, MountsAnnotation) || !strings.Contains(stderr, `mount 2 "nopath": expected NAME:PATH`) {
		t.Errorf("a malformed entry: exit %d, %q", code, stderr)
	}
	if got := h.take(); len(got) != 0 {
		t.Errorf("a malformed annotation reached the agent: %v", got)
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
	for _, field := range []string{"node_stage_secrets", "node_publish_secrets"} {
		ann := "[" + referenceVolume("v0", field, valueSecret) + "," + referenceVolume("v1", field, refSecret) + "]"
		code, stderr := runHook(t, agentSocket, map[string]string{VolumesAnnotation: ann})
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

		code, stderr = runHook(t, agentSocket, map[string]string{VolumesAnnotation: ann}, "--allow-reference-secrets")
		if got := preparedVolumes(t, h); code != ExitOK || len(got) != 1 || len(got[0]) != 2 {
			t.Errorf("%s: with --allow-reference-secrets: exit %d (%s), prepared %v", field, code, stderr, got)
		}

		code, stderr = runHook(t, agentSocket, map[string]string{VolumesAnnotation: "[" + referenceVolume("v0", field, valueSecret) + "]"})
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
	code, _ := runHook(t, agentSocket, map[string]string{VolumesAnnotation: "[" + referenceVolume("v1", "node_stage_secrets", refSecret) + "]"}, "--allow-reference-secrets=false")
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
	needRootCaller(t)
	sock, store := serveNamed(t, noBackend{})
	create := func(name string, flags ...string) (int, string) {
		var errOut bytes.Buffer
		e := &env{stdin: strings.NewReader(""), stdout: &bytes.Buffer{}, stderr: &errOut}
		args := append([]string{"volume", "create", name, "--plugin", "loop", "--volume-id", name, "--api-socket", sock}, flags...)
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
		d, err := store.Get(tc.name)
		if err != nil || d.AllowAnnotations != tc.allow || d.ShareEngineMounts != tc.share {
			t.Errorf("%s: definition %+v, %v; want allow %v, share %v", tc.name, d, err, tc.allow, tc.share)
		}
	}
	if code, stderr := create("bad", "--share-engine-mounts"); code == ExitOK || !strings.Contains(stderr, "option share_engine_mounts needs allow_annotations=true") {
		t.Errorf("--share-engine-mounts alone: exit %d, %q", code, stderr)
	}
}
