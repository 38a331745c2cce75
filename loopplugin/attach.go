package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/loopdev"
)

// Attach mode (the default; Config.NodeOnly turns it off): the controller
// attaches. ControllerPublishVolume attaches the image to a loop device of
// its own (no autoclear: it stays attached with nothing mounted) and
// records the attachment in the pool (.csi-loop/attachments/<id>.json,
// written atomically before the call returns); NodeStageVolume stages from
// the device the publish_context names, which must still back the image
// (after a reboot, or a detach, it does not: FailedPrecondition, attach
// again); NodeUnstageVolume leaves it attached; ControllerUnpublishVolume
// detaches it once nothing is mounted from it. The plugin holds the
// device open (see held), so a container given its node cannot detach it.
//
// In node-only mode (and for volumes staged by a release before attach
// mode, which have no attachment record) NodeStageVolume attaches the
// device itself and NodeUnstageVolume detaches it.

// publish_context keys of ControllerPublishVolume.
const (
	// ContextDevice is the loop device's path, /dev/loopN.
	ContextDevice = "device"
	// ContextDeviceNumber is its number, "major:minor": with the image's
	// identity, what NodeStageVolume checks (a path alone may name another
	// file's device after a reboot or a detach).
	ContextDeviceNumber = "deviceNumber"
)

// attachment is the record of a controller attach.
type attachment struct {
	NodeID   string `json:"node_id"`
	Device   string `json:"device"`
	Major    uint32 `json:"major"`
	Minor    uint32 `json:"minor"`
	ReadOnly bool   `json:"read_only"`
}

func (a attachment) rdev() uint64 { return unix.Mkdev(a.Major, a.Minor) }

func (a attachment) publishContext() map[string]string {
	return map[string]string{ContextDevice: a.Device, ContextDeviceNumber: fmt.Sprintf("%d:%d", a.Major, a.Minor)}
}

// attachmentOf returns the volume's attachment record; ok is false when
// there is none.
func (p *Plugin) attachmentOf(id string) (a attachment, ok bool, err error) {
	err = p.pool.readRecord(metaAttachments, id, &a)
	if errors.Is(err, ErrNotFound) {
		return attachment{}, false, nil
	}
	return a, err == nil, err
}

// attachedDevice returns the device of the volume's attachment if it still
// backs the image.
func (p *Plugin) attachedDevice(vol Volume, ds devices) (loopdev.Device, attachment, bool, error) {
	a, ok, err := p.attachmentOf(vol.ID)
	if err != nil || !ok {
		return loopdev.Device{}, a, false, err
	}
	d, ok := ds.withRdev(a.rdev())
	return d, a, ok, nil
}

// ControllerPublishVolume attaches the volume to this node (see Attach
// mode above). Attached already with the same read-only setting: the same
// answer; with another: AlreadyExists. Another node id: NotFound (this
// plugin's volumes are reachable from its own node only).
func (s *controllerServer) ControllerPublishVolume(ctx context.Context, req *csi.ControllerPublishVolumeRequest) (*csi.ControllerPublishVolumeResponse, error) {
	p := s.p
	if p.nodeOnly {
		return nil, unimplementedf("ControllerPublishVolume: the plugin runs in node-only mode (--node-only)")
	}
	var capErr error
	if req.GetVolumeCapability() == nil {
		capErr = invalidf("volume_capability is required")
	} else if _, err := p.parseCapability(req.GetVolumeCapability()); err != nil {
		capErr = err
	}
	var nodeErr error
	if req.GetNodeId() == "" {
		nodeErr = invalidf("node_id is required")
	}
	vol, unlock, err := p.lockedVolume(ctx, req.GetVolumeId(), false, nodeErr, capErr)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if req.GetNodeId() != p.nodeID {
		return nil, notFoundf("node %q: the volumes of pool %s are reachable from node %q only", req.GetNodeId(), p.pool.Dir(), p.nodeID)
	}
	ds, err := devicesOf(vol)
	if err != nil {
		return nil, err
	}
	if _, a, ok, err := p.attachedDevice(vol, ds); err != nil {
		return nil, err
	} else if ok {
		if a.ReadOnly != req.GetReadonly() {
			return nil, incompatiblef("volume %s is attached with readonly=%v", vol.ID, a.ReadOnly)
		}
		return &csi.ControllerPublishVolumeResponse{PublishContext: a.publishContext()}, nil
	}
	// One new attachment at a time: two cannot both take the last place.
	p.attachMu.Lock()
	defer p.attachMu.Unlock()
	if err := p.checkAttachLimit(); err != nil {
		return nil, err
	}
	dev, f, err := loopdev.Attach(ctx, vol.Path, loopdev.Options{ReadOnly: req.GetReadonly()})
	if err != nil {
		return nil, fmt.Errorf("attach volume %s: %w", vol.ID, err)
	}
	a := attachment{NodeID: p.nodeID, Device: dev.Path, Major: dev.Major, Minor: dev.Minor, ReadOnly: req.GetReadonly()}
	if err := p.pool.writeRecord(metaAttachments, vol.ID, a); err != nil {
		f.Close()
		return nil, errors.Join(err, loopdev.Detach(dev, vol.Path))
	}
	p.held.keep(dev.Name, f)
	p.log.Info("attached", "volume", vol.ID, "device", dev.Path, "read_only", a.ReadOnly)
	return &csi.ControllerPublishVolumeResponse{PublishContext: a.publishContext()}, nil
}

