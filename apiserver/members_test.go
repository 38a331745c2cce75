package apiserver

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/mount"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

const memberUID, memberGID = 5000, 4321

var memberCred = &unix.Ucred{Uid: memberUID, Gid: memberGID, Pid: 1 << 30}

func TestParseRoots(t *testing.T) {
	for _, c := range []struct {
		in      string
		want    []string
		wantErr string
	}{
		{"", nil, ""},
		{"/srv/a, /srv/b,", []string{"/srv/a", "/srv/b"}, ""},
		{"srv/a", nil, "not an absolute path"},
		{"/srv/a/../b", nil, "not a clean path"},
		{"/srv/a/", nil, "not a clean path"},
		{"/", nil, "any host directory"},
	} {
		got, err := ParseRoots(c.in)
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("ParseRoots(%q) = %v, %v; want an error containing %q", c.in, got, err, c.wantErr)
			}
			continue
		}
		if err != nil || strings.Join(got, ",") != strings.Join(c.want, ",") {
			t.Errorf("ParseRoots(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}

// memberProcess starts a process of uid 5000 (in the host's namespaces,
// or in a user and mount namespace of its own) and returns its pid.
func memberProcess(t *testing.T, ownNamespaces bool) int {
	t.Helper()
	cmd := exec.Command("sleep", "60")
	attr := &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: memberUID, Gid: memberGID, NoSetGroups: true}}
	if ownNamespaces {
		attr.Cloneflags = syscall.CLONE_NEWUSER | syscall.CLONE_NEWNS
		attr.UidMappings = []syscall.SysProcIDMap{{ContainerID: memberUID, HostID: memberUID, Size: 1}}
		attr.GidMappings = []syscall.SysProcIDMap{{ContainerID: memberGID, HostID: memberGID, Size: 1}}
	}
	cmd.SysProcAttr = attr
	if err := cmd.Start(); err != nil {
		switch {
		case os.Geteuid() != 0:
			t.Skipf("not root: cannot start a process of uid %d: %v", memberUID, err)
		case ownNamespaces && (errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL) || errors.Is(err, syscall.ENOSPC)):
			t.Skipf("this kernel does not let root make a user namespace: %v", err)
		}
		t.Fatalf("starting a process of uid %d (own namespaces %v): %v", memberUID, ownNamespaces, err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	return cmd.Process.Pid
}

func TestMembersCheckPrepare(t *testing.T) {
	testhelp.NeedRoot(t)
	base := t.TempDir()
	roots := filepath.Join(base, "roots")
	rootfs, sandbox := filepath.Join(roots, "c1", "rootfs"), filepath.Join(roots, "c1", "sandbox")
	for _, d := range []string{rootfs, sandbox, filepath.Join(base, "outside")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(filepath.Join(base, "outside"), filepath.Join(roots, "escape")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("c1", filepath.Join(roots, "inside")); err != nil {
		t.Fatal(err)
	}
	ownPid := memberProcess(t, false)
	nsPid := memberProcess(t, true)
	m := Members{Roots: []string{roots}}
	vol := func(path string) []*agentv1.Volume { return []*agentv1.Volume{{ContainerPath: path}} }
	me := strconv.Itoa(memberUID) + ":" + strconv.Itoa(memberGID)
	for _, c := range []struct {
		name    string
		m       Members
		req     *agentv1.PrepareRequest
		wantErr string // "": allowed
	}{
		{"rootfs below a prefix", m, &agentv1.PrepareRequest{Rootfs: rootfs, Volumes: vol("/data")}, ""},
		{"sandbox below a prefix, own user", m, &agentv1.PrepareRequest{Sandbox: sandbox, User: me, Volumes: vol("data")}, ""},
		{"a symlink resolving inside", m, &agentv1.PrepareRequest{Rootfs: filepath.Join(roots, "inside", "rootfs"), Volumes: vol("/data")}, ""},
		{"own process", m, &agentv1.PrepareRequest{Rootfs: rootfs, Pid: int32(ownPid), Volumes: vol("/data")}, ""},

		{"no --api-group-roots", Members{}, &agentv1.PrepareRequest{Rootfs: rootfs, Volumes: vol("/data")}, "the agent has no --api-group-roots"},
		{"rootfs /etc", m, &agentv1.PrepareRequest{Rootfs: "/etc", Volumes: vol("/data")}, `rootfs "/etc" is not under any --api-group-roots prefix`},
		{"rootfs is the prefix itself", m, &agentv1.PrepareRequest{Rootfs: roots, Volumes: vol("/data")}, "is not under any --api-group-roots prefix"},
		{"rootfs not clean", m, &agentv1.PrepareRequest{Rootfs: roots + "/c1/../../outside", Volumes: vol("/data")}, "is not an absolute clean path"},
		{"rootfs through a symlink out", m, &agentv1.PrepareRequest{Rootfs: filepath.Join(roots, "escape"), Volumes: vol("/data")}, "resolves to"},
		{"rootfs missing", m, &agentv1.PrepareRequest{Rootfs: filepath.Join(roots, "nope"), Volumes: vol("/data")}, "resolving it"},
		{"sandbox outside", m, &agentv1.PrepareRequest{Sandbox: "/var/lib", Volumes: vol("data")}, `sandbox "/var/lib" is not under`},
		{"host path: absolute container_path, no rootfs", m, &agentv1.PrepareRequest{Sandbox: sandbox, Volumes: vol("/usr/local/bin")}, `volumes[0].container_path "/usr/local/bin" is absolute and the request has no rootfs`},
		{"user root", m, &agentv1.PrepareRequest{Rootfs: rootfs, User: "root", Volumes: vol("/data")}, `user "root" is uid 0`},
		{"user 0:0", m, &agentv1.PrepareRequest{Rootfs: rootfs, User: "0:0", Volumes: vol("/data")}, `user "0:0" is uid 0`},
		{"user another uid", m, &agentv1.PrepareRequest{Rootfs: rootfs, User: "1000", Volumes: vol("/data")}, `user "1000" is uid 1000`},
		{"own uid, another group", m, &agentv1.PrepareRequest{Rootfs: rootfs, User: strconv.Itoa(memberUID) + ":0", Volumes: vol("/data")}, "has gid 0"},
		{"pid 1", m, &agentv1.PrepareRequest{Rootfs: rootfs, Pid: 1, Volumes: vol("/data")}, "pid 1 is not the caller's process"},
		{"negative pid", m, &agentv1.PrepareRequest{Rootfs: rootfs, Pid: -3, Volumes: vol("/data")}, "is not a process id"},
		{"own process in its own namespaces", m, &agentv1.PrepareRequest{Rootfs: rootfs, Pid: int32(nsPid), Volumes: vol("/data")}, "belongs to another user namespace"},
	} {
		checked, err := c.m.CheckPrepare(memberCred, c.req)
		if c.wantErr == "" {
			if err != nil {
				t.Errorf("%s: refused: %v", c.name, err)
			} else if c.req.GetRootfs() != "" && checked.Rootfs != rootfs {
				t.Errorf("%s: rootfs %s checked as %s; want %s, resolved", c.name, c.req.GetRootfs(), checked.Rootfs, rootfs)
			} else if pid := c.req.GetPid(); pid != 0 {
				if ns, _ := mount.MountNamespace(int(pid)); checked.MountNamespace != ns {
					t.Errorf("%s: mount namespace %d checked; want the pid's, %d", c.name, checked.MountNamespace, ns)
				}
			}
			continue
		}
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), c.wantErr) {
			t.Errorf("%s: got %v; want PermissionDenied containing %q", c.name, err, c.wantErr)
		}
	}
}

func TestMembersCheckCleanupAndMounts(t *testing.T) {
	m := Members{Roots: []string{"/srv/roots"}}
	mounts := func(points ...string) []*statev1.ContainerMount {
		var out []*statev1.ContainerMount
		for _, p := range points {
			out = append(out, &statev1.ContainerMount{VolumeId: "v", MountPoint: p})
		}
		return out
	}
	containers := []isolator.ContainerInfo{
		{ID: "mine", Rootfs: "/srv/roots/a/rootfs", Mounts: mounts("/srv/roots/a/rootfs/data")},
		{ID: "sandboxed", Mounts: mounts("/srv/roots/b/sandbox/data")},
		{ID: "roots", Rootfs: "/var/lib/containers/x/rootfs", Mounts: mounts("/var/lib/containers/x/rootfs/data")},
		{ID: "host-path", Mounts: mounts("/usr/local/bin")},
		{ID: "mixed", Rootfs: "/srv/roots/a/rootfs", Mounts: mounts("/srv/roots/a/rootfs/data", "/srv/other/data")},
		{ID: "empty"},
	}
	for id, wantErr := range map[string]string{
		"mine": "", "sandboxed": "", "unknown": "",
		"roots":     `its rootfs "/var/lib/containers/x/rootfs" is not under`,
		"host-path": `its mount point "/usr/local/bin" is not under`,
		"mixed":     `its mount point "/srv/other/data" is not under`,
		"empty":     "only root may clean it up",
	} {
		err := m.CheckCleanup(memberCred, id, containers)
		if wantErr == "" {
			if err != nil {
				t.Errorf("cleanup %s: refused: %v", id, err)
			}
			continue
		}
		if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("cleanup %s: got %v; want PermissionDenied containing %q", id, err, wantErr)
		}
	}
	if err := (Members{}).CheckCleanup(memberCred, "mine", containers); status.Code(err) != codes.PermissionDenied {
		t.Errorf("cleanup without --api-group-roots: %v, want PermissionDenied", err)
	}
	if err := m.CheckMounts(memberCred, Mounts(mounts("/srv/roots/a/rootfs/data"))); err != nil {
		t.Errorf("a mount below the prefix: %v", err)
	}
	if err := m.CheckMounts(memberCred, Mounts(mounts("/srv/roots/a/rootfs/data", "/etc/cron.d"))); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), `"/etc/cron.d"`) {
		t.Errorf("a mount outside the prefixes: %v, want PermissionDenied naming it", err)
	}
}

