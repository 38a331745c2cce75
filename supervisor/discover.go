package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/csicompat"
	"github.com/csiagent/csiagent/pluginconfig"
	"github.com/csiagent/csiagent/proto/fence"
	"github.com/csiagent/csiagent/proto/identity"
	"github.com/csiagent/csiagent/proto/replication"
	"github.com/csiagent/csiagent/proto/volumegroup"
)

const (
	// DefaultReadyTimeout bounds the whole readiness sequence: socket,
	// Probe until ready, info and capability discovery.
	DefaultReadyTimeout = time.Minute
	// DefaultProbeInterval is the period of health probes once ready.
	DefaultProbeInterval = 30 * time.Second
	// probeFailureLimit failed probes in a row make a plugin unavailable
	// (managed: restarted).
	probeFailureLimit = 3
	// rpcTimeout bounds each discovery or probe call.
	rpcTimeout = 10 * time.Second
	// probeRetryMax caps the pause between Probe calls while a plugin is
	// not ready yet (it starts at 50 ms and doubles).
	probeRetryMax = 2 * time.Second
)

// errNotReady: Probe answered ready=false.
var errNotReady = errors.New("probe: plugin says it is not ready")

// discovery is what the readiness sequence learns of a plugin instance.
type discovery struct {
	pluginName, vendorVersion string
	pluginCaps, nodeCaps      []string
	controllerCaps            []string
	nodeID                    string
	topology                  map[string]string
	maxVolumes                int64
	addons                    []string
	// Set when csi-addons is served apart from CSI.
	addonsEndpoint, addonsIdentity string
}

// WaitForSocket returns when path exists as a socket, watching its
// directory with inotify rather than polling. It gives up when ctx ends or
// abort is closed (the process died).
func WaitForSocket(ctx context.Context, path string, abort <-chan struct{}) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watching for socket %s: %w", path, err)
	}
	defer w.Close()
	if err := w.Add(filepath.Dir(path)); err != nil {
		return fmt.Errorf("watching for socket %s: %w", path, err)
	}
	for {
		if st, err := os.Stat(path); err == nil && st.Mode()&os.ModeSocket != 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("socket %s did not appear: %w", path, ctx.Err())
		case <-abort:
			return errors.New("process exited before creating its socket")
		case <-w.Events:
		case err := <-w.Errors:
			return fmt.Errorf("watching for socket %s: %w", path, err)
		}
	}
}

// dial makes a client connection to a plugin's unix socket. It connects
// lazily; calls fail fast (no WaitForReady) while nothing listens. Every
// call on it goes through interceptor(typ), if set.
func dial(socket, typ string, interceptor func(typ string) grpc.UnaryClientInterceptor) (*grpc.ClientConn, error) {
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if interceptor != nil {
		opts = append(opts, grpc.WithChainUnaryInterceptor(interceptor(typ)))
	}
	conn, err := grpc.NewClient("unix://"+socket, opts...)
	if err != nil {
		return nil, fmt.Errorf("connecting to %s: %w", socket, err)
	}
	return conn, nil
}

// probe calls Probe once; an unset ready counts as ready (CSI spec).
func probe(ctx context.Context, conn *grpc.ClientConn) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, rpcTimeout)
	defer cancel()
	resp, err := csi.NewIdentityClient(conn).Probe(ctx, &csi.ProbeRequest{})
	if err != nil {
		return false, fmt.Errorf("probe: %w", err)
	}
	return resp.GetReady() == nil || resp.GetReady().GetValue(), nil
}

// probeUntilReady calls Probe until the plugin says ready, backing off
// from 50 ms to probeRetryMax between tries, until ctx ends.
func probeUntilReady(ctx context.Context, conn *grpc.ClientConn, abort <-chan struct{}) error {
	pause := 50 * time.Millisecond
	var last error
	for {
		ready, err := probe(ctx, conn)
		if err == nil && ready {
			return nil
		}
		last = err
		if err == nil {
			last = errNotReady
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("not ready in time (last: %v): %w", last, ctx.Err())
		case <-abort:
			t.Stop()
			return errors.New("process exited before it was ready")
		case <-t.C:
		}
		pause = min(pause*2, probeRetryMax)
	}
}

