package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/spf13/cobra"
	"google.golang.org/grpc"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = Main(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestCheckConfig(t *testing.T) {
	t.Run("shipped configs are valid", func(t *testing.T) {
		code, out, errOut := run(t, "check-config", "../testdata/plugins")
		if code != ExitOK {
			t.Fatalf("exit %d, stderr %s, stdout %s", code, errOut, out)
		}
		for _, want := range []string{
			"loop.json", "loop.csi.csiagent.io", "managed", "CONTROLLER_SERVICE,NODE_SERVICE",
			"unmanaged.json", "node=unix:///var/lib/unmanaged-plugin/csi.sock",
			"3 plugin(s), 0 invalid file(s)",
		} {
			if !strings.Contains(out, want) {
				t.Errorf("output lacks %q:\n%s", want, out)
			}
		}
	})
	t.Run("a bad file is reported and exits 1, the rest still listed", func(t *testing.T) {
		dir := t.TempDir()
		good := `{"type":"good","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/run/g.sock"}]}`
		if err := os.WriteFile(filepath.Join(dir, "good.json"), []byte(good), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "bad.json"), []byte(`{"type":"bad"}`), 0o644); err != nil {
			t.Fatal(err)
		}
		code, out, _ := run(t, "check-config", dir)
		if code != ExitProblem {
			t.Fatalf("exit %d, want %d", code, ExitProblem)
		}
		if !strings.Contains(out, "INVALID "+filepath.Join(dir, "bad.json")+": neither containers nor endpoints is set") ||
			!strings.Contains(out, "good.json") || !strings.Contains(out, "1 plugin(s), 1 invalid file(s)") {
			t.Errorf("output:\n%s", out)
		}
		code, out, _ = run(t, "check-config", "--output", "json", dir)
		var rep checkReport
		if err := json.Unmarshal([]byte(out), &rep); err != nil || code != ExitProblem {
			t.Fatalf("json output (exit %d): %v\n%s", code, err, out)
		}
		if len(rep.Plugins) != 1 || rep.Plugins[0].Type != "good" || len(rep.Errors) != 1 || rep.Errors[0].File != filepath.Join(dir, "bad.json") {
			t.Errorf("report = %+v", rep)
		}
	})
	t.Run("missing directory", func(t *testing.T) {
		code, _, errOut := run(t, "check-config", filepath.Join(t.TempDir(), "nope"))
		if code != ExitProblem || !strings.Contains(errOut, "no such file or directory") {
			t.Errorf("exit %d, stderr %q", code, errOut)
		}
	})
	t.Run("usage errors", func(t *testing.T) {
		for _, args := range [][]string{
			{"check-config", "a", "b"},
			{"check-config", "--output", "yaml", "dir"},
			{"check-config", "--bogus", "dir"},
			{"no-such-command"},
			{},
		} {
			if code, _, _ := run(t, args...); code != ExitUsage {
				t.Errorf("%q: exit %d, want %d", args, code, ExitUsage)
			}
		}
	})
}

func TestVersionAndHelp(t *testing.T) {
	if code, out, _ := run(t, "version"); code != ExitOK || !strings.HasPrefix(out, "csi-agent ") {
		t.Errorf("version: exit %d, %q", code, out)
	}
	if code, out, _ := run(t, "help"); code != ExitOK || !strings.Contains(out, "check-config") {
		t.Errorf("help: exit %d, %q", code, out)
	}
}

// TestHelpEveryCommand: -h and --help work on every command, print its
// usage on stdout and exit 0.
func TestHelpEveryCommand(t *testing.T) {
	var paths [][]string
	var walk func(c *cobra.Command, path []string)
	walk = func(c *cobra.Command, path []string) {
		paths = append(paths, path)
		for _, sub := range c.Commands() {
			walk(sub, append(slices.Clone(path), sub.Name()))
		}
	}
	walk((&env{}).newRoot(), nil)
	if len(paths) < 25 {
		t.Fatalf("only %d commands in the tree", len(paths))
	}
	for _, p := range paths {
		for _, h := range []string{"-h", "--help"} {
			code, out, errOut := run(t, append(slices.Clone(p), h)...)
			if code != ExitOK || !strings.Contains(out, "Usage:\n  csi-agent") {
				t.Errorf("%q: exit %d, stdout %q, stderr %q", append(p, h), code, out, errOut)
			}
		}
	}
}

// TestCompletion: csi-agent completion SHELL prints a completion script.
func TestCompletion(t *testing.T) {
	for _, shell := range []string{"bash", "zsh", "fish"} {
		code, out, errOut := run(t, "completion", shell)
		if code != ExitOK || !strings.Contains(out, "csi-agent") || len(out) < 1000 {
			t.Errorf("completion %s: exit %d, %d bytes, stderr %q", shell, code, len(out), errOut)
		}
	}
}

// TestSingleDashLongFlags: -name works as --name, as it did with Go's
// flag package, so scripts written for it keep working; "--" ends flags.
func TestSingleDashLongFlags(t *testing.T) {
	code, out, errOut := run(t, "check-config", "-output", "json", "../testdata/plugins")
	if code != ExitOK || !json.Valid([]byte(out)) {
		t.Errorf("check-config -output json: exit %d, stderr %q\n%s", code, errOut, out)
	}
	code, out, _ = run(t, "check-config", "-output=json", "../testdata/plugins")
	if code != ExitOK || !json.Valid([]byte(out)) {
		t.Errorf("check-config -output=json: exit %d\n%s", code, out)
	}
	if code, _, errOut := run(t, "check-config", "--", "-output"); code != ExitProblem || !strings.Contains(errOut, "-output") {
		t.Errorf("check-config -- -output: exit %d, stderr %q; want the directory -output not found", code, errOut)
	}
}

