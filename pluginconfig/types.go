package pluginconfig

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// DefaultName is the plugin instance name Mesos assumes when a config file
// has no "name".
const DefaultName = "default"

// SettingsKey is the one key outside the Mesos schema that a config file may
// carry: csiagent's own per-plugin settings. Mesos ignores it.
const SettingsKey = "csiagent"

// PluginInfo is Mesos's CSIPluginInfo (include/mesos/mesos.proto, Mesos 1.11)
// in its JSON form, plus csiagent's settings under SettingsKey.
type PluginInfo struct {
	// Type is the CSI plugin's type; volumes name it as their plugin_name.
	Type string `json:"type"`
	// Name tells apart instances of one type; DefaultName when absent.
	Name string `json:"name,omitempty"`
	// Containers make the plugin managed: csiagent runs their commands.
	Containers []Container `json:"containers,omitempty"`
	// Endpoints make the plugin unmanaged: someone else runs it.
	Endpoints []Endpoint `json:"endpoints,omitempty"`
	// TargetPathRoot, when set, is where staging and target paths live
	// (plugins that may only mount below a fixed directory need it).
	TargetPathRoot string `json:"target_path_root,omitempty"`
	// TargetPathExists, as Mesos defines it: the plugin expects the target
	// path to exist when NodePublishVolume is called (not CSI v1
	// compliant), so csiagent creates it; false: csiagent creates only
	// its parent and the plugin the target, as CSI says.
	TargetPathExists bool `json:"target_path_exists,omitempty"`
	// Settings are csiagent's own per-plugin settings.
	Settings *Settings `json:"csiagent,omitempty"`
}

// Equal reports whether two configs mean the same: their normalised JSON
// forms are equal (nil and empty lists are alike).
func (p *PluginInfo) Equal(q *PluginInfo) bool {
	a, errA := json.Marshal(p)
	b, errB := json.Marshal(q)
	return errA == nil && errB == nil && bytes.Equal(a, b)
}

// Managed reports whether csiagent launches the plugin's processes.
func (p *PluginInfo) Managed() bool { return len(p.Containers) > 0 }

// Services lists the CSI services the plugin offers, in the order
// CONTROLLER_SERVICE, NODE_SERVICE.
func (p *PluginInfo) Services() []Service {
	var out []Service
	for _, s := range []Service{ControllerService, NodeService} {
		if p.Serves(s) {
			out = append(out, s)
		}
	}
	return out
}

// Serves reports whether some container or endpoint offers service s.
func (p *PluginInfo) Serves(s Service) bool {
	for _, c := range p.Containers {
		for _, cs := range c.Services {
			if cs == s {
				return true
			}
		}
	}
	for _, e := range p.Endpoints {
		if e.CSIService == s {
			return true
		}
	}
	return false
}

// Container is Mesos's CSIPluginContainerInfo: one process of a managed
// plugin and the CSI services it serves.
type Container struct {
	Services  []Service  `json:"services"`
	Command   *Command   `json:"command,omitempty"`
	Resources []Resource `json:"resources,omitempty"`
	// Container is Mesos's ContainerInfo (a container image to run the
	// plugin in). csiagent runs plugins as host processes and rejects it.
	Container json.RawMessage `json:"container,omitempty"`
}

// Command is Mesos's CommandInfo, the fields csiagent honours.
type Command struct {
	// Value is a shell command line when Shell is true, else the executable
	// (looked up in PATH like execlp).
	Value string `json:"value"`
	// Arguments is the whole argv, argv[0] included, when Shell is false.
	Arguments []string `json:"arguments,omitempty"`
	// Shell defaults to true, as in Mesos.
	Shell       *bool        `json:"shell,omitempty"`
	Environment *Environment `json:"environment,omitempty"`
	// User, when set, is the user the process runs as.
	User string `json:"user,omitempty"`
	// URIs is Mesos's fetcher list; csiagent fetches nothing and rejects it.
	URIs json.RawMessage `json:"uris,omitempty"`
}

// UsesShell reports whether Value runs under /bin/sh -c.
func (c *Command) UsesShell() bool { return c.Shell == nil || *c.Shell }

// Environment is Mesos's Environment.
type Environment struct {
	Variables []Variable `json:"variables"`
}

// Variable is one environment variable. Only plain values are supported
// (Mesos's VALUE type, its default).
type Variable struct {
	Name  string `json:"name"`
	Type  string `json:"type,omitempty"`
	Value string `json:"value"`
	// Secret is Mesos's secret-typed variable, which csiagent rejects.
	Secret json.RawMessage `json:"secret,omitempty"`
}

// Resource is a Mesos Resource as written in plugin configs (cpus, mem).
// The supervisor enforces cpus and mem where cgroups allow it.
type Resource struct {
	Name   string          `json:"name"`
	Type   string          `json:"type"`
	Scalar *Scalar         `json:"scalar,omitempty"`
	Ranges *Ranges         `json:"ranges,omitempty"`
	Set    json.RawMessage `json:"set,omitempty"`
	Role   string          `json:"role,omitempty"`
}

