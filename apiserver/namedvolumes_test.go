package apiserver

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/peer"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// failingNamed fails every call with err; Page returns one volume.
type failingNamed struct{ err error }

func (f failingNamed) Define(context.Context, string, map[string]string, map[string]string) error {
	return f.err
}
func (f failingNamed) Undefine(context.Context, string, bool, map[string]string) error { return f.err }
func (f failingNamed) Status(string) (namedvol.Status, error)                          { return namedvol.Status{}, f.err }
func (f failingNamed) Page(after string, max int) ([]namedvol.Status, string, error) {
	d := &namedvol.Definition{Name: "data", Plugin: "loop", VolumeID: "vol1", AllowAnnotations: true}
	return []namedvol.Status{{Definition: d, State: "PUBLISHED", Containers: 2, EngineMounts: []string{"m1"}, Mountpoint: "/x"}}, fmt.Sprint(after, max), f.err
}
func (f failingNamed) Reconcile(context.Context, string, []string) ([]string, map[string]string) {
	return nil, nil
}
func (f failingNamed) Resolve(context.Context, []namedvol.Mount, bool, func([]*statev1.Volume) error) error {
	return f.err
}

// TestNamedVolumeCodes: the named volumes' errors reach API callers with
// their codes, and a volume's status with every field.
func TestNamedVolumeCodes(t *testing.T) {
	ctx := peer.NewContext(context.Background(), &peer.Peer{AuthInfo: peerInfo{cred: &unix.Ucred{}}}) // root
	for _, tc := range []struct {
		err  error
		want codes.Code
	}{
		{fmt.Errorf("%w: name", namedvol.ErrInvalid), codes.InvalidArgument},
		{fmt.Errorf("%w: data", namedvol.ErrNotFound), codes.NotFound},
		{fmt.Errorf("%w: data", namedvol.ErrExists), codes.AlreadyExists},
		{fmt.Errorf("in use: %w", namedvol.ErrInUse), codes.FailedPrecondition},
		{fmt.Errorf("mount 1: %w", namedvol.ErrAnnotationRefused), codes.PermissionDenied},
		{context.DeadlineExceeded, codes.DeadlineExceeded},
	} {
		s := New(Config{Named: failingNamed{tc.err}})
		_, err1 := s.CreateNamedVolume(ctx, &agentv1.CreateNamedVolumeRequest{Name: "data"})
		_, err2 := s.RemoveNamedVolume(ctx, &agentv1.RemoveNamedVolumeRequest{Name: "data"})
		_, err3 := s.GetNamedVolume(ctx, &agentv1.GetNamedVolumeRequest{Name: "data"})
		_, err4 := s.ListNamedVolumes(ctx, &agentv1.ListNamedVolumesRequest{})
		for i, err := range []error{err1, err2, err3, err4} {
			if status.Code(err) != tc.want || status.Convert(err).Message() != tc.err.Error() {
				t.Errorf("%v: call %d: %v, want %v with the message", tc.err, i+1, err, tc.want)
			}
		}
	}
	s := New(Config{Named: failingNamed{}})
	resp, err := s.ListNamedVolumes(ctx, &agentv1.ListNamedVolumesRequest{StartingAfter: "a"})
	var v *agentv1.NamedVolume
	if len(resp.GetVolumes()) == 1 {
		v = resp.GetVolumes()[0]
	}
	if err != nil || v == nil || resp.GetNext() != fmt.Sprint("a", namedPageSize) || v.GetName() != "data" || v.GetOptions()[namedvol.KeyVolumeID] != "vol1" ||
		v.GetOptions()[namedvol.KeyAllowAnnotations] != "true" || v.GetState() != "PUBLISHED" || v.GetContainers() != 2 ||
		len(v.GetEngineMountIds()) != 1 || v.GetEngineMountIds()[0] != "m1" || v.GetMountpoint() != "/x" {
		t.Errorf("ListNamedVolumes = %v, %v; want the volume with every field, and the default page of %d", resp, err, namedPageSize)
	}
}

// ReconcileEngineMounts needs an engine, and "other" means the mounts of
// no known engine.
func TestReconcileEngineMountsNeedsAnEngine(t *testing.T) {
	for name, want := range map[string]string{"docker": "docker", "podman": "podman", "other": ""} {
		if got, err := engineOf(name); err != nil || got != want {
			t.Errorf("engine %s: %q, %v; want %q", name, got, err, want)
		}
	}
	s := New(Config{Named: failingNamed{}})
	for _, engine := range []string{"", "containerd"} {
		if _, err := s.ReconcileEngineMounts(context.Background(), &agentv1.ReconcileEngineMountsRequest{Engine: engine}); status.Code(err) != codes.InvalidArgument && status.Code(err) != codes.Unauthenticated {
			t.Errorf("engine %q: %v", engine, err)
		}
		if _, err := engineOf(engine); status.Code(err) != codes.InvalidArgument {
			t.Errorf("engine %q: %v, want InvalidArgument", engine, err)
		}
	}
}

// A member may not define or remove named volumes (it could point a name
// others use at another volume, secrets or owner).
func TestNamedVolumesRootOnly(t *testing.T) {
	s := New(Config{Named: failingNamed{namedvol.ErrNotFound}})
	member := peer.NewContext(context.Background(), &peer.Peer{AuthInfo: peerInfo{cred: memberCred}})
	_, err1 := s.CreateNamedVolume(member, &agentv1.CreateNamedVolumeRequest{Name: "data"})
	_, err2 := s.RemoveNamedVolume(member, &agentv1.RemoveNamedVolumeRequest{Name: "data"})
	for i, err := range []error{err1, err2} {
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "only root may call it") {
			t.Errorf("call %d by a member: %v", i+1, err)
		}
	}
	if _, err := s.GetNamedVolume(member, &agentv1.GetNamedVolumeRequest{Name: "data"}); status.Code(err) != codes.NotFound {
		t.Errorf("a member's GetNamedVolume: %v; want it asked (NotFound here)", err)
	}
}
