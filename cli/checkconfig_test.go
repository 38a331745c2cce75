package cli

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/agent"
)

// checkHangBound is how long check-config may take here before it counts
// as hung; a failure bound, far above the milliseconds it takes.
const checkHangBound = 20 * time.Second

// runBounded is Main(ctx, args) that fails the test instead of hanging it.
func runBounded(t *testing.T, ctx context.Context, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	done := make(chan int, 1)
	go func() { done <- Main(ctx, args, &out, &errb) }()
	select {
	case code = <-done:
		return code, out.String(), errb.String()
	case <-time.After(checkHangBound):
		t.Fatalf("%v hung for %v", args, checkHangBound)
	}
	return 0, "", ""
}

// TestCheckConfigSpecialFiles: entries that would block or are not files
// (a FIFO without a writer, a link to a character device, a directory
// named *.json) are each reported as invalid, without hanging.
func TestCheckConfigSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	good := `{"type":"good","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/run/g.sock"}]}`
	if err := os.WriteFile(filepath.Join(dir, "good.json"), []byte(good), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(filepath.Join(dir, "fifo.json"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/dev/zero", filepath.Join(dir, "zero.json")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(filepath.Join(dir, "dir.json"), 0o755); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runBounded(t, context.Background(), "check-config", dir)
	if code != ExitProblem {
		t.Fatalf("exit %d, want %d; stderr %q", code, ExitProblem, errOut)
	}
	for _, want := range []string{
		"INVALID " + filepath.Join(dir, "fifo.json") + ": not a regular file: it is a FIFO (named pipe)",
		"INVALID " + filepath.Join(dir, "zero.json") + ": not a regular file: it is a character device",
		"INVALID " + filepath.Join(dir, "dir.json") + ": not a regular file: it is a directory",
		"1 plugin(s), 3 invalid file(s)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
}

// TestCheckConfigInterrupted: once its context ends (SIGINT, SIGTERM in
// main), check-config stops and says so instead of finishing the load.
func TestCheckConfigInterrupted(t *testing.T) {
	dir := t.TempDir()
	good := `{"type":"good","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/run/g.sock"}]}`
	if err := os.WriteFile(filepath.Join(dir, "good.json"), []byte(good), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	code, out, errOut := runBounded(t, ctx, "check-config", dir)
	if code != ExitProblem || !strings.Contains(errOut, "interrupted: context canceled") || out != "" {
		t.Errorf("exit %d, stdout %q, stderr %q; want exit %d and interrupted", code, out, errOut, ExitProblem)
	}
}

// TestCheckConfigDefaultDir: with no argument, check-config checks the
// directory serve watches by default (before: a usage error).
func TestCheckConfigDefaultDir(t *testing.T) {
	code, out, errOut := runBounded(t, context.Background(), "check-config", "--output", "json")
	if code == ExitUsage || !strings.Contains(out+errOut, agent.DefaultConfigDir) {
		t.Errorf("check-config with no directory: exit %d\nstdout: %s\nstderr: %s\nwant %s checked", code, out, errOut, agent.DefaultConfigDir)
	}
}

// TestCheckConfigLaunch: a managed plugin whose socket path under
// --runtime-dir would not fit a unix socket address, or whose resources
// no cgroup limit holds, is reported invalid (serve would fail only at
// its launch); an unmanaged plugin launches nothing.
func TestCheckConfigLaunch(t *testing.T) {
	dir := t.TempDir()
	managed := func(typ, resources string) string {
		return `{"type":"` + typ + `","containers":[{"services":["NODE_SERVICE"],"command":{"value":"/bin/true"}` + resources + `}]}`
	}
	for name, c := range map[string]string{
		"ok.json":    managed("ok.example", `,"resources":[{"name":"cpus","type":"SCALAR","scalar":{"value":0.5}}]`),
		"long.json":  managed("long."+strings.Repeat("x", 40)+".example", ""),
		"cpus.json":  managed("cpus.example", `,"resources":[{"name":"cpus","type":"SCALAR","scalar":{"value":1e12}}]`),
		"other.json": `{"type":"unmanaged.` + strings.Repeat("x", 60) + `","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/run/g.sock"}]}`,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	runtimeDir := "/run/" + strings.Repeat("r", 40)
	code, out, errOut := runBounded(t, context.Background(), "check-config", "--runtime-dir", runtimeDir, dir)
	if code != ExitProblem {
		t.Fatalf("exit %d, want %d; stderr %q\n%s", code, ExitProblem, errOut, out)
	}
	for _, want := range []string{
		"INVALID " + filepath.Join(dir, "long.json") + ": cannot launch: containers[0]: socket path " + runtimeDir + "/csi/long.",
		"longer than the 107 a unix socket address holds",
		"INVALID " + filepath.Join(dir, "cpus.json") + ": cannot launch: containers[0]: resources: cpus 1e+12",
		"4 plugin(s), 2 invalid file(s)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	for _, unwanted := range []string{"ok.json: cannot", "other.json: cannot"} {
		if strings.Contains(out, unwanted) {
			t.Errorf("output has %q:\n%s", unwanted, out)
		}
	}
}
