package agent

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/controllerops"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
)

// keyRotation is what one scheduled EncryptionKeyRotate call reports.
type keyRotation struct {
	Start    time.Time
	Duration time.Duration
}

// LogValue is how the schedule logs a successful rotation.
func (r keyRotation) LogValue() slog.Value {
	return slog.GroupValue(slog.Time("start", r.Start), slog.Duration("duration", r.Duration))
}

// keyRotationJob is the key rotation schedule's job: EncryptionKeyRotate
// on the published volumes of plugins that offer it (same slots, caps
// rules, error table and persisted next run as reclaim, another call and
// its own caps).
type keyRotationJob struct{ a *Agent }

var _ pervolume.Job[keyRotation] = keyRotationJob{}

// Volumes lists published volumes of plugins that offer key rotation.
func (j keyRotationJob) Volumes() []pervolume.Volume {
	return j.a.publishedOffering(controllerops.KeyRotationService, func(pv isolator.PublishedVolume) time.Time { return pv.NextKeyRotation })
}

// Do rotates the volume's key once.
func (j keyRotationJob) Do(ctx context.Context, plugin, id string) (keyRotation, error) {
	start := time.Now()
	err := j.a.ctrlops.RotateKeyOnce(ctx, plugin, id)
	if status.Code(err) == codes.FailedPrecondition {
		if _, published := controllerPlugins(j).Published(plugin, id); !published {
			err = fmt.Errorf("%w: %w", pervolume.ErrNotPublished, err)
		}
	}
	j.a.metrics.keyRotations.WithLabelValues(plugin, codeOf(err)).Inc()
	return keyRotation{Start: start, Duration: time.Since(start)}, err
}

func (j keyRotationJob) Schedule(plugin, id string, next time.Time) error {
	return j.a.iso.ScheduleKeyRotation(context.Background(), plugin, id, next)
}
