package integration

import (
	"context"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

func apiClient(t *testing.T, socket string) agentv1.AgentClient {
	t.Helper()
	return agentv1.NewAgentClient(apiConn(t, socket))
}

// apiConn is a connection to the agent API, closed when the test ends.
func apiConn(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	conn := dial(t, socket)
	t.Cleanup(func() { conn.Close() })
	return conn
}

// dial connects to the agent API at socket; the caller closes the
// connection.
func dial(t *testing.T, socket string) *grpc.ClientConn {
	t.Helper()
	// WaitForReady: the socket file exists a moment before the agent
	// accepts on it.
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	return conn
}

// TestManagedLoopPlugin starts the real csi-loop-plugin from a config file
// and checks what the API reports of it.
func TestManagedLoopPlugin(t *testing.T) {
	h := newHarness(t)
	pool := mkPool(t, filepath.Join(h.extra, "pool"))
	h.writeConfig("loop.json", managedConfig("loop.test", false, bins.loop, "csi-loop-plugin", "--pool="+pool))
	h.start(fastConfig(h))
	h.waitPlugin("loop.test", "ready", ready)

	st, err := os.Stat(filepath.Join(h.run, "agent.sock"))
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("API socket mode = %v, %v; want 0600", st.Mode(), err)
	}
	resp, err := apiClient(t, filepath.Join(h.run, "agent.sock")).GetPlugin(context.Background(), &agentv1.GetPluginRequest{Type: "loop.test"})
	if err != nil {
		t.Fatal(err)
	}
	p := resp.Plugin
	in := p.Instances[0]
	if !p.Managed || p.ConfigFile != filepath.Join(h.confDir, "loop.json") || in.Pid == 0 || in.Adopted {
		t.Errorf("plugin = %v", p)
	}
	if in.PluginName != "loop.csiagent.io" || in.NodeId != "node-1" {
		t.Errorf("identity: name %q node %q", in.PluginName, in.NodeId)
	}
	for _, want := range []string{"STAGE_UNSTAGE_VOLUME", "GET_VOLUME_STATS"} {
		if !slices.Contains(in.NodeCapabilities, want) {
			t.Errorf("node capabilities %v lack %s", in.NodeCapabilities, want)
		}
	}
	if !slices.Contains(in.PluginCapabilities, "CONTROLLER_SERVICE") {
		t.Errorf("plugin capabilities %v", in.PluginCapabilities)
	}
	for _, want := range []string{"reclaimspace.ReclaimSpaceNode", "reclaimspace.ReclaimSpaceController"} {
		if !slices.Contains(in.AddonsServices, want) {
			t.Errorf("addons %v lack %s", in.AddonsServices, want)
		}
	}
	if !strings.HasPrefix(in.Endpoint, "unix://"+h.run) {
		t.Errorf("endpoint %q not under the runtime dir", in.Endpoint)
	}
	logs, _ := filepath.Glob(filepath.Join(h.work, "csi", "loop.test", "default", "logs", "container-0.std*.log"))
	if len(logs) != 2 {
		t.Errorf("plugin logs = %v, want stdout and stderr files", logs)
	}
	_, err = apiClient(t, filepath.Join(h.run, "agent.sock")).GetPlugin(context.Background(), &agentv1.GetPluginRequest{Type: "nope"})
	if status.Code(err) != codes.NotFound {
		t.Errorf("GetPlugin(unknown) = %v, want NotFound", err)
	}
}

