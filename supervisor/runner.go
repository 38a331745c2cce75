package supervisor

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/defaults"
	"github.com/csiagent/csiagent/pluginconfig"
)

// Config is what every supervised plugin shares. Zero durations take the
// defaults.
type Config struct {
	// WorkDir keeps process records and logs under csi/<type>/<name>/;
	// RuntimeDir the plugins' sockets.
	WorkDir, RuntimeDir string
	// Commit writes the process records and makes their directories: the
	// daemon's Committer of WorkDir. Nil: one without a root (tests).
	Commit *atomicfile.Committer
	// NodeID is given to node plugins as MESOS_AGENT_ID.
	NodeID        string
	ReadyTimeout  time.Duration
	ProbeInterval time.Duration
	BackoffBase   time.Duration
	BackoffMax    time.Duration
	BackoffReset  time.Duration
	Logger        *slog.Logger
	// Limits enforces managed plugins' resources; nil: they run without.
	Limits *Limiter
	// Interceptor, if set, wraps every unary call on a connection to a
	// plugin of type typ (the daemon counts them).
	Interceptor func(typ string) grpc.UnaryClientInterceptor
	// OnChange is called after any instance's status changed.
	OnChange func()
	// OnReady is called when an instance of plugin typ has become ready:
	// a new process may implement what the last did not.
	OnReady func(typ string)
}

func (c *Config) setDefaults() {
	defaults.Set(&c.ReadyTimeout, DefaultReadyTimeout)
	defaults.Set(&c.ProbeInterval, DefaultProbeInterval)
	defaults.Set(&c.BackoffBase, DefaultBackoffBase)
	defaults.Set(&c.BackoffMax, DefaultBackoffMax)
	defaults.Set(&c.BackoffReset, DefaultBackoffReset)
	c.Logger = defaults.Logger(c.Logger)
	if c.Commit == nil {
		c.Commit = &atomicfile.Committer{}
	}
	if c.OnChange == nil {
		c.OnChange = func() {}
	}
	if c.OnReady == nil {
		c.OnReady = func(string) {}
	}
}

