package loopplugin

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	vg "github.com/csiagent/csiagent/proto/volumegroup"
)

// groupIDs returns the group's member volume ids.
func groupIDs(g *vg.VolumeGroup) []string {
	var ids []string
	for _, v := range g.GetVolumes() {
		ids = append(ids, v.GetVolumeId())
	}
	return ids
}

// TestVolumeGroups walks the csi-addons VolumeGroup service through its
// calls and the error table: each step is one call with the code it must
// return and an optional check of the response. The steps share one
// plugin and run in order. No root needed: groups are pool records and
// volumes are sparse files.
func TestVolumeGroups(t *testing.T) {
	e := newEnv(t, slog.LevelWarn)
	ctx := context.Background()
	for _, v := range []string{"v1", "v2", "v3"} {
		e.createVolume(t, v, 16<<20)
	}
	tooMany := make([]string, MaxGroupVolumes+1)
	for i := range tooMany {
		tooMany[i] = fmt.Sprintf("vol-%d", i)
	}
	params := map[string]string{"tier": "gold"}

	type step struct {
		name  string
		call  func() (any, error)
		code  codes.Code
		check func(t *testing.T, resp any)
	}
	create := func(name string, p map[string]string) func() (any, error) {
		return func() (any, error) {
			return e.vg.CreateVolumeGroup(ctx, &vg.CreateVolumeGroupRequest{Name: name, Parameters: p})
		}
	}
	modify := func(id string, vols ...string) func() (any, error) {
		return func() (any, error) {
			return e.vg.ModifyVolumeGroupMembership(ctx, &vg.ModifyVolumeGroupMembershipRequest{VolumeGroupId: id, VolumeIds: vols})
		}
	}
	get := func(id string) func() (any, error) {
		return func() (any, error) {
			return e.vg.ControllerGetVolumeGroup(ctx, &vg.ControllerGetVolumeGroupRequest{VolumeGroupId: id})
		}
	}
	del := func(id string) func() (any, error) {
		return func() (any, error) {
			return e.vg.DeleteVolumeGroup(ctx, &vg.DeleteVolumeGroupRequest{VolumeGroupId: id})
		}
	}
	list := func(max int32, token string) func() (any, error) {
		return func() (any, error) {
			return e.vg.ListVolumeGroups(ctx, &vg.ListVolumeGroupsRequest{MaxEntries: max, StartingToken: token})
		}
	}
	deleteVolume := func(id string) func() (any, error) {
		return func() (any, error) {
			return e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id})
		}
	}
	members := func(want ...string) func(t *testing.T, resp any) {
		return func(t *testing.T, resp any) {
			var g *vg.VolumeGroup
			switch r := resp.(type) {
			case *vg.CreateVolumeGroupResponse:
				g = r.GetVolumeGroup()
			case *vg.ModifyVolumeGroupMembershipResponse:
				g = r.GetVolumeGroup()
			case *vg.ControllerGetVolumeGroupResponse:
				g = r.GetVolumeGroup()
			}
			if got := groupIDs(g); !slices.Equal(got, want) {
				t.Errorf("members = %v, want %v", got, want)
			}
			if g.GetVolumeGroupId() != "g1" || g.GetVolumeGroupContext()["tier"] != "gold" {
				t.Errorf("group = %v", g)
			}
			for _, v := range g.GetVolumes() {
				if v.GetCapacityBytes() != 16<<20 {
					t.Errorf("volume %s capacity %d", v.GetVolumeId(), v.GetCapacityBytes())
				}
			}
		}
	}
	var token string // carried between the list steps
	page := func(want []string, last bool) func(t *testing.T, resp any) {
		return func(t *testing.T, resp any) {
			r := resp.(*vg.ListVolumeGroupsResponse)
			var got []string
			for _, en := range r.GetEntries() {
				got = append(got, en.GetVolumeGroup().GetVolumeGroupId())
			}
			if !slices.Equal(got, want) || (r.GetNextToken() == "") != last {
				t.Errorf("page = %v next %q, want %v (last %v)", got, r.GetNextToken(), want, last)
			}
			token = r.GetNextToken()
		}
	}

	for _, s := range []step{
		{name: "create without name", call: create("", nil), code: codes.InvalidArgument},
		{name: "create with a path as name", call: create("a/b", nil), code: codes.InvalidArgument},
		{name: "create", call: create("g1", params), check: members()},
		{name: "create again", call: create("g1", params), check: members()},
		{name: "create again, other parameters", call: create("g1", map[string]string{"tier": "bronze"}), code: codes.AlreadyExists},
		{name: "get without id", call: get(""), code: codes.InvalidArgument},
		{name: "get unknown", call: get("nope"), code: codes.NotFound},
		{name: "get", call: get("g1"), check: members()},
		{name: "modify without id", call: modify("", "v1"), code: codes.InvalidArgument},
		{name: "modify unknown group", call: modify("nope", "v1"), code: codes.NotFound},
		{name: "modify with unknown volume", call: modify("g1", "v1", "ghost"), code: codes.NotFound},
		{name: "modify with invalid volume id", call: modify("g1", "../v1"), code: codes.InvalidArgument},
		{name: "modify over the limit", call: modify("g1", tooMany...), code: codes.ResourceExhausted},
		{name: "add members", call: modify("g1", "v2", "v1", "v1"), check: members("v1", "v2")},
		{name: "add members again", call: modify("g1", "v1", "v2"), check: members("v1", "v2")},
		{name: "get members", call: get("g1"), check: members("v1", "v2")},
		{name: "delete a member volume", call: deleteVolume("v1"), code: codes.FailedPrecondition},
		{name: "create g2", call: create("g2", nil)},
		{name: "member of another group", call: modify("g2", "v1"), code: codes.InvalidArgument},
		{name: "create g3", call: create("g3", nil)},
		{name: "create g4", call: create("g4", nil)},
		{name: "create g5", call: create("g5", nil)},
		{name: "list negative max", call: list(-1, ""), code: codes.InvalidArgument},
		{name: "list bad token", call: list(2, "bogus"), code: codes.Aborted},
		{name: "list all", call: list(0, ""), check: page([]string{"g1", "g2", "g3", "g4", "g5"}, true)},
		{name: "list page 1", call: list(2, ""), check: page([]string{"g1", "g2"}, false)},
		{name: "list page 2", call: func() (any, error) { return list(2, token)() }, check: page([]string{"g3", "g4"}, false)},
		{name: "delete g3 while paging", call: del("g3")},
		{name: "list page 3", call: func() (any, error) { return list(2, token)() }, check: page([]string{"g5"}, true)},
		{name: "remove a member", call: modify("g1", "v1"), check: members("v1")},
		{name: "delete the former member", call: deleteVolume("v2")},
		{name: "delete without id", call: del(""), code: codes.InvalidArgument},
		{name: "delete unknown", call: del("nope")},
		{name: "delete", call: del("g1"), check: func(t *testing.T, _ any) {
			if _, err := os.Stat(filepath.Join(e.pool, "v1.img")); !os.IsNotExist(err) {
				t.Errorf("member volume v1 not deleted with its group: %v", err)
			}
			if _, err := os.Stat(filepath.Join(e.pool, "v3.img")); err != nil {
				t.Errorf("non-member v3 deleted: %v", err)
			}
		}},
		{name: "get deleted", call: get("g1"), code: codes.NotFound},
		{name: "delete again", call: del("g1")},
	} {
		t.Run(s.name, func(t *testing.T) {
			resp, err := s.call()
			if got := status.Code(err); got != s.code {
				t.Fatalf("code = %s (%v), want %s", got, err, s.code)
			}
			if s.check != nil && err == nil {
				s.check(t, resp)
			}
		})
	}

	t.Run("records survive a restart", func(t *testing.T) {
		if _, err := e.vg.ModifyVolumeGroupMembership(ctx, &vg.ModifyVolumeGroupMembershipRequest{VolumeGroupId: "g2", VolumeIds: []string{"v3"}}); err != nil {
			t.Fatal(err)
		}
		p2, err := New(Config{Pool: e.pool, NodeID: "n", Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		resp, err := (&volumeGroupServer{p: p2}).ControllerGetVolumeGroup(ctx, &vg.ControllerGetVolumeGroupRequest{VolumeGroupId: "g2"})
		if err != nil || !slices.Equal(groupIDs(resp.GetVolumeGroup()), []string{"v3"}) {
			t.Fatalf("after restart: %v, %v", resp, err)
		}
	})
}

// TestDeleteVolumeGroupInUse: a group with a staged member is in use;
// nothing is deleted until it is unstaged.
func TestDeleteVolumeGroupInUse(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelWarn)
	ctx := context.Background()
	a, b := e.createVolume(t, "a", 16<<20), e.createVolume(t, "b", 16<<20)
	if _, err := e.vg.CreateVolumeGroup(ctx, &vg.CreateVolumeGroupRequest{Name: "g"}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.vg.ModifyVolumeGroupMembership(ctx, &vg.ModifyVolumeGroupMembershipRequest{VolumeGroupId: "g", VolumeIds: []string{a, b}}); err != nil {
		t.Fatal(err)
	}
	staging := filepath.Join(e.dir, "staging")
	e.stage(t, b, staging, mountCap("", snw))
	_, err := e.vg.DeleteVolumeGroup(ctx, &vg.DeleteVolumeGroupRequest{VolumeGroupId: "g"})
	wantCode(t, err, codes.FailedPrecondition)
	for _, v := range []string{a, b} {
		if _, err := os.Stat(filepath.Join(e.pool, v+".img")); err != nil {
			t.Errorf("volume %s deleted by a refused group delete: %v", v, err)
		}
	}
	e.unstage(t, b, staging)
	if _, err := e.vg.DeleteVolumeGroup(ctx, &vg.DeleteVolumeGroupRequest{VolumeGroupId: "g"}); err != nil {
		t.Fatal(err)
	}
	vols, err := e.p.pool.List()
	if err != nil || len(vols) != 0 {
		t.Errorf("volumes left: %v, %v", vols, err)
	}
}
