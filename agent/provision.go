package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/retrypolicy"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/namedvol"
	"github.com/csiagent/csiagent/pluginconfig"
	"github.com/csiagent/csiagent/snapcat"
)

// Provisioning: the engine endpoint's CreateVolume and DeleteVolume
// (dockerplugin.Backend), on the plugin's controller.

// Retries of CreateVolume and DeleteVolume: CSI's tables make Aborted (an
// operation on the volume is pending) and the transport's Unavailable and
// DeadlineExceeded worth another call; the rest (AlreadyExists with
// another capacity, ResourceExhausted out of capacity, OutOfRange,
// FailedPrecondition in use, ...) are answers.
var provisionRetry = []codes.Code{codes.Aborted, codes.Unavailable, codes.DeadlineExceeded}

// notCreatedCodes are CreateVolume's answers after which the plugin has
// made no volume (namedvol.ErrNotCreated).
var notCreatedCodes = []codes.Code{codes.InvalidArgument, codes.OutOfRange, codes.ResourceExhausted,
	codes.NotFound, codes.Unimplemented, codes.PermissionDenied, codes.Unauthenticated}

const (
	provisionRetryBase = 500 * time.Millisecond
	provisionRetryMax  = 10 * time.Second
)

func (b engineBackend) CreateVolume(ctx context.Context, d *namedvol.Definition, secrets map[string]string) error {
	ctrl, err := b.a.provisioner(ctx, d.Plugin)
	if err != nil {
		return fmt.Errorf("%w (%w)", err, namedvol.ErrNotCreated)
	}
	p := d.Provision
	req := &csi.CreateVolumeRequest{
		Name:               p.CSIName,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: p.Size},
		VolumeCapabilities: []*csi.VolumeCapability{d.Capability()},
		Parameters:         p.Parameters,
		Secrets:            secrets,
	}
	switch {
	case p.FromSnapshot != "":
		id, err := b.a.snapshotID(d.Plugin, p.FromSnapshot)
		if err != nil {
			return fmt.Errorf("%w (%w)", err, namedvol.ErrNotCreated)
		}
		req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: id}}}
	case p.FromVolume != "":
		req.VolumeContentSource = &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: p.FromVolume}}}
	}
	// This node's topology, required and preferred: the volume is for
	// containers here.
	if seg := ctrl.topology; len(seg) > 0 && ctrl.constrained {
		t := []*csi.Topology{{Segments: seg}}
		req.AccessibilityRequirements = &csi.TopologyRequirement{Requisite: t, Preferred: t}
	}
	var resp *csi.CreateVolumeResponse
	calls, err := callPlugin(ctx, d.Plugin, "CreateVolume", func(ctx context.Context) error {
		var err error
		resp, err = ctrl.client.CreateVolume(ctx, req)
		return err
	})
	if calls == 1 && slices.Contains(notCreatedCodes, status.Code(err)) {
		// The one call's answer: an earlier call that failed (retried:
		// Aborted, Unavailable, DeadlineExceeded) may have made it.
		return fmt.Errorf("%w (%w)", err, namedvol.ErrNotCreated)
	}
	if err != nil {
		return err
	}
	v := resp.GetVolume()
	if v.GetVolumeId() == "" {
		return fmt.Errorf("plugin %s: CreateVolume %s answered no volume id", d.Plugin, req.Name)
	}
	d.Created(v.GetVolumeId(), v.GetVolumeContext(), v.GetAccessibleTopology())
	return nil
}

func (b engineBackend) DeleteVolume(ctx context.Context, typ, volumeID string, secrets map[string]string) error {
	ctrl, err := b.a.provisioner(ctx, typ)
	if err != nil {
		return err
	}
	if err := b.a.iso.WaitRecovered(ctx); err != nil {
		return err
	}
	// Under the volume's lock, off the node: no Prepare of it (an alias,
	// an API caller naming its id) comes between the caller's check that
	// nothing uses it and the deletion.
	return b.a.iso.WhileOffNode(ctx, typ, volumeID, func() error {
		_, err := callPlugin(ctx, typ, "DeleteVolume", func(ctx context.Context) error {
			_, err := ctrl.client.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: volumeID, Secrets: secrets})
			if status.Code(err) == codes.NotFound {
				return nil // deleted already (a removal repeated after a crash)
			}
			return err
		})
		return err
	})
}

