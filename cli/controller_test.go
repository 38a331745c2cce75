package cli

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/volumegroup"
)

// fakeAgent is the agent's Controller API for CLI tests: it records each
// request and answers with the scripted replies, then the scripted error.
type fakeAgent struct {
	agentv1.UnimplementedControllerServer
	mu      sync.Mutex
	method  string
	req     proto.Message
	replies []proto.Message
	err     error
}

func (f *fakeAgent) set(err error, replies ...proto.Message) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.method, f.req, f.replies, f.err = "", nil, replies, err
}

func (f *fakeAgent) last() (string, proto.Message) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.method, f.req
}

// serve records req and plays the script on stream.
func serve[R any](f *fakeAgent, method string, req proto.Message, stream grpc.ServerStreamingServer[R]) error {
	f.mu.Lock()
	f.method, f.req = method, proto.Clone(req)
	replies, err := f.replies, f.err
	f.mu.Unlock()
	for _, r := range replies {
		if err := stream.Send(any(r).(*R)); err != nil {
			return err
		}
	}
	return err
}

func (f *fakeAgent) CreateVolumeGroup(r *agentv1.CreateVolumeGroupRequest, s grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	return serve(f, "CreateVolumeGroup", r, s)
}

func (f *fakeAgent) ModifyVolumeGroup(r *agentv1.ModifyVolumeGroupRequest, s grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	return serve(f, "ModifyVolumeGroup", r, s)
}

func (f *fakeAgent) DeleteVolumeGroup(r *agentv1.DeleteVolumeGroupRequest, s grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	return serve(f, "DeleteVolumeGroup", r, s)
}

func (f *fakeAgent) GetVolumeGroup(r *agentv1.GetVolumeGroupRequest, s grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	return serve(f, "GetVolumeGroup", r, s)
}

func (f *fakeAgent) ListVolumeGroups(r *agentv1.ListVolumeGroupsRequest, s grpc.ServerStreamingServer[agentv1.ListVolumeGroupsReply]) error {
	return serve(f, "ListVolumeGroups", r, s)
}

func (f *fakeAgent) EnableReplication(r *agentv1.ReplicationRequest, s grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return serve(f, "EnableReplication", r, s)
}

func (f *fakeAgent) PromoteVolume(r *agentv1.ReplicationRequest, s grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return serve(f, "PromoteVolume", r, s)
}

func (f *fakeAgent) ResyncVolume(r *agentv1.ReplicationRequest, s grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return serve(f, "ResyncVolume", r, s)
}

func (f *fakeAgent) GetReplicationInfo(r *agentv1.ReplicationRequest, s grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return serve(f, "GetReplicationInfo", r, s)
}

func (f *fakeAgent) GetReplicationDestination(r *agentv1.ReplicationRequest, s grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return serve(f, "GetReplicationDestination", r, s)
}

func (f *fakeAgent) CreateGroupSnapshot(r *agentv1.CreateGroupSnapshotRequest, s grpc.ServerStreamingServer[agentv1.GroupSnapshotReply]) error {
	return serve(f, "CreateGroupSnapshot", r, s)
}

func (f *fakeAgent) GetGroupSnapshot(r *agentv1.GetGroupSnapshotRequest, s grpc.ServerStreamingServer[agentv1.GroupSnapshotReply]) error {
	return serve(f, "GetGroupSnapshot", r, s)
}

func (f *fakeAgent) DeleteGroupSnapshot(r *agentv1.DeleteGroupSnapshotRequest, s grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	return serve(f, "DeleteGroupSnapshot", r, s)
}

func (f *fakeAgent) CreateSnapshot(r *agentv1.CreateSnapshotRequest, s grpc.ServerStreamingServer[agentv1.SnapshotReply]) error {
	return serve(f, "CreateSnapshot", r, s)
}

func (f *fakeAgent) DeleteSnapshot(r *agentv1.DeleteSnapshotRequest, s grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	return serve(f, "DeleteSnapshot", r, s)
}

func (f *fakeAgent) ListSnapshots(_ context.Context, r *agentv1.ListSnapshotsRequest) (*agentv1.ListSnapshotsReply, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.method, f.req = "ListSnapshots", r
	if f.err != nil {
		return nil, f.err
	}
	return f.replies[0].(*agentv1.ListSnapshotsReply), nil
}

