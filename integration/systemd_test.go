package integration

import (
	"bytes"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSystemdUnitVerifies runs systemd-analyze verify on the shipped unit
// (with ExecStart pointing at the test's binary): it must pass with
// nothing on stderr, since verify only warns about unknown keys.
func TestSystemdUnitVerifies(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Fatalf("systemd-analyze is not installed (make deps installs Debian's systemd): %v", err)
	}
	unit, err := os.ReadFile("../deploy/csi-agent.service")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "csi-agent.service")
	if err := os.WriteFile(path, bytes.ReplaceAll(unit, []byte("/usr/local/bin/csi-agent"), []byte(bins.agent)), 0o644); err != nil {
		t.Fatal(err)
	}
	// Its sockets, which it names (Sockets=), verified with it.
	paths := []string{path}
	for _, name := range []string{"csi-agent-api.socket", "csi-agent-docker-plugin.socket"} {
		b, err := os.ReadFile(filepath.Join("../deploy", name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(unit, []byte(name)) || !bytes.Contains(b, []byte("SocketMode=0600")) {
			t.Errorf("%s: not in the service's Sockets=, or not SocketMode=0600", name)
		}
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(analyze, append([]string{"verify"}, paths...)...)
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil || stderr.Len() > 0 {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, stderr.String())
	}
	for _, want := range []string{"Type=notify", "WatchdogSec=", "KillMode=process", "Restart=on-failure", "RuntimeDirectory=csi-agent", "RuntimeDirectoryPreserve=yes"} {
		if !bytes.Contains(unit, []byte(want)) {
			t.Errorf("the unit lacks %s", want)
		}
	}
}

// TestSdNotify runs the daemon as systemd would (NOTIFY_SOCKET,
// WATCHDOG_USEC) and reads what it tells systemd: READY=1 with a status
// once serving and recovered, watchdog keep-alives, STOPPING=1 on SIGTERM.
func TestSdNotify(t *testing.T) {
	h := newHarness(t)
	h.writeConfig("t.json", testPluginConfig("notified"))
	sockPath := filepath.Join(h.run, "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sockPath, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cmd := exec.Command(bins.agent, "serve", "--csi-plugin-config-dir", h.confDir, "--work-dir", h.work,
		"--runtime-dir", h.run, "--node-id", "n1", "--plugin-probe-interval", "100ms")
	cmd.Env = append(os.Environ(), "NOTIFY_SOCKET="+sockPath, "WATCHDOG_USEC=200000")
	cmd.Stderr = testWriter{t}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
		// The agent leaves its plugin running for a successor.
		var rec struct {
			PID int `json:"pid"`
		}
		if readProcessRecord(h.work, filepath.Join(h.work, "csi", "notified", "default", "containers", "0", "process.json"), &rec) == nil {
			killAndWait(t, rec.PID)
		}
	})
	var got []string
	read := func(until string) {
		t.Helper()
		buf := make([]byte, 4096)
		for {
			if err := conn.SetReadDeadline(time.Now().Add(waitTimeout)); err != nil {
				t.Fatal(err)
			}
			n, err := conn.Read(buf)
			if err != nil {
				t.Fatalf("waiting for %q from the agent (got %q): %v", until, got, err)
			}
			msg := string(buf[:n])
			got = append(got, msg)
			if strings.Contains(msg, until) {
				return
			}
		}
	}
	read("READY=1")
	if !strings.Contains(got[len(got)-1], "STATUS=") {
		t.Errorf("READY=1 should come with a status: %q", got[len(got)-1])
	}
	read("WATCHDOG=1")
	read("1/1 plugins ready")
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	read("STOPPING=1")
	if err := cmd.Wait(); err != nil {
		t.Errorf("agent exit after SIGTERM: %v, want 0", err)
	}
}