// TestMesosExamples runs the two examples of the Mesos CSI doc, adapted to
// the loop plugin: a managed plugin whose shell command uses
// $CSI_ENDPOINT, and an unmanaged plugin with a target_path_root. Both
// declare NODE_SERVICE only, as Mesos (which cannot attach) has them: the
// loop plugin runs --node-only.
func TestMesosExamples(t *testing.T) {
	h := newHarness(t)
	pool := mkPool(t, filepath.Join(h.extra, "pool"))
	h.writeConfig("managed.json", `{
"type": "org.apache.mesos.csi.managed-plugin",
"containers": [{
  "services": ["NODE_SERVICE"],
  "command": {"value": "`+bins.loop+` --endpoint=$CSI_ENDPOINT --pool=`+pool+` --node-only"},
  "resources": [
    {"name": "cpus", "type": "SCALAR", "scalar": {"value": 0.1}},
    {"name": "mem", "type": "SCALAR", "scalar": {"value": 1024}}
  ]
}]}`)
	sock := filepath.Join(h.run, "unmanaged.sock")
	startLoopPlugin(t, sock, mkPool(t, filepath.Join(h.extra, "pool2")), "--node-only")
	h.writeConfig("unmanaged.json", `{
"type": "org.apache.mesos.csi.unmanaged-plugin",
"endpoints": [{"csi_service": "NODE_SERVICE", "endpoint": "`+sock+`"}],
"target_path_root": "`+filepath.Join(h.extra, "mnt")+`"
}`)
	h.start(fastConfig(h))
	m := h.waitPlugin("org.apache.mesos.csi.managed-plugin", "ready", ready)
	if m.Instances[0].NodeId != "node-1" {
		t.Errorf("managed node id %q: MESOS_AGENT_ID not passed", m.Instances[0].NodeId)
	}
	u := h.waitPlugin("org.apache.mesos.csi.unmanaged-plugin", "ready", ready)
	if u.Managed || u.Instances[0].Pid != 0 || u.Instances[0].Endpoint != "unix://"+sock {
		t.Errorf("unmanaged plugin = %v", u)
	}
}

