package integration

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/internal/atomicfile"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// waitTimeout bounds every wait for an expected state: a failure bound,
// not a synchronisation sleep.
const waitTimeout = 30 * time.Second

// harness runs an in-process agent on temporary directories.
type harness struct {
	t                         *testing.T
	a                         *agent.Agent
	cfg                       agent.Config // the running agent's, APISocket set
	confDir, work, run, extra string
	cancel                    context.CancelFunc
	done                      chan error
}

func fastConfig(h *harness) agent.Config {
	return agent.Config{
		ConfigDir: h.confDir, WorkDir: h.work, RuntimeDir: h.run, NodeID: "node-1", APIGroup: -1,
		ReadyTimeout: 10 * time.Second, ProbeInterval: 100 * time.Millisecond,
		BackoffBase: 100 * time.Millisecond, BackoffMax: 2 * time.Second, BackoffReset: time.Minute,
		ShutdownTimeout: 2 * time.Second,
		Logger:          slog.New(slog.NewTextHandler(testWriter{h.t}, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
}

// newHarness makes the directories; the runtime dir is short, for
// sun_path.
func newHarness(t *testing.T) *harness {
	t.Helper()
	// Registered first, so it runs after every other cleanup: once the
	// agent and its plugins are gone, no goroutine of theirs may remain.
	t.Cleanup(func() { goleak.VerifyNone(t) })
	base := t.TempDir()
	run, err := os.MkdirTemp("", "csr")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(run) })
	h := &harness{t: t, confDir: filepath.Join(base, "conf"), work: filepath.Join(base, "work"), run: run, extra: filepath.Join(base, "extra")}
	for _, d := range []string{h.confDir, h.extra} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return h
}

func (h *harness) start(cfg agent.Config) {
	h.t.Helper()
	h.launch(cfg)
	h.t.Cleanup(h.stop)
}

// launch starts an agent with cfg and waits for its API.
func (h *harness) launch(cfg agent.Config) {
	h.t.Helper()
	if cfg.APISocket == "" { // the agent's default
		cfg.APISocket = filepath.Join(cmp.Or(cfg.RuntimeDir, agent.DefaultRuntimeDir), "agent.sock")
	}
	a, err := agent.New(cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.a, h.cfg, h.cancel, h.done = a, cfg, cancel, make(chan error, 1)
	go func() { h.done <- a.Run(ctx) }()
	h.waitAPI()
}

// waitAPI waits for the agent's API socket.
func (h *harness) waitAPI() {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	// The agent makes the directory too; it must exist to be watched.
	if err := os.MkdirAll(filepath.Dir(h.cfg.APISocket), 0o755); err != nil {
		h.t.Fatal(err)
	}
	if err := supervisor.WaitForSocket(ctx, h.cfg.APISocket, nil); err != nil {
		h.t.Fatal(err)
	}
}

// stop shuts the agent down for good: it cleans up every container left
// (so a failed test leaks no mount), then kills every plugin process the
// agent left running (it leaves them for its successor on purpose).
func (h *harness) stop() {
	if h.cancel == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	conn := dial(h.t, h.cfg.APISocket)
	if resp, err := agentv1.NewAgentClient(conn).Reconcile(ctx, &agentv1.ReconcileRequest{}); err != nil {
		h.t.Errorf("cleaning up at the end of the test: %v", err)
	} else if len(resp.Failed) > 0 {
		h.t.Errorf("cleaning up at the end of the test: %v", resp.Failed)
	}
	conn.Close()
	h.halt()
	h.killPlugins()
}

// killPlugins kills the plugin processes a halted agent left running for
// its successor: those its process records name
// (<work-dir>/csi/<type>/<name>/containers/<N>/process.json), if they
// are still the processes recorded (same start time).
func (h *harness) killPlugins() {
	h.t.Helper()
	records, err := filepath.Glob(filepath.Join(h.cfg.WorkDir, "csi", "*", "*", "containers", "*", "process.json"))
	if err != nil {
		h.t.Fatal(err)
	}
	for _, f := range records {
		var rec struct {
			PID        int    `json:"pid"`
			StartTicks uint64 `json:"start_ticks"`
		}
		if err := readProcessRecord(h.cfg.WorkDir, f, &rec); err != nil {
			h.t.Fatal(err)
		}
		if rec.PID > 0 && startTicks(rec.PID) == rec.StartTicks {
			killAndWait(h.t, rec.PID)
		}
	}
}

// startTicks is the start time of process pid (field 22 of
// /proc/<pid>/stat), 0 if it does not run.
func startTicks(pid int) uint64 {
	f := procStat(pid)
	if len(f) < 20 {
		return 0
	}
	n, _ := strconv.ParseUint(f[19], 10, 64)
	return n
}

// halt stops the agent as SIGTERM would: plugins, mounts and checkpoints
// stay for the next agent.
func (h *harness) halt() {
	h.cancel()
	h.cancel = nil
	if err := <-h.done; err != nil {
		h.t.Errorf("agent Run: %v", err)
	}
}

// restart halts the agent and starts a new one on the same directories.
func (h *harness) restart(cfg agent.Config) {
	h.t.Helper()
	h.halt()
	h.launch(cfg)
}

// killAndWait kills a process group and waits for its leader to exit.
func killAndWait(t *testing.T, pid int) {
	t.Helper()
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return // gone already
	}
	defer unix.Close(fd)
	_ = unix.Kill(-pid, unix.SIGKILL)
	_ = unix.Kill(pid, unix.SIGKILL)
	if !pidfdExited(fd, waitTimeout) {
		t.Errorf("process %d did not exit after SIGKILL", pid)
	}
}

// pidfdExited reports whether the process of pidfd fd exits within
// timeout (negative: no bound). A poll interrupted by a signal (the Go
// runtime's own preemption signals among them) goes on waiting.
func pidfdExited(fd int, timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for {
		ms := -1
		if timeout >= 0 {
			ms = max(int(time.Until(deadline).Milliseconds()), 0)
		}
		n, err := unix.Poll(fds, ms)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return n == 1
	}
}

// alive reports whether pid runs (and is not a zombie).
func alive(pid int) bool {
	f := procStat(pid)
	return len(f) > 0 && f[0] != "Z" && f[0] != "X"
}

// procStat is /proc/<pid>/stat from field 3 (the state) on, nil if pid
// does not exist.
func procStat(pid int) []string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil
	}
	// The command name, field 2, ends at the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	return strings.Fields(string(b[i+1:]))
}

