package supervisor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/cgroup"
	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/pluginconfig"
)

// testPlugin is internal/testplugin, built once by TestMain.
var testPlugin string

func TestMain(m *testing.M) {
	bins, remove, err := testhelp.BuildBinaries("github.com/csiagent/csiagent/internal/testplugin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	testPlugin = bins[0]
	code := m.Run()
	remove()
	os.Exit(code)
}

// changes makes an OnChange that wakes the returned channel.
func changes() (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	return ch, func() {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

// waitState waits, woken by changes, until p's first instance satisfies
// cond, and returns it.
func waitState(t *testing.T, p *Plugin, changed <-chan struct{}, what string, cond func(*InstanceStatus) bool) *InstanceStatus {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for {
		in := p.Status().Instances[0]
		if cond(in) {
			return in
		}
		select {
		case <-changed:
		case <-deadline:
			t.Fatalf("not %s after 30s: %s (%s)", what, in.State, in.LastError)
		}
	}
}

func managedPlugin(t *testing.T, bin string, args ...string) *pluginconfig.Plugin {
	t.Helper()
	raw, _ := json.Marshal(map[string]any{
		"type": "t.example",
		"containers": []any{map[string]any{
			"services": []string{"NODE_SERVICE"},
			"command":  map[string]any{"value": bin, "shell": false, "arguments": append([]string{"testplugin"}, args...)},
		}},
	})
	info, err := pluginconfig.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	return &pluginconfig.Plugin{File: "t.json", Info: info}
}

// TestManagedLifecycle: a managed plugin is launched and becomes ready;
// killed, it is restarted after its backoff; stopped without terminate,
// its process is handed to a successor that keeps it; stopped with
// terminate, the process and its record go.
func TestManagedLifecycle(t *testing.T) {
	dir := t.TempDir()
	changed, notify := changes()
	var mu sync.Mutex
	var ready []string
	cfg := Config{
		WorkDir: filepath.Join(dir, "w"), RuntimeDir: filepath.Join(dir, "r"), NodeID: "n1",
		BackoffBase: 10 * time.Millisecond, BackoffMax: 20 * time.Millisecond, ProbeInterval: time.Hour,
		OnChange: notify, OnReady: func(typ string) {
			mu.Lock()
			ready = append(ready, typ)
			mu.Unlock()
		},
	}
	plugin := managedPlugin(t, testPlugin, "-max-volumes-per-node", "7", "-topology-host", "h1")
	isReady := func(in *InstanceStatus) bool { return in.State == StateReady }

	p := Start(t.Context(), cfg, plugin, nil)
	first := waitState(t, p, changed, "ready", isReady)
	if first.Pid == 0 || first.PluginName != "test.csi.csiagent.io" || first.NodeID != "n1" ||
		first.MaxVolumesPerNode != 7 || first.AccessibleTopology["topology.test.csiagent.io/host"] != "h1" {
		t.Fatalf("ready instance %+v: want a pid and what discovery found (NodeGetInfo's limit and topology too)", first)
	}
	if s, conn, ok := p.Instance(pluginconfig.NodeService); !ok || conn == nil || s.Pid != first.Pid {
		t.Errorf("Instance(node) = %v, %v, %v; want the ready instance with its connection", s, conn, ok)
	}
	if _, _, ok := p.Instance(pluginconfig.ControllerService); ok {
		t.Error("Instance(controller) found one; the plugin has no controller container")
	}

	if err := unix.Kill(first.Pid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	second := waitState(t, p, changed, "restarted", func(in *InstanceStatus) bool {
		return isReady(in) && in.Pid != first.Pid
	})
	if second.Restarts != 1 {
		t.Errorf("restarts = %d, want 1", second.Restarts)
	}

	handover := p.Stop(false)
	if st := p.Status(); st.State != StateStopped || len(handover) != 1 {
		t.Fatalf("after Stop(false): %s, %d processes handed over; want STOPPED and 1", st.State, len(handover))
	}
	p = Start(t.Context(), cfg, plugin, handover)
	kept := waitState(t, p, changed, "ready", isReady)
	if kept.Pid != second.Pid {
		t.Errorf("the successor runs pid %d, want the handed-over %d", kept.Pid, second.Pid)
	}
	mu.Lock()
	if len(ready) != 3 || ready[0] != "t.example" {
		t.Errorf("OnReady calls %q, want t.example three times", ready)
	}
	mu.Unlock()

	p.Stop(true)
	if err := unix.Kill(kept.Pid, 0); !errors.Is(err, unix.ESRCH) {
		t.Errorf("pid %d after Stop(true): kill 0 = %v, want ESRCH", kept.Pid, err)
	}
	record := filepath.Join(cfg.WorkDir, "csi", "t.example", plugin.Info.Name, "containers", "0", "process.json")
	if _, err := os.Stat(record); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("process record after Stop(true): %v, want it gone", err)
	}
	if !strings.HasSuffix(p.LogDir(), filepath.Join("t.example", plugin.Info.Name, "logs")) {
		t.Errorf("LogDir = %s", p.LogDir())
	}
}

// TestApplyInvalidLogsNothing: an invalid config is logged once, by the
// watcher that found it; applying its event logs nothing more (before,
// every invalid edit was logged twice).
func TestApplyInvalidLogsNothing(t *testing.T) {
	var buf bytes.Buffer
	s := NewSet(Config{Logger: slog.New(slog.NewTextHandler(&buf, nil))})
	s.Apply(context.Background(), pluginconfig.Update{Events: []pluginconfig.Event{{Kind: pluginconfig.Invalid, File: "/etc/csi-agent/plugins.d/x.json", Err: errors.New("bad")}}})
	if buf.Len() > 0 {
		t.Errorf("Apply logged: %s", buf.String())
	}
}

// TestStopUnclaimed: the agent stops leaving its managed plugins running
// for the next one to adopt; a plugin whose config went (or was renamed)
// meanwhile is adopted by no one. The next agent's StopUnclaimed stops
// its process and removes its record and socket, and leaves alone the
// processes its own configs claim. Before, the orphan ran for good (and a
// renamed plugin ran twice).
func TestStopUnclaimed(t *testing.T) {
	dir := t.TempDir()
	changed, notify := changes()
	cfg := Config{
		WorkDir: filepath.Join(dir, "w"), RuntimeDir: filepath.Join(dir, "r"), NodeID: "n1",
		BackoffBase: 10 * time.Millisecond, BackoffMax: 20 * time.Millisecond, ProbeInterval: time.Hour, OnChange: notify,
	}
	isReady := func(in *InstanceStatus) bool { return in.State == StateReady }
	gone, kept := managedPlugin(t, testPlugin), managedPlugin(t, testPlugin)
	kept.Info.Type = "kept.example"
	added := func(ps ...*pluginconfig.Plugin) pluginconfig.Update {
		var u pluginconfig.Update
		for _, p := range ps {
			u.Events = append(u.Events, pluginconfig.Event{Kind: pluginconfig.Added, Type: p.Info.Type, Plugin: p})
		}
		return u
	}
	first := NewSet(cfg)
	first.Apply(t.Context(), added(gone, kept))
	orphan := waitState(t, first.Get(gone.Info.Type), changed, "ready", isReady)
	keptPid := waitState(t, first.Get(kept.Info.Type), changed, "ready", isReady).Pid
	first.StopAll() // the agent stops; its plugins run on

	next := NewSet(cfg) // gone's config was removed meanwhile
	next.Apply(t.Context(), added(kept))
	adopted := waitState(t, next.Get(kept.Info.Type), changed, "ready", isReady)
	next.StopUnclaimed(t.Context())
	if err := unix.Kill(orphan.Pid, 0); !errors.Is(err, unix.ESRCH) {
		t.Errorf("the unclaimed plugin's pid %d after StopUnclaimed: kill 0 = %v; want ESRCH", orphan.Pid, err)
	}
	record := filepath.Join(cfg.WorkDir, "csi", gone.Info.Type, gone.Info.Name, "containers", "0", "process.json")
	if _, err := os.Stat(record); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the unclaimed plugin's record: %v; want it gone", err)
	}
	if adopted.Pid != keptPid || unix.Kill(keptPid, 0) != nil {
		t.Errorf("the claimed plugin runs pid %d (alive: %v); want %d adopted, alive", adopted.Pid, unix.Kill(keptPid, 0), keptPid)
	}
	next.Get(kept.Info.Type).Stop(true)
}

// TestStopUnclaimedReleasesCgroup: an unclaimed plugin process stopped
// by StopUnclaimed has its container's cgroup removed with its record (it
// was left under the agent's parent cgroup for good). The cgroup tree is
// a fake one (cgroup.Config.Root): the process itself runs without
// limits, which this test does not need.
func TestStopUnclaimedReleasesCgroup(t *testing.T) {
	root := t.TempDir()
	for name, content := range map[string]string{"cgroup.controllers": "cpu memory\n", "cgroup.subtree_control": ""} {
		if err := os.WriteFile(filepath.Join(root, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	m, err := cgroup.Detect(cgroup.Config{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	changed, notify := changes()
	cfg := Config{
		WorkDir: filepath.Join(dir, "w"), RuntimeDir: filepath.Join(dir, "r"), NodeID: "n1",
		BackoffBase: 10 * time.Millisecond, BackoffMax: 20 * time.Millisecond, ProbeInterval: time.Hour, OnChange: notify,
	}
	gone := managedPlugin(t, testPlugin)
	first := NewSet(cfg)
	first.Apply(t.Context(), pluginconfig.Update{Events: []pluginconfig.Event{{Kind: pluginconfig.Added, Type: gone.Info.Type, Plugin: gone}}})
	pid := waitState(t, first.Get(gone.Info.Type), changed, "ready", func(in *InstanceStatus) bool { return in.State == StateReady }).Pid
	first.StopAll()
	// Its cgroup, as a launch with limits makes it.
	leaf := filepath.Join(m.Parent(), gone.Info.Type+":"+gone.Info.Name+":container-0")
	if err := os.Mkdir(leaf, 0o755); err != nil {
		t.Fatal(err)
	}

	cfg.Limits = &Limiter{m: m}
	NewSet(cfg).StopUnclaimed(t.Context())
	if err := unix.Kill(pid, 0); !errors.Is(err, unix.ESRCH) {
		t.Errorf("the unclaimed plugin's pid %d after StopUnclaimed: kill 0 = %v; want ESRCH", pid, err)
	}
	if _, err := os.Stat(leaf); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the unclaimed plugin's cgroup %s after StopUnclaimed: %v; want it removed", leaf, err)
	}
}
