package dockerplugin

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"

	"github.com/docker/go-plugins-helpers/volume"

	"github.com/csiagent/csiagent/namedvol"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// TestProvision: a definition with size creates its backend volume
// (CreateVolume by the name's CSI name) and records the answer (id,
// context, topology); the same request again is no change and makes
// nothing; another one under the name is ErrExists. A creation cut after
// the plugin made the volume (its answer lost) leaves the intent: the
// volume cannot be mounted or removed (ErrCreating, state CREATING), and the create
// repeated finds the volume the plugin made, never a second. Removal keeps
// the backend volume unless asked (--delete) or the definition says so
// for engines (delete_on_remove).
func TestProvision(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, _ := newTestServer(t, b)
	opts := map[string]string{"plugin": "p", "size": "1GiB", "param.tier": "fast"}
	for range 2 {
		if err := s.Define(ctx, "new", opts, nil); err != nil {
			t.Fatal(err)
		}
	}
	d, err := s.cfg.Store.Get("new")
	if err != nil {
		t.Fatal(err)
	}
	if b.creates != 1 || d.VolumeID != "vol-1" || d.Creating() || d.VolumeContext["made-by"] != "fake" || d.Provision.Size != 1<<30 || d.Provision.Parameters["tier"] != "fast" {
		t.Fatalf("after two creates: %d volumes made, definition %+v %+v", b.creates, d, d.Provision)
	}
	if topo := d.Volume("/data", false).GetSource().GetCsiVolume().GetStaticProvisioning().GetAccessibleTopology(); len(topo) != 1 || topo[0].GetSegments()["zone"] != "a" {
		t.Errorf("the isolator's volume carries accessible topology %v, want zone=a", topo)
	}
	if err := s.Define(ctx, "new", map[string]string{"plugin": "p", "size": "2GiB"}, nil); !errors.Is(err, namedvol.ErrExists) {
		t.Errorf("another size under the name: %v, want ErrExists", err)
	}

	b.createFails = errors.New("the agent died before the answer")
	if err := s.Define(ctx, "cut", map[string]string{"plugin": "p", "size": "64MiB", "delete_on_remove": "true"}, nil); err == nil {
		t.Fatal("the cut creation succeeded")
	}
	if st, err := s.Status("cut"); err != nil || st.State != namedvol.Creating {
		t.Errorf("status of the cut creation: %+v, %v; want %s", st, err, namedvol.Creating)
	}
	if _, err := s.Mount(ctx, &volume.MountRequest{Name: "cut", ID: "m1"}); !errors.Is(err, namedvol.ErrCreating) {
		t.Errorf("mounting the cut creation: %v, want ErrCreating", err)
	}
	if err := s.Undefine(ctx, "cut", false, nil); !errors.Is(err, namedvol.ErrCreating) {
		t.Errorf("removing the cut creation (its volume made, its name only in the intent): %v, want ErrCreating", err)
	}
	b.createFails = nil
	if err := s.Define(ctx, "cut", map[string]string{"plugin": "p", "size": "64MiB", "delete_on_remove": "true"}, nil); err != nil {
		t.Fatal(err)
	}
	if b.creates != 2 {
		t.Errorf("%d volumes made for two names: the repeated create made another", b.creates)
	}

	if err := s.Undefine(ctx, "new", false, nil); err != nil {
		t.Fatal(err)
	}
	if err := s.Remove(ctx, &volume.RemoveRequest{Name: "cut"}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(b.deleted, []string{"vol-2"}) {
		t.Errorf("deleted %v: want only vol-2 (delete_on_remove; the other kept)", b.deleted)
	}
}

// TestProvisionRefusedLeavesNoIntent: a creation the plugin refused
// without making a volume (namedvol.ErrNotCreated: an option it rejects,
// no CREATE_DELETE_VOLUME) leaves no definition, and the name can be
// created again; before, its intent stayed, which neither a corrected
// create (ErrExists) nor a removal (ErrCreating) could get past. A
// refusal after an earlier attempt's intent keeps that intent (the
// earlier attempt may have made the volume).
func TestProvisionRefusedLeavesNoIntent(t *testing.T) {
	ctx := context.Background()
	b := &fakeBackend{containers: map[string]*statev1.PrepareRequest{}}
	s, _ := newTestServer(t, b)
	b.createRefused = fmt.Errorf("plugin p: CreateVolume: size too large: %w", namedvol.ErrNotCreated)
	if err := s.Define(ctx, "big", map[string]string{"plugin": "p", "size": "1TiB"}, nil); !errors.Is(err, namedvol.ErrNotCreated) {
		t.Fatalf("a refused creation: %v, want ErrNotCreated", err)
	}
	if _, err := s.Status("big"); !errors.Is(err, namedvol.ErrNotFound) {
		t.Fatalf("the name after a refused creation: %v, want ErrNotFound", err)
	}
	b.createRefused = nil
	if err := s.Define(ctx, "big", map[string]string{"plugin": "p", "size": "1GiB"}, nil); err != nil {
		t.Fatalf("a corrected creation: %v", err)
	}

	b.createFails = errors.New("the agent died before the answer")
	if err := s.Define(ctx, "cut", map[string]string{"plugin": "p", "size": "64MiB"}, nil); err == nil {
		t.Fatal("the cut creation succeeded")
	}
	b.createFails, b.createRefused = nil, fmt.Errorf("refused now: %w", namedvol.ErrNotCreated)
	if err := s.Define(ctx, "cut", map[string]string{"plugin": "p", "size": "64MiB"}, nil); err == nil {
		t.Fatal("the refused repeat succeeded")
	}
	if st, err := s.Status("cut"); err != nil || st.State != namedvol.Creating {
		t.Errorf("an earlier attempt's intent after a refused repeat: %+v, %v; want it kept, %s", st, err, namedvol.Creating)
	}
}
