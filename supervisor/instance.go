package supervisor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/pluginconfig"
)

// instance is one container (managed) or endpoint (unmanaged) of a plugin,
// with the goroutine that keeps it healthy.
type instance struct {
	cfg      *Config
	log      *slog.Logger
	typ      string
	pluginID string // <type>:<name>
	services []pluginconfig.Service
	// declaredAddons: the config's csi_addons_services.
	declaredAddons []string
	socket         string
	// addonsSocket is where csi-addons is served apart from CSI: the
	// configured csi_addons_endpoint (unmanaged; required), or the
	// $CSIADDONS_ENDPOINT offered to a managed command (used if created).
	addonsSocket string
	// Managed only.
	container *pluginconfig.Container
	dir       string // state directory: process record
	logDir    string
	logPrefix string
	hash      string
	inherit   *handover // a live process handed over by a rolled config

	mu     sync.Mutex
	status *InstanceStatus
	proc   *process
	conn   *grpc.ClientConn
	// addons is the csi-addons endpoint's connection, nil when csi-addons
	// is served on conn.
	addons   *grpc.ClientConn
	launched bool // this agent launched or adopted a process before
}

// handover is a running process passed from an instance being replaced to
// its successor, so an unchanged container is not restarted.
type handover struct {
	proc *process
	hash string
}

func (in *instance) managed() bool { return in.container != nil }

