package apiserver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/isolator"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// What members of --api-group (callers other than root) may do. Root keeps
// the whole API. A member:
//
//   - prepares only into a rootfs or a sandbox strictly below one of the
//     --api-group-roots prefixes (after filepath.Clean, and again after
//     resolving symlinks in the agent's own view), never with an absolute
//     container_path and no rootfs (a host path); without
//     --api-group-roots, not at all;
//   - passes a pid only of a process whose real, effective, saved and
//     filesystem uids are the member's, in a mount namespace owned by the
//     agent's user namespace (one the member could not have made and
//     arranged itself);
//   - passes a user only that is the member's own uid, with its own gid
//     (primary or supplementary);
//   - cleans up only containers whose rootfs and mount points are below
//     the prefixes (the isolator does not record who prepared a container:
//     members sharing prefixes can clean up each other's containers);
//   - may not call Reconcile, which cleans up every container not listed.
//
// Checks are made on the request before the isolator acts, and a
// member's prepared mount points are checked again after it: the
// isolator resolves container paths inside the root safely
// (RESOLVE_IN_ROOT), but opens the rootfs or sandbox itself by path, so a
// member who can rename a directory between a prefix and its rootfs could
// swap it for a symlink between the check and that open. The check after
// finds such a mount outside the prefixes, undoes the prepare and refuses
// it; closing the window needs the isolator to open the root beneath the
// prefix (openat2 RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS).

// Members is the policy for members of --api-group.
type Members struct {
	// Roots are the --api-group-roots prefixes (ParseRoots): absolute,
	// clean, not "/". None: members may not prepare.
	Roots []string
}

// ParseRoots parses --api-group-roots: comma-separated absolute clean
// directory prefixes, not "/".
func ParseRoots(s string) ([]string, error) {
	var out []string
	for _, r := range strings.Split(s, ",") {
		r = strings.TrimSpace(r)
		switch {
		case r == "":
			continue
		case !filepath.IsAbs(r):
			return nil, fmt.Errorf("%q is not an absolute path", r)
		case filepath.Clean(r) != r:
			return nil, fmt.Errorf("%q is not a clean path (%q)", r, filepath.Clean(r))
		case r == "/":
			return nil, errors.New(`"/" would let members prepare into any host directory`)
		}
		out = append(out, r)
	}
	return out, nil
}

// callerCred is the calling peer's credentials (PeerCredentials), nil
// when there are none.
func callerCred(ctx context.Context) *unix.Ucred {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return nil
	}
	pi, ok := p.AuthInfo.(peerInfo)
	if !ok {
		return nil
	}
	return pi.cred
}

// member returns the caller's credentials when it is not root (a member
// of --api-group: Access let it in), nil for root; a call without
// credentials is refused (Access refuses it first).
func member(ctx context.Context) (*unix.Ucred, error) {
	c := callerCred(ctx)
	if c == nil {
		return nil, status.Error(codes.Unauthenticated, "no peer credentials")
	}
	if c.Uid == 0 {
		return nil, nil
	}
	return c, nil
}

// denied is a PermissionDenied refusal of a member's call.
func denied(c *unix.Ucred, format string, args ...any) error {
	return status.Errorf(codes.PermissionDenied, "uid %d (an --api-group member): %s", c.Uid, fmt.Sprintf(format, args...))
}

// noRoots is the refusal when the agent has no --api-group-roots.
const noRoots = "members of --api-group may not prepare: the agent has no --api-group-roots (members may prepare only into a rootfs or sandbox below those prefixes)"

// Checked is what CheckPrepare checked, for the Prepare to go on with:
// the rootfs and sandbox resolved (symlinks followed), to be opened with
// no symlink on the way (statev1.PrepareRequest.confined), and the mount
// namespace the pid was found in (made by the host), which the pid must
// still be in.
type Checked struct {
	Rootfs, Sandbox string
	MountNamespace  uint64
}

// CheckPrepare refuses a member's Prepare request that is not within the
// policy (PermissionDenied naming the field and the rule).
func (m Members) CheckPrepare(c *unix.Ucred, req *agentv1.PrepareRequest) (Checked, error) {
	var out Checked
	if len(m.Roots) == 0 {
		return out, denied(c, noRoots)
	}
	for _, f := range []struct {
		name, dir string
		to        *string
	}{{"rootfs", req.GetRootfs(), &out.Rootfs}, {"sandbox", req.GetSandbox(), &out.Sandbox}} {
		if f.dir == "" {
			continue
		}
		resolved, err := m.checkDir(f.name, f.dir)
		if err != nil {
			return Checked{}, denied(c, "%v", err)
		}
		*f.to = resolved
	}
	ns, err := checkPaths(c, req)
	if err != nil {
		return Checked{}, err
	}
	out.MountNamespace = ns
	return out, nil
}

