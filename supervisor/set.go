package supervisor

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"

	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/proclog"
	"github.com/csiagent/csiagent/pluginconfig"
)

// Errors of Set.Ready.
var (
	// ErrNotConfigured: no config defines the plugin type (the set has
	// no plugin of that type).
	ErrNotConfigured = errors.New("plugin not configured")
	// ErrNoService: the plugin's config has no instance serving the
	// service asked for.
	ErrNoService = errors.New("plugin does not serve the service")
	// ErrNotReady: the instance did not become ready before the caller's
	// deadline.
	ErrNotReady = errors.New("plugin not ready")
)

// Set is the daemon's supervised plugins, one Plugin per type, following
// the config directory's updates (Apply). Callers wait on it for a ready
// connection (Ready) and read the plugins' status; it is safe for
// concurrent use.
type Set struct {
	cfg Config
	log *slog.Logger

	mu         sync.Mutex
	plugins    map[string]*Plugin
	fileErrors []*pluginconfig.FileError
	// changed is closed and replaced at every change (Notify).
	changed chan struct{}
}

// NewSet makes an empty set whose plugins share cfg. cfg.OnChange, if
// set, is called after the set's own wake-up of its waiters.
func NewSet(cfg Config) *Set {
	cfg.setDefaults()
	s := &Set{cfg: cfg, log: cfg.Logger, plugins: map[string]*Plugin{}, changed: make(chan struct{})}
	onChange := cfg.OnChange
	s.cfg.OnChange = func() {
		s.Notify()
		onChange()
	}
	return s
}

// Changed returns a channel closed at the next Notify (or plugin status
// change): take it before reading the state it guards.
func (s *Set) Changed() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.changed
}

// Notify wakes everyone waiting on Changed.
func (s *Set) Notify() {
	s.mu.Lock()
	defer s.mu.Unlock()
	close(s.changed)
	s.changed = make(chan struct{})
}

// Apply turns one config update into started, rolled and stopped plugins,
// and returns the types whose config was added or changed (a new config
// may offer what the old did not).
func (s *Set) Apply(ctx context.Context, u pluginconfig.Update) (changed []string) {
	s.mu.Lock()
	s.fileErrors = u.Errors
	s.mu.Unlock()
	// Plugins removed stop together, after the loop: each may take
	// terminateTimeout and killWait, which the agent's loop (its watchdog
	// among what it serves) must not wait for one after the other.
	var removed []*Plugin
	for _, ev := range u.Events {
		switch ev.Kind {
		case pluginconfig.Added:
			s.log.Info("plugin config added", "plugin", ev.Type, "file", ev.File)
			s.start(ctx, ev.Plugin, nil)
		case pluginconfig.Changed:
			s.log.Info("plugin config changed: rolling", "plugin", ev.Type, "file", ev.File)
			// Containers whose launch config is unchanged keep their
			// process; the others are restarted.
			var inherit Handover
			if old := s.Get(ev.Type); old != nil {
				inherit = old.Stop(false)
			}
			s.start(ctx, ev.Plugin, inherit)
		case pluginconfig.Removed:
			s.log.Info("plugin config removed: stopping", "plugin", ev.Type, "file", ev.File)
			s.mu.Lock()
			p := s.plugins[ev.Type]
			delete(s.plugins, ev.Type)
			s.mu.Unlock()
			if p != nil {
				removed = append(removed, p)
			}
		case pluginconfig.Invalid:
			// The watcher keeps the last good config, and has logged
			// the error (once per edit): nothing changes here.
		}
		if ev.Kind == pluginconfig.Added || ev.Kind == pluginconfig.Changed {
			changed = append(changed, ev.Type)
		}
	}
	var wg sync.WaitGroup
	for _, p := range removed {
		wg.Go(func() { p.Stop(true) })
	}
	wg.Wait()
	s.Notify()
	return changed
}

// StopUnclaimed stops the managed plugin processes an earlier agent
// recorded for plugin containers that no config has now (a file removed,
// a plugin renamed, a container dropped while the agent was down; the
// agent leaves its plugins running when it stops): each recorded process
// that is still the one launched is terminated, and its record and
// socket removed. Instances of the current configs adopt or stop their
// own records. Called once, after the first Apply; the processes stop
// together, within terminateTimeout and killWait.
func (s *Set) StopUnclaimed(ctx context.Context) {
	claimed, sockets := map[string]bool{}, map[string]bool{}
	for _, p := range s.all() {
		for _, in := range p.instances {
			claimed[in.recordPath()] = true
			sockets[in.socket] = true
		}
	}
	paths, err := filepath.Glob(filepath.Join(s.cfg.WorkDir, "csi", "*", "*", "containers", "*", "process.json"))
	if err != nil {
		s.log.Warn("looking for plugin processes no config claims", "error", err)
		return
	}
	var wg sync.WaitGroup
	for _, path := range paths {
		if !claimed[path] {
			wg.Go(func() { s.stopRecorded(ctx, path, sockets) })
		}
	}
	wg.Wait()
}