// ControllerUnpublishVolume detaches the volume's attachment: refused
// (FailedPrecondition) while it is staged or published; a volume that is
// not attached, or does not exist, is detached already.
func (s *controllerServer) ControllerUnpublishVolume(ctx context.Context, req *csi.ControllerUnpublishVolumeRequest) (*csi.ControllerUnpublishVolumeResponse, error) {
	p := s.p
	if p.nodeOnly {
		return nil, unimplementedf("ControllerUnpublishVolume: the plugin runs in node-only mode (--node-only)")
	}
	vol, unlock, err := p.lockedVolume(ctx, req.GetVolumeId(), false)
	if errors.Is(err, ErrNotFound) {
		return &csi.ControllerUnpublishVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	defer unlock()
	if n := req.GetNodeId(); n != "" && n != p.nodeID {
		return &csi.ControllerUnpublishVolumeResponse{}, nil // never attached there
	}
	ds, err := devicesOf(vol)
	if err != nil {
		return nil, err
	}
	d, _, ok, err := p.attachedDevice(vol, ds)
	if err != nil {
		return nil, err
	}
	if ok {
		byDev, err := ds.mounts()
		if err != nil {
			return nil, err
		}
		if at := byDev[d.Name]; len(at) > 0 {
			return nil, preconditionf("volume %s is still staged or published at %s: unpublish and unstage it first", vol.ID, strings.Join(at, ", "))
		}
		p.held.release(d.Name)
		if err := loopdev.Detach(d, vol.Path); err != nil {
			return nil, fmt.Errorf("volume %s: %w", vol.ID, err)
		}
		p.log.Info("detached", "volume", vol.ID, "device", d.Path)
	}
	if err := p.pool.removeRecord(metaAttachments, vol.ID); err != nil {
		return nil, fmt.Errorf("volume %s: %w", vol.ID, err)
	}
	return &csi.ControllerUnpublishVolumeResponse{}, nil
}

// stageDevice is the device NodeStageVolume stages in attach mode: the one
// the publish_context names, if it is the volume's attachment and still
// backs the image. In node-only mode, none (the stage attaches).
func (p *Plugin) stageDevice(vol Volume, pc map[string]string) (*loopdev.Device, error) {
	if p.nodeOnly {
		return nil, nil
	}
	path, number := pc[ContextDevice], pc[ContextDeviceNumber]
	if path == "" || number == "" {
		return nil, preconditionf("volume %s is not attached: publish_context has no %s and %s (ControllerPublishVolume must be called before NodeStageVolume: declare CONTROLLER_SERVICE in the plugin's config, so that the CO attaches it, or run csi-loop-plugin --node-only for a CO that never attaches)", vol.ID, ContextDevice, ContextDeviceNumber)
	}
	rdev, err := parseDeviceNumber(number)
	if err != nil {
		return nil, invalidf("publish_context %s %q: %v", ContextDeviceNumber, number, err)
	}
	ds, err := devicesOf(vol)
	if err != nil {
		return nil, err
	}
	d, a, ok, err := p.attachedDevice(vol, ds)
	if err != nil {
		return nil, err
	}
	if !ok || a.rdev() != rdev || d.Path != path {
		return nil, preconditionf("volume %s is not attached as publish_context says (%s, %s): attached again or detached since (a reboot detaches every loop device); call ControllerPublishVolume again", vol.ID, path, number)
	}
	return &d, nil
}

// parseDeviceNumber parses "major:minor".
func parseDeviceNumber(s string) (uint64, error) {
	maj, min, ok := strings.Cut(s, ":")
	if !ok {
		return 0, errors.New("want major:minor")
	}
	a, err := strconv.ParseUint(maj, 10, 32)
	if err != nil {
		return 0, err
	}
	b, err := strconv.ParseUint(min, 10, 32)
	if err != nil {
		return 0, err
	}
	return unix.Mkdev(uint32(a), uint32(b)), nil
}

// checkAttachLimit refuses a new attachment (ResourceExhausted) when
// max_volumes_per_node volumes are attached already. Attachments are
// counted from the records whose device still backs their image.
func (p *Plugin) checkAttachLimit() error {
	if p.maxVolumes <= 0 {
		return nil
	}
	ids, err := p.pool.listRecords(metaAttachments)
	if err != nil {
		return err
	}
	n := 0
	for _, id := range ids {
		vol, err := p.pool.Get(id)
		if err != nil {
			continue // a record of a deleted volume
		}
		ds, err := devicesOf(vol)
		if err != nil {
			return err
		}
		if _, _, ok, err := p.attachedDevice(vol, ds); err != nil {
			return err
		} else if ok {
			n++
		}
	}
	if int64(n) >= p.maxVolumes {
		return limitf("%d volume(s) are attached to node %s, its max_volumes_per_node: detach one first", n, p.nodeID)
	}
	return nil
}