// snapshotID is the plugin's id of the snapshot a restore names: an entry
// of the snapshot catalogue (S, or GROUP/VOLUME_ID for a member of a group
// snapshot), which must be of plugin typ; a name whose entry the
// catalogue does not have is the plugin's own id.
func (a *Agent) snapshotID(typ, name string) (string, error) {
	entry, _, _ := strings.Cut(name, "/")
	if _, err := a.snapshots.Get(entry); errors.Is(err, snapcat.ErrNotFound) {
		return name, nil
	}
	plugin, id, err := a.snapshots.Lookup(name)
	switch {
	case err != nil:
		return "", fmt.Errorf("%w: option %s=%s: %w", isolator.ErrPrecondition, namedvol.KeyFromSnapshot, name, err)
	case plugin != typ:
		return "", fmt.Errorf("%w: option %s=%s: snapshot of plugin %s, not %s", isolator.ErrPrecondition, namedvol.KeyFromSnapshot, name, plugin, typ)
	}
	return id, nil
}

// provisionerClient is a plugin's controller that creates volumes, with
// this node's topology.
type provisionerClient struct {
	client csi.ControllerClient
	// topology is the node service's NodeGetInfo accessible_topology;
	// constrained: the plugin has VOLUME_ACCESSIBILITY_CONSTRAINTS (only
	// then may a CO pass accessibility requirements).
	topology    map[string]string
	constrained bool
}

// provisioner waits for the plugin's controller and node services and
// checks that the controller creates volumes (CREATE_DELETE_VOLUME).
func (a *Agent) provisioner(ctx context.Context, typ string) (provisionerClient, error) {
	st, conn, err := a.ready(ctx, typ, pluginconfig.ControllerService)
	if err != nil {
		return provisionerClient{}, fmt.Errorf("plugin %s: its controller, which creates volumes: %w", typ, err)
	}
	if !slices.Contains(st.ControllerCapabilities, csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME.String()) {
		return provisionerClient{}, fmt.Errorf("%w: plugin %s's controller does not create or delete volumes (no CREATE_DELETE_VOLUME; it has %s): name a pre-provisioned volume with volume_id instead",
			isolator.ErrPrecondition, typ, strings.Join(st.ControllerCapabilities, ", "))
	}
	nst, _, err := a.ready(ctx, typ, pluginconfig.NodeService)
	if err != nil {
		return provisionerClient{}, fmt.Errorf("plugin %s: its node service, whose topology new volumes get: %w", typ, err)
	}
	return provisionerClient{
		client:      csi.NewControllerClient(a.set.ConnFor(typ, pluginconfig.ControllerService, "csi.v1.Controller", conn)),
		topology:    nst.AccessibleTopology,
		constrained: slices.Contains(st.PluginCapabilities, csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS.String()),
	}, nil
}

// callPlugin makes one controller RPC until ctx ends, retrying the codes of
// provisionRetry with jittered backoff (retrypolicy.Retry), and says how
// many calls it made. Its error keeps the plugin's code (a status error
// the API passes on) and names the plugin and the RPC.
func callPlugin(ctx context.Context, typ, rpc string, call func(context.Context) error) (attempts int, err error) {
	attempts, err = retrypolicy.Retry(ctx, provisionRetryBase, provisionRetryMax, provisionRetry, call, nil)
	if err == nil {
		return attempts, nil
	}
	s := status.Convert(err)
	return attempts, status.Errorf(s.Code(), "plugin %s: %s: %s (after %d call(s))", typ, rpc, s.Message(), attempts)
}
