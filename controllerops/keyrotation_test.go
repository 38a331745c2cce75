package controllerops

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	ekr "github.com/csiagent/csiagent/proto/encryptionkeyrotation"
)

// fakeRotator answers EncryptionKeyRotate with the scripted codes, then OK.
type fakeRotator struct {
	ekr.UnimplementedEncryptionKeyRotationControllerServer
	mu     sync.Mutex
	script []codes.Code
	reqs   []*ekr.EncryptionKeyRotateRequest
}

func (f *fakeRotator) EncryptionKeyRotate(_ context.Context, req *ekr.EncryptionKeyRotateRequest) (*ekr.EncryptionKeyRotateResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reqs = append(f.reqs, req)
	if len(f.script) > 0 {
		c := f.script[0]
		f.script = f.script[1:]
		return nil, status.Error(c, "scripted")
	}
	return &ekr.EncryptionKeyRotateResponse{}, nil
}

// fakePlugins serves one node connection and one published volume.
type fakePlugins struct {
	conn *grpc.ClientConn
}

func (p fakePlugins) ControllerConn(context.Context, string, string) (*grpc.ClientConn, error) {
	return nil, status.Error(codes.FailedPrecondition, "no controller")
}
func (p fakePlugins) NodeConn(context.Context, string, string) (*grpc.ClientConn, error) {
	return p.conn, nil
}
func (p fakePlugins) Offers(string, string) bool { return true }
func (p fakePlugins) LogDir(string) string       { return "" }
func (p fakePlugins) Published(plugin, id string) (PublishedVolume, bool) {
	return PublishedVolume{TargetPath: "/var/lib/target/" + id}, plugin == "p" && id == "v1"
}
func (p fakePlugins) NodeCapabilities(string) []string { return []string{"EXPAND_VOLUME"} }
func (p fakePlugins) NamedVolume(string) (string, string, error) {
	return "", "", errors.New("no named volumes")
}
func (p fakePlugins) ContainerVolumes(string) ([]VolumeRef, bool) { return nil, false }
func (p fakePlugins) Publishing(id string) []string {
	if id == "v1" {
		return []string{"p"}
	}
	return nil
}

func serveUnix(t *testing.T, register func(*grpc.Server)) *grpc.ClientConn {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	register(srv)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestRotateKey: the published volume's path is sent; Aborted is retried
// (the spec's table), NotFound for a volume not published is refused
// before any call, InvalidArgument is not retried.
func TestRotateKey(t *testing.T) {
	rot := &fakeRotator{script: []codes.Code{codes.Aborted}}
	node := serveUnix(t, func(s *grpc.Server) { ekr.RegisterEncryptionKeyRotationControllerServer(s, rot) })
	api := agentv1.NewControllerClient(serveUnix(t, func(s *grpc.Server) {
		agentv1.RegisterControllerServer(s, New(Config{Plugins: fakePlugins{node}, Log: slog.New(slog.DiscardHandler)}))
	}))
	retry := &agentv1.RetryPolicy{InitialBackoff: durationpb.New(10 * time.Millisecond)}
	run := func(req *agentv1.RotateKeyRequest) (progress int, err error) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		stream, err := api.RotateKey(ctx, req)
		if err != nil {
			return 0, err
		}
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return progress, nil
			}
			if err != nil {
				return progress, err
			}
			if m.GetProgress() != nil {
				progress++
			}
		}
	}
	n, err := run(&agentv1.RotateKeyRequest{PluginName: "p", VolumeId: "v1", Secrets: map[string]string{"k": "v"}, Retry: retry})
	if err != nil || n != 1 || len(rot.reqs) != 2 || rot.reqs[1].GetVolumePath() != "/var/lib/target/v1" || rot.reqs[1].GetSecrets()["k"] != "v" {
		t.Fatalf("rotate: %d progress, %v; plugin got %v", n, err, rot.reqs)
	}
	if _, err := run(&agentv1.RotateKeyRequest{PluginName: "p", VolumeId: "v2", Retry: retry}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("a volume not published here: %v, want FailedPrecondition", err)
	}
	rot.script = []codes.Code{codes.InvalidArgument}
	if _, err := run(&agentv1.RotateKeyRequest{PluginName: "p", VolumeId: "v1", Retry: retry}); status.Code(err) != codes.InvalidArgument || len(rot.reqs) != 3 {
		t.Errorf("InvalidArgument: %v after %d calls, want not retried", err, len(rot.reqs))
	}
}

// fakeFleet is FleetLocks: it reports the lock held by node-b once (as a
// lock another node held would), or fails with err.
type fakeFleet struct {
	mu               sync.Mutex
	err              error
	locked, unlocked []string
}

func (f *fakeFleet) Lock(ctx context.Context, kind, id string, waiting func(holder string)) (context.Context, func(), error) {
	if f.err != nil {
		return nil, nil, f.err
	}
	waiting("node-b")
	f.mu.Lock()
	f.locked = append(f.locked, kind+"/"+id)
	f.mu.Unlock()
	return ctx, func() {
		f.mu.Lock()
		f.unlocked = append(f.unlocked, kind+"/"+id)
		f.mu.Unlock()
	}, nil
}

// TestFleetLock: in a fleet, an operation also takes the object's
// fleet-wide lock (its kind naming the plugin), reports the wait with the
// holding node, calls the plugin holding it and releases it; a fleet
// whose store does not answer fails the operation with its code before
// any plugin call.
func TestFleetLock(t *testing.T) {
	rot := &fakeRotator{}
	node := serveUnix(t, func(s *grpc.Server) { ekr.RegisterEncryptionKeyRotationControllerServer(s, rot) })
	fleet := &fakeFleet{}
	api := agentv1.NewControllerClient(serveUnix(t, func(s *grpc.Server) {
		agentv1.RegisterControllerServer(s, New(Config{Plugins: fakePlugins{node}, Log: slog.New(slog.DiscardHandler), Fleet: fleet}))
	}))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	run := func() (waits []string, err error) {
		stream, err := api.RotateKey(ctx, &agentv1.RotateKeyRequest{PluginName: "p", VolumeId: "v1"})
		if err != nil {
			return nil, err
		}
		for {
			m, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return waits, nil
			}
			if err != nil {
				return waits, err
			}
			if m.GetProgress().GetKind() == agentv1.Progress_WAITING {
				waits = append(waits, m.GetProgress().GetMessage())
			}
		}
	}
	waits, err := run()
	if err != nil || len(waits) != 1 || !strings.Contains(waits[0], "node node-b") || len(rot.reqs) != 1 {
		t.Fatalf("rotate in a fleet: %v, waits %q, %d plugin calls", err, waits, len(rot.reqs))
	}
	if !slices.Equal(fleet.locked, []string{"p volume/v1"}) || !slices.Equal(fleet.unlocked, fleet.locked) {
		t.Fatalf("fleet locks taken %q, released %q; want p volume/v1 once each", fleet.locked, fleet.unlocked)
	}
	fleet.err = status.Error(codes.Unavailable, "etcd does not answer")
	if _, err := run(); status.Code(err) != codes.Unavailable || len(rot.reqs) != 1 {
		t.Fatalf("fleet store down: %v after %d plugin calls, want Unavailable and no call", err, len(rot.reqs))
	}
}