// TestUnmanagedReconnect: an unmanaged plugin that goes away is marked
// unavailable, and ready again when it comes back.
func TestUnmanagedReconnect(t *testing.T) {
	h := newHarness(t)
	sock := filepath.Join(h.run, "u.sock")
	pool := mkPool(t, filepath.Join(h.extra, "pool"))
	h.writeConfig("u.json", `{"type":"u","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"},{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://`+sock+`"}]}`)
	h.start(fastConfig(h))
	h.waitPlugin("u", "starting (no socket yet)", func(p *agentv1.Plugin) bool {
		return p != nil && p.State == agentv1.PluginState_PLUGIN_STATE_STARTING
	})
	cmd := startLoopPlugin(t, sock, pool)
	p := h.waitPlugin("u", "ready", ready)
	if len(p.Instances) != 1 || len(p.Instances[0].Services) != 2 {
		t.Errorf("two services on one socket should be one instance: %v", p.Instances)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	p = h.waitPlugin("u", "unavailable", func(p *agentv1.Plugin) bool {
		return p.State == agentv1.PluginState_PLUGIN_STATE_UNAVAILABLE
	})
	if !strings.Contains(p.Instances[0].LastError, "probe") {
		t.Errorf("last error %q should say the probes failed", p.Instances[0].LastError)
	}
	startLoopPlugin(t, sock, pool)
	h.waitPlugin("u", "ready again", ready)
}

// TestLiveConfig adds, changes and removes config files while the agent
// runs, with a bad file beside the good ones.
func TestLiveConfig(t *testing.T) {
	h := newHarness(t)
	pool := mkPool(t, filepath.Join(h.extra, "pool"))
	h.writeConfig("bad.json", `{"type":"bad","containers":[]}`)
	h.start(fastConfig(h))
	h.writeConfig("a.json", managedConfig("a", false, bins.loop, "csi-loop-plugin", "--pool="+pool, "--name=first"))
	p := h.waitPlugin("a", "ready", ready)
	pid := p.Instances[0].Pid
	if errs := h.listPlugins().ConfigErrors; len(errs) != 1 || filepath.Base(errs[0].File) != "bad.json" {
		t.Errorf("config errors = %v, want bad.json's", errs)
	}

	if p.GetReclaim().GetScheduled() {
		t.Fatalf("reclaim scheduled before the config sets an interval: %v", p.GetReclaim())
	}

	// A change that does not touch the command keeps the process.
	h.writeConfig("a.json", strings.Replace(managedConfig("a", false, bins.loop, "csi-loop-plugin", "--pool="+pool, "--name=first"),
		`"type":"a"`, `"type":"a","csiagent":{"reclaim_space":{"interval":"1h"}}`, 1))
	h.waitPlugin("a", "reloaded with its settings (reclaim scheduled)", func(p *agentv1.Plugin) bool {
		return ready(p) && p.GetReclaim().GetScheduled()
	})
	if got := h.waitPlugin("a", "ready", ready).Instances[0].Pid; got != pid {
		t.Errorf("settings-only change restarted the plugin: pid %d -> %d", pid, got)
	}

	// A command change rolls it.
	h.writeConfig("a.json", managedConfig("a", false, bins.loop, "csi-loop-plugin", "--pool="+pool, "--name=second"))
	p = h.waitPlugin("a", "rolled", func(p *agentv1.Plugin) bool {
		return ready(p) && p.Instances[0].PluginName == "second"
	})
	if p.Instances[0].Pid == pid || alive(int(pid)) {
		t.Errorf("old process %d should be gone, new pid %d", pid, p.Instances[0].Pid)
	}

	// Breaking the file changes nothing that runs.
	newPid := p.Instances[0].Pid
	h.writeConfig("a.json", `{"type":"a"`)
	p = h.waitPlugin("a", "reporting its config error", func(p *agentv1.Plugin) bool { return p.ConfigError != "" })
	if !ready(p) || p.Instances[0].Pid != newPid || !strings.Contains(p.ConfigError, "not valid JSON") {
		t.Errorf("after breaking the file: %v", p)
	}

	if err := os.Remove(filepath.Join(h.confDir, "a.json")); err != nil {
		t.Fatal(err)
	}
	h.waitPlugin("a", "removed", func(p *agentv1.Plugin) bool { return p == nil })
	if alive(int(newPid)) {
		t.Errorf("plugin process %d still runs after its config was removed", newPid)
	}
	if _, err := os.Stat(filepath.Join(h.run, "csi", "a", "default", "c0.sock")); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
}

// TestSocketPathTooLong: a runtime dir too deep for sun_path gives a
// clear error, and other plugins are not affected.
func TestSocketPathTooLong(t *testing.T) {
	h := newHarness(t)
	long := strings.Repeat("x", 60)
	h.writeConfig("a.json", managedConfig("a."+long, false, bins.loop, "csi-loop-plugin"))
	cfg := fastConfig(h)
	cfg.RuntimeDir = filepath.Join(h.run, long)
	h.start(cfg)
	p := h.waitPlugin("a."+long, "failed", func(p *agentv1.Plugin) bool {
		return p != nil && p.Instances[0].LastError != ""
	})
	if !strings.Contains(p.Instances[0].LastError, "longer than the 107 a unix socket address holds") {
		t.Errorf("last error = %q", p.Instances[0].LastError)
	}
	if p.Instances[0].Pid != 0 {
		t.Errorf("pid = %d, want none", p.Instances[0].Pid)
	}
}

func testPluginConfig(typ string, flags ...string) string {
	return managedConfig(typ, false, bins.test, append([]string{"testplugin", "--name=" + typ}, flags...)...)
}

// TestCrashLoopBackoff: a plugin that keeps exiting is restarted with
// growing delays.
func TestCrashLoopBackoff(t *testing.T) {
	h := newHarness(t)
	h.writeConfig("c.json", testPluginConfig("crashy", "--exit-immediately"))
	h.start(fastConfig(h))
	var delays []time.Duration
	var lastRestarts uint32 = 1 << 31
	h.waitPlugin("crashy", "backing off 4 times", func(p *agentv1.Plugin) bool {
		in := p.GetInstances()
		if len(in) == 0 || in[0].State != agentv1.PluginState_PLUGIN_STATE_BACKOFF || in[0].Restarts == lastRestarts {
			return false
		}
		lastRestarts = in[0].Restarts
		delays = append(delays, in[0].NextStart.AsTime().Sub(in[0].StateSince.AsTime()))
		if !strings.Contains(in[0].LastError, "exited with status 3") {
			t.Errorf("last error %q should give the exit status", in[0].LastError)
		}
		return len(delays) == 4
	})
	for i := 1; i < len(delays); i++ {
		if delays[i] < delays[i-1]*3/2 {
			t.Errorf("backoff delays %v do not grow (base 100ms, doubling)", delays)
		}
	}
}

// TestProbeFailureRestart: three failed probes in a row restart a managed
// plugin.
func TestProbeFailureRestart(t *testing.T) {
	h := newHarness(t)
	flag := filepath.Join(h.extra, "fail-probes")
	h.writeConfig("p.json", testPluginConfig("prober", "--probe-fail-file="+flag))
	h.start(fastConfig(h))
	p := h.waitPlugin("prober", "ready", ready)
	pid := p.Instances[0].Pid
	if err := os.WriteFile(flag, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	p = h.waitPlugin("prober", "restarted after failed probes", func(p *agentv1.Plugin) bool {
		return p.Instances[0].State == agentv1.PluginState_PLUGIN_STATE_BACKOFF
	})
	if !strings.Contains(p.Instances[0].LastError, "3 probes failed in a row") {
		t.Errorf("last error = %q", p.Instances[0].LastError)
	}
	if alive(int(pid)) {
		t.Errorf("unhealthy process %d still runs", pid)
	}
	if err := os.Remove(flag); err != nil {
		t.Fatal(err)
	}
	p = h.waitPlugin("prober", "ready again", ready)
	if p.Instances[0].Restarts != 1 || p.Instances[0].Pid == pid {
		t.Errorf("restarts %d pid %d (old %d)", p.Instances[0].Restarts, p.Instances[0].Pid, pid)
	}
}

// TestReadinessDeadline: a plugin that never finishes readiness is killed
// when the deadline passes.
func TestReadinessDeadline(t *testing.T) {
	h := newHarness(t)
	h.writeConfig("s.json", testPluginConfig("stuck", "--hang-info"))
	cfg := fastConfig(h)
	// Long enough for the process to start serving on a loaded machine,
	// so that the deadline ends the hung GetPluginInfo.
	cfg.ReadyTimeout = 2 * time.Second
	h.start(cfg)
	p := h.waitPlugin("stuck", "past its deadline", func(p *agentv1.Plugin) bool {
		return p != nil && p.Instances[0].State == agentv1.PluginState_PLUGIN_STATE_BACKOFF
	})
	if e := p.Instances[0].LastError; !strings.Contains(e, "GetPluginInfo") || !strings.Contains(e, "DeadlineExceeded") {
		t.Errorf("last error = %q", e)
	}
}

// TestLaunchEnvironment checks argv and environment of a managed plugin:
// shell false passes arguments as the whole argv, environment variables,
// CSI_ENDPOINT and MESOS_AGENT_ID are set, and the agent's own
// environment is not inherited.
func TestLaunchEnvironment(t *testing.T) {
	t.Setenv("TESTPLUGIN_LEAK", "agent-env")
	h := newHarness(t)
	cfg := strings.Replace(testPluginConfig("env", "extra-arg"), `"shell":false`,
		`"shell":false,"environment":{"variables":[{"name":"TESTPLUGIN_X","value":"42"}]}`, 1)
	h.writeConfig("e.json", cfg)
	h.start(fastConfig(h))
	h.waitPlugin("env", "ready", ready)
	out, err := os.ReadFile(filepath.Join(h.work, "csi", "env", "default", "logs", "container-0.stdout.log"))
	if err != nil {
		t.Fatal(err)
	}
	var launched struct {
		Argv []string          `json:"argv"`
		Env  map[string]string `json:"env"`
		Pgid int               `json:"pgid"`
		Pid  int               `json:"pid"`
	}
	if err := json.Unmarshal([]byte(strings.SplitN(string(out), "\n", 2)[0]), &launched); err != nil {
		t.Fatalf("stdout %q: %v", out, err)
	}
	if want := []string{"testplugin", "--name=env", "extra-arg"}; !slices.Equal(launched.Argv, want) {
		t.Errorf("argv = %q, want %q", launched.Argv, want)
	}
	want := map[string]string{
		"TESTPLUGIN_X":   "42",
		"CSI_ENDPOINT":   "unix://" + filepath.Join(h.run, "csi", "env", "default", "c0.sock"),
		"MESOS_AGENT_ID": "node-1",
	}
	if !maps.Equal(launched.Env, want) {
		t.Errorf("env = %v, want %v", launched.Env, want)
	}
	if launched.Pgid != launched.Pid {
		t.Errorf("plugin should lead its own process group: pid %d pgid %d", launched.Pid, launched.Pgid)
	}
}
