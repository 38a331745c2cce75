package integration

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
)

// ownDockerd is a dockerd of one test's own (its data root, exec root and
// socket), which the test may kill and start again.
type ownDockerd struct {
	t    *testing.T
	dir  string
	host string
	cmd  *exec.Cmd
}

func startOwnDockerd(t *testing.T) *ownDockerd {
	t.Helper()
	needDocker(t)                       // the shared one starts here: so does this one
	dir, err := os.MkdirTemp("", "csd") // short: a socket path has a limit
	if err != nil {
		t.Fatal(err)
	}
	d := &ownDockerd{t: t, dir: dir, host: "unix://" + filepath.Join(dir, "docker.sock")}
	t.Cleanup(func() {
		d.stop(syscall.SIGTERM)
		// Shims of containers a killed containerd left.
		if entries, err := os.ReadDir("/proc"); err == nil {
			for _, e := range entries {
				pid, err := strconv.Atoi(e.Name())
				if err != nil {
					continue
				}
				if b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline")); err == nil && strings.Contains(string(b), dir) {
					killAndWait(t, pid)
				}
			}
		}
		if ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir)); err == nil {
			for i := len(ms) - 1; i >= 0; i-- {
				syscall.Unmount(ms[i].Mountpoint, syscall.MNT_DETACH)
			}
		}
		os.RemoveAll(dir)
	})
	d.start()
	img, err := busyboxTar()
	if err != nil {
		t.Fatal(err)
	}
	c := exec.Command("docker", "-H", d.host, "import", "-", image)
	c.Stdin = bytes.NewReader(img)
	if out, err := c.CombinedOutput(); err != nil {
		t.Fatalf("docker import: %v: %s", err, out)
	}
	return d
}

// start starts dockerd and waits for it.
func (d *ownDockerd) start() {
	d.t.Helper()
	log, err := os.OpenFile(filepath.Join(d.dir, "dockerd.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		d.t.Fatal(err)
	}
	defer log.Close()
	d.cmd = exec.Command("dockerd", dockerdArgs(d.dir, d.host)...)
	d.cmd.Stdout, d.cmd.Stderr = log, log
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	deadline := time.Now().Add(waitTimeout)
	for exec.Command("docker", "-H", d.host, "version").Run() != nil {
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(d.dir, "dockerd.log"))
			d.t.Fatalf("dockerd did not start (again):\n%s", b[max(0, len(b)-6000):])
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stop signals dockerd and waits for it to exit.
func (d *ownDockerd) stop(sig syscall.Signal) {
	if d.cmd == nil {
		return
	}
	d.cmd.Process.Signal(sig)
	done := make(chan struct{})
	go func() { d.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(waitTimeout):
		d.cmd.Process.Kill()
		<-done
	}
	d.cmd = nil
}

func (d *ownDockerd) docker(args ...string) string {
	d.t.Helper()
	out, err := exec.Command("docker", append([]string{"-H", d.host}, args...)...).CombinedOutput()
	if err != nil {
		d.t.Fatalf("docker %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestDockerdKilledReleasesVolume: dockerd is SIGKILLed with a container
// holding a volume, and started again: the container is gone (exited), but
// Docker never unmounts its volume. The agent, asking Docker every resync
// interval which volumes its containers hold, releases the mount by
// itself: nothing stays mounted or published, and the volume can be
// removed. Before, it stayed published for good ("unmount it first").
func TestDockerdKilledReleasesVolume(t *testing.T) {
	d := startOwnDockerd(t)
	e := newEnvFor(t, func(e *env) { e.serveArgs = []string{"--docker-host", d.host, "--resync-interval", "200ms"} })
	t.Cleanup(func() { exec.Command("docker", "-H", d.host, "rm", "-f", "-v", "holder").Run() })
	e.loopVolume("vol1")
	d.docker("volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "data")
	// Its sleep, pid 1, ignores SIGTERM: dockerd back stops it after
	// --stop-timeout (default 10 s) and only then answers.
	d.docker("run", "-d", "--name", "holder", "--stop-timeout", "1", "--network", "none", "-v", "data:/data", image, "sleep", "600")
	d.docker("exec", "holder", "sh", "-c", "echo kept > /data/f")
	// Docker's mount stays while its container runs, check after check.
	time.Sleep(time.Second) // several check intervals: what is checked is that nothing happens
	if v := e.inspect("data"); mountsOf(v) != 1 || v.GetState() != "PUBLISHED" {
		t.Fatalf("with the container running: %v", v)
	}

	// dockerd and the containerd it runs (which, its log pipe gone, would
	// hang), as when the machine's docker service is killed; the
	// container's shim and process live on until dockerd, back, stops
	// them (no live-restore).
	d.stop(syscall.SIGKILL)
	pidfile := filepath.Join(d.dir, "exec", "containerd", "containerd.pid")
	b, err := os.ReadFile(pidfile)
	if err != nil {
		t.Fatal(err)
	}
	if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
		killAndWait(t, pid)
	}
	// Reaped or not (a zombie's pid would look alive), it is gone.
	os.Remove(pidfile)
	d.start()
	e.waitReleased("data", "the mount of the container dockerd forgot")
	d.docker("rm", "holder")
	d.docker("volume", "rm", "data")
}

// TestDockerStopWhileAgentDown: the agent is down (killed, no systemd
// socket) while docker stop stops a container holding a volume: Docker's
// Unmount fails and Docker forgets the mount. The agent, back, releases it
// by itself (Docker lists the container as exited), with no command.
func TestDockerStopWhileAgentDown(t *testing.T) {
	needDocker(t)
	e := newEnvFor(t, func(e *env) { e.serveArgs = []string{"--docker-host", dockerHost, "--resync-interval", "200ms"} })
	t.Cleanup(func() {
		if out, err := dockerCmd("volume", "ls", "-q", "--filter", "driver="+e.driver); err == nil && out != "" {
			dockerCmd(append([]string{"volume", "rm", "-f"}, strings.Fields(out)...)...)
		}
	})
	e.loopVolume("vol1")
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "data")
	c := e.container("-v", "data:/data")
	e.killAgent()
	if out, err := dockerCmd("stop", "-t", "1", c); err != nil {
		t.Logf("docker stop with the agent down: %v %s", err, out)
	}
	e.startAgent()
	e.waitReleased("data", "the mount Docker forgot while the agent was down")
}

// waitReleased waits until the named volume has no engine mount and
// nothing of the agent's is mounted (what: what should have been
// released, for the failure).
func (e *env) waitReleased(name, what string) {
	e.t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for {
		v := e.inspect(name)
		if mountsOf(v) == 0 && len(e.publishedUnder()) == 0 {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%s was not released: %v, %d mounts of the agent's", what, v, len(e.publishedUnder()))
		}
		time.Sleep(100 * time.Millisecond)
	}
}