// connFor is the connection that serves service (a discovery name such as
// replication.Controller): the csi-addons endpoint's for csi-addons
// services when the instance has one, else csiConn. CSI's own services
// (csi.v1.*) are always on csiConn.
func (in *instance) connFor(service string, csiConn *grpc.ClientConn) *grpc.ClientConn {
	if strings.HasPrefix(service, "csi.v1.") {
		return csiConn
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if in.addons != nil {
		return in.addons
	}
	return csiConn
}

// update changes the instance's reported status under its lock and tells
// waiters.
func (in *instance) update(f func(s *InstanceStatus)) {
	in.mu.Lock()
	prev := in.status.State
	f(in.status)
	if in.status.State != prev {
		in.status.StateSince = time.Now()
	}
	in.mu.Unlock()
	in.cfg.OnChange()
}

func (in *instance) snapshot() *InstanceStatus {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.status.clone()
}

// run keeps the instance healthy until ctx ends.
func (in *instance) run(ctx context.Context) {
	bo := backoff{base: in.cfg.BackoffBase, max: in.cfg.BackoffMax, reset: in.cfg.BackoffReset}
	for {
		healthy, err := in.life(ctx)
		if ctx.Err() != nil {
			return
		}
		delay := bo.next(healthy)
		state := StateBackoff
		if !in.managed() {
			state = StateUnavailable
		}
		in.log.Warn("plugin instance failed; retrying", "error", err, "retry_in", delay.Round(time.Millisecond))
		in.update(func(s *InstanceStatus) {
			s.State, s.LastError, s.Pid = state, err.Error(), 0
			s.NextStart = time.Now().Add(delay)
		})
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// life runs one life of the instance: start or adopt the process (managed)
// or wait for the socket (unmanaged), readiness, then probes until
// something fails. It returns how long the instance was ready, and why it
// ended.
func (in *instance) life(ctx context.Context) (time.Duration, error) {
	in.update(func(s *InstanceStatus) {
		s.State, s.NextStart = StateStarting, time.Time{}
	})
	var exited <-chan struct{} // nil for unmanaged: never fires
	if in.managed() {
		p, err := in.startProcess(ctx)
		if err != nil {
			return 0, err
		}
		exited = p.exited
		defer func() {
			// ctx ending means stop or shutdown: the owner decides whether
			// the process goes. Any other end of life kills it.
			if ctx.Err() == nil {
				in.stopProcess(context.Background())
			}
		}()
	}
	conn, addons, disc, err := in.becomeReady(ctx, exited)
	if err != nil {
		return 0, err
	}
	in.mu.Lock()
	in.conn, in.addons = conn, addons
	in.mu.Unlock()
	defer func() {
		in.mu.Lock()
		in.conn, in.addons = nil, nil
		in.mu.Unlock()
		conn.Close()
		if addons != nil {
			addons.Close()
		}
	}()
	readyAt := time.Now()
	in.update(func(s *InstanceStatus) {
		s.State, s.LastError = StateReady, ""
		s.PluginName, s.VendorVersion = disc.pluginName, disc.vendorVersion
		s.PluginCapabilities, s.NodeCapabilities = disc.pluginCaps, disc.nodeCaps
		s.NodeID, s.AddonsServices = disc.nodeID, disc.addons
		s.AccessibleTopology, s.MaxVolumesPerNode = disc.topology, disc.maxVolumes
		s.ControllerCapabilities = disc.controllerCaps
		s.AddonsEndpoint, s.AddonsIdentity = disc.addonsEndpoint, disc.addonsIdentity
	})
	in.log.Info("plugin ready", "plugin_name", disc.pluginName, "version", disc.vendorVersion, "addons", disc.addons)
	// A new process (or connection) may implement what the last did not.
	in.cfg.OnReady(in.typ)
	tick := time.NewTicker(in.cfg.ProbeInterval)
	defer tick.Stop()
	failures := 0
	for {
		select {
		case <-ctx.Done():
			return time.Since(readyAt), ctx.Err()
		case <-exited:
			return time.Since(readyAt), fmt.Errorf("plugin process %s", in.procErr())
		case <-tick.C:
		}
		ready, err := probe(ctx, conn)
		if ctx.Err() != nil {
			return time.Since(readyAt), ctx.Err()
		}
		if err == nil && ready {
			failures = 0
			continue
		}
		if err == nil {
			err = errNotReady
		}
		failures++
		in.log.Warn("plugin probe failed", "failures", failures, "error", err)
		if failures >= probeFailureLimit {
			return time.Since(readyAt), fmt.Errorf("%d probes failed in a row, last: %w", failures, err)
		}
	}
}

// becomeReady waits for the socket, probes until ready and discovers the
// plugin, all within the ready timeout. addons is the csi-addons
// endpoint's connection, nil when csi-addons is looked for on conn.
func (in *instance) becomeReady(ctx context.Context, exited <-chan struct{}) (conn, addons *grpc.ClientConn, _ *discovery, _ error) {
	ctx, cancel := context.WithTimeout(ctx, in.cfg.ReadyTimeout)
	defer cancel()
	if err := WaitForSocket(ctx, in.socket, exited); err != nil {
		return nil, nil, nil, in.withExit(err, exited)
	}
	conn, err := dial(in.socket, in.typ, in.cfg.Interceptor)
	if err != nil {
		return nil, nil, nil, err
	}
	fail := func(err error) (*grpc.ClientConn, *grpc.ClientConn, *discovery, error) {
		conn.Close()
		if addons != nil {
			addons.Close()
		}
		return nil, nil, nil, in.withExit(err, exited)
	}
	if err := probeUntilReady(ctx, conn, exited); err != nil {
		return fail(err)
	}
	if in.addonsSocket != "" {
		// A managed command serves csi-addons apart only if it passed
		// $CSIADDONS_ENDPOINT on: by the time it is ready, the socket is
		// there or it is not used. A configured one must come.
		use := true
		if in.managed() {
			st, err := os.Stat(in.addonsSocket)
			use = err == nil && st.Mode()&os.ModeSocket != 0
		} else if err := WaitForSocket(ctx, in.addonsSocket, exited); err != nil {
			return fail(fmt.Errorf("csi-addons endpoint: %w", err))
		}
		if use {
			if addons, err = dial(in.addonsSocket, in.typ, in.cfg.Interceptor); err != nil {
				return fail(err)
			}
		}
	}
	disc, err := discover(ctx, conn, addons, in.services, in.declaredAddons)
	if err != nil {
		return fail(err)
	}
	if addons != nil {
		disc.addonsEndpoint = "unix://" + in.addonsSocket
	}
	return conn, addons, disc, nil
}

// withExit adds the process's exit status to an error caused by its exit.
func (in *instance) withExit(err error, exited <-chan struct{}) error {
	select {
	case <-exited:
		return fmt.Errorf("%w: plugin process %s", err, in.procErr())
	default:
		return err
	}
}

// procErr says how the process ended, with the last line it wrote to
// stderr: usually the reason a plugin gives up.
func (in *instance) procErr() error {
	in.mu.Lock()
	err := errors.New("exited")
	if in.proc != nil && in.proc.err != nil {
		err = in.proc.err
	}
	in.mu.Unlock()
	if line := lastLine(filepath.Join(in.logDir, in.logPrefix+".stderr.log")); line != "" {
		return fmt.Errorf("%w; its last words on stderr: %s", err, line)
	}
	return err
}

// lastLine returns the last non-empty line of a file's final 4 KiB,
// shortened for an error message.
func lastLine(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	const window, maxLen = 4096, 300
	st, err := f.Stat()
	if err != nil {
		return ""
	}
	buf := make([]byte, min(window, st.Size()))
	n, _ := f.ReadAt(buf, st.Size()-int64(len(buf)))
	lines := strings.Split(strings.TrimRight(string(buf[:n]), "\n"), "\n")
	line := strings.TrimSpace(lines[len(lines)-1])
	if len(line) > maxLen {
		line = line[:maxLen] + "…"
	}
	return line
}

// cgroupName names the instance's cgroup: <type>:<name>:container-<i>.
func (in *instance) cgroupName() string {
	return in.pluginID + ":" + in.logPrefix
}

// containerLabel names a plugin's container i in its log files and
// cgroup: container-<i>.
func containerLabel(i string) string { return "container-" + i }

func (in *instance) recordPath() string { return filepath.Join(in.dir, "process.json") }

// startProcess hands over, adopts or launches the instance's process.
func (in *instance) startProcess(ctx context.Context) (*process, error) {
	if h := in.inherit; h != nil {
		in.inherit = nil
		select {
		case <-h.proc.exited:
		default:
			if h.hash == in.hash {
				in.setProc(h.proc, false)
				return h.proc, nil
			}
			in.log.Info("plugin config changed: stopping the old process", "pid", h.proc.pid)
			terminate(ctx, h.proc)
			h.proc.release()
		}
	}
	if !in.launched {
		if p, err := in.adoptRecorded(ctx); p != nil || err != nil {
			return p, err
		}
	}
	if err := checkSocketPath(in.socket); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(in.socket), 0o750); err != nil {
		return nil, fmt.Errorf("creating socket directory: %w", err)
	}
	if err := os.Remove(in.socket); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("removing stale socket: %w", err)
	}
	if err := in.cfg.Commit.MkdirAll(in.dir, 0o750); err != nil {
		return nil, fmt.Errorf("creating plugin state directory: %w", err)
	}
	cgroupFD, cleanup, err := in.cfg.Limits.prepare(in, in.container.Resources)
	if err != nil {
		return nil, err
	}
	defer cleanup()
	p, rec, err := launch(launchSpec{
		container: *in.container, socket: in.socket, addons: in.addonsSocket, nodeID: in.cfg.NodeID,
		dir: in.dir, runtimeDir: in.cfg.RuntimeDir, logDir: in.logDir, logPrefix: in.logPrefix, configHash: in.hash, cgroupFD: cgroupFD,
	})
	if err != nil {
		return nil, err
	}
	if err := in.writeRecord(ctx, rec); err != nil {
		// Without the record a restarted agent cannot adopt the process
		// (it starts another); without the process no container's volume
		// can be restored. The record's file keeps slots reserved (see
		// atomicfile), so this fails only where none was ever written.
		in.log.Error("plugin process not recorded: an agent restarted before the next start will not adopt it", "pid", p.pid, "error", err)
	}
	in.log.Info("plugin process started", "pid", p.pid)
	in.setProc(p, false)
	return p, nil
}

// adoptRecorded adopts the process an earlier agent recorded, or stops it
// when its config changed. (nil, nil) means there is nothing to adopt.
func (in *instance) adoptRecorded(ctx context.Context) (*process, error) {
	rec, err := readRecord(in.cfg.Commit.Root(), in.recordPath())
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			in.log.Warn("ignoring unreadable plugin process record", "error", err)
		}
		return nil, nil
	}
	p, err := adopt(rec)
	if err != nil {
		in.log.Info("recorded plugin process not adopted", "pid", rec.PID, "reason", err)
		return nil, nil
	}
	if rec.ConfigHash != in.hash || rec.Socket != in.socket {
		in.log.Info("plugin config changed while the agent was down: stopping the old process", "pid", rec.PID)
		terminate(ctx, p)
		p.release()
		return nil, nil
	}
	in.log.Info("adopted running plugin process", "pid", rec.PID, "started_at", rec.StartedAt)
	in.setProc(p, true)
	return p, nil
}