// Scalar is Mesos's Value.Scalar; never negative.
type Scalar struct {
	Value float64 `json:"value"`
}

// Ranges is Mesos's Value.Ranges (e.g. ports).
type Ranges struct {
	Range []Range `json:"range"`
}

// Range is Mesos's Value.Range, Begin <= End.
type Range struct {
	Begin uint64 `json:"begin"`
	End   uint64 `json:"end"`
}

// Endpoint is Mesos's CSIPluginEndpoint: where an unmanaged plugin listens.
type Endpoint struct {
	CSIService Service `json:"csi_service"`
	// Endpoint is a unix socket, normalised to a unix:// URI.
	Endpoint string `json:"endpoint"`
}

// SocketPath is the endpoint's filesystem path.
func (e Endpoint) SocketPath() string { return strings.TrimPrefix(e.Endpoint, unixScheme) }

// Settings are csiagent's own per-plugin settings, under SettingsKey.
type Settings struct {
	ReclaimSpace *ReclaimPolicy `json:"reclaim_space,omitempty"`
	// KeyRotation schedules csi-addons EncryptionKeyRotate on the
	// plugin's published volumes, with the same fields (interval 0: off).
	KeyRotation *ReclaimPolicy `json:"key_rotation,omitempty"`
	// CSIAddonsEndpoint is where an unmanaged plugin serves csi-addons
	// (ceph-csi's --csi-addons-endpoint), normalised to a unix:// URI;
	// empty: on its CSI endpoints. Managed plugins are told theirs in
	// $CSIADDONS_ENDPOINT instead.
	CSIAddonsEndpoint string `json:"csi_addons_endpoint,omitempty"`
	// CSIAddonsServices declares the optional services the plugin serves
	// (AddonServices' names), for a plugin that answers neither the
	// csi-addons identity service nor gRPC server reflection: the agent
	// never calls a service whose calls may act to find out whether it is
	// there.
	CSIAddonsServices []string `json:"csi_addons_services,omitempty"`
}

// AddonServices are the optional services csiagent uses, by gRPC full
// name: csi-addons' and CSI's GroupController.
var AddonServices = []string{
	"reclaimspace.ReclaimSpaceNode", "reclaimspace.ReclaimSpaceController",
	"encryptionkeyrotation.EncryptionKeyRotationController", "volumegroup.Controller",
	"replication.Controller", "fence.FenceController", "csi.v1.GroupController",
}

// ReclaimPolicy overrides the agent-wide defaults of a per-volume schedule
// (reclaim space, key rotation) for one plugin. A nil field keeps the
// agent's default.
type ReclaimPolicy struct {
	// Interval between two reclaims of one volume; 0 disables reclaim.
	Interval *Duration `json:"interval,omitempty"`
	// Timeout of one NodeReclaimSpace call.
	Timeout *Duration `json:"timeout,omitempty"`
	// MaxConcurrent reclaims of this plugin at once.
	MaxConcurrent *int `json:"max_concurrent,omitempty"`
}

// Service is Mesos's CSIPluginContainerInfo.Service, written as its name.
type Service string

// The services of CSIPluginContainerInfo.Service.
const (
	UnknownService    Service = "UNKNOWN"
	ControllerService Service = "CONTROLLER_SERVICE"
	NodeService       Service = "NODE_SERVICE"
)

// services lists the enum in number order: protobuf's JSON form may write
// a service as its number.
func services() [3]Service {
	return [...]Service{UnknownService, ControllerService, NodeService}
}

// UnmarshalJSON accepts the enum's name or number.
func (s *Service) UnmarshalJSON(b []byte) error {
	known := services()
	var n int
	if err := json.Unmarshal(b, &n); err == nil {
		if n < 0 || n >= len(known) {
			return fmt.Errorf("unknown service number %d; expected CONTROLLER_SERVICE or NODE_SERVICE", n)
		}
		*s = known[n]
		return nil
	}
	var name string
	if err := json.Unmarshal(b, &name); err != nil {
		return fmt.Errorf("expected a service name, got %s", b)
	}
	for _, k := range known {
		if Service(name) == k {
			*s = k
			return nil
		}
	}
	return fmt.Errorf("unknown service %q; expected CONTROLLER_SERVICE or NODE_SERVICE", name)
}

// Duration is a time.Duration written as a Go duration string ("168h").
type Duration time.Duration

// UnmarshalJSON parses a duration string such as "10m" or "0".
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("expected a duration string such as \"10m\", got %s", b)
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("expected a duration such as \"10m\" or \"168h\", got %q", s)
	}
	if v < 0 {
		return fmt.Errorf("duration %q is negative", s)
	}
	*d = Duration(v)
	return nil
}

// MarshalJSON writes the duration as a string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}
