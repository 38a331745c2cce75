package integration

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// agentProcess is a real `csi-agent serve`, so it can be SIGKILLed.
type agentProcess struct {
	cmd *exec.Cmd
}

func startAgentProcess(t *testing.T, h *harness) *agentProcess {
	t.Helper()
	cmd := exec.Command(bins.agent, "serve", "--csi-plugin-config-dir", h.confDir, "--work-dir", h.work,
		"--runtime-dir", h.run, "--node-id", "node-1", "--plugin-probe-interval", "100ms", "--log-level", "debug")
	cmd.Stderr = testWriter{t}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ap := &agentProcess{cmd: cmd}
	t.Cleanup(func() { ap.kill() })
	return ap
}

func (ap *agentProcess) kill() {
	if ap.cmd.ProcessState == nil {
		_ = ap.cmd.Process.Signal(unix.SIGKILL)
		_ = ap.cmd.Wait()
	}
}

// watchUntil follows WatchPlugins on the agent's socket until cond holds
// for the plugin of type typ.
func watchUntil(t *testing.T, socket, typ, what string, cond func(*agentv1.Plugin) bool) *agentv1.Plugin {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	client := apiClient(t, socket)
	for ctx.Err() == nil {
		// The agent may not be listening yet: wait for it.
		stream, err := client.WatchPlugins(ctx, &agentv1.ListPluginsRequest{}, grpc.WaitForReady(true))
		if err != nil {
			continue
		}
		for {
			resp, err := stream.Recv()
			if err != nil {
				break
			}
			for _, p := range resp.Plugins {
				if p.Type == typ && cond(p) {
					return p
				}
			}
		}
	}
	t.Fatalf("plugin %s not %s within %v", typ, what, waitTimeout)
	return nil
}

// TestAdoptAfterAgentKill: a SIGKILLed agent's successor adopts the live
// plugin process instead of restarting it; if the config changed while no
// agent ran, the successor rolls the plugin.
func TestAdoptAfterAgentKill(t *testing.T) {
	h := newHarness(t)
	socket := filepath.Join(h.run, "agent.sock")
	h.writeConfig("t.json", testPluginConfig("adoptee"))
	ap := startAgentProcess(t, h)
	p := watchUntil(t, socket, "adoptee", "ready", ready)
	pid := int(p.Instances[0].Pid)
	t.Cleanup(func() { killAndWait(t, pid) })

	ap.kill()
	if !alive(pid) {
		t.Fatalf("plugin %d died with the agent", pid)
	}
	ap = startAgentProcess(t, h)
	p = watchUntil(t, socket, "adoptee", "ready after agent restart", ready)
	if in := p.Instances[0]; int(in.Pid) != pid || !in.Adopted || in.Restarts != 0 {
		t.Fatalf("after restart: pid %d adopted %v restarts %d; want pid %d adopted", in.Pid, in.Adopted, in.Restarts, pid)
	}

	ap.kill()
	h.writeConfig("t.json", testPluginConfig("adoptee", "--probe-not-ready=1"))
	startAgentProcess(t, h)
	p = watchUntil(t, socket, "adoptee", "ready with the new config", ready)
	newPid := int(p.Instances[0].Pid)
	t.Cleanup(func() { killAndWait(t, newPid) })
	if newPid == pid || p.Instances[0].Adopted {
		t.Errorf("changed config should roll the plugin: pid %d -> %d, adopted %v", pid, newPid, p.Instances[0].Adopted)
	}
	if alive(pid) {
		t.Errorf("old plugin process %d still runs", pid)
	}
}
