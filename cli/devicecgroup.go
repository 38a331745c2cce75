package cli

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// deviceRule is one entry of a bundle's linux.resources.devices (the OCI
// runtime spec's LinuxDeviceCgroup): the container's device cgroup.
type deviceRule struct {
	Allow  bool   `json:"allow"`
	Type   string `json:"type"`  // "a" (or empty): any; "b", "c"
	Major  *int64 `json:"major"` // nil or -1: any
	Minor  *int64 `json:"minor"`
	Access string `json:"access"` // of "rwm"; empty: all
}

// matches reports whether r is about block device major:minor.
func (r deviceRule) matches(major, minor int64) bool {
	is := func(n *int64, want int64) bool { return n == nil || *n == -1 || *n == want }
	return (r.Type == "" || r.Type == "a" || r.Type == "b") && is(r.Major, major) && is(r.Minor, minor)
}

// allowed reports whether rules may let the container open block device
// major:minor for each access in access ("r", "rw"): whether some rule
// allows it. It errs on the side of allowed: the runtimes' emulation of
// the device controller (runc's) does not let a later, narrower deny take
// back a wildcard allow in a default-deny list, and a default-allow list
// (a rule allowing everything first) is taken as allowing. What it refuses
// is certain: no rule allows the device (runc, Docker and Podman begin
// with a rule denying every device, and runc denies with no rules at all).
func allowed(rules []deviceRule, major, minor int64, access string) bool {
	for _, a := range access {
		ok := false
		for _, r := range rules {
			if r.Allow && r.matches(major, minor) && (r.Access == "" || strings.ContainsRune(r.Access, a)) {
				ok = true
			}
		}
		if !ok {
			return false
		}
	}
	return true
}

// checkDevices fails, naming the rule to add, for each block volume of
// mounts (the agent says which: block_device) whose device the container's
// device cgroup (rules) does not let it open as it was given (read-only:
// r; else rw). Without the rule, the device node is there but every open
// fails with EPERM.
func checkDevices(mounts []*agentv1.ContainerMount, rules []deviceRule) error {
	if os.Geteuid() != 0 {
		// A rootless runtime applies no device rules.
		return nil
	}
	var errs []error
	for _, m := range mounts {
		rdev := m.GetBlockDevice()
		if rdev == 0 {
			continue
		}
		major, minor := int64(unix.Major(rdev)), int64(unix.Minor(rdev))
		access := "rw"
		if m.GetReadonly() {
			access = "r"
		}
		if !allowed(rules, major, minor, access) {
			errs = append(errs, fmt.Errorf("block volume %s at %s is device %d:%d, which the container's device cgroup does not allow (%s): add {\"allow\": true, \"type\": \"b\", \"major\": %d, \"minor\": %d, \"access\": %q} to linux.resources.devices (runc), or run it with --device-cgroup-rule 'b %d:%d %s' (Docker, Podman); 'b %d:* %s' allows every device of that driver",
				m.GetVolumeId(), m.GetContainerPath(), major, minor, access, major, minor, access, major, minor, access, major, access))
		}
	}
	return errors.Join(errs...)
}