// startFakeAgent serves a fakeAgent on a socket; it returns the socket.
func startFakeAgent(t *testing.T) (*fakeAgent, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "csc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	socket := filepath.Join(dir, "agent.sock")
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeAgent{}
	srv := grpc.NewServer()
	agentv1.RegisterControllerServer(srv, f)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
	return f, socket
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func group(id string, vols ...string) *volumegroup.VolumeGroup {
	g := &volumegroup.VolumeGroup{VolumeGroupId: id, VolumeGroupContext: map[string]string{"pool": "fast"}}
	for _, v := range vols {
		g.Volumes = append(g.Volumes, &volumegroup.VgVolume{VolumeId: v})
	}
	return g
}

func TestControllerCLIGroups(t *testing.T) {
	f, socket := startFakeAgent(t)
	secrets := writeFile(t, "secrets.json", `{"user": "admin", "password": "s3cr3t-cli"}`)

	t.Run("create: flags, secrets, progress, table", func(t *testing.T) {
		f.set(nil,
			&agentv1.VolumeGroupReply{Progress: &agentv1.Progress{Kind: agentv1.Progress_RETRY, Rpc: "volumegroup.Controller/CreateVolumeGroup",
				Attempt: 1, MaxAttempts: 3, Code: "Unavailable", Message: "restarting", Hint: "the plugin's controller is unreachable", RetryIn: durationpb.New(time.Second)}},
			&agentv1.VolumeGroupReply{VolumeGroup: group("vg-db", "v1", "v2")})
		code, out, errOut := run(t, "group", "create", "--api-socket", socket, "--plugin", "loop", "--name", "db", "--volumes", "v1, v2",
			"--param", "pool=fast", "--param", "mode=x=y", "--secrets-file", secrets, "--max-attempts", "3", "--backoff", "100ms", "--timeout", "1m")
		if code != ExitOK {
			t.Fatalf("exit %d: %s", code, errOut)
		}
		_, req := f.last()
		want := &agentv1.CreateVolumeGroupRequest{PluginName: "loop", Name: "db", VolumeIds: []string{"v1", "v2"},
			Parameters: map[string]string{"pool": "fast", "mode": "x=y"}, Secrets: map[string]string{"user": "admin", "password": "s3cr3t-cli"},
			Retry: &agentv1.RetryPolicy{MaxAttempts: 3, InitialBackoff: durationpb.New(100 * time.Millisecond), MaxBackoff: durationpb.New(30 * time.Second), Timeout: durationpb.New(time.Minute)}}
		if !proto.Equal(req, want) {
			t.Errorf("request %v, want %v", req, want)
		}
		for _, w := range []string{"VOLUME GROUP", "vg-db", "v1,v2", "pool=fast"} {
			if !strings.Contains(out, w) {
				t.Errorf("stdout lacks %q:\n%s", w, out)
			}
		}
		if want := "csi-agent group create: CreateVolumeGroup failed (call 1 of 3): Unavailable: restarting; calling again in 1s — the plugin's controller is unreachable\n"; errOut != want {
			t.Errorf("stderr %q, want %q", errOut, want)
		}
		if strings.Contains(out+errOut, "s3cr3t-cli") {
			t.Error("a secret was printed")
		}
	})

	t.Run("get json", func(t *testing.T) {
		f.set(nil, &agentv1.VolumeGroupReply{VolumeGroup: group("vg-db", "v1")})
		code, out, errOut := run(t, "group", "get", "--api-socket", socket, "--plugin", "loop", "--id", "vg-db", "--output", "json")
		if code != ExitOK || !strings.Contains(out, `"volume_group_id": "vg-db"`) || !strings.Contains(out, `"volume_id": "v1"`) {
			t.Errorf("exit %d, stdout %s, stderr %s", code, out, errOut)
		}
	})

	t.Run("modify", func(t *testing.T) {
		f.set(nil, &agentv1.VolumeGroupReply{VolumeGroup: group("vg-db")})
		if code, _, errOut := run(t, "group", "modify", "--api-socket", socket, "--plugin", "loop", "--id", "vg-db", "--remove-all"); code != ExitOK {
			t.Fatalf("exit %d: %s", code, errOut)
		}
		if _, req := f.last(); !req.(*agentv1.ModifyVolumeGroupRequest).GetRemoveAll() {
			t.Errorf("request %v", req)
		}
		f.set(nil, &agentv1.VolumeGroupReply{VolumeGroup: group("vg-db", "v3")})
		if code, out, errOut := run(t, "group", "modify", "--api-socket", socket, "--plugin", "loop", "--id", "vg-db", "--volumes", "v3"); code != ExitOK || !strings.Contains(out, "v3") {
			t.Fatalf("exit %d: %s %s", code, out, errOut)
		}
	})

	t.Run("delete", func(t *testing.T) {
		f.set(nil, &agentv1.OperationReply{Done: true})
		code, out, _ := run(t, "group", "delete", "--api-socket", socket, "--plugin", "loop", "--id", "vg-db")
		if code != ExitOK || out != "volume group vg-db deleted\n" {
			t.Errorf("exit %d, %q", code, out)
		}
	})

	t.Run("list pages", func(t *testing.T) {
		f.set(nil,
			&agentv1.ListVolumeGroupsReply{Progress: &agentv1.Progress{Kind: agentv1.Progress_RESTART, Rpc: "volumegroup.Controller/ListVolumeGroups",
				Code: "Aborted", Message: "bad token", Hint: "listing again from the beginning"}},
			&agentv1.ListVolumeGroupsReply{VolumeGroups: []*volumegroup.VolumeGroup{group("g1"), group("g2")}, NextToken: "t2", Restarted: true})
		code, out, errOut := run(t, "group", "list", "--api-socket", socket, "--plugin", "loop", "--page", "--max-entries", "2", "--starting-token", "t1")
		if code != ExitOK {
			t.Fatalf("exit %d: %s", code, errOut)
		}
		_, req := f.last()
		if l := req.(*agentv1.ListVolumeGroupsRequest); l.GetAllPages() || l.GetMaxEntries() != 2 || l.GetStartingToken() != "t1" {
			t.Errorf("request %v", l)
		}
		if !strings.Contains(out, "g1") || !strings.Contains(out, "g2") || !strings.Contains(out, "next page: --starting-token t2") {
			t.Errorf("stdout %s", out)
		}
		if !strings.Contains(errOut, "ListVolumeGroups: Aborted: bad token — listing again from the beginning") {
			t.Errorf("stderr %s", errOut)
		}
		f.set(nil, &agentv1.ListVolumeGroupsReply{})
		if code, _, _ := run(t, "group", "list", "--api-socket", socket, "--plugin", "loop"); code != ExitOK {
			t.Fatal(code)
		}
		if _, req := f.last(); !req.(*agentv1.ListVolumeGroupsRequest).GetAllPages() {
			t.Error("every page is the default")
		}
	})

	t.Run("agent error", func(t *testing.T) {
		f.set(status.Error(codes.FailedPrecondition, "plugin loop: volumegroup.Controller/DeleteVolumeGroup: in use (gave up after 5 calls). Make sure nothing uses it"))
		code, _, errOut := run(t, "group", "delete", "--api-socket", socket, "--plugin", "loop", "--id", "vg-db")
		if code != ExitProblem || errOut != "csi-agent group delete: FailedPrecondition: plugin loop: volumegroup.Controller/DeleteVolumeGroup: in use (gave up after 5 calls). Make sure nothing uses it\n" {
			t.Errorf("exit %d, %q", code, errOut)
		}
	})
}

func TestControllerCLIReplication(t *testing.T) {
	f, socket := startFakeAgent(t)

	f.set(nil, &agentv1.ReplicationReply{Done: true, Ready: true})
	code, out, errOut := run(t, "replication", "promote", "--api-socket", socket, "--plugin", "loop", "--group", "vg-1", "--force", "--replication-id", "r1", "--param", "k=v")
	if code != ExitOK || out != "volume group vg-1: promoted\n" {
		t.Fatalf("exit %d: %q %s", code, out, errOut)
	}
	method, req := f.last()
	want := &agentv1.ReplicationRequest{PluginName: "loop", Source: &agentv1.ReplicationRequest_VolumeGroupId{VolumeGroupId: "vg-1"}, Force: true,
		ReplicationId: "r1", Parameters: map[string]string{"k": "v"}}
	req.(*agentv1.ReplicationRequest).Retry = nil
	if method != "PromoteVolume" || !proto.Equal(req, want) {
		t.Errorf("%s %v, want %v", method, req, want)
	}

	f.set(nil,
		&agentv1.ReplicationReply{Progress: &agentv1.Progress{Kind: agentv1.Progress_NOT_READY, Rpc: "replication.Controller/ResyncVolume", Attempt: 1,
			Message: "the resync of volume v1 is not ready yet", RetryIn: durationpb.New(500 * time.Millisecond)}},
		&agentv1.ReplicationReply{Done: true, Ready: true})
	code, out, errOut = run(t, "replication", "resync", "--api-socket", socket, "--plugin", "loop", "--volume", "v1")
	if code != ExitOK || out != "volume v1: resynced\n" ||
		errOut != "csi-agent replication resync: the resync of volume v1 is not ready yet (call 1); calling ResyncVolume again in 500ms\n" {
		t.Errorf("exit %d: %q %q", code, out, errOut)
	}
	f.set(nil, &agentv1.ReplicationReply{Done: true, Ready: false})
	code, out, _ = run(t, "replication", "resync", "--api-socket", socket, "--plugin", "loop", "--volume", "v1", "--no-wait")
	if _, req := f.last(); code != ExitOK || !strings.Contains(out, "not ready yet") || !req.(*agentv1.ReplicationRequest).GetNoWait() {
		t.Errorf("exit %d: %q", code, out)
	}

	f.set(nil, &agentv1.ReplicationReply{Done: true, Ready: true, Info: &agentv1.ReplicationInfo{
		LastSyncTime: timestamppb.Now(), LastSyncDuration: durationpb.New(90 * time.Second), LastSyncBytes: 4096,
		Status: "DEGRADED", StatusMessage: "behind by 3 syncs"}})
	code, out, _ = run(t, "replication", "info", "--api-socket", socket, "--plugin", "loop", "--volume", "v1")
	if code != ExitOK || !strings.Contains(out, "LAST SYNC") || !strings.Contains(out, "1m30s") || !strings.Contains(out, "4.0 KiB") ||
		!strings.Contains(out, "DEGRADED") || !strings.Contains(out, "behind by 3 syncs") {
		t.Errorf("exit %d: %s", code, out)
	}
	code, out, _ = run(t, "replication", "info", "--api-socket", socket, "--plugin", "loop", "--volume", "v1", "--output", "json")
	if code != ExitOK || !strings.Contains(out, `"last_sync_bytes": "4096"`) {
		t.Errorf("exit %d: %s", code, out)
	}

	f.set(nil, &agentv1.ReplicationReply{Done: true, Ready: true, Destination: &agentv1.ReplicationDestination{
		VolumeGroupId: "peer-g", VolumeIds: map[string]string{"v2": "peer-v2", "v1": "peer-v1"}}})
	code, out, _ = run(t, "replication", "destination", "--api-socket", socket, "--plugin", "loop", "--group", "g")
	if want := "SOURCE          DESTINATION\nvolume group g  volume group peer-g\n  volume v1     volume peer-v1\n  volume v2     volume peer-v2\n"; code != ExitOK || out != want {
		t.Errorf("destination: exit %d:\n%s\nwant\n%s", code, out, want)
	}
}

func TestControllerCLIGroupSnapshots(t *testing.T) {
	f, socket := startFakeAgent(t)
	gs := &csi.VolumeGroupSnapshot{GroupSnapshotId: "gs-1", ReadyToUse: true, CreationTime: timestamppb.Now(), Snapshots: []*csi.Snapshot{
		{SnapshotId: "s-a", SourceVolumeId: "a", SizeBytes: 1 << 20, ReadyToUse: true},
		{SnapshotId: "s-b", SourceVolumeId: "b", SizeBytes: 1 << 20, ReadyToUse: true},
	}}
	f.set(nil, &agentv1.GroupSnapshotReply{GroupSnapshot: gs})
	code, out, errOut := run(t, "group-snapshot", "create", "--api-socket", socket, "--plugin", "loop", "--name", "nightly", "--volumes", "a,b", "--no-wait")
	if code != ExitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	_, req := f.last()
	if r := req.(*agentv1.CreateGroupSnapshotRequest); r.GetName() != "nightly" || strings.Join(r.GetSourceVolumeIds(), ",") != "a,b" || !r.GetNoWait() {
		t.Errorf("request %v", r)
	}
	for _, w := range []string{"gs-1", "s-a", "1.0 MiB", "--id gs-1 --snapshot-ids s-a,s-b"} {
		if !strings.Contains(out, w) {
			t.Errorf("stdout lacks %q:\n%s", w, out)
		}
	}
	f.set(nil, &agentv1.GroupSnapshotReply{GroupSnapshot: gs})
	code, out, _ = run(t, "group-snapshot", "get", "--api-socket", socket, "--plugin", "loop", "--id", "gs-1", "--snapshot-ids", "s-a,s-b", "--output", "json")
	if _, req := f.last(); code != ExitOK || !strings.Contains(out, `"group_snapshot_id": "gs-1"`) || len(req.(*agentv1.GetGroupSnapshotRequest).GetSnapshotIds()) != 2 {
		t.Errorf("exit %d: %s", code, out)
	}
	f.set(nil, &agentv1.OperationReply{Done: true})
	code, out, _ = run(t, "group-snapshot", "delete", "--api-socket", socket, "--plugin", "loop", "--id", "gs-1", "--snapshot-ids", "s-a,s-b")
	if code != ExitOK || out != "group snapshot gs-1 deleted\n" {
		t.Errorf("exit %d: %q", code, out)
	}
}

// TestControllerCLISnapshots: --volume is a named volume, or with --plugin
// a volume id; ls shows a group's members and an interrupted create; rm
// and group-snapshot get/delete take the catalogue name; --container sends
// the freeze timeout.
func TestControllerCLISnapshots(t *testing.T) {
	f, socket := startFakeAgent(t)
	entry := &agentv1.SnapshotEntry{Name: "s1", Kind: "snapshot", PluginName: "loop", SourceVolumeIds: []string{"v1"}, NamedVolume: "data", SnapshotId: "id-1", ReadyToUse: true, SizeBytes: 1 << 20}
	for _, tc := range []struct {
		args       []string
		named, id  string
		wantPlugin string
	}{
		{args: []string{"--volume", "data"}, named: "data"},
		{args: []string{"--volume", "v1", "--plugin", "loop"}, id: "v1", wantPlugin: "loop"},
	} {
		f.set(nil, &agentv1.SnapshotReply{Snapshot: entry})
		code, out, errOut := run(t, append([]string{"snapshot", "create", "--api-socket", socket, "--name", "s1"}, tc.args...)...)
		_, req := f.last()
		r := req.(*agentv1.CreateSnapshotRequest)
		if code != ExitOK || r.GetNamedVolume() != tc.named || r.GetSourceVolumeId() != tc.id || r.GetPluginName() != tc.wantPlugin || !strings.Contains(out, "data (v1)") {
			t.Errorf("create %v: exit %d, request %v\n%s%s", tc.args, code, r, out, errOut)
		}
	}
	f.set(nil, &agentv1.ListSnapshotsReply{Snapshots: []*agentv1.SnapshotEntry{
		entry,
		{Name: "g1", Kind: "group", PluginName: "loop", SourceVolumeIds: []string{"a", "b"}, ContainerId: "c1", GroupSnapshotId: "gs", Members: map[string]string{"b": "sb", "a": "sa"}, ReadyToUse: true},
		{Name: "g2", Kind: "group", PluginName: "loop", SourceVolumeIds: []string{"a"}, Interrupted: true},
	}})
	code, out, _ := run(t, "snapshot", "ls", "--api-socket", socket)
	for _, w := range []string{"container c1", "gs [a=sa b=sb]", "interrupted: run create again", "1.0 MiB"} {
		if code != ExitOK || !strings.Contains(out, w) {
			t.Errorf("ls: exit %d, stdout lacks %q:\n%s", code, w, out)
		}
	}
	f.set(nil, &agentv1.OperationReply{Done: true})
	if code, out, _ := run(t, "snapshot", "rm", "s1", "--api-socket", socket); code != ExitOK || out != "snapshot s1 deleted\n" {
		t.Errorf("rm: exit %d: %q", code, out)
	}
	if _, req := f.last(); req.(*agentv1.DeleteSnapshotRequest).GetName() != "s1" {
		t.Errorf("rm request %v", req)
	}
	f.set(nil, &agentv1.OperationReply{Done: true})
	if code, out, _ := run(t, "group-snapshot", "delete", "--name", "g1", "--api-socket", socket); code != ExitOK || out != "group snapshot g1 deleted\n" {
		t.Errorf("group-snapshot delete --name: exit %d: %q", code, out)
	}
	f.set(nil, &agentv1.GroupSnapshotReply{GroupSnapshot: &csi.VolumeGroupSnapshot{GroupSnapshotId: "gs"}})
	if code, _, errOut := run(t, "group-snapshot", "create", "--container", "c1", "--name", "g3", "--freeze-timeout", "3s", "--api-socket", socket); code != ExitOK {
		t.Fatalf("group-snapshot create --container: exit %d: %s", code, errOut)
	}
	if _, req := f.last(); req.(*agentv1.CreateGroupSnapshotRequest).GetContainerId() != "c1" || req.(*agentv1.CreateGroupSnapshotRequest).GetFreezeTimeout().AsDuration() != 3*time.Second {
		t.Errorf("create --container request %v", req)
	}
}

// TestControllerCLIUsage: mistakes are caught before the agent is asked,
// with exit 2 and a message that says what to give.
func TestControllerCLIUsage(t *testing.T) {
	f, socket := startFakeAgent(t)
	badJSON := writeFile(t, "bad.json", `{"password": 12345678}`)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"group"}, "  csi-agent group [command]\n\nAvailable Commands:\n  create"},
		{[]string{"group", "rename"}, `unknown subcommand "rename"`},
		{[]string{"group", "create", "--name", "x"}, "--plugin is required"},
		{[]string{"group", "create", "--plugin", "p"}, "--name is required"},
		{[]string{"group", "create", "--plugin", "p", "--name", "x", "extra"}, "unexpected arguments"},
		{[]string{"group", "create", "--plugin", "p", "--name", "x", "--volumes", "a,,b"}, "an empty id"},
		{[]string{"group", "create", "--plugin", "p", "--name", "x", "--param", "novalue"}, "want KEY=VALUE"},
		{[]string{"group", "create", "--plugin", "p", "--name", "x", "--output", "yaml"}, "expected table or json"},
		{[]string{"group", "create", "--plugin", "p", "--name", "x", "--max-attempts", "0"}, "--max-attempts 0"},
		{[]string{"group", "create", "--plugin", "p", "--name", "x", "--secrets-file", "/nonexistent"}, "--secrets-file"},
		{[]string{"group", "create", "--plugin", "p", "--name", "x", "--secrets-file", badJSON}, "must be a JSON object whose values are strings"},
		{[]string{"group", "modify", "--plugin", "p", "--id", "g"}, "--volumes (the members afterwards) or --remove-all"},
		{[]string{"group", "modify", "--plugin", "p", "--id", "g", "--volumes", "a", "--remove-all"}, "exclude each other"},
		{[]string{"replication", "enable", "--plugin", "p"}, "exactly one of --volume and --group"},
		{[]string{"replication", "enable", "--plugin", "p", "--volume", "v", "--group", "g"}, "exactly one of --volume and --group"},
		{[]string{"replication", "enable", "--plugin", "p", "--volume", "v", "--force"}, "unknown flag: --force"},
		{[]string{"replication", "info", "--plugin", "p", "--volume", "v", "--param", "a=b"}, "unknown flag: --param"},
		{[]string{"group-snapshot", "create", "--plugin", "p", "--name", "n"}, "--name and one of --volumes and --container are required"},
		{[]string{"group-snapshot", "create", "--name", "n", "--volumes", "a"}, "--plugin is required with --volumes"},
		{[]string{"group-snapshot", "create", "--name", "n", "--volumes", "a", "--container", "c"}, "one of --volumes and --container"},
		{[]string{"group-snapshot", "get", "--plugin", "p", "--id", "g"}, "--plugin, --id and --snapshot-ids, are required"},
		{[]string{"group-snapshot", "get", "--name", "g", "--id", "g"}, "--name takes no --id"},
		{[]string{"group-snapshot", "delete", "--plugin", "p", "--snapshot-ids", "a"}, "--plugin, --id and --snapshot-ids, are required"},
		{[]string{"snapshot", "create", "--name", "s"}, "--name and --volume are required"},
		{[]string{"snapshot", "rm"}, "accepts 1 arg"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			args := tc.args
			if len(args) > 2 {
				args = append(args, "--api-socket", socket)
			}
			code, _, errOut := run(t, args...)
			if code != ExitUsage || !strings.Contains(errOut, tc.want) {
				t.Errorf("exit %d, stderr %q; want %d and %q", code, errOut, ExitUsage, tc.want)
			}
			if strings.Contains(errOut, "12345678") {
				t.Errorf("a secret was printed: %q", errOut)
			}
		})
	}
	if method, _ := f.last(); method != "" {
		t.Errorf("a usage error reached the agent: %s", method)
	}
	for _, args := range [][]string{{"group", "-h"}, {"replication", "--help"}, {"group-snapshot", "help"}, {"group", "list", "-h"}} {
		if code, out, errOut := run(t, args...); code != ExitOK || !strings.Contains(out, "Usage:\n  csi-agent "+args[0]) {
			t.Errorf("%q: exit %d, %q", args, code, out+errOut)
		}
	}
}
