package integration

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestSecretsStayInCheckpoints runs prepare, reclaim and cleanup with known
// secret values and then searches every log line and every file the agent
// and its plugin wrote: the values (plain or base64) may appear only in
// the 0600 checkpoints.
func TestSecretsStayInCheckpoints(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	data := h.dir("plugin-data")
	const stage, publish = "s3cr3t-stage-value", "s3cr3t-publish-value"
	h.writeConfig("s.json", testPluginConfig("vault", "--data-dir="+data, "--reclaim",
		"--require-stage-secret=key="+stage, "--require-publish-secret=token="+publish))
	var logs bytes.Buffer
	cfg := fastConfig(h)
	cfg.Logger = slogTo(&logs)
	h.start(cfg)
	spec := volumeSpec{plugin: "vault", id: "v", path: "d", stageSecrets: map[string]*agentv1.Secret{
		"key": {Type: agentv1.Secret_VALUE, Value: &agentv1.Secret_Value{Data: []byte(stage)}},
	}}
	v := spec.volume()
	v.Source.CsiVolume.StaticProvisioning.NodePublishSecrets = map[string]*agentv1.Secret{
		"token": {Type: agentv1.Secret_VALUE, Value: &agentv1.Secret_Value{Data: []byte(publish)}},
	}
	sb := h.dir("sb")
	if _, err := h.api().Prepare(t.Context(), &agentv1.PrepareRequest{ContainerId: "c", Sandbox: sb, Volumes: []*agentv1.Volume{v}}); err != nil {
		t.Fatal(err)
	}
	// While prepared, the checkpoint must hold them (a republish after a
	// reboot needs them) and be private.
	checkpoints, _ := filepath.Glob(filepath.Join(h.work, "csi", "vault", "default", "volumes", "*", "volume.state"))
	if len(checkpoints) != 1 {
		t.Fatalf("volume checkpoints: %v", checkpoints)
	}
	if st, err := os.Stat(checkpoints[0]); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("checkpoint mode %v, %v; want 0600", st.Mode(), err)
	}
	if msgs, err := h.reclaimNow(&agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}}); err != nil || msgs[len(msgs)-1].Summary.Failures != 0 {
		t.Fatalf("reclaim: %v, %v", msgs, err)
	}
	var leaks []string
	forbidden := []string{stage, publish, base64.StdEncoding.EncodeToString([]byte(stage)), base64.StdEncoding.EncodeToString([]byte(publish))}
	scan := func() {
		for _, root := range []string{h.work, h.run, h.extra} {
			_ = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
				if err != nil || !d.Type().IsRegular() || d.Name() == "volume.state" || d.Name() == "volumes.state" {
					return nil
				}
				if strings.HasPrefix(d.Name(), ".journal-") {
					// The work dir's journal holds the checkpoints'
					// versions until its checkpoint: as private.
					if st, err := os.Stat(path); err == nil && st.Mode().Perm() != 0o600 {
						leaks = append(leaks, fmt.Sprintf("%s (mode %v)", path, st.Mode()))
					}
					return nil
				}
				b, _ := os.ReadFile(path)
				for _, f := range forbidden {
					if bytes.Contains(b, []byte(f)) {
						leaks = append(leaks, path)
					}
				}
				return nil
			})
		}
	}
	scan()
	h.mustCleanup("c")
	scan()
	h.stop()
	for _, line := range strings.Split(logs.String(), "\n") {
		for _, f := range forbidden {
			if strings.Contains(line, f) {
				leaks = append(leaks, "agent log: "+line)
			}
		}
	}
	if len(leaks) > 0 {
		t.Errorf("secret values outside the checkpoints: %v", leaks)
	}
	if !strings.Contains(logs.String(), "node_stage_secrets") {
		t.Error("the log should show which secrets were passed (keys only)")
	}
}
