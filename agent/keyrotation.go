package agent

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/controllerops"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/reclaim"
)

// DefaultKeyRotationTimeout bounds one scheduled EncryptionKeyRotate call.
const DefaultKeyRotationTimeout = 10 * time.Minute

// keyRotationTarget lets a second instance of the reclaim scheduler rotate
// the keys of published volumes: same slots, caps, error table and
// persisted next run, another call.
type keyRotationTarget struct{ a *Agent }

var _ reclaim.Target = keyRotationTarget{}

// Volumes lists published volumes of plugins that offer key rotation.
func (t keyRotationTarget) Volumes() []reclaim.Volume {
	return t.a.publishedOffering(controllerops.KeyRotationService, func(pv isolator.PublishedVolume) time.Time { return pv.NextKeyRotation })
}

// Reclaim (the scheduler's call) rotates the volume's key once.
func (t keyRotationTarget) Reclaim(ctx context.Context, plugin, id string) (reclaim.Result, error) {
	start := time.Now()
	err := t.a.ctrlops.RotateKeyOnce(ctx, plugin, id)
	if status.Code(err) == codes.FailedPrecondition {
		if _, published := controllerPlugins(t).Published(plugin, id); !published {
			err = fmt.Errorf("%w: %w", reclaim.ErrNotPublished, err)
		}
	}
	t.a.metrics.keyRotations.WithLabelValues(plugin, codeOf(err)).Inc()
	return reclaim.Result{Start: start, Duration: time.Since(start), PreUsage: -1, PostUsage: -1}, err
}

func (t keyRotationTarget) Schedule(plugin, id string, next time.Time) error {
	return t.a.iso.ScheduleKeyRotation(context.Background(), plugin, id, next)
}