// discover asks a ready plugin who it is and what it can do, and which
// optional services (csi-addons', CSI's GroupController) it answers.
// csi-addons is looked for on addons when not nil (a separate csi-addons
// endpoint, as ceph-csi serves it), else on conn. Which services are there
// is read, in this order, from: the endpoint's csi-addons
// identity.Identity/GetCapabilities; gRPC server reflection; declared (the
// config's csi_addons_services); else only the services whose calls merely
// read are called with an empty request (Unimplemented = absent). A service
// whose calls may act is never called to find out.
func discover(ctx context.Context, conn, addons *grpc.ClientConn, services []pluginconfig.Service, declared []string) (*discovery, error) {
	d := &discovery{}
	if err := d.identity(ctx, conn); err != nil {
		return nil, err
	}
	serves := func(s pluginconfig.Service) bool { return slices.Contains(services, s) }
	addonsConn := conn
	if addons != nil {
		addonsConn = addons
	}
	known, err := addonsCapabilities(ctx, addonsConn, serves, d)
	if err != nil {
		return nil, err
	}
	if addons == nil {
		d.addonsIdentity = "" // shown for an endpoint of its own only
	}
	if known && serves(pluginconfig.ControllerService) {
		// The GroupController is CSI's: asked on the CSI endpoint.
		err := withTimeout(ctx, func(ctx context.Context) error {
			_, err := csi.NewGroupControllerClient(conn).GroupControllerGetCapabilities(ctx, &csi.GroupControllerGetCapabilitiesRequest{})
			return err
		})
		if ok, err := answered(err); err != nil {
			return nil, fmt.Errorf("discovering csi.v1.GroupController: %w", err)
		} else if ok {
			d.addons = append(d.addons, "csi.v1.GroupController")
		}
	}
	if serves(pluginconfig.ControllerService) {
		d.controller(ctx, conn)
	}
	if serves(pluginconfig.NodeService) {
		if err := d.node(ctx, conn); err != nil {
			return nil, err
		}
	}
	if known {
		return d, nil // the csi-addons identity said
	}
	return d, d.optionalServices(ctx, conn, addonsConn, serves, declared)
}

// withTimeout calls f with ctx bounded by the discovery call timeout.
func withTimeout(ctx context.Context, f func(ctx context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, rpcTimeout)
	defer cancel()
	return f(ctx)
}

// identity asks the plugin's identity service its name, version and
// capabilities.
func (d *discovery) identity(ctx context.Context, conn *grpc.ClientConn) error {
	id := csi.NewIdentityClient(conn)
	if err := withTimeout(ctx, func(ctx context.Context) error {
		r, err := id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		d.pluginName, d.vendorVersion = r.GetName(), r.GetVendorVersion()
		return err
	}); err != nil {
		return fmt.Errorf("GetPluginInfo: %w", err)
	}
	if err := withTimeout(ctx, func(ctx context.Context) error {
		r, err := id.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
		for _, c := range r.GetCapabilities() {
			switch {
			case c.GetService() != nil:
				d.pluginCaps = append(d.pluginCaps, c.GetService().GetType().String())
			case c.GetVolumeExpansion() != nil:
				d.pluginCaps = append(d.pluginCaps, "VOLUME_EXPANSION_"+c.GetVolumeExpansion().GetType().String())
			}
		}
		return err
	}); err != nil {
		return fmt.Errorf("GetPluginCapabilities: %w", err)
	}
	return nil
}

// controller asks the plugin's controller service its capabilities (e.g.
// GET_CAPACITY, PUBLISH_UNPUBLISH_VOLUME). They do not gate readiness: a
// controller that cannot say now (its backend unreachable, Unimplemented,
// no answer in time) is taken to have none, and the instance's node
// service is ready all the same.
func (d *discovery) controller(ctx context.Context, conn *grpc.ClientConn) {
	_ = withTimeout(ctx, func(ctx context.Context) error {
		r, err := csi.NewControllerClient(conn).ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
		for _, c := range r.GetCapabilities() {
			d.controllerCaps = append(d.controllerCaps, c.GetRpc().GetType().String())
		}
		return err
	})
}