// TestMemberHandlers: the handlers refuse a member's calls before they
// reach the isolator (the server here has none); a call without peer
// credentials is refused too.
func TestMemberHandlers(t *testing.T) {
	s := New(Config{Members: Members{Roots: []string{"/srv/roots"}}})
	member := peer.NewContext(context.Background(), &peer.Peer{AuthInfo: peerInfo{cred: memberCred}})
	req := &agentv1.PrepareRequest{ContainerId: "c1", Rootfs: "/etc", Volumes: []*agentv1.Volume{{ContainerPath: "/x"}}}
	if _, err := s.Prepare(member, req); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), `rootfs "/etc" is not under any --api-group-roots prefix`) {
		t.Errorf("member Prepare into /etc: %v", err)
	}
	if _, err := s.Prepare(context.Background(), req); status.Code(err) != codes.Unauthenticated {
		t.Errorf("Prepare without credentials: %v, want Unauthenticated", err)
	}
	if _, err := s.Reconcile(member, &agentv1.ReconcileRequest{}); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "only root may call it") {
		t.Errorf("member Reconcile: %v", err)
	}
	if _, err := s.ReconcileEngineMounts(member, &agentv1.ReconcileEngineMountsRequest{}); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "only root may call it") {
		t.Errorf("member ReconcileEngineMounts: %v", err)
	}
}
