package agent

import (
	"fmt"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// sdNotifier tells systemd (Type=notify) how the agent is doing: READY=1
// once the API serves and recovery is done, STATUS= lines, and watchdog
// keep-alives from the main loop. Without NOTIFY_SOCKET it does nothing.
type sdNotifier struct {
	a *Agent
	// watchdog is the keep-alive period (half of WatchdogSec), 0 if off.
	watchdog time.Duration
}

func newSDNotifier(a *Agent) *sdNotifier {
	n := &sdNotifier{a: a}
	if d, err := daemon.SdWatchdogEnabled(false); err == nil && d > 0 {
		n.watchdog = d / 2
	}
	return n
}

func (n *sdNotifier) send(state string) {
	if _, err := daemon.SdNotify(false, state); err != nil {
		n.a.log.Warn("notifying systemd", "error", err)
	}
}

// ready says the agent serves.
func (n *sdNotifier) ready() { n.send(daemon.SdNotifyReady + "\n" + n.status()) }

// stopping says the agent shuts down.
func (n *sdNotifier) stopping() { n.send(daemon.SdNotifyStopping + "\nSTATUS=shutting down") }

// alive feeds the watchdog and refreshes the status.
func (n *sdNotifier) alive() { n.send(daemon.SdNotifyWatchdog + "\n" + n.status()) }

// status is a STATUS= line: plugins ready, volumes published, containers,
// and what is pending (a plugin down holds up its volumes).
func (n *sdNotifier) status() string {
	plugins, _ := n.a.snapshot()
	ready := 0
	for _, p := range plugins {
		if p.State == agentv1.PluginState_PLUGIN_STATE_READY {
			ready++
		}
	}
	published := 0
	for _, v := range n.a.iso.ListVolumes() {
		if v.State == statev1.VolumeCheckpoint_PUBLISHED {
			published++
		}
	}
	line := fmt.Sprintf("STATUS=%d/%d plugins ready, %d volumes published, %d containers", ready, len(plugins), published, len(n.a.iso.ListContainers()))
	if p := n.a.iso.Pending(); p != "" {
		line += "; " + p
	}
	return line
}
