package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// waitTimeout bounds every wait for an expected state: a failure bound,
// not a synchronisation sleep.
const waitTimeout = 30 * time.Second

// bins are the real binaries the tests run, built once in TestMain.
var bins struct{ agent, loop, test string }

func TestMain(m *testing.M) {
	paths, remove, err := testhelp.BuildBinaries("github.com/csiagent/csiagent/cmd/csi-agent",
		"github.com/csiagent/csiagent/cmd/csi-loop-plugin", "github.com/csiagent/csiagent/internal/testplugin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	bins.agent, bins.loop, bins.test = paths[0], paths[1], paths[2]
	code := m.Run()
	remove()
	os.Exit(code)
}

// harness runs an in-process agent on temporary directories.
type harness struct {
	t                         *testing.T
	a                         *Agent
	confDir, work, run, extra string
	cancel                    context.CancelFunc
	done                      chan error
}

func fastConfig(h *harness) Config {
	return Config{
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

func (h *harness) start(cfg Config) {
	h.t.Helper()
	a, err := New(cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.a, h.cancel, h.done = a, cancel, make(chan error, 1)
	go func() { h.done <- a.Run(ctx) }()
	h.t.Cleanup(h.stop)
	h.waitAPI()
}

// waitAPI waits for the agent's API socket.
func (h *harness) waitAPI() {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	// The agent makes the directory too; it must exist to be watched.
	if err := os.MkdirAll(filepath.Dir(h.a.cfg.APISocket), 0o755); err != nil {
		h.t.Fatal(err)
	}
	if err := supervisor.WaitForSocket(ctx, h.a.cfg.APISocket, nil); err != nil {
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
	if resp := h.a.iso.Reconcile(ctx, nil); len(resp.Failed) > 0 {
		h.t.Errorf("cleaning up at the end of the test: %v", resp.Failed)
	}
	// After the halt: an instance launched meanwhile (a retry after a
	// backoff) is in the final snapshot.
	h.halt()
	plugins, _ := h.a.snapshot()
	for _, p := range plugins {
		for _, in := range p.Instances {
			if in.Pid != 0 {
				killAndWait(h.t, int(in.Pid))
			}
		}
	}
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
func (h *harness) restart(cfg Config) {
	h.t.Helper()
	h.halt()
	a, err := New(cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.a, h.cancel, h.done = a, cancel, make(chan error, 1)
	go func() { h.done <- a.Run(ctx) }()
	h.waitAPI()
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
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	if n, err := unix.Poll(fds, int(waitTimeout.Milliseconds())); n != 1 || err != nil {
		t.Errorf("process %d did not exit after SIGKILL", pid)
	}
}

// alive reports whether pid runs (and is not a zombie).
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name, which ends at the last ')'.
	i := bytes.LastIndexByte(b, ')')
	return i >= 0 && i+2 < len(b) && b[i+2] != 'Z' && b[i+2] != 'X'
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
// the agent's change notifications.
func (h *harness) waitPlugin(typ string, what string, cond func(p *agentv1.Plugin) bool) *agentv1.Plugin {
	h.t.Helper()
	deadline := time.NewTimer(waitTimeout)
	defer deadline.Stop()
	var last *agentv1.Plugin
	for {
		changed := h.a.set.Changed()
		plugins, _ := h.a.snapshot()
		last = nil
		for _, p := range plugins {
			if p.Type == typ {
				last = p
			}
		}
		// typ "" waits on any change, for conditions on other state.
		if cond(last) {
			return last
		}
		select {
		case <-changed:
		case <-deadline.C:
			b, _ := json.MarshalIndent(last, "", "  ")
			h.t.Fatalf("plugin %s: not %s within %v; last status: %s", typ, what, waitTimeout, b)
		}
	}
}

// configInForce is the config the agent runs plugin typ with.
func (h *harness) configInForce(typ string) *pluginconfig.PluginInfo {
	if r := h.a.set.Get(typ); r != nil {
		return r.Config().Info
	}
	return nil
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

// startLoopPlugin runs csi-loop-plugin as an unmanaged plugin on socket.
func startLoopPlugin(t *testing.T, socket, pool string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(bins.loop, "--endpoint", "unix://"+socket, "--pool", pool, "--node-id", "node-1")
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
