// Package cgroup enforces the cpus and mem resources of managed CSI plugin
// containers with cgroup v2, where the host allows it.
//
// Detect finds the cgroup2 mount (through mountinfo, so /sys/fs/cgroup on a
// unified host and /sys/fs/cgroup/unified on a hybrid one), checks that its
// root offers the cpu and memory controllers, creates a parent cgroup for
// plugins (Config.Parent, "csi-agent" by default) and enables both
// controllers on the way down to it. It is not read-only: it leaves the
// parent and the enabled controllers in place, and is idempotent, so every
// agent start calls it again. When limits cannot be enforced it returns an
// error wrapping ErrUnsupported that says why (for example, on a hybrid host
// whose cpu and memory controllers are bound to cgroup v1); the caller logs
// that once and runs plugins without limits.
//
// Manager.Prepare creates one leaf cgroup per plugin container, writes its
// cpu.max and memory.max, and returns the leaf's directory, whose descriptor
// goes into syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}: the child
// is born in the leaf (clone3 with CLONE_INTO_CGROUP, Linux 5.7+), with no
// window in which it runs unlimited and no step that needs the agent after
// the fork. The leaf outlives the agent along with the plugin in it; a
// restarted agent that adopts the plugin calls Manager.Remove by name once
// the plugin has exited.
//
// Limits are computed from the Mesos scalars by LimitsFor: cpus becomes a
// CFS quota of cpus*100ms per 100ms period (at least 1ms), mem (MiB) becomes
// memory.max in bytes. Swap, cpu.weight and io are left to the host.
//
// When not to use it: for unmanaged plugins (the agent does not start them),
// or to place processes after they started (write cgroup.procs yourself; this
// package only creates cgroups for children yet to be born). Do not point
// Config.Parent at a cgroup that holds processes, such as the agent's own
// systemd service cgroup: cgroup v2 lets only cgroups without processes of
// their own hand controllers to children, and Detect reports that as
// unsupported. A parent outside the agent's service cgroup also keeps
// "systemctl restart" from killing the plugins with the agent.
//
// A Manager holds no mutable state; its methods are safe for concurrent use
// on different names.
package cgroup