// stopRecorded is StopUnclaimed for one record; sockets are those the
// current configs use (kept).
func (s *Set) stopRecorded(ctx context.Context, path string, sockets map[string]bool) {
	log := s.log.With("record", path)
	rec, err := readRecord(s.cfg.Commit.Root(), path)
	if err != nil {
		log.Warn("an unclaimed plugin process record cannot be read; left", "error", err)
		return
	}
	if p, err := adopt(rec); err == nil {
		log.Warn("stopping a plugin process that no config has now (changed while the agent was down)", "pid", rec.PID, "started_at", rec.StartedAt)
		exited := terminate(ctx, p)
		p.release()
		if !exited {
			log.Error("plugin process did not exit after SIGKILL (uninterruptible sleep?): left, with its record", "pid", rec.PID)
			return
		}
	}
	// The process was born in its container's cgroup, if it had
	// limits: <work>/csi/<type>/<name>/containers/<i>/process.json.
	if rel, err := filepath.Rel(s.cfg.WorkDir, path); err == nil {
		if p := strings.Split(rel, string(filepath.Separator)); len(p) == 6 {
			s.cfg.Limits.release(log, p[1]+":"+p[2]+":"+containerLabel(p[4]))
		}
	}
	socket := rec.Socket
	if sockets[socket] {
		socket = ""
	}
	removeRecord(s.cfg.Commit, log, path, socket)
}

// removeRecord removes a plugin process's record and, unless "", its
// socket, logging what fails.
func removeRecord(commit *atomicfile.Committer, log *slog.Logger, record, socket string) {
	if _, err := commit.Remove(record); err != nil {
		log.Warn("cleaning up after plugin process", "error", err)
	}
	if socket == "" {
		return
	}
	if err := os.Remove(socket); err != nil && !errors.Is(err, fs.ErrNotExist) {
		log.Warn("cleaning up after plugin process", "error", err)
	}
}

func (s *Set) start(ctx context.Context, p *pluginconfig.Plugin, inherit Handover) {
	r := Start(ctx, s.cfg, p, inherit)
	s.mu.Lock()
	s.plugins[p.Info.Type] = r
	s.mu.Unlock()
}

// StopAll stops supervising every plugin, leaving managed processes
// running for the next agent to adopt.
func (s *Set) StopAll() {
	for _, p := range s.all() {
		p.Stop(false).Release()
	}
}

func (s *Set) all() []*Plugin {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*Plugin, 0, len(s.plugins))
	for _, p := range s.plugins {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].plugin.Info.Type < out[j].plugin.Info.Type })
	return out
}

// Get is the plugin of type typ, nil if no config defines it.
func (s *Set) Get(typ string) *Plugin {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.plugins[typ]
}

// Statuses reports every plugin, sorted by type, each with the error of
// its config file if the file's latest version was refused, and the
// config directory's refused files.
func (s *Set) Statuses() ([]*PluginStatus, []*pluginconfig.FileError) {
	ps := s.all()
	s.mu.Lock()
	errs := s.fileErrors
	s.mu.Unlock()
	out := make([]*PluginStatus, 0, len(ps))
	for _, p := range ps {
		st := p.Status()
		for _, fe := range errs {
			if fe.File == p.plugin.File {
				st.ConfigError = fe.Err.Error()
			}
		}
		out = append(out, st)
	}
	return out, errs
}

// Ready waits, woken by status changes, until the plugin's instance
// serving svc is ready, and returns its status and connection. Errors
// wrap ErrNotConfigured, ErrNoService, or ErrNotReady (with the instance's
// state and last error) when ctx ends first.
func (s *Set) Ready(ctx context.Context, typ string, svc pluginconfig.Service) (*InstanceStatus, *grpc.ClientConn, error) {
	for {
		changed := s.Changed()
		p := s.Get(typ)
		if p == nil {
			return nil, nil, fmt.Errorf("%w: Unknown CSI plugin '%s'", ErrNotConfigured, typ)
		}
		st, conn, ok := p.Instance(svc)
		if !ok {
			return nil, nil, fmt.Errorf("%w: plugin %s has no %s", ErrNoService, typ, svc)
		}
		if conn != nil {
			return st, conn, nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			why := st.State.String()
			if st.LastError != "" {
				why += ": " + st.LastError
			}
			return nil, nil, fmt.Errorf("%w: plugin %s is not ready (%s)", ErrNotReady, typ, why)
		}
	}
}

// ConnFor is the connection that serves service (a discovery name) on
// the plugin's instance serving svc: its csi-addons endpoint's when it has
// one and service is csi-addons', else csiConn.
func (s *Set) ConnFor(typ string, svc pluginconfig.Service, service string, csiConn *grpc.ClientConn) *grpc.ClientConn {
	if p := s.Get(typ); p != nil {
		if c := p.ConnFor(svc, service); c != nil {
			return c
		}
	}
	return csiConn
}

// Offers reports whether a ready instance of the plugin answers service.
func (s *Set) Offers(typ, service string) bool {
	p := s.Get(typ)
	return p != nil && p.Offers(service)
}

// NodeCapabilities are the node capabilities discovery found on the
// plugin's instances.
func (s *Set) NodeCapabilities(typ string) []string {
	p := s.Get(typ)
	if p == nil {
		return nil
	}
	var caps []string
	for _, in := range p.Status().Instances {
		caps = append(caps, in.NodeCapabilities...)
	}
	return caps
}

// LogDir is where a managed plugin's logs are ("" for unmanaged plugins,
// whose logs the agent does not keep, and unknown ones).
func (s *Set) LogDir(typ string) string {
	p := s.Get(typ)
	if p == nil || !p.plugin.Info.Managed() {
		return ""
	}
	return p.LogDir()
}

// RotateLogs rotates every managed plugin's log files over maxBytes,
// keeping keep old ones.
func (s *Set) RotateLogs(maxBytes int64, keep int) {
	for _, p := range s.all() {
		if !p.plugin.Info.Managed() {
			continue
		}
		logs, _ := filepath.Glob(filepath.Join(p.LogDir(), "*.log"))
		for _, f := range logs {
			if _, err := proclog.Rotate(f, maxBytes, keep); err != nil {
				s.log.Warn("rotating plugin log", "file", f, "error", err)
			}
		}
	}
}