// checkPaths is CheckPrepare's checks of the container paths, the user
// and the pid; it returns the pid's mount namespace (0: no pid).
func checkPaths(c *unix.Ucred, req *agentv1.PrepareRequest) (uint64, error) {
	for i, v := range req.GetVolumes() {
		if filepath.IsAbs(v.GetContainerPath()) && req.GetRootfs() == "" {
			return 0, denied(c, "volumes[%d].container_path %q is absolute and the request has no rootfs: members may not mount on host paths", i, v.GetContainerPath())
		}
	}
	for i, m := range req.GetNamedMounts() {
		if filepath.IsAbs(m.GetContainerPath()) && req.GetRootfs() == "" {
			return 0, denied(c, "named_mounts[%d].container_path %q is absolute and the request has no rootfs: members may not mount on host paths", i, m.GetContainerPath())
		}
	}
	if err := checkUser(c, req.GetUser()); err != nil {
		return 0, denied(c, "%v", err)
	}
	if pid := req.GetPid(); pid != 0 {
		ns, err := checkPid(c, int(pid))
		if err != nil {
			return 0, denied(c, "%v", err)
		}
		return ns, nil
	}
	return 0, nil
}

// checkDir checks a member's rootfs or sandbox: clean, strictly below a
// prefix, and, symlinks resolved, still strictly below a prefix (itself
// resolved). It returns it resolved.
func (m Members) checkDir(field, dir string) (string, error) {
	if !filepath.IsAbs(dir) || filepath.Clean(dir) != dir {
		return "", fmt.Errorf("%s %q is not an absolute clean path", field, dir)
	}
	if !m.below(dir) {
		return "", fmt.Errorf("%s %q is not under any --api-group-roots prefix (%s)", field, dir, strings.Join(m.Roots, ","))
	}
	resolved, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return "", fmt.Errorf("%s %q: resolving it, to check that it stays under the --api-group-roots prefixes: %w", field, dir, err)
	}
	for _, r := range m.Roots {
		rr, err := filepath.EvalSymlinks(r)
		if err == nil && strictlyBelow(resolved, rr) {
			return resolved, nil
		}
	}
	return "", fmt.Errorf("%s %q resolves to %q, which is not under any --api-group-roots prefix (%s)", field, dir, resolved, strings.Join(m.Roots, ","))
}

// below reports whether path is strictly below one of the prefixes,
// lexically.
func (m Members) below(path string) bool {
	for _, r := range m.Roots {
		if strictlyBelow(path, r) {
			return true
		}
	}
	return false
}

func strictlyBelow(path, prefix string) bool {
	return strings.HasPrefix(filepath.Clean(path), prefix+"/")
}

// checkUser allows "" (created directories keep the agent's ownership)
// or the caller's own uid with its own gid, resolved as the isolator
// resolves it (a name, a uid, or UID:GID).
func checkUser(c *unix.Ucred, name string) error {
	if name == "" {
		return nil
	}
	uid, gid, err := lookupUser(name)
	if err != nil {
		return fmt.Errorf("user %q: %w", name, err)
	}
	if uid != int(c.Uid) {
		return fmt.Errorf("user %q is uid %d: members may give created directories only to their own uid (%d)", name, uid, c.Uid)
	}
	if gid != int(c.Gid) && !inGroup(int(c.Pid), gid) {
		return fmt.Errorf("user %q has gid %d: members may give created directories only to one of their own groups (%d)", name, gid, c.Gid)
	}
	return nil
}

// lookupUser resolves a user as the isolator does (isolator's lookupUser:
// the two must agree, or a member's user could pass here as one and act
// there as another).
func lookupUser(name string) (uid, gid int, err error) {
	if u, g, ok := strings.Cut(name, ":"); ok {
		uid, uerr := strconv.ParseUint(u, 10, 31)
		gid, gerr := strconv.ParseUint(g, 10, 31)
		if uerr != nil || gerr != nil {
			return 0, 0, errors.New("want a name, a uid or UID:GID")
		}
		return int(uid), int(gid), nil
	}
	u, err := user.Lookup(name)
	if err != nil {
		if n, perr := strconv.Atoi(name); perr == nil && !strings.HasPrefix(name, "-") {
			return n, n, nil
		}
		return 0, 0, err
	}
	uid, uerr := strconv.Atoi(u.Uid)
	gid, gerr := strconv.Atoi(u.Gid)
	if uerr != nil || gerr != nil {
		return 0, 0, fmt.Errorf("uid %q, gid %q are not numbers", u.Uid, u.Gid)
	}
	return uid, gid, nil
}

