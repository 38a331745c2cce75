package apiserver

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/reclaim"
)

// progressLines is a reclaim stream in short: "plugin/id outcome pre>post
// code" per volume, then "summary volumes freed failures".
func progressLines(sent []*agentv1.ReclaimSpaceProgress) []string {
	var out []string
	for _, p := range sent {
		if s := p.GetSummary(); s != nil {
			out = append(out, fmt.Sprintf("summary %d %d %d", s.GetVolumes(), s.GetBytesFreed(), s.GetFailures()))
			continue
		}
		r := p.GetResult()
		out = append(out, fmt.Sprintf("%s/%s %s %d>%d %s", p.GetVolume().GetPluginName(), p.GetVolume().GetVolumeId(), r.GetOutcome(), r.GetPreUsage(), r.GetPostUsage(), r.GetCode()))
	}
	return out
}

// TestReclaimSpaceOnline: the target picks the published volumes the
// reclaim schedule runs now; each result is the isolator's record, else
// the schedule's.
func TestReclaimSpaceOnline(t *testing.T) {
	vol := func(ref *agentv1.VolumeRef) *agentv1.ReclaimSpaceRequest {
		return &agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_Volume{Volume: ref}}
	}
	for _, c := range []struct {
		name   string
		req    *agentv1.ReclaimSpaceRequest
		code   codes.Code
		msg    string
		events []string
		sent   []string
	}{
		{name: "all", req: &agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}},
			events: []string{"ReclaimNow [loop/v1 loop/v2 nfs/v2]"},
			// v1's result is the isolator's record; v2's failed.
			sent: []string{"loop/v1 ok 100>50 ", "loop/v2 no space 30>20 ResourceExhausted", "nfs/v2 ok 30>20 ", "summary 2 60 1"}},
		{name: "a volume", req: vol(&agentv1.VolumeRef{VolumeId: "v1"}),
			events: []string{"ReclaimNow [loop/v1]"}, sent: []string{"loop/v1 ok 100>50 ", "summary 2 60 1"}},
		{name: "a volume of a plugin", req: vol(&agentv1.VolumeRef{PluginName: "nfs", VolumeId: "v2"}),
			events: []string{"ReclaimNow [nfs/v2]"}, sent: []string{"nfs/v2 ok 30>20 ", "summary 2 60 1"}},
		{name: "a volume id of two plugins", req: vol(&agentv1.VolumeRef{VolumeId: "v2"}), code: codes.InvalidArgument, msg: "name the plugin"},
		{name: "a volume not published", req: vol(&agentv1.VolumeRef{VolumeId: "v9"}), code: codes.NotFound, msg: `volume "v9" is not published on this host by a plugin that offers ` + reclaim.NodeService},
		{name: "a container", req: &agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_ContainerId{ContainerId: "c1"}},
			events: []string{"ReclaimNow [loop/v2 nfs/v2]"}, sent: []string{"loop/v2 no space 30>20 ResourceExhausted", "nfs/v2 ok 30>20 ", "summary 2 60 1"}},
		{name: "a container without volumes", req: &agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_ContainerId{ContainerId: "c9"}},
			code: codes.NotFound, msg: `container "c9" has no volumes`},
		{name: "no target", req: &agentv1.ReclaimSpaceRequest{}, code: codes.InvalidArgument, msg: "name a volume, a container, or all"},
		{name: "secrets online", req: &agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}, Secrets: map[string]string{"k": "v"}},
			code: codes.InvalidArgument, msg: "NodeReclaimSpace takes none"},
		{name: "a retry policy online", req: &agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}, Retry: &agentv1.RetryPolicy{MaxAttempts: 2}},
			code: codes.InvalidArgument, msg: "secrets, parameters and retry are for an offline reclaim"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture()
			f.schedules.reclaimable = []pervolume.Volume{{Plugin: "loop", ID: "v1"}, {Plugin: "loop", ID: "v2"}, {Plugin: "nfs", ID: "v2"}}
			f.schedules.results = map[string]runResult{"loop/v2": {reclaim.Result{PreUsage: 30, PostUsage: 20}, status.Error(codes.ResourceExhausted, "no space")}}
			f.schedules.summary = reclaim.Summary{Summary: pervolume.Summary{Volumes: 2, Failures: 1}, BytesFreed: 60}
			f.core.volumes = []isolator.VolumeInfo{{Plugin: "loop", ID: "v1", LastReclaim: &statev1.ReclaimResult{Outcome: "ok", PreUsage: 100, PostUsage: 50}}}
			f.core.containers = []isolator.ContainerInfo{{ID: "c1", Mounts: []*statev1.ContainerMount{{PluginName: "loop", VolumeId: "v2"}, {PluginName: "nfs", VolumeId: "v2"}}}, {ID: "c9"}}
			stream := &fakeStream[agentv1.ReclaimSpaceProgress]{ctx: caller(rootCred)}
			err := f.server().ReclaimSpace(c.req, stream)
			checkStatus(t, err, c.code, c.msg)
			checkEvents(t, f.log, c.events...)
			if got := progressLines(stream.sent); strings.Join(got, "\n") != strings.Join(c.sent, "\n") {
				t.Errorf("sent\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(c.sent, "\n"))
			}
		})
	}
}

// TestReclaimSpaceStreamBroken: a send that fails ends the call with its
// error, without the summary.
func TestReclaimSpaceStreamBroken(t *testing.T) {
	f := newFixture()
	f.schedules.reclaimable = []pervolume.Volume{{Plugin: "loop", ID: "v1"}, {Plugin: "loop", ID: "v2"}}
	broken := errors.New("the caller left")
	stream := &fakeStream[agentv1.ReclaimSpaceProgress]{ctx: caller(rootCred), sendErr: broken}
	if err := f.server().ReclaimSpace(&agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}}, stream); !errors.Is(err, broken) || len(stream.sent) != 1 {
		t.Errorf("ReclaimSpace = %v after %d messages, want the send's error after the first", err, len(stream.sent))
	}
}

