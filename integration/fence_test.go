package integration

import (
	"context"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/csiagent/csiagent/controllerops"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/fence"
)

// fakeFence keeps the fenced CIDRs (csi-loop-plugin has no network to
// fence, so fencing is tested against this fake).
type fakeFence struct {
	fence.UnimplementedFenceControllerServer
	f *fakeController
}

func (s fakeFence) FenceClusterNetwork(ctx context.Context, req *fence.FenceClusterNetworkRequest) (*fence.FenceClusterNetworkResponse, error) {
	return answer(ctx, s.f, "FenceClusterNetwork", "fence", req, func() *fence.FenceClusterNetworkResponse { return &fence.FenceClusterNetworkResponse{} })
}

func (s fakeFence) UnfenceClusterNetwork(ctx context.Context, req *fence.UnfenceClusterNetworkRequest) (*fence.UnfenceClusterNetworkResponse, error) {
	return answer(ctx, s.f, "UnfenceClusterNetwork", "fence", req, func() *fence.UnfenceClusterNetworkResponse { return &fence.UnfenceClusterNetworkResponse{} })
}

func (s fakeFence) ListClusterFence(ctx context.Context, req *fence.ListClusterFenceRequest) (*fence.ListClusterFenceResponse, error) {
	return answer(ctx, s.f, "ListClusterFence", "fence", req, func() *fence.ListClusterFenceResponse {
		return &fence.ListClusterFenceResponse{Cidrs: []*fence.CIDR{{Cidr: "10.2.0.0/16"}, {Cidr: "10.1.0.0/24"}}}
	})
}

// TestControllerFence: fence and unfence pass normalised CIDRs, parameters
// and secrets; the spec's table: InvalidArgument is not retried,
// Unavailable is; bad CIDRs never reach the plugin.
func TestControllerFence(t *testing.T) {
	h := newCtrlHarness(t)
	c, f := h.client, h.fake
	p := h.waitPlugin("fake", "ready", ready)
	if !slices.Contains(p.GetInstances()[0].GetAddonsServices(), controllerops.FenceService) {
		t.Fatalf("discovery did not find %s: %v", controllerops.FenceService, p.GetInstances()[0].GetAddonsServices())
	}
	f.arm()
	req := &agentv1.FenceRequest{PluginName: "fake", Cidrs: []string{"10.1.0.7/24", " 192.168.0.0/16"}, Parameters: map[string]string{"clusterID": "c1"},
		Secrets: map[string]string{"key": "s3cr3t-fence"}, Retry: fast()}
	f.script("FenceClusterNetwork", fail(codes.Unavailable, "restarting"))
	ps, res, err := collect(c.FenceNetwork(opCtx(t), req))
	if err != nil || !res.GetDone() || !slices.Equal(kinds(ps), []agentv1.Progress_Kind{agentv1.Progress_RETRY}) {
		t.Fatalf("fence: %v %v %v", kinds(ps), res, err)
	}
	got := f.request("FenceClusterNetwork", 1).(*fence.FenceClusterNetworkRequest)
	var cs []string
	for _, x := range got.GetCidrs() {
		cs = append(cs, x.GetCidr())
	}
	if !slices.Equal(cs, []string{"10.1.0.0/24", "192.168.0.0/16"}) || got.GetParameters()["clusterID"] != "c1" || got.GetSecrets()["key"] != "s3cr3t-fence" {
		t.Errorf("plugin got %v", got)
	}
	if strings.Contains(h.logs.String(), "s3cr3t-fence") {
		t.Error("the fence secret reached the log")
	}
	if _, res, err := collect(c.UnfenceNetwork(opCtx(t), req)); err != nil || !res.GetDone() || f.count("UnfenceClusterNetwork") != 1 {
		t.Errorf("unfence: %v %v", res, err)
	}
	if _, res, err := collect(c.ListFences(opCtx(t), &agentv1.FenceRequest{PluginName: "fake", Retry: fast()})); err != nil ||
		!slices.Equal(res.GetCidrs(), []string{"10.1.0.0/24", "10.2.0.0/16"}) {
		t.Errorf("list: %v %v", res, err)
	}

	f.script("FenceClusterNetwork", fail(codes.InvalidArgument, "clusterID unknown"))
	_, _, err = collect(c.FenceNetwork(opCtx(t), req))
	wantStatus(t, err, codes.InvalidArgument, "clusterID unknown", "1 call, not retried", "fix the request")

	before := f.count("FenceClusterNetwork")
	for _, tc := range []struct {
		req  *agentv1.FenceRequest
		want string
	}{
		{&agentv1.FenceRequest{PluginName: "fake"}, "cidrs is required"},
		{&agentv1.FenceRequest{PluginName: "fake", Cidrs: []string{"10.1.0.300/24"}}, `cidr "10.1.0.300/24"`},
		{&agentv1.FenceRequest{PluginName: "fake", Cidrs: []string{"10.1.0.0"}}, `cidr "10.1.0.0"`},
	} {
		_, _, err := collect(c.FenceNetwork(opCtx(t), tc.req))
		wantStatus(t, err, codes.InvalidArgument, tc.want)
	}
	_, _, err = collect(c.ListFences(opCtx(t), &agentv1.FenceRequest{PluginName: "fake", Cidrs: []string{"10.0.0.0/8"}}))
	wantStatus(t, err, codes.InvalidArgument, "cidrs must be empty")
	if n := f.count("FenceClusterNetwork") - before; n != 0 {
		t.Errorf("invalid requests made %d plugin calls", n)
	}
}
