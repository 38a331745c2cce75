package cli

import (
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

func (f *fakeAgent) FenceNetwork(r *agentv1.FenceRequest, s grpc.ServerStreamingServer[agentv1.FenceReply]) error {
	return serve(f, "FenceNetwork", r, s)
}

func (f *fakeAgent) UnfenceNetwork(r *agentv1.FenceRequest, s grpc.ServerStreamingServer[agentv1.FenceReply]) error {
	return serve(f, "UnfenceNetwork", r, s)
}

func (f *fakeAgent) ListFences(r *agentv1.FenceRequest, s grpc.ServerStreamingServer[agentv1.FenceReply]) error {
	return serve(f, "ListFences", r, s)
}

func TestFenceCLI(t *testing.T) {
	f, socket := startFakeAgent(t)
	f.set(nil, &agentv1.FenceReply{Done: true})
	code, out, errOut := run(t, "fence", "--api-socket", socket, "--plugin", "ceph", "--cidr", "10.1.0.0/24,10.2.0.0/24", "--cidr", "10.3.0.0/24", "--param", "clusterID=c1")
	method, req := f.last()
	r, _ := req.(*agentv1.FenceRequest)
	if code != ExitOK || out != "10.1.0.0/24, 10.2.0.0/24, 10.3.0.0/24: fenced\n" || method != "FenceNetwork" ||
		!slices.Equal(r.GetCidrs(), []string{"10.1.0.0/24", "10.2.0.0/24", "10.3.0.0/24"}) || r.GetParameters()["clusterID"] != "c1" {
		t.Errorf("fence: exit %d %q %q; %s %v", code, out, errOut, method, r)
	}
	f.set(nil, &agentv1.FenceReply{Done: true})
	if code, out, _ := run(t, "unfence", "--api-socket", socket, "--plugin", "ceph", "--cidr", "10.1.0.0/24"); code != ExitOK || out != "10.1.0.0/24: unfenced\n" {
		t.Errorf("unfence: exit %d %q", code, out)
	}
	if m, _ := f.last(); m != "UnfenceNetwork" {
		t.Errorf("unfence called %s", m)
	}
	f.set(nil, &agentv1.FenceReply{Done: true, Cidrs: []string{"10.1.0.0/24", "10.2.0.0/16"}})
	if code, out, _ := run(t, "fence", "--list", "--api-socket", socket, "--plugin", "ceph"); code != ExitOK || out != "10.1.0.0/24\n10.2.0.0/16\n" {
		t.Errorf("fence --list: exit %d %q", code, out)
	}
	if code, _, errOut := run(t, "fence", "--api-socket", socket, "--cidr", "10.1.0.0/24"); code != ExitUsage || errOut == "" {
		t.Errorf("fence without --plugin: exit %d %q", code, errOut)
	}
}

func (f *fakeAgent) RotateKey(r *agentv1.RotateKeyRequest, s grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	return serve(f, "RotateKey", r, s)
}

func TestKeyRotateCLI(t *testing.T) {
	f, socket := startFakeAgent(t)
	f.set(nil, &agentv1.OperationReply{Done: true})
	code, out, errOut := run(t, "keyrotate", "--api-socket", socket, "--plugin", "ceph", "--volume", "v1")
	_, req := f.last()
	if code != ExitOK || out != "volume v1: encryption key rotated\n" || req.(*agentv1.RotateKeyRequest).GetVolumeId() != "v1" {
		t.Errorf("keyrotate: exit %d %q %q %v", code, out, errOut, req)
	}
	if code, _, errOut := run(t, "keyrotate", "--api-socket", socket, "--plugin", "ceph"); code != ExitUsage || errOut == "" {
		t.Errorf("keyrotate without --volume: exit %d %q", code, errOut)
	}
}

func (f *fakeAgent) ExpandVolume(r *agentv1.ExpandVolumeRequest, s grpc.ServerStreamingServer[agentv1.ExpandVolumeReply]) error {
	return serve(f, "ExpandVolume", r, s)
}

func TestExpandCLI(t *testing.T) {
	f, socket := startFakeAgent(t)
	f.set(nil, &agentv1.ExpandVolumeReply{Done: true, CapacityBytes: 2 << 30})
	code, out, errOut := run(t, "expand", "--api-socket", socket, "--plugin", "loop", "--volume", "v1", "--size", "2GiB")
	_, req := f.last()
	if r := req.(*agentv1.ExpandVolumeRequest); code != ExitOK || out != "volume v1: expanded to 2.0 GiB\n" || r.GetVolumeId() != "v1" || r.GetRequiredBytes() != 2<<30 {
		t.Errorf("expand: exit %d %q %q %v", code, out, errOut, r)
	}
	if code, _, errOut := run(t, "expand", "--api-socket", socket, "--plugin", "loop", "--volume", "v1", "--size", "lots"); code != ExitUsage || errOut == "" {
		t.Errorf("expand --size lots: exit %d %q", code, errOut)
	}
	// The agent finds the plugin publishing the volume (before: --plugin
	// was required).
	code, _, errOut = run(t, "expand", "--api-socket", socket, "--volume", "v1", "--size", "2GiB")
	if _, req = f.last(); code != ExitOK || req.(*agentv1.ExpandVolumeRequest).GetPluginName() != "" {
		t.Errorf("expand without --plugin: exit %d %q %v", code, errOut, req)
	}
	// The other controller commands still need it.
	if code, _, errOut := run(t, "keyrotate", "--api-socket", socket, "--volume", "v1"); code != ExitUsage || !strings.Contains(errOut, "--plugin is required") {
		t.Errorf("keyrotate without --plugin: exit %d %q", code, errOut)
	}
}