func (in *instance) setProc(p *process, adopted bool) {
	in.mu.Lock()
	if in.launched {
		in.status.Restarts++
	}
	in.launched = true
	in.proc = p
	in.status.Pid = p.pid
	in.status.Adopted = adopted
	in.mu.Unlock()
	in.cfg.OnChange()
}

// stopProcess terminates the instance's process, if any, and forgets it:
// record and socket are removed (kept, with an error, for a process that
// does not exit: the next agent start finds it, see Set.StopUnclaimed).
func (in *instance) stopProcess(ctx context.Context) {
	in.mu.Lock()
	p := in.proc
	in.proc = nil
	in.mu.Unlock()
	if p == nil {
		return
	}
	exited := terminate(ctx, p)
	p.release()
	if exited {
		in.cfg.Limits.release(in.log, in.cgroupName())
		removeRecord(in.cfg.Commit, in.log, in.recordPath(), in.socket)
	} else {
		in.log.Error("plugin process did not exit after SIGKILL (uninterruptible sleep?): left, with its record", "pid", p.pid)
	}
	in.update(func(s *InstanceStatus) {
		// No process, so not ready: never report READY with pid 0.
		s.Pid = 0
		if s.State == StateReady {
			s.State = StateUnavailable
		}
	})
}

// release hands the live process over (for a config roll) and forgets it.
func (in *instance) release() *handover {
	in.mu.Lock()
	defer in.mu.Unlock()
	p := in.proc
	in.proc = nil
	if p == nil {
		return nil
	}
	return &handover{proc: p, hash: in.hash}
}

// writeRecord records the instance's process, durably (the next agent
// adopts it from the record), in the record's reserved slots.
func (in *instance) writeRecord(ctx context.Context, rec *processRecord) error {
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	n, err := in.cfg.Commit.Put(in.recordPath(), b, 0o600)
	if err != nil {
		return err
	}
	return in.cfg.Commit.Wait(ctx, n)
}