// checkPid allows a pid of a live process of the caller's uid (real,
// effective, saved and filesystem uid) whose mount namespace belongs to
// the agent's user namespace: a namespace an unprivileged member made
// (in a user namespace of its own) could bind any host directory below a
// prefix. The process is held by a pidfd opened first and checked alive
// after the reads, so they are of that process, not of one that reused
// its pid. (The isolator looks the pid up again; the pid could be reused
// in between, by a process the member does not choose.)
func checkPid(c *unix.Ucred, pid int) (mountNS uint64, err error) {
	if pid < 0 {
		return 0, fmt.Errorf("pid %d is not a process id", pid)
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0, fmt.Errorf("pid %d: %w", pid, err)
	}
	defer unix.Close(pidfd)
	dir := filepath.Join("/proc", strconv.Itoa(pid))
	uids, err := statusUids(filepath.Join(dir, "status"))
	if err != nil {
		return 0, fmt.Errorf("pid %d: %w", pid, err)
	}
	for _, u := range uids {
		if u != int(c.Uid) {
			return 0, fmt.Errorf("pid %d is not the caller's process (its uids are %v): members may pass only the pid of a process of their own uid %d", pid, uids, c.Uid)
		}
	}
	if mountNS, err = checkNamespaceOwner(filepath.Join(dir, "ns", "mnt")); err != nil {
		return 0, fmt.Errorf("pid %d: %w", pid, err)
	}
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil {
		return 0, fmt.Errorf("pid %d exited while it was checked: %w", pid, err)
	}
	return mountNS, nil
}

// statusUids reads the Uid line of a /proc/<pid>/status file.
func statusUids(path string) ([]int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Uid:"); ok {
			var out []int
			for _, f := range strings.Fields(rest) {
				n, err := strconv.Atoi(f)
				if err != nil {
					return nil, fmt.Errorf("%s: bad Uid line %q", path, line)
				}
				out = append(out, n)
			}
			if len(out) == 0 {
				break
			}
			return out, nil
		}
	}
	return nil, fmt.Errorf("%s: no Uid line", path)
}

// checkNamespaceOwner refuses a mount namespace not owned by the agent's
// own user namespace.
func checkNamespaceOwner(nsPath string) (uint64, error) {
	ns, err := os.Open(nsPath)
	if err != nil {
		return 0, err
	}
	defer ns.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(ns.Fd()), &st); err != nil {
		return 0, fmt.Errorf("its mount namespace: %w", err)
	}
	fd, err := unix.IoctlRetInt(int(ns.Fd()), unix.NS_GET_USERNS)
	if err != nil {
		return 0, fmt.Errorf("the owner of its mount namespace: %w", err)
	}
	defer unix.Close(fd)
	var owner, self unix.Stat_t
	if err := unix.Fstat(fd, &owner); err != nil {
		return 0, fmt.Errorf("the owner of its mount namespace: %w", err)
	}
	if err := unix.Stat("/proc/self/ns/user", &self); err != nil {
		return 0, fmt.Errorf("the agent's user namespace: %w", err)
	}
	if owner.Dev != self.Dev || owner.Ino != self.Ino {
		return 0, errors.New("its mount namespace belongs to another user namespace than the agent's (one its owner may have made): members may pass only pids in namespaces the host made")
	}
	return st.Ino, nil
}

// CheckMounts refuses the mounts of a member's Prepare whose mount point
// is not below a prefix (see the TOCTOU note above).
func (m Members) CheckMounts(c *unix.Ucred, mounts []*agentv1.ContainerMount) error {
	for _, mt := range mounts {
		if !m.below(mt.GetMountPoint()) {
			return denied(c, "volume %s: its mount point %q is not under any --api-group-roots prefix (a directory of the rootfs or sandbox was replaced while it was prepared?); the prepare was undone", mt.GetVolumeId(), mt.GetMountPoint())
		}
	}
	return nil
}

// CheckCleanup refuses a member's cleanup of a container not prepared
// below the prefixes: its rootfs and every mount point must be below one
// (and there must be something to judge by). A container the agent does
// not know is the isolator's to answer.
func (m Members) CheckCleanup(c *unix.Ucred, id string, containers []isolator.ContainerInfo) error {
	for _, ci := range containers {
		if ci.ID != id {
			continue
		}
		if len(m.Roots) == 0 {
			return denied(c, "container %q: members may clean up only containers prepared under --api-group-roots, and the agent has none", id)
		}
		if ci.Rootfs == "" && len(ci.Mounts) == 0 {
			return denied(c, "container %q has neither a rootfs nor mounts to show it was prepared under --api-group-roots: only root may clean it up", id)
		}
		if ci.Rootfs != "" && !m.below(ci.Rootfs) {
			return denied(c, "container %q: its rootfs %q is not under any --api-group-roots prefix: members may clean up only containers prepared under them", id, ci.Rootfs)
		}
		for _, mt := range ci.Mounts {
			if !m.below(mt.GetMountPoint()) {
				return denied(c, "container %q: its mount point %q is not under any --api-group-roots prefix: members may clean up only containers prepared under them", id, mt.GetMountPoint())
			}
		}
	}
	return nil
}