// TestReclaimSpaceOffline: ControllerReclaimSpace of one named volume,
// through the plugin's controller, with the request's secrets,
// parameters and retry policy.
func TestReclaimSpaceOffline(t *testing.T) {
	ref := &agentv1.VolumeRef{PluginName: "nfs", VolumeId: "v1"}
	offline := func(change func(*agentv1.ReclaimSpaceRequest)) *agentv1.ReclaimSpaceRequest {
		r := &agentv1.ReclaimSpaceRequest{Offline: true, Target: &agentv1.ReclaimSpaceRequest_Volume{Volume: ref},
			Secrets: map[string]string{"s": "1"}, Parameters: map[string]string{"p": "2"},
			Retry: &agentv1.RetryPolicy{MaxAttempts: 3, Timeout: durationpb.New(time.Minute)}}
		if change != nil {
			change(r)
		}
		return r
	}
	ok := &statev1.ReclaimResult{Outcome: "ok", PreUsage: 100, PostUsage: 40, BytesReclaimed: 60}
	called := []string{"ControllerConn nfs " + reclaim.ControllerService, "ReclaimOffline nfs/v1 client=true"}
	for _, c := range []struct {
		name   string
		req    *agentv1.ReclaimSpaceRequest
		setup  func(*fixture)
		code   codes.Code
		msg    string
		events []string
		sent   []string
	}{
		{name: "reclaimed", req: offline(nil), setup: func(f *fixture) { f.core.offline = ok },
			events: called, sent: []string{"nfs/v1 ok 100>40 ", "summary 1 60 0"}},
		{name: "the plugin failed", req: offline(nil),
			setup: func(f *fixture) {
				f.core.offline = &statev1.ReclaimResult{Outcome: "busy", PreUsage: -1, PostUsage: -1, Code: "Aborted"}
				f.core.offlineErr = status.Error(codes.Aborted, "busy")
			},
			events: called, sent: []string{"nfs/v1 busy -1>-1 Aborted", "summary 1 0 1"}},
		{name: "no call made", req: offline(nil),
			setup: func(f *fixture) {
				f.core.offlineErr = fmt.Errorf("%w: volume nfs/v1 is in use on this host", isolator.ErrPrecondition)
			},
			code: codes.FailedPrecondition, msg: "volume nfs/v1 is in use on this host", events: called},
		{name: "no plugin", req: offline(func(r *agentv1.ReclaimSpaceRequest) {
			r.Target = &agentv1.ReclaimSpaceRequest_Volume{Volume: &agentv1.VolumeRef{VolumeId: "v1"}}
		}),
			code: codes.InvalidArgument, msg: "offline reclaim needs the plugin and the volume id"},
		{name: "all", req: offline(func(r *agentv1.ReclaimSpaceRequest) { r.Target = &agentv1.ReclaimSpaceRequest_All{All: true} }),
			code: codes.InvalidArgument, msg: "offline reclaim needs the plugin and the volume id"},
		{name: "the plugin lacks the service", req: offline(nil), setup: func(f *fixture) { f.plugins.offers = nil },
			code: codes.FailedPrecondition, msg: "plugin nfs does not offer " + reclaim.ControllerService},
		{name: "a bad retry policy", req: offline(func(r *agentv1.ReclaimSpaceRequest) { r.Retry.MaxAttempts = 1000 }),
			code: codes.InvalidArgument, msg: "retry.max_attempts 1000"},
		{name: "a bad retry timeout", req: offline(func(r *agentv1.ReclaimSpaceRequest) { r.Retry.Timeout = durationpb.New(time.Microsecond) }),
			code: codes.InvalidArgument, msg: "retry.timeout"},
		{name: "the controller is not ready", req: offline(nil), setup: func(f *fixture) { f.plugins.connErr = status.Error(codes.Unavailable, "nfs is starting") },
			code: codes.Unavailable, msg: "nfs is starting", events: called[:1]},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture()
			f.plugins.offers = []string{"nfs " + reclaim.ControllerService}
			if c.setup != nil {
				c.setup(f)
			}
			stream := &fakeStream[agentv1.ReclaimSpaceProgress]{ctx: caller(rootCred)}
			err := f.server().ReclaimSpace(c.req, stream)
			checkStatus(t, err, c.code, c.msg)
			checkEvents(t, f.log, c.events...)
			if got := progressLines(stream.sent); strings.Join(got, "\n") != strings.Join(c.sent, "\n") {
				t.Errorf("sent\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(c.sent, "\n"))
			}
			if len(c.events) == 2 {
				if f.core.secrets["s"] != "1" || f.core.params["p"] != "2" || f.core.policy.Attempts != 3 || f.core.policy.Timeout != time.Minute {
					t.Errorf("the isolator got secrets %v, parameters %v, policy %+v; want the request's", f.core.secrets, f.core.params, f.core.policy)
				}
			}
		})
	}
}

// TestReclaimSpaceWaitsForRecovery: a reclaim at start waits for the
// first recovery pass, and fails Unavailable when the caller leaves first.
func TestReclaimSpaceWaitsForRecovery(t *testing.T) {
	f := newFixture()
	f.core.notRecovered = true
	stream := &fakeStream[agentv1.ReclaimSpaceProgress]{ctx: cancelled(caller(rootCred))}
	err := f.server().ReclaimSpace(&agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}}, stream)
	checkStatus(t, err, codes.Unavailable, "still recovering")
	checkEvents(t, f.log)
}