// Plugin supervises one plugin config: one instance per container
// (managed) or endpoint (unmanaged), each kept healthy by its own
// goroutine until Stop.
type Plugin struct {
	cfg       Config
	plugin    *pluginconfig.Plugin
	instances []*instance
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

// Handover holds the live processes of a stopped Plugin, by container
// index, for its successor to keep (see Start).
type Handover map[int]*handover

// Start supervises p until Stop. Processes in inherit whose container's
// launch config is unchanged are kept; the others are stopped.
func Start(ctx context.Context, cfg Config, p *pluginconfig.Plugin, inherit Handover) *Plugin {
	cfg.setDefaults()
	r := &Plugin{cfg: cfg, plugin: p}
	info := p.Info
	base := filepath.Join("csi", info.Type, info.Name)
	for i := range info.Containers {
		c := &info.Containers[i]
		socket := socketPath(cfg.RuntimeDir, info, i)
		in := r.newInstance(c.Services, socket, i)
		in.container = c
		in.dir = filepath.Join(cfg.WorkDir, base, "containers", fmt.Sprint(i))
		in.logDir = r.LogDir()
		in.logPrefix = containerLabel(fmt.Sprint(i))
		in.hash = configHash(*c, socket, cfg.NodeID)
		// Served there only if the command passes it on (optional).
		if addons := filepath.Join(cfg.RuntimeDir, base, fmt.Sprintf("c%d-addons.sock", i)); len(addons) <= MaxSocketPath {
			in.addonsSocket = addons
		}
		in.inherit = inherit[i]
	}
	for i, e := range info.Endpoints {
		// One instance per distinct socket: an unmanaged plugin often
		// serves both services on one.
		if prev := r.bySocket(e.SocketPath()); prev != nil {
			prev.services = append(prev.services, e.CSIService)
			prev.status.Services = append(prev.status.Services, string(e.CSIService))
			continue
		}
		in := r.newInstance([]pluginconfig.Service{e.CSIService}, e.SocketPath(), i)
		if st := info.Settings; st != nil && st.CSIAddonsEndpoint != "" {
			in.addonsSocket = pluginconfig.Endpoint{Endpoint: st.CSIAddonsEndpoint}.SocketPath()
		}
	}
	// Processes of containers the config no longer has must go.
	for i, h := range inherit {
		if i >= len(info.Containers) {
			terminate(ctx, h.proc)
			h.proc.release()
		}
	}
	ctx, r.cancel = context.WithCancel(ctx)
	for _, in := range r.instances {
		r.wg.Go(func() { in.run(ctx) })
	}
	return r
}

func (r *Plugin) newInstance(services []pluginconfig.Service, socket string, i int) *instance {
	names := make([]string, len(services))
	for k, s := range services {
		names[k] = string(s)
	}
	in := &instance{
		cfg:      &r.cfg,
		log:      r.cfg.Logger.With("plugin", r.plugin.Info.Type, "instance", i),
		typ:      r.plugin.Info.Type,
		pluginID: r.plugin.Info.Type + ":" + r.plugin.Info.Name,
		services: append([]pluginconfig.Service(nil), services...),
		socket:   socket,
		declaredAddons: func() []string {
			if st := r.plugin.Info.Settings; st != nil {
				return st.CSIAddonsServices
			}
			return nil
		}(),
		status: &InstanceStatus{
			Services:   names,
			Endpoint:   "unix://" + socket,
			State:      StateStarting,
			StateSince: time.Now(),
		},
	}
	r.instances = append(r.instances, in)
	return in
}

func (r *Plugin) bySocket(socket string) *instance {
	for _, in := range r.instances {
		if in.socket == socket {
			return in
		}
	}
	return nil
}

// Config is the plugin config supervised.
func (r *Plugin) Config() *pluginconfig.Plugin { return r.plugin }

// LogDir is where a managed plugin's process logs are.
func (r *Plugin) LogDir() string {
	return filepath.Join(r.cfg.WorkDir, "csi", r.plugin.Info.Type, r.plugin.Info.Name, "logs")
}

// Stop ends supervision. With terminate, managed processes are stopped
// too; without, their live processes are returned for a successor (Start)
// to keep, or to be released and left for the next agent to adopt.
func (r *Plugin) Stop(terminate bool) Handover {
	r.cancel()
	r.wg.Wait()
	out := Handover{}
	for i, in := range r.instances {
		if in.managed() {
			if terminate {
				in.stopProcess(context.Background())
			} else if h := in.release(); h != nil {
				out[i] = h
			}
		}
		in.update(func(s *InstanceStatus) {
			s.State, s.NextStart = StateStopped, time.Time{}
		})
	}
	return out
}

// Release lets go of the processes without stopping them: the next agent
// adopts them.
func (h Handover) Release() {
	for _, p := range h {
		p.proc.release()
	}
}

// Status reports the plugin and its instances; the plugin is as healthy
// as its least healthy instance.
func (r *Plugin) Status() *PluginStatus {
	info := r.plugin.Info
	p := &PluginStatus{
		Type: info.Type, Name: info.Name, ConfigFile: r.plugin.File, Managed: info.Managed(),
		State: StateReady,
	}
	for _, in := range r.instances {
		s := in.snapshot()
		p.Instances = append(p.Instances, s)
		if s.State != StateReady && p.State == StateReady {
			p.State = s.State
		}
	}
	return p
}

// Instance finds the instance serving svc: its status and, while it is
// ready, its connection (nil otherwise). ok is false when no instance
// serves svc.
func (r *Plugin) Instance(svc pluginconfig.Service) (status *InstanceStatus, conn *grpc.ClientConn, ok bool) {
	var in *instance
	for _, cand := range r.instances {
		if slices.Contains(cand.services, svc) {
			in = cand
		}
	}
	if in == nil {
		return nil, nil, false
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	status = in.status.clone()
	if status.State == StateReady {
		conn = in.conn
	}
	return status, conn, true
}

// ConnFor is the connection that serves service (a discovery name such as
// replication.Controller) on the instance serving svc, while it is ready
// (nil otherwise): the csi-addons endpoint's for csi-addons services when
// the instance has one, else its CSI connection.
func (r *Plugin) ConnFor(svc pluginconfig.Service, service string) *grpc.ClientConn {
	var in *instance
	for _, cand := range r.instances {
		if slices.Contains(cand.services, svc) {
			in = cand
		}
	}
	if in == nil {
		return nil
	}
	in.mu.Lock()
	conn := in.conn
	ready := in.status.State == StateReady
	in.mu.Unlock()
	if !ready || conn == nil {
		return nil
	}
	return in.connFor(service, conn)
}

// Offers reports whether an instance's discovery found the csi-addons or
// CSI service (e.g. "volumegroup.Controller").
func (r *Plugin) Offers(service string) bool {
	for _, in := range r.instances {
		if slices.Contains(in.snapshot().AddonsServices, service) {
			return true
		}
	}
	return false
}
