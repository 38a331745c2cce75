package supervisor

import (
	"maps"
	"slices"
	"strconv"
	"time"
)

// State is a plugin's or an instance's state. The numbers and names are
// the agent API's PluginState's (without its PLUGIN_STATE_ prefix), which
// the API edge relies on.
type State int32

// The states.
const (
	StateUnspecified State = iota
	// StateStarting: launched or connecting; readiness checks not passed.
	StateStarting
	// StateReady: probed ready and its capabilities discovered.
	StateReady
	// StateUnavailable: was ready; probes fail now (unmanaged) or it is
	// being restarted.
	StateUnavailable
	// StateBackoff: exited or failed to start; waiting out its restart
	// backoff.
	StateBackoff
	// StateStopped: its config was removed or the agent is shutting down.
	StateStopped
)

var stateNames = []string{"UNSPECIFIED", "STARTING", "READY", "UNAVAILABLE", "BACKOFF", "STOPPED"}

func (s State) String() string {
	if s >= 0 && int(s) < len(stateNames) {
		return stateNames[s]
	}
	return "State(" + strconv.Itoa(int(s)) + ")"
}

// InstanceStatus is one instance of a plugin (a container of a managed
// plugin, an endpoint of an unmanaged one) as the supervisor reports it.
type InstanceStatus struct {
	// Services are the CSI services it serves (CONTROLLER_SERVICE,
	// NODE_SERVICE); Endpoint its unix:// endpoint.
	Services []string
	Endpoint string
	State    State
	// Pid is a managed instance's process id, 0 when not running;
	// Restarts its restarts since the agent began supervising it; Adopted
	// whether its running process was adopted from an earlier agent.
	Pid       int
	Restarts  uint32
	Adopted   bool
	LastError string
	// StateSince is when State was entered; NextStart, in StateBackoff,
	// when the next start is due (zero otherwise).
	StateSince, NextStart time.Time
	// What discovery found: GetPluginInfo's name and version,
	// GetPluginCapabilities, NodeGetCapabilities, NodeGetInfo's node id,
	// the csi-addons and optional CSI services answered, the csi-addons
	// endpoint when apart from Endpoint ("" otherwise) and its identity.
	PluginName, VendorVersion            string
	PluginCapabilities, NodeCapabilities []string
	NodeID                               string
	AddonsServices                       []string
	AddonsEndpoint, AddonsIdentity       string
	// NodeGetInfo's accessible topology segments and max volumes per node
	// (0: no limit).
	AccessibleTopology map[string]string
	MaxVolumesPerNode  int64
	// ControllerCapabilities are ControllerGetCapabilities' RPC types of an
	// instance serving the controller service (e.g. GET_CAPACITY).
	ControllerCapabilities []string
}

// clone is a copy of s that shares nothing with it.
func (s *InstanceStatus) clone() *InstanceStatus {
	c := *s
	c.Services = slices.Clone(s.Services)
	c.PluginCapabilities = slices.Clone(s.PluginCapabilities)
	c.NodeCapabilities = slices.Clone(s.NodeCapabilities)
	c.AddonsServices = slices.Clone(s.AddonsServices)
	c.AccessibleTopology = maps.Clone(s.AccessibleTopology)
	c.ControllerCapabilities = slices.Clone(s.ControllerCapabilities)
	return &c
}

// PluginStatus is a supervised plugin and its instances.
type PluginStatus struct {
	Type, Name string
	// ConfigFile is the config file it came from; ConfigError the newest
	// error of that file, when it became invalid after loading (the plugin
	// keeps its last good config).
	ConfigFile, ConfigError string
	Managed                 bool
	// State is the least healthy instance's: READY when every one is.
	State     State
	Instances []*InstanceStatus
}
