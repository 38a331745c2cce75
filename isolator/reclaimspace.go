package isolator

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/csiagent/csiagent/internal/retrypolicy"
	"github.com/csiagent/csiagent/proto/reclaimspace"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// ReclaimNode is the csi-addons call the isolator makes on a plugin.
type ReclaimNode interface {
	NodeReclaimSpace(ctx context.Context, in *reclaimspace.NodeReclaimSpaceRequest, opts ...grpc.CallOption) (*reclaimspace.NodeReclaimSpaceResponse, error)
}

// ReclaimController is the offline csi-addons call.
type ReclaimController interface {
	ControllerReclaimSpace(ctx context.Context, in *reclaimspace.ControllerReclaimSpaceRequest, opts ...grpc.CallOption) (*reclaimspace.ControllerReclaimSpaceResponse, error)
}

// PublishedVolume is a published volume and its reclaim and key rotation
// schedules.
type PublishedVolume struct {
	Plugin, ID                   string
	NextReclaim, NextKeyRotation time.Time
	// Since is when the volume was published.
	Since time.Time
}

// Published lists the published volumes.
func (iso *Isolator) Published() []PublishedVolume {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	out := make([]PublishedVolume, 0, len(iso.volumes))
	for k, v := range iso.volumes {
		if v.cp.GetState() != stPublished {
			continue
		}
		pv := PublishedVolume{Plugin: k.plugin, ID: k.id}
		if s := v.cp.GetStateSince(); s != nil {
			pv.Since = s.AsTime()
		}
		if n := v.cp.GetNextReclaim(); n != nil {
			pv.NextReclaim = n.AsTime()
		}
		if n := v.cp.GetNextKeyRotation(); n != nil {
			pv.NextKeyRotation = n.AsTime()
		}
		out = append(out, pv)
	}
	return out
}

// ScheduleReclaim persists a volume's next reclaim time.
func (iso *Isolator) ScheduleReclaim(ctx context.Context, plugin, id string, next time.Time) error {
	return iso.schedule(ctx, plugin, id, func(cp *statev1.VolumeCheckpoint) { cp.NextReclaim = timestamppb.New(next) })
}

// ScheduleKeyRotation persists a volume's next key rotation time.
func (iso *Isolator) ScheduleKeyRotation(ctx context.Context, plugin, id string, next time.Time) error {
	return iso.schedule(ctx, plugin, id, func(cp *statev1.VolumeCheckpoint) { cp.NextKeyRotation = timestamppb.New(next) })
}

// schedule records a schedule's next run with a volume.
func (iso *Isolator) schedule(ctx context.Context, plugin, id string, set func(cp *statev1.VolumeCheckpoint)) error {
	return iso.withVolume(ctx, volumeKey{plugin, id}, func(v *volume) error {
		if v == nil {
			return ErrNotPublished
		}
		return iso.updateVolume(v, set)
	})
}

// ReclaimSpace calls NodeReclaimSpace on a published volume with its lock
// held, so it never overlaps a prepare or a cleanup of the volume; a
// second reclaim of the volume while one runs fails with Aborted; the
// cleanup that removes the volume's last user cancels it and refuses new
// ones (ErrNotPublished).
// The result is kept with the volume. The error is the plugin's status
// error (its code drives the caller's retry policy), or wraps
// ErrNotPublished.
func (iso *Isolator) ReclaimSpace(ctx context.Context, client ReclaimNode, plugin, id string) (*statev1.ReclaimResult, error) {
	key := volumeKey{plugin, id}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	iso.mu.Lock()
	switch {
	case iso.reclaiming[key] != nil:
		iso.mu.Unlock()
		return nil, status.Errorf(codes.Aborted, "volume %s: a reclaim of it is already running", key)
	case iso.releasing[key] > 0:
		iso.mu.Unlock()
		return nil, fmt.Errorf("volume %s: its last container is being cleaned up: %w", key, ErrNotPublished)
	}
	iso.reclaiming[key] = cancel
	iso.mu.Unlock()
	defer func() {
		iso.mu.Lock()
		delete(iso.reclaiming, key)
		iso.mu.Unlock()
	}()
	var res *statev1.ReclaimResult
	var callErr error
	err := iso.withVolume(ctx, key, func(v *volume) error {
		if v == nil || v.cp.GetState() != stPublished {
			return fmt.Errorf("volume %s: %w", key, ErrNotPublished)
		}
		static := v.cp.GetStaticProvisioning()
		secrets, err := iso.resolveSecrets(static.GetNodeStageSecrets())
		if err != nil {
			return fmt.Errorf("volume %s: node_stage_secrets: %w", key, err)
		}
		req := &reclaimspace.NodeReclaimSpaceRequest{
			VolumeId: id, VolumePath: v.cp.GetTargetPath(), VolumeCapability: static.GetVolumeCapability(), Secrets: secrets,
		}
		node, err := iso.cfg.Plugins.Node(ctx, plugin)
		if err != nil {
			return err
		}
		if node.StageUnstage {
			req.StagingTargetPath = v.cp.GetStagingPath()
		}
		iso.setReclaimActive(key, true)
		start := time.Now()
		resp, err := client.NodeReclaimSpace(ctx, req)
		iso.setReclaimActive(key, false)
		iso.cfg.CrashPoint("rpc NodeReclaimSpace")
		res = reclaimResult(start, resp.GetPreUsage().GetUsageBytes(), resp.GetPostUsage().GetUsageBytes(),
			resp.GetPreUsage() != nil, resp.GetPostUsage() != nil, err)
		callErr = err
		return iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.LastReclaim = res })
	})
	if err != nil {
		return nil, err
	}
	return res, callErr
}

