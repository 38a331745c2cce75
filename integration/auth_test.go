package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/supervisor"
)

// TestAPIPeerCredentials runs the real CLI as other users against the
// agent's socket: root and members of the API group get through, anyone
// else is refused by the peer-credential check even when the socket's
// mode would let them connect.
func TestAPIPeerCredentials(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	// Let other users reach the socket's directory.
	if err := os.Chmod(h.run, 0o755); err != nil {
		t.Fatal(err)
	}
	const apiGroup = 4321
	cfg := fastConfig(h)
	cfg.APIGroup = apiGroup
	cfg.DockerPluginSocket = filepath.Join(h.run, "docker-plugin.sock")
	h.start(cfg)
	socket := filepath.Join(h.run, "agent.sock")
	supervisor.WaitForSocket(t.Context(), socket, nil)
	st, err := os.Stat(socket)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o660 || st.Sys().(*syscall.Stat_t).Gid != apiGroup {
		t.Fatalf("socket mode %v gid %d, want 0660 gid %d", st.Mode().Perm(), st.Sys().(*syscall.Stat_t).Gid, apiGroup)
	}
	// The volume plugin socket (container engines) is root's alone,
	// whatever --api-group (and its peers must be root: apiserver
	// TestHTTPPeerCheck).
	if st, err := os.Stat(cfg.DockerPluginSocket); err != nil || st.Mode().Perm() != 0o600 || st.Sys().(*syscall.Stat_t).Uid != 0 {
		t.Fatalf("volume plugin socket: %v, %v; want 0600 root", st, err)
	}
	cases := []struct {
		name      string
		cred      *syscall.Credential
		chmod     os.FileMode
		wantError string
	}{
		{"root", nil, 0, ""},
		{"api group member (primary group)", &syscall.Credential{Uid: 5000, Gid: apiGroup}, 0, ""},
		{"api group member (supplementary)", &syscall.Credential{Uid: 5000, Gid: 5000, Groups: []uint32{apiGroup}}, 0, ""},
		{"stranger, socket mode refuses", &syscall.Credential{Uid: 5000, Gid: 5000}, 0, "may not connect to the agent at"},
		{"stranger, socket world-writable", &syscall.Credential{Uid: 5000, Gid: 5000}, 0o666,
			"PermissionDenied: uid 5000 may not use the csi-agent API: only root and members of the --api-group may"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.chmod != 0 {
				if err := os.Chmod(socket, tc.chmod); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { os.Chmod(socket, 0o660) })
			}
			for _, c := range []struct {
				args []string
				want string
			}{
				{[]string{"plugins", "--api-socket", socket}, tc.wantError},
				{[]string{"volume", "ls", "--api-socket", socket}, tc.wantError},
			} {
				cmd := exec.Command(bins.agent, c.args...)
				cmd.SysProcAttr = &syscall.SysProcAttr{Credential: tc.cred}
				out, err := cmd.CombinedOutput()
				if c.want == "" {
					if err != nil {
						t.Fatalf("%v refused: %v\n%s", c.args, err, out)
					}
					continue
				}
				if err == nil || !strings.Contains(string(out), c.want) {
					t.Fatalf("%v: got %v, output %q; want an error containing %q", c.args, err, out, c.want)
				}
			}
		})
	}
}
