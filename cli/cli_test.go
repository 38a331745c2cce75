package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fsnotify/fsnotify"
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
			{"check-config"},
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

func TestPluginsAgainstRunningAgent(t *testing.T) {
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
