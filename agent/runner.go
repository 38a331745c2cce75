package agent

import (
	"context"
	"fmt"
	"path/filepath"
	"sync"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// runner supervises one plugin config: one instance per container or
// endpoint.
type runner struct {
	a         *Agent
	plugin    *pluginconfig.Plugin
	instances []*instance
	cancel    context.CancelFunc
	wg        sync.WaitGroup
}

func newRunner(a *Agent, p *pluginconfig.Plugin, inherit map[int]*handover) *runner {
	r := &runner{a: a, plugin: p}
	info := p.Info
	base := filepath.Join("csi", info.Type, info.Name)
	for i := range info.Containers {
		c := &info.Containers[i]
		socket := filepath.Join(a.cfg.RuntimeDir, base, fmt.Sprintf("c%d.sock", i))
		in := r.newInstance(c.Services, socket, i)
		in.container = c
		in.dir = filepath.Join(a.cfg.WorkDir, base, "containers", fmt.Sprint(i))
		in.logDir = r.logDir()
		in.logPrefix = fmt.Sprintf("container-%d", i)
		in.hash = configHash(*c, socket, a.cfg.NodeID)
		// Served there only if the command passes it on (optional).
		if addons := filepath.Join(a.cfg.RuntimeDir, base, fmt.Sprintf("c%d-addons.sock", i)); len(addons) <= maxSocketPath {
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
	return r
}

func (r *runner) newInstance(services []pluginconfig.Service, socket string, i int) *instance {
	names := make([]string, len(services))
	for k, s := range services {
		names[k] = string(s)
	}
	in := &instance{
		a:        r.a,
		log:      r.a.log.With("plugin", r.plugin.Info.Type, "instance", i),
		typ:      r.plugin.Info.Type,
		pluginID: r.plugin.Info.Type + ":" + r.plugin.Info.Name,
		services: append([]pluginconfig.Service(nil), services...),
		socket:   socket,
		status: &agentv1.PluginInstance{
			Services:   names,
			Endpoint:   "unix://" + socket,
			State:      agentv1.PluginState_PLUGIN_STATE_STARTING,
			StateSince: timestamppb.Now(),
		},
	}
	r.instances = append(r.instances, in)
	return in
}

func (r *runner) bySocket(socket string) *instance {
	for _, in := range r.instances {
		if in.socket == socket {
			return in
		}
	}
	return nil
}

func (r *runner) logDir() string {
	return filepath.Join(r.a.cfg.WorkDir, "csi", r.plugin.Info.Type, r.plugin.Info.Name, "logs")
}

func (r *runner) start(ctx context.Context) {
	ctx, r.cancel = context.WithCancel(ctx)
	for _, in := range r.instances {
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			in.run(ctx)
		}()
	}
}

// stop ends supervision. With terminate, managed processes are stopped
// too; without, their live processes are returned by container index for
// a successor (or the next agent) to take over.
func (r *runner) stop(terminate bool) map[int]*handover {
	r.cancel()
	r.wg.Wait()
	out := map[int]*handover{}
	for i, in := range r.instances {
		if in.managed() {
			if terminate {
				in.stopProcess(context.Background())
			} else if h := in.release(); h != nil {
				out[i] = h
			}
		}
		in.update(func(s *agentv1.PluginInstance) {
			s.State, s.NextStart = agentv1.PluginState_PLUGIN_STATE_STOPPED, nil
		})
	}
	return out
}

// status reports the plugin; errs are the config directory's bad files.
func (r *runner) status(errs []*pluginconfig.FileError) *agentv1.Plugin {
	info := r.plugin.Info
	p := &agentv1.Plugin{
		Type: info.Type, Name: info.Name, ConfigFile: r.plugin.File, Managed: info.Managed(),
		State:   agentv1.PluginState_PLUGIN_STATE_READY,
		Reclaim: r.a.reclaimTotals(info.Type),
	}
	for _, fe := range errs {
		if fe.File == r.plugin.File {
			p.ConfigError = fe.Err.Error()
		}
	}
	for _, in := range r.instances {
		s := in.snapshot()
		p.Instances = append(p.Instances, s)
		// The plugin is as healthy as its least healthy instance.
		if s.State != agentv1.PluginState_PLUGIN_STATE_READY && p.State == agentv1.PluginState_PLUGIN_STATE_READY {
			p.State = s.State
		}
	}
	return p
}

func cloneInstance(s *agentv1.PluginInstance) *agentv1.PluginInstance {
	return proto.Clone(s).(*agentv1.PluginInstance)
}