// ReclaimOffline calls ControllerReclaimSpace for a volume that is not
// published on this host, with the request's secrets and parameters, and
// retries as csi-addons' error table says (policy: attempts and
// backoff): Aborted (another operation on the volume is pending) and
// NotFound (the volume may not be visible yet) with exponential backoff,
// and Unavailable and DeadlineExceeded (the plugin's transport); any
// other code ends it. The volume stays locked meanwhile: it cannot be
// published while its space is reclaimed offline.
func (iso *Isolator) ReclaimOffline(ctx context.Context, client ReclaimController, plugin, id string, secrets, params map[string]string, policy retrypolicy.Policy) (*statev1.ReclaimResult, error) {
	var res *statev1.ReclaimResult
	var callErr error
	err := iso.withVolume(ctx, volumeKey{plugin, id}, func(v *volume) error {
		if v != nil {
			return fmt.Errorf("%w: volume %s/%s is in use on this host (%s): reclaim it online", ErrPrecondition, plugin, id, v.cp.GetState())
		}
		req := &reclaimspace.ControllerReclaimSpaceRequest{VolumeId: id, Secrets: secrets, Parameters: params}
		for attempt := 1; ; attempt++ {
			start := time.Now()
			resp, err := client.ControllerReclaimSpace(ctx, req)
			res = reclaimResult(start, resp.GetPreUsage().GetUsageBytes(), resp.GetPostUsage().GetUsageBytes(),
				resp.GetPreUsage() != nil, resp.GetPostUsage() != nil, err)
			callErr = err
			if err == nil || !offlineRetried[status.Code(err)] || attempt >= policy.Attempts {
				return nil
			}
			wait := policy.Backoff(attempt)
			iso.log.Info("retrying ControllerReclaimSpace", "volume", plugin+"/"+id, "attempt", attempt, "code", status.Code(err).String(), "wait", wait)
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil // the last answer stands
			case <-t.C:
			}
		}
	})
	if err != nil {
		return nil, err
	}
	return res, callErr
}

// offlineRetried are the ControllerReclaimSpace codes retried with
// backoff (csi-addons' error table; the transport's).
var offlineRetried = map[codes.Code]bool{
	codes.Aborted: true, codes.NotFound: true, codes.Unavailable: true, codes.DeadlineExceeded: true,
}

func reclaimResult(start time.Time, pre, post int64, hasPre, hasPost bool, err error) *statev1.ReclaimResult {
	res := &statev1.ReclaimResult{
		Start: timestamppb.New(start), Duration: durationpb.New(time.Since(start)),
		Outcome: "ok", PreUsage: -1, PostUsage: -1,
	}
	if hasPre {
		res.PreUsage = pre
	}
	if hasPost {
		res.PostUsage = post
	}
	if hasPre && hasPost {
		res.BytesReclaimed = pre - post
	}
	if err != nil {
		st := status.Convert(err)
		res.Outcome, res.Code = st.Message(), st.Code().String()
	}
	return res
}

// releaseLast, when id is the volume's last user, keeps new reclaims of
// the volume off and cancels the one running (at most one runs), so the
// cleanup does not wait for it. It reports whether it cancelled one; done
// lets reclaims in again.
func (iso *Isolator) releaseLast(key volumeKey, id string) (cancelled bool, done func()) {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	v := iso.volumes[key]
	if v == nil || len(v.cp.GetUsers()) != 1 || v.cp.GetUsers()[0] != id {
		return false, func() {}
	}
	iso.releasing[key]++
	if cancel := iso.reclaiming[key]; cancel != nil {
		cancel()
		cancelled = true
	}
	return cancelled, func() {
		iso.mu.Lock()
		if iso.releasing[key]--; iso.releasing[key] == 0 {
			delete(iso.releasing, key)
		}
		iso.mu.Unlock()
	}
}

// reclaimCancelWait bounds a cleanup's wait for a reclaim it cancelled to
// let go of the volume.
const reclaimCancelWait = 5 * time.Second

func (iso *Isolator) setReclaimActive(key volumeKey, on bool) {
	iso.mu.Lock()
	if on {
		iso.reclaimActive[key] = true
	} else {
		delete(iso.reclaimActive, key)
	}
	iso.mu.Unlock()
	iso.cfg.OnChange()
}
