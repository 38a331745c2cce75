package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// noBackend is an isolator with no containers and no volumes, where every
// plugin type is configured.
type noBackend struct{}

func (noBackend) Prepare(context.Context, *statev1.PrepareRequest) ([]*statev1.ContainerMount, error) {
	return nil, errors.New("not in this test")
}
func (noBackend) Cleanup(context.Context, string) error    { return nil }
func (noBackend) ListContainers() []isolator.ContainerInfo { return nil }
func (noBackend) ListVolumes() []isolator.VolumeInfo       { return nil }
func (noBackend) CheckPlugin(string) error                 { return nil }
func (noBackend) CreateVolume(context.Context, *namedvol.Definition, map[string]string) error {
	return errors.New("not in this test")
}
func (noBackend) DeleteVolume(context.Context, string, string, map[string]string) error {
	return errors.New("not in this test")
}

// serveNamed serves the agent API's named volume calls over a real
// dockerplugin.Server with backend, on a socket of its own, and returns
// the socket and the server's store.
func serveNamed(t *testing.T, backend dockerplugin.Backend) (string, *namedvol.Store) {
	t.Helper()
	dir, err := os.MkdirTemp("", "csp") // short: a socket path has a limit
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	commit, err := atomicfile.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	commit.Fsync = func(string) error { return nil } // durability is not tested here
	store, err := namedvol.OpenStore(commit, filepath.Join(dir, "named"))
	if err != nil {
		t.Fatal(err)
	}
	named, err := dockerplugin.New(dockerplugin.Config{Store: store, Backend: backend, Dir: filepath.Join(dir, "engine"), Commit: commit})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "a.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(apiserver.PeerCredentials{}))
	agentv1.RegisterAgentServer(srv, apiserver.New(apiserver.Config{Named: named, OnVolumesChanged: func() {}}))
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	return sock, store
}

// volume ls lists 10,000 named volumes (several MiB of answers).
func TestVolumeLsListsTenThousandVolumes(t *testing.T) {
	if testing.Short() {
		t.Skip("defines 10,000 volumes (tens of seconds under -race): skipped under -short; make test runs it")
	}
	const n = 10000
	sock, store := serveNamed(t, noBackend{})
	names := make(chan string)
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range names {
				d := &namedvol.Definition{Name: name, Plugin: "loop.csi.csiagent.io", VolumeID: name,
					VolumeContext: map[string]string{"zone": strings.Repeat("z", 200)}}
				if err := store.Create(context.Background(), d); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	for i := range n {
		names <- fmt.Sprintf("vol-%05d", i)
	}
	close(names)
	wg.Wait()
	code, out, errOut := run(t, "volume", "ls", "--api-socket", sock)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if code != ExitOK || len(lines) != n+1 {
		t.Fatalf("volume ls: exit %d, %d lines, stderr %q; want %d volumes", code, len(lines), errOut, n)
	}
	if !strings.HasPrefix(lines[1], "vol-00000 ") || !strings.HasPrefix(lines[n], "vol-09999 ") || !strings.Contains(lines[n], "loop.csi.csiagent.io") {
		t.Errorf("volume ls: first and last volumes:\n%s\n%s", lines[1], lines[n])
	}
	code, out, errOut = run(t, "volume", "ls", "--api-socket", sock, "--output", "json")
	var list struct{ Volumes []struct{ Name string } }
	err := json.Unmarshal([]byte(out), &list)
	vols := list.Volumes
	if code != ExitOK || err != nil || len(vols) != n {
		t.Fatalf("volume ls --output json: exit %d, %d volumes, %v, stderr %q", code, len(vols), err, errOut)
	}
	for i, v := range vols {
		if want := fmt.Sprintf("vol-%05d", i); v.Name != want {
			t.Fatalf("volume %d is %s, want %s", i, v.Name, want)
		}
	}
}

// volume create refuses a definition over the cap, naming it.
func TestVolumeCreateRefusesDefinitionOverTheCap(t *testing.T) {
	needRootCaller(t)
	sock, _ := serveNamed(t, noBackend{})
	args := []string{"volume", "create", "big", "--api-socket", sock, "--plugin", "p", "--volume-id", "v"}
	for k := range 70 {
		args = append(args, "--context", fmt.Sprintf("k%d=%s", k, strings.Repeat("x", 1000)))
	}
	code, _, errOut := run(t, args...)
	if code != ExitProblem || !strings.Contains(errOut, "more than the cap of 65536 bytes") {
		t.Errorf("volume create of a 70 KB definition: exit %d, %q; want an error naming the 65536-byte cap", code, errOut)
	}
	if code, _, errOut := run(t, "volume", "inspect", "big", "--api-socket", sock); code != ExitProblem || !strings.Contains(errOut, "no such named volume") {
		t.Errorf("volume inspect of the refused volume: exit %d, %q", code, errOut)
	}
}
