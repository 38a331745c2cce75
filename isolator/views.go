package isolator

import (
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/timestamppb"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// VolumeInfo is a tracked volume as ListVolumes reports it (no secrets).
type VolumeInfo struct {
	Plugin, ID string
	State      statev1.VolumeCheckpoint_State
	StateSince time.Time
	// Users are the containers using the volume: its reference count.
	Users                   []string
	StagingPath, TargetPath string
	Block, Readonly         bool
	// Capability is the one the volume is staged and published with (nil
	// for a volume rebuilt without its request).
	Capability *csi.VolumeCapability
	LastError  string
	// NextReclaim and NextKeyRotation are the persisted next runs (zero:
	// none persisted yet); LastReclaim the last reclaim's result (nil:
	// none); Reclaiming a reclaim call runs now.
	NextReclaim, NextKeyRotation time.Time
	LastReclaim                  *statev1.ReclaimResult
	Reclaiming                   bool
	// LastRepair says what the last repair did ("": never repaired).
	LastRepair string
	// Pending says why nothing is done to the volume for now (its plugin
	// has no config); "": nothing waits.
	Pending string
	// Attached: ControllerPublishVolume attached it to this node, with
	// PublishContext.
	Attached       bool
	PublishContext map[string]string
}

// ContainerInfo is a container with volumes as ListContainers reports it.
type ContainerInfo struct {
	ID     string
	Phase  statev1.ContainerCheckpoint_Phase
	Mounts []*statev1.ContainerMount
	// Rootfs and Manager are the request's; LastError why its last
	// operation failed.
	Rootfs, Manager, LastError string
}

// ReconcileResult is what Reconcile cleaned up, and what it could not
// (container id: why; Reconcile or Cleanup retries).
type ReconcileResult struct {
	CleanedUp []string
	Failed    map[string]string
}

// optionalTime is t, or the zero time for an unset timestamp.
func optionalTime(t *timestamppb.Timestamp) time.Time {
	if t == nil {
		return time.Time{}
	}
	return t.AsTime()
}