func TestPluginsAgainstRunningAgent(t *testing.T) {
	needRootCaller(t)
	conf := t.TempDir()
	runDir, err := os.MkdirTemp("", "csc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(runDir) })
	// An unmanaged plugin whose socket never appears: listed, not ready.
	if err := os.WriteFile(filepath.Join(conf, "u.json"), []byte(`{"type":"u.example","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"`+runDir+`/none.sock"}]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(conf, "bad.json"), []byte(`{`), 0o644); err != nil {
		t.Fatal(err)
	}
	socket := filepath.Join(runDir, "agent.sock")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan int, 1)
	go func() {
		done <- Main(ctx, []string{"serve", "--csi-plugin-config-dir", conf, "--work-dir", filepath.Join(t.TempDir(), "w"),
			"--runtime-dir", runDir, "--node-id", "n1", "--log-level", "error"}, io.Discard, io.Discard)
	}()
	t.Cleanup(func() {
		cancel()
		if code := <-done; code != ExitOK {
			t.Errorf("serve exited %d after cancel, want 0", code)
		}
	})
	// The agent may not be listening yet; the CLI fails fast, so watch
	// for its socket first.
	waitForFile(t, socket)
	// The API serves before the first config scan is applied: wait until
	// the plugin is listed.
	waitForPlugin(t, socket, "u.example")
	code, out, errOut := run(t, "plugins", "--api-socket", socket)
	if code != ExitOK {
		t.Fatalf("plugins: exit %d: %s", code, errOut)
	}
	for _, want := range []string{"u.example", "unmanaged", "STARTING", "node", "INVALID " + filepath.Join(conf, "bad.json")} {
		if !strings.Contains(out, want) {
			t.Errorf("plugins output lacks %q:\n%s", want, out)
		}
	}
	code, out, _ = run(t, "plugins", "--api-socket", socket, "--output", "json", "u.example")
	if code != ExitOK || !strings.Contains(out, `"type": "u.example"`) || !strings.Contains(out, `"PLUGIN_STATE_STARTING"`) {
		t.Errorf("plugins NAME --output json: exit %d\n%s", code, out)
	}
	// As the README writes it: the type first, the flags after.
	code, out, errOut = run(t, "plugins", "u.example", "--api-socket", socket)
	if code != ExitOK || !strings.Contains(out, "Type:") || !strings.Contains(out, "u.example") {
		t.Errorf("plugins TYPE --api-socket: exit %d, stderr %q\n%s", code, errOut, out)
	}
	code, _, errOut = run(t, "plugins", "--api-socket", socket, "nope")
	if code != ExitProblem || !strings.Contains(errOut, `NotFound: no plugin of type "nope"`) {
		t.Errorf("unknown plugin: exit %d, %q", code, errOut)
	}
	// An unknown container is clean already, forced or not.
	for _, args := range [][]string{{"--force", "gone"}, {"--container", "gone", "--force"}, {"gone"}} {
		if code, _, errOut := run(t, append([]string{"cleanup", "--api-socket", socket}, args...)...); code != ExitOK {
			t.Errorf("cleanup %v: exit %d: %s", args, code, errOut)
		}
	}
	for _, args := range [][]string{{}, {"a", "b"}, {"--container", "a", "b"}} {
		if code, _, errOut := run(t, append([]string{"cleanup", "--api-socket", socket}, args...)...); code != ExitUsage || !strings.Contains(errOut, "container id") {
			t.Errorf("cleanup %v: exit %d, %q; want a usage error about the container id", args, code, errOut)
		}
	}
}

func TestPluginsWithoutAgent(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "agent.sock")
	code, _, errOut := run(t, "plugins", "--api-socket", sock)
	if code != ExitProblem || !strings.Contains(errOut, "cannot reach the agent at "+sock+": is csi-agent serve running?") {
		t.Errorf("exit %d, stderr %q", code, errOut)
	}
}

func TestServeFlagErrors(t *testing.T) {
	for _, args := range [][]string{
		{"serve", "--log-format", "xml"},
		{"serve", "--log-level", "loud"},
		{"serve", "--work-dir", "relative"},
		{"serve", "extra"},
	} {
		if code, _, errOut := run(t, args...); code != ExitUsage {
			t.Errorf("%q: exit %d (%s), want %d", args, code, errOut, ExitUsage)
		}
	}
}

// waitForPlugin follows WatchPlugins until a plugin of type typ is listed.
func waitForPlugin(t *testing.T, socket, typ string) {
	t.Helper()
	client, closeConn, err := dialAgent(socket)
	if err != nil {
		t.Fatal(err)
	}
	defer closeConn()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := client.WatchPlugins(ctx, &agentv1.ListPluginsRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			t.Fatalf("waiting for plugin %s to be listed: %v", typ, err)
		}
		for _, p := range resp.GetPlugins() {
			if p.GetType() == typ {
				return
			}
		}
	}
}

// waitForFile waits for path to exist, woken by inotify on its directory.
func waitForFile(t *testing.T, path string) {
	t.Helper()
	w, err := fsnotify.NewWatcher()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if err := w.Add(filepath.Dir(path)); err != nil {
		t.Fatal(err)
	}
	timeout := time.After(30 * time.Second)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		select {
		case <-w.Events:
		case <-timeout:
			t.Fatalf("%s did not appear", path)
		}
	}
}

// needRootCaller skips t unless it runs as root: the agent's API lets
// only root define volumes, and other users only as --api-group members.
// It needs no mount, so it runs under -short (make unit) too.
func needRootCaller(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("calls the agent's API as root (other users may not define volumes)")
	}
}
