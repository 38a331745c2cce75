package pluginconfig

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
)

const (
	// maxComponentLen bounds type and name: both become path components
	// under the work dir, and socket paths must fit in sun_path.
	maxComponentLen = 128
	unixScheme      = "unix://"
)

// Parse decodes and validates one config file's content. The result has
// its defaults filled in and its endpoints normalised.
func Parse(data []byte) (*PluginInfo, error) {
	var p PluginInfo
	if err := decodeStrict(data, &p); err != nil {
		return nil, err
	}
	if err := normalize(&p); err != nil {
		return nil, err
	}
	return &p, nil
}

// normalize validates p and fills in Mesos's defaults.
func normalize(p *PluginInfo) error {
	if p.Type == "" {
		return fieldErr("type", "required: the plugin type that volumes name as plugin_name, e.g. \"org.example.csi\"")
	}
	if err := checkComponent(p.Type); err != nil {
		return fieldErr("type", "%v", err)
	}
	if p.Name == "" {
		p.Name = DefaultName
	}
	if err := checkComponent(p.Name); err != nil {
		return fieldErr("name", "%v", err)
	}
	switch {
	case len(p.Containers) > 0 && len(p.Endpoints) > 0:
		return fieldErr("", "both containers and endpoints are set; a plugin is either managed (containers) or unmanaged (endpoints)")
	case len(p.Containers) == 0 && len(p.Endpoints) == 0:
		return fieldErr("", "neither containers nor endpoints is set; a managed plugin needs containers, an unmanaged one endpoints")
	}
	servedBy := map[Service]string{}
	for i := range p.Containers {
		if err := normalizeContainer(&p.Containers[i], fmt.Sprintf("containers[%d]", i), servedBy); err != nil {
			return err
		}
	}
	for i := range p.Endpoints {
		if err := normalizeEndpoint(&p.Endpoints[i], fmt.Sprintf("endpoints[%d]", i), servedBy); err != nil {
			return err
		}
	}
	if _, ok := servedBy[NodeService]; !ok {
		what := "containers"
		if len(p.Endpoints) > 0 {
			what = "endpoints"
		}
		return fieldErr(what, "no NODE_SERVICE: csiagent stages and publishes volumes through the node service, so one of the %s must serve it", what)
	}
	if p.TargetPathRoot != "" {
		if !filepath.IsAbs(p.TargetPathRoot) {
			return fieldErr("target_path_root", "must be an absolute path, got %q", p.TargetPathRoot)
		}
		p.TargetPathRoot = filepath.Clean(p.TargetPathRoot)
	}
	if p.Settings != nil && p.Settings.CSIAddonsEndpoint != "" {
		path := SettingsKey + ".csi_addons_endpoint"
		if p.Managed() {
			return fieldErr(path, "for unmanaged plugins only: a managed plugin's command is told its csi-addons socket in $CSIADDONS_ENDPOINT")
		}
		uri, err := unixURI(p.Settings.CSIAddonsEndpoint)
		if err != nil {
			return fieldErr(path, "%v", err)
		}
		for _, e := range p.Endpoints {
			if e.Endpoint == uri {
				return fieldErr(path, "%s is also a CSI endpoint; leave csi_addons_endpoint out when csi-addons is served on the CSI socket", uri)
			}
		}
		p.Settings.CSIAddonsEndpoint = uri
	}
	if p.Settings != nil {
		if err := p.Settings.ReclaimSpace.validate(SettingsKey+".reclaim_space", "reclaim"); err != nil {
			return err
		}
		if err := p.Settings.KeyRotation.validate(SettingsKey+".key_rotation", "key rotation"); err != nil {
			return err
		}
		for i, name := range p.Settings.CSIAddonsServices {
			path := fmt.Sprintf("%s.csi_addons_services[%d]", SettingsKey, i)
			if !slices.Contains(AddonServices, name) {
				return fieldErr(path, "%q is not a service csiagent uses (one of %s)", name, strings.Join(AddonServices, ", "))
			}
			if slices.Contains(p.Settings.CSIAddonsServices[:i], name) {
				return fieldErr(path, "%q is listed twice", name)
			}
		}
	}
	return nil
}

// validate checks a schedule's overrides (nil: none) at path.
func (rp *ReclaimPolicy) validate(path, what string) error {
	if rp == nil {
		return nil
	}
	if rp.Timeout != nil && *rp.Timeout == 0 {
		return fieldErr(path+".timeout", "must be greater than 0 (set interval to \"0\" to disable %s)", what)
	}
	if rp.MaxConcurrent != nil && *rp.MaxConcurrent < 1 {
		return fieldErr(path+".max_concurrent", "must be at least 1, got %d", *rp.MaxConcurrent)
	}
	return nil
}

