package isolator

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// A Cleanup is acknowledged only once its intent (the CLEANING record, or
// the record's removal that supersedes it) is durable: it does not return
// while the first commit round is held back.
func TestCleanupWaitsForItsIntentToBeDurable(t *testing.T) {
	work := t.TempDir()
	req := &agentv1.PrepareRequest{}
	if err := proto.Unmarshal(seedRequest(nil), req); err != nil {
		t.Fatal(err)
	}
	cdir := filepath.Join(work, "isolators", "volume", "csi", "c1")
	vdir := filepath.Join(work, "csi", "loop", "default", "volumes", "vol-1")
	mounts := filepath.Join(work, "csi", "loop", "default", "mounts", "vol-1")
	for _, d := range []string{cdir, vdir, filepath.Join(mounts, "staging")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	seed := &Isolator{}
	if _, err := seed.writeCheckpoint(cdir, containerStateFile, &statev1.ContainerCheckpoint{ContainerId: "c1", Request: req, Phase: agentv1.ContainerStatus_PREPARED}); err != nil {
		t.Fatal(err)
	}
	if _, err := seed.writeCheckpoint(vdir, volumeStateFile, &statev1.VolumeCheckpoint{
		State: stNodeReady, PluginName: "loop", Users: []string{"c1"}, BootId: "b",
		StaticProvisioning: req.GetVolumes()[0].GetSource().GetCsiVolume().GetStaticProvisioning(),
		StagingPath:        filepath.Join(mounts, "staging"), TargetPath: filepath.Join(mounts, "target"),
	}); err != nil {
		t.Fatal(err)
	}

	// The first commit round's first fsync waits for Cleanup to return,
	// up to a bound: Cleanup returning meanwhile is the failure.
	returned := make(chan struct{})
	var first sync.Once
	var early atomic.Bool
	iso, err := New(Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b", Logger: slog.New(slog.DiscardHandler),
		Fsync: func(path string) error {
			first.Do(func() {
				select {
				case <-returned:
					early.Store(true)
				case <-time.After(500 * time.Millisecond):
				}
			})
			f, err := os.Open(path)
			if err != nil {
				return err
			}
			defer f.Close()
			return f.Sync()
		}})
	if err != nil {
		t.Fatal(err)
	}
	err = iso.Cleanup(context.Background(), "c1", false)
	close(returned)
	if err != nil {
		t.Fatal(err)
	}
	if err := iso.commit.Sync(context.Background()); err != nil {
		t.Fatal(err)
	}
	if early.Load() {
		t.Fatal("Cleanup returned while its CLEANING record was not yet durable")
	}
	if _, err := os.Stat(filepath.Join(cdir, containerStateFile)); !os.IsNotExist(err) {
		t.Errorf("container record still on disk after Cleanup: %v", err)
	}
	if len(iso.ListVolumes()) != 0 || len(iso.ListContainers()) != 0 {
		t.Errorf("still tracked after Cleanup: %v %v", iso.ListVolumes(), iso.ListContainers())
	}
}