func (h *harness) writeConfig(name, content string) {
	h.t.Helper()
	tmp := filepath.Join(h.confDir, "."+name+".tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		h.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(h.confDir, name)); err != nil {
		h.t.Fatal(err)
	}
}

// waitPlugin waits until the plugin of type typ satisfies cond, woken by
// the agent's change notifications (WatchPlugins).
func (h *harness) waitPlugin(typ string, what string, cond func(p *agentv1.Plugin) bool) *agentv1.Plugin {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	conn := dial(h.t, h.cfg.APISocket)
	defer conn.Close()
	stream, err := agentv1.NewAgentClient(conn).WatchPlugins(ctx, &agentv1.ListPluginsRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	var last *agentv1.Plugin
	for {
		resp, err := stream.Recv()
		if err != nil {
			b, _ := json.MarshalIndent(last, "", "  ")
			h.t.Fatalf("plugin %s: not %s within %v (%v); last status: %s", typ, what, waitTimeout, err, b)
		}
		last = nil
		for _, p := range resp.Plugins {
			if p.Type == typ {
				last = p
			}
		}
		// typ "" waits on any change, for conditions on other state.
		if cond(last) {
			return last
		}
	}
}

// listPlugins is the agent API's ListPlugins.
func (h *harness) listPlugins() *agentv1.ListPluginsResponse {
	h.t.Helper()
	conn := dial(h.t, h.cfg.APISocket)
	defer conn.Close()
	resp, err := agentv1.NewAgentClient(conn).ListPlugins(context.Background(), &agentv1.ListPluginsRequest{})
	if err != nil {
		h.t.Fatal(err)
	}
	return resp
}

func ready(p *agentv1.Plugin) bool {
	return p != nil && p.State == agentv1.PluginState_PLUGIN_STATE_READY
}

func managedConfig(typ string, shell bool, value string, args ...string) string {
	cmd := map[string]any{"value": value, "shell": shell}
	if len(args) > 0 {
		cmd["arguments"] = args
	}
	b, _ := json.Marshal(map[string]any{
		"type": typ,
		"containers": []any{map[string]any{
			"services": []string{"CONTROLLER_SERVICE", "NODE_SERVICE"},
			"command":  cmd,
		}},
	})
	return string(b)
}

// mkPool makes a pool directory for csi-loop-plugin.
func mkPool(t *testing.T, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// startLoopPlugin runs csi-loop-plugin as an unmanaged plugin on socket
// (with its flags extra besides). Its controller attaches the volumes
// unless extra has --node-only: its config declares CONTROLLER_SERVICE.
func startLoopPlugin(t *testing.T, socket, pool string, extra ...string) *exec.Cmd {
	t.Helper()
	return startUnmanaged(t, bins.loop, append([]string{"--endpoint", "unix://" + socket, "--pool", pool, "--node-id", "node-1"}, extra...)...)
}

// startUnmanaged runs a plugin process the agent does not manage (its
// stderr in the test's log), killed when the test ends.
func startUnmanaged(t *testing.T, bin string, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Stderr = testWriter{t}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

// testWriter sends log lines to t.Log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}

// readProcessRecord decodes a plugin's process record (a record file of
// the agent's Committer of work, see atomicfile) into rec.
func readProcessRecord(work, path string, rec any) error {
	b, _, err := atomicfile.ReadRecord(work, path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, rec); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
