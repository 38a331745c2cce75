package supervisor

import (
	"fmt"
	"log/slog"

	"github.com/csiagent/csiagent/internal/cgroup"
	"github.com/csiagent/csiagent/pluginconfig"
)

// Limiter enforces managed plugins' Mesos resources (cpus, mem) with
// cgroup v2, where the host allows it. A nil *Limiter enforces nothing.
type Limiter struct {
	m *cgroup.Manager // nil: limits are not enforced
}

// NewLimiter finds out, once, whether limits can be enforced, and says so
// when they cannot.
func NewLimiter(log *slog.Logger) *Limiter {
	m, err := cgroup.Detect(cgroup.Config{Logger: log})
	if err != nil {
		log.Warn("plugin resource limits (cpus, mem) will not be enforced; plugins run without them", "reason", err)
		return &Limiter{}
	}
	return &Limiter{m: m}
}

// prepare returns a cgroup directory fd for the plugin's process to be
// born in, or -1 when there is nothing to enforce, and a cleanup that
// closes the agent's copy of the fd.
func (l *Limiter) prepare(in *instance, resources []pluginconfig.Resource) (int, func(), error) {
	nothing := func() {}
	if l == nil || l.m == nil {
		return -1, nothing, nil
	}
	lim, any, err := limitsOf(resources)
	if err != nil || !any {
		return -1, nothing, err
	}
	dir, err := l.m.Prepare(in.cgroupName(), lim)
	if err != nil {
		return -1, nothing, fmt.Errorf("applying resource limits: %w", err)
	}
	return int(dir.Fd()), func() { dir.Close() }, nil
}

// limitsOf is the cgroup limits of a plugin container's resources (cpus,
// mem; the others are not enforced); any is false when it names neither.
func limitsOf(resources []pluginconfig.Resource) (lim cgroup.Limits, any bool, err error) {
	var cpus, mem float64
	for _, r := range resources {
		if r.Scalar == nil {
			continue
		}
		switch r.Name {
		case "cpus":
			cpus += r.Scalar.Value
		case "mem":
			mem += r.Scalar.Value
		}
	}
	if cpus == 0 && mem == 0 {
		return cgroup.Limits{}, false, nil
	}
	if lim, err = cgroup.LimitsFor(cpus, mem); err != nil {
		return cgroup.Limits{}, false, fmt.Errorf("resources: %w", err)
	}
	return lim, true, nil
}

// release removes the cgroup name (an instance's cgroupName) once its
// process has exited.
func (l *Limiter) release(log *slog.Logger, name string) {
	if l == nil || l.m == nil {
		return
	}
	if err := l.m.Remove(name); err != nil {
		log.Warn("removing plugin cgroup", "cgroup", name, "error", err)
	}
}
