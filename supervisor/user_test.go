package supervisor

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/pluginconfig"
)

// TestCommandUser: a managed plugin whose command names a user runs as
// that user and becomes ready, with the systemd unit's UMask=0077 in force
// when the agent makes its directories.
func TestCommandUser(t *testing.T) {
	testhelp.NeedRoot(t)
	u, err := user.Lookup("nobody")
	var unknown user.UnknownUserError
	if errors.As(err, &unknown) {
		t.Skipf("no user nobody to run the plugin as: %v", err)
	}
	if err != nil {
		t.Fatalf("looking up user nobody: %v", err)
	}
	// As on a host: the directories above the agent's are searchable.
	base := t.TempDir()
	for _, d := range []string{filepath.Dir(base), base} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	old := unix.Umask(0o077)
	t.Cleanup(func() { unix.Umask(old) })
	work, run := filepath.Join(base, "work"), filepath.Join(base, "run")
	for _, d := range []string{work, run} {
		if err := os.MkdirAll(d, 0o755); err != nil { // 0700 under the umask
			t.Fatal(err)
		}
	}

	raw, _ := json.Marshal(map[string]any{
		"type": "user.example",
		"containers": []any{map[string]any{
			"services": []string{"NODE_SERVICE"},
			"command":  map[string]any{"value": testPlugin, "shell": false, "arguments": []string{"testplugin"}, "user": "nobody"},
		}},
	})
	info, err := pluginconfig.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	changed, notify := changes()
	p := Start(t.Context(), Config{
		WorkDir: work, RuntimeDir: run, NodeID: "n1", ReadyTimeout: 20 * time.Second, BackoffBase: time.Hour, OnChange: notify,
	}, &pluginconfig.Plugin{File: "user.json", Info: info}, nil)
	t.Cleanup(func() { p.Stop(true) })

	in := waitState(t, p, changed, "ready", func(in *InstanceStatus) bool {
		return in.State == StateReady
	})
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", in.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(status), "\n") {
		if name, ids, ok := strings.Cut(line, ":"); ok && (name == "Uid" || name == "Gid") {
			want := u.Uid
			if name == "Gid" {
				want = u.Gid
			}
			for _, id := range strings.Fields(ids) {
				if id != want {
					t.Errorf("plugin process %s: %s, want %s everywhere", name, ids, want)
					break
				}
			}
		}
	}
}

// TestGiveSocketDirStaysBelowRoot: a socket directory outside the runtime
// directory is refused, and nothing above it is made searchable.
func TestGiveSocketDirStaysBelowRoot(t *testing.T) {
	base := t.TempDir()
	root, outside := filepath.Join(base, "run"), filepath.Join(base, "elsewhere", "sock")
	for _, d := range []string{root, outside} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	for _, dir := range []string{outside, root, base} {
		if err := giveSocketDir(root, dir, &syscall.Credential{Uid: 65534, Gid: 65534}); err == nil {
			t.Errorf("socket directory %s accepted, root %s", dir, root)
		}
	}
	st, err := os.Stat(filepath.Dir(outside))
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o700 {
		t.Errorf("%s: mode %v, want 0700 untouched", filepath.Dir(outside), st.Mode().Perm())
	}
}