// node asks the plugin's node service its capabilities and NodeGetInfo
// (node id, topology, volume limit).
func (d *discovery) node(ctx context.Context, conn *grpc.ClientConn) error {
	node := csi.NewNodeClient(conn)
	if err := withTimeout(ctx, func(ctx context.Context) error {
		r, err := node.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
		for _, c := range r.GetCapabilities() {
			d.nodeCaps = append(d.nodeCaps, csicompat.NodeCapabilityName(c.GetRpc().GetType()))
		}
		return err
	}); err != nil {
		return fmt.Errorf("NodeGetCapabilities: %w", err)
	}
	if err := withTimeout(ctx, func(ctx context.Context) error {
		r, err := node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
		d.nodeID, d.topology, d.maxVolumes = r.GetNodeId(), r.GetAccessibleTopology().GetSegments(), r.GetMaxVolumesPerNode()
		return err
	}); err != nil {
		return fmt.Errorf("NodeGetInfo: %w", err)
	}
	return nil
}

// optionalServices finds, without the csi-addons identity, the optional
// services the plugin answers: gRPC server reflection, else the config's
// list (declared), else a read-only call to each service whose calls only
// read. A service whose every call may act (reclaims, key rotation) is
// never called to find out.
func (d *discovery) optionalServices(ctx context.Context, conn, addonsConn *grpc.ClientConn, serves func(pluginconfig.Service) bool, declared []string) error {
	reflections := map[*grpc.ClientConn]reflected{}
	for _, a := range addonServices {
		if !serves(a.role) {
			continue
		}
		c := addonsConn
		if a.csi {
			c = conn
		}
		r, seen := reflections[c]
		if !seen {
			var err error
			if r, err = reflectServices(ctx, c); err != nil {
				return fmt.Errorf("discovering %s: %w", a.name, err)
			}
			reflections[c] = r
		}
		var ok bool
		switch {
		case r.ok:
			ok = r.services[a.name]
		case len(declared) > 0:
			ok = slices.Contains(declared, a.name)
		case a.probe != nil:
			var err error
			if ok, err = answered(withTimeout(ctx, a.probe(c))); err != nil {
				return fmt.Errorf("discovering %s: %w", a.name, err)
			}
		}
		if ok {
			d.addons = append(d.addons, a.name)
		}
	}
	return nil
}

// reflected is what gRPC server reflection lists of an endpoint; ok is
// false when the endpoint does not serve reflection.
type reflected struct {
	ok       bool
	services map[string]bool
}

// reflectServices lists an endpoint's services by gRPC server reflection
// (grpc.reflection.v1): read-only, and the one general way a gRPC server
// says what it serves. Not served (Unimplemented): ok is false.
func reflectServices(ctx context.Context, conn *grpc.ClientConn) (reflected, error) {
	ctx, cancel := context.WithTimeout(ctx, rpcTimeout)
	defer cancel()
	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		return reflected{}, notAnswered(err)
	}
	defer stream.CloseSend()
	err = stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{ListServices: "*"}})
	var resp *reflectionpb.ServerReflectionResponse
	if err == nil || errors.Is(err, io.EOF) {
		// io.EOF: the server ended the stream; Recv has its status.
		resp, err = stream.Recv()
	}
	if status.Code(err) == codes.Unimplemented {
		return reflected{}, nil
	}
	if err != nil {
		return reflected{}, notAnswered(err)
	}
	r := reflected{ok: true, services: map[string]bool{}}
	for _, s := range resp.GetListServicesResponse().GetService() {
		r.services[s.GetName()] = true
	}
	return r, nil
}

// notAnswered keeps the errors that mean the endpoint did not answer (as
// answered does); any other answer is none.
func notAnswered(err error) error {
	_, err = answered(err)
	return err
}

// addonService is an optional service the agent uses: the role that
// serves it, on which endpoint (csi: the CSI one, else the csi-addons
// one), and, for a service whose calls only read, a call with an empty
// request that tells whether it is there (nil: its calls may act, so it is
// never called to find out).
type addonService struct {
	name  string
	role  pluginconfig.Service
	csi   bool
	probe func(*grpc.ClientConn) func(context.Context) error
}