func normalizeContainer(c *Container, path string, servedBy map[Service]string) error {
	if len(c.Services) == 0 {
		return fieldErr(path+".services", "required: list CONTROLLER_SERVICE and/or NODE_SERVICE")
	}
	for j, s := range c.Services {
		if err := claimService(s, fmt.Sprintf("%s.services[%d]", path, j), path, servedBy); err != nil {
			return err
		}
	}
	if len(c.Container) > 0 && string(c.Container) != "null" {
		return fieldErr(path+".container", "container images are not supported: csiagent runs managed plugins as host processes from command")
	}
	if c.Command == nil {
		return fieldErr(path+".command", "required: the command that starts the plugin")
	}
	cmd := c.Command
	if strings.TrimSpace(cmd.Value) == "" {
		return fieldErr(path+".command.value", "required: the executable (shell: false) or shell command line (shell: true)")
	}
	if cmd.UsesShell() && len(cmd.Arguments) > 0 {
		return fieldErr(path+".command.arguments", "only used with \"shell\": false; with a shell, put the arguments in value")
	}
	if cmd.Shell == nil {
		shell := true
		cmd.Shell = &shell
	}
	if len(cmd.URIs) > 0 && string(cmd.URIs) != "null" {
		return fieldErr(path+".command.uris", "not supported: csiagent fetches nothing; install the plugin on the host")
	}
	if cmd.Environment != nil {
		seen := map[string]bool{}
		for k, v := range cmd.Environment.Variables {
			vp := fmt.Sprintf("%s.command.environment.variables[%d]", path, k)
			switch {
			case v.Name == "" || strings.ContainsAny(v.Name, "=\x00"):
				return fieldErr(vp+".name", "must be a non-empty name without '=' or NUL, got %q", v.Name)
			case seen[v.Name]:
				return fieldErr(vp+".name", "%q is set twice", v.Name)
			case v.Type != "" && v.Type != "VALUE":
				return fieldErr(vp+".type", "%q is not supported; only VALUE variables are", v.Type)
			case len(v.Secret) > 0 && string(v.Secret) != "null":
				return fieldErr(vp+".secret", "secret variables are not supported; use a value, or let the plugin read its secret from a file")
			case strings.ContainsRune(v.Value, 0):
				return fieldErr(vp+".value", "contains a NUL byte")
			}
			seen[v.Name] = true
		}
	}
	for k := range c.Resources {
		if err := c.Resources[k].validate(fmt.Sprintf("%s.resources[%d]", path, k)); err != nil {
			return err
		}
	}
	return nil
}

// validate checks one resource at path: a name, and no negative amount
// (the decoder refused numbers out of range, whence NaN and Inf).
func (r *Resource) validate(path string) error {
	if r.Name == "" {
		return fieldErr(path+".name", "required, e.g. \"cpus\" or \"mem\"")
	}
	if r.Scalar != nil && r.Scalar.Value < 0 {
		return fieldErr(path+".scalar.value", "%s must not be negative, got %v", r.Name, r.Scalar.Value)
	}
	if r.Ranges != nil {
		for i, rg := range r.Ranges.Range {
			if rg.Begin > rg.End {
				return fieldErr(fmt.Sprintf("%s.ranges.range[%d]", path, i), "begin %d is after end %d", rg.Begin, rg.End)
			}
		}
	}
	return nil
}

func normalizeEndpoint(e *Endpoint, path string, servedBy map[Service]string) error {
	if e.CSIService == "" {
		return fieldErr(path+".csi_service", "required: CONTROLLER_SERVICE or NODE_SERVICE")
	}
	if err := claimService(e.CSIService, path+".csi_service", path, servedBy); err != nil {
		return err
	}
	if e.Endpoint == "" {
		return fieldErr(path+".endpoint", "required: the plugin's unix socket, e.g. \"unix:///run/plugin/csi.sock\"")
	}
	uri, err := unixURI(e.Endpoint)
	if err != nil {
		return fieldErr(path+".endpoint", "%v", err)
	}
	e.Endpoint = uri
	return nil
}

// unixURI normalises a unix socket endpoint (unix:///path or /path) to a
// unix:// URI.
func unixURI(endpoint string) (string, error) {
	sock := endpoint
	switch {
	case strings.HasPrefix(sock, unixScheme):
		sock = strings.TrimPrefix(sock, unixScheme)
	case strings.Contains(sock, "://"):
		return "", fmt.Errorf("%q is not a unix socket; only unix:// endpoints are supported", endpoint)
	}
	if !filepath.IsAbs(sock) {
		return "", fmt.Errorf("%q must be an absolute socket path (unix:///path or /path)", endpoint)
	}
	return unixScheme + filepath.Clean(sock), nil
}

// claimService records that owner serves s, rejecting UNKNOWN and a
// service served twice.
func claimService(s Service, path, owner string, servedBy map[Service]string) error {
	if s == UnknownService {
		return fieldErr(path, "UNKNOWN is not a service; expected CONTROLLER_SERVICE or NODE_SERVICE")
	}
	if prev, ok := servedBy[s]; ok {
		if prev == owner {
			return fieldErr(path, "%s is listed twice", s)
		}
		return fieldErr(path, "%s is already served by %s; each service has one provider", s, prev)
	}
	servedBy[s] = owner
	return nil
}

// checkComponent accepts a string that is safe as one path component.
func checkComponent(s string) error {
	if len(s) > maxComponentLen {
		return fmt.Errorf("longer than %d bytes", maxComponentLen)
	}
	if s == "." || s == ".." {
		return fmt.Errorf("%q is not allowed (it is used as a directory name)", s)
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("%q has the character %q; use letters, digits, '.', '_' and '-' (it is used as a directory name)", s, r)
		}
	}
	return nil
}