// addonServices are the optional services, by gRPC full name
// (pluginconfig.AddonServices).
var addonServices = []addonService{
	{name: "reclaimspace.ReclaimSpaceNode", role: pluginconfig.NodeService},
	{name: "encryptionkeyrotation.EncryptionKeyRotationController", role: pluginconfig.NodeService},
	{name: "reclaimspace.ReclaimSpaceController", role: pluginconfig.ControllerService},
	{name: "volumegroup.Controller", role: pluginconfig.ControllerService, probe: func(c *grpc.ClientConn) func(context.Context) error {
		return emptyCall(volumegroup.NewControllerClient(c).ControllerGetVolumeGroup)
	}},
	{name: "replication.Controller", role: pluginconfig.ControllerService, probe: func(c *grpc.ClientConn) func(context.Context) error {
		return emptyCall(replication.NewControllerClient(c).GetVolumeReplicationInfo)
	}},
	{name: "fence.FenceController", role: pluginconfig.ControllerService, probe: func(c *grpc.ClientConn) func(context.Context) error {
		return emptyCall(fence.NewFenceControllerClient(c).ListClusterFence)
	}},
	{name: "csi.v1.GroupController", role: pluginconfig.ControllerService, csi: true, probe: func(c *grpc.ClientConn) func(context.Context) error {
		return emptyCall(csi.NewGroupControllerClient(c).GroupControllerGetCapabilities)
	}},
}

// emptyCall calls method with an empty request.
func emptyCall[Req, Resp any](method func(context.Context, *Req, ...grpc.CallOption) (Resp, error)) func(context.Context) error {
	return func(ctx context.Context) error {
		_, err := method(ctx, new(Req))
		return err
	}
}

// answered reads a discovery call's error: Unimplemented means the service
// is absent, a transport failure is an error, any other answer (an empty
// request is usually InvalidArgument) means it is there.
func answered(err error) (bool, error) {
	switch status.Code(err) {
	case codes.Unimplemented:
		return false, nil
	case codes.DeadlineExceeded, codes.Unavailable, codes.Canceled:
		return false, err
	}
	return true, nil
}

// addonsCapabilities asks a csi-addons endpoint's identity.Identity who it
// is and what it offers, filling d (only the services of the roles the
// instance serves). known is false when the endpoint does not serve
// identity (Unimplemented): the caller probes each service instead.
func addonsCapabilities(ctx context.Context, conn *grpc.ClientConn, serves func(pluginconfig.Service) bool, d *discovery) (known bool, _ error) {
	ctx, cancel := context.WithTimeout(ctx, rpcTimeout)
	defer cancel()
	id := identity.NewIdentityClient(conn)
	info, err := id.GetIdentity(ctx, &identity.GetIdentityRequest{})
	if status.Code(err) == codes.Unimplemented {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("csi-addons GetIdentity: %w", err)
	}
	caps, err := id.GetCapabilities(ctx, &identity.GetCapabilitiesRequest{})
	if err != nil {
		return false, fmt.Errorf("csi-addons GetCapabilities: %w", err)
	}
	d.addonsIdentity = strings.TrimSpace(info.GetName() + " " + info.GetVendorVersion())
	node, ctrl := serves(pluginconfig.NodeService), serves(pluginconfig.ControllerService)
	add := func(ok bool, service string) {
		if ok && !slices.Contains(d.addons, service) {
			d.addons = append(d.addons, service)
		}
	}
	for _, c := range caps.GetCapabilities() {
		add(node && c.GetReclaimSpace().GetType() == identity.Capability_ReclaimSpace_ONLINE, "reclaimspace.ReclaimSpaceNode")
		add(ctrl && c.GetReclaimSpace().GetType() == identity.Capability_ReclaimSpace_OFFLINE, "reclaimspace.ReclaimSpaceController")
		add(ctrl && c.GetVolumeGroup().GetType() == identity.Capability_VolumeGroup_VOLUME_GROUP, "volumegroup.Controller")
		add(ctrl && c.GetVolumeReplication().GetType() == identity.Capability_VolumeReplication_VOLUME_REPLICATION, "replication.Controller")
		add(ctrl && c.GetNetworkFence().GetType() == identity.Capability_NetworkFence_NETWORK_FENCE, "fence.FenceController")
		add(node && c.GetEncryptionKeyRotation().GetType() == identity.Capability_EncryptionKeyRotation_ENCRYPTIONKEYROTATION,
			"encryptionkeyrotation.EncryptionKeyRotationController")
	}
	return true, nil
}
