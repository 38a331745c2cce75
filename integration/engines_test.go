package integration

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// image is the test image: a busybox-static rootfs, imported.
const image = "csiagent-test-busybox"

// The container engines are set up by the first test that needs each,
// below engineDir (made by TestMain), and stopped by TestMain.
var (
	engineDir              string
	dockerOnce, podmanOnce sync.Once
	stopDockerd            = func() {}
	// dockerHost is the test's own dockerd; dockerSkip says why there is
	// none on this machine (not root, it does not start), dockerBroken why
	// the tests' own set-up failed or dockerd is not installed (make deps
	// installs it): the tests then fail.
	dockerHost, dockerSkip, dockerBroken string
	// podmanRoot holds the podman storage with the test image imported;
	// podmanSkip says why podman does not run here, podmanBroken why the
	// tests' own set-up failed.
	podmanRoot, podmanSkip, podmanBroken string
	// driver is the name of every test's agent as Docker's volume plugin
	// (registerDriver); driverErr says why it could not be registered.
	driverOnce sync.Once
	driver     string
	driverErr  error
)

// stopEngines stops what the tests started of the engines.
func stopEngines() {
	stopDockerd()
	podmanCleanUp()
	if driver != "" {
		os.Remove(driverSpec())
	}
}

// startDockerd starts a dockerd of the tests' own (own data root, exec
// root and socket; no network setup) and imports the test image, or sets
// dockerSkip or dockerBroken.
func startDockerd(dir string) (stop func()) {
	stop = func() {}
	if os.Geteuid() != 0 {
		dockerSkip = "needs root: runs dockerd"
		return stop
	}
	if _, err := exec.LookPath("dockerd"); err != nil {
		dockerBroken = "dockerd is not installed (make deps installs Debian's docker.io)"
		return stop
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		dockerBroken = err.Error()
		return stop
	}
	if err := removeDeadTestSpecs(); err != nil {
		dockerBroken = err.Error()
		return stop
	}
	sock := filepath.Join(dir, "docker.sock")
	logf, err := os.Create(filepath.Join(dir, "dockerd.log"))
	if err != nil {
		dockerBroken = err.Error()
		return stop
	}
	cmd := exec.Command("dockerd", dockerdArgs(dir, "unix://"+sock)...)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		dockerBroken = "dockerd is installed but cannot be run: " + err.Error()
		return stop
	}
	// Its exit is watched through a pidfd, not by a goroutine in Wait:
	// dockerd lives across tests, which check that no goroutine of
	// theirs outlives them.
	pidfd, err := unix.PidfdOpen(cmd.Process.Pid, 0)
	if err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		dockerBroken = fmt.Sprintf("pidfd_open dockerd: %v", err)
		return stop
	}
	stop = func() {
		cmd.Process.Signal(syscall.SIGTERM)
		if !pidfdExited(pidfd, waitTimeout) {
			cmd.Process.Kill()
		}
		cmd.Wait()
		unix.Close(pidfd)
		logf.Close()
		// What dockerd left mounted under its roots (it unmounts its own
		// on a clean stop).
		if ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir)); err == nil {
			for i := len(ms) - 1; i >= 0; i-- {
				syscall.Unmount(ms[i].Mountpoint, syscall.MNT_DETACH)
			}
		}
	}
	dockerHost = "unix://" + sock
	deadline := time.Now().Add(waitTimeout)
	for {
		if out, err := dockerCmd("version"); err == nil {
			break
		} else if time.Now().After(deadline) {
			log, _ := os.ReadFile(logf.Name())
			dockerSkip = fmt.Sprintf("dockerd does not start on this machine: %v: %s\n%s", err, out, tail(log))
			return stop
		}
		if pidfdExited(pidfd, 100*time.Millisecond) {
			log, _ := os.ReadFile(logf.Name())
			dockerSkip = "dockerd exited at start: " + tail(log)
			return stop
		}
	}
	img, err := busyboxTar()
	if err == nil {
		c := exec.Command("docker", "-H", dockerHost, "import", "-", image)
		c.Stdin = bytes.NewReader(img)
		var out []byte
		if out, err = c.CombinedOutput(); err != nil {
			err = fmt.Errorf("docker import: %w: %s", err, out)
		}
	}
	if err != nil {
		// dockerd runs: a test image it refuses is a failure, not a
		// reason to skip.
		dockerBroken = "cannot make the test image: " + err.Error()
	}
	return stop
}

// The tests register their agents with Docker as one plugin named
// testDriver<random> by a spec file in specDir (registerDriver), which
// every dockerd on the host reads.
const (
	specDir    = "/etc/docker/plugins"
	testDriver = "csi-agent-test-"
)

// removeDeadTestSpecs removes the spec files a killed test run left whose
// socket no longer answers (not this run's: its link dangles between
// tests). dockerd asks every plugin it finds there on "docker volume
// ls", retrying one that does not answer for 30 s.
func removeDeadTestSpecs() error {
	specs, err := filepath.Glob(filepath.Join(specDir, testDriver+"*.spec"))
	if err != nil {
		return err
	}
	for _, spec := range specs {
		if driver != "" && spec == driverSpec() {
			continue
		}
		b, err := os.ReadFile(spec)
		if err != nil {
			return fmt.Errorf("a test plugin spec: %w", err)
		}
		if c, err := net.DialTimeout("unix", strings.TrimPrefix(strings.TrimSpace(string(b)), "unix://"), time.Second); err == nil {
			c.Close()
			continue
		}
		if err := os.Remove(spec); err != nil {
			return fmt.Errorf("the dead test plugin spec: %w", err)
		}
	}
	return nil
}

// dockerdArgs runs a dockerd of the tests' own below dir (data root, exec
// root, pid file), listening at host, with no network set-up.
func dockerdArgs(dir, host string) []string {
	return []string{"--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver=vfs",
		"--data-root", filepath.Join(dir, "data"), "--exec-root", filepath.Join(dir, "exec"),
		"--pidfile", filepath.Join(dir, "dockerd.pid"), "-H", host}
}

func tail(b []byte) string {
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// busyboxTar is a rootfs of busybox-static and the applets the tests use.
func busyboxTar() ([]byte, error) {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return nil, fmt.Errorf("busybox-static is not installed: %w", err)
	}
	data, err := os.ReadFile(bb)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	tw.WriteHeader(&tar.Header{Name: "bin/", Typeflag: tar.TypeDir, Mode: 0o755})
	tw.WriteHeader(&tar.Header{Name: "tmp/", Typeflag: tar.TypeDir, Mode: 0o1777})
	tw.WriteHeader(&tar.Header{Name: "bin/busybox", Typeflag: tar.TypeReg, Mode: 0o755, Size: int64(len(data))})
	tw.Write(data)
	for _, applet := range []string{"sh", "cat", "echo", "sleep", "touch", "ls", "true", "grep"} {
		tw.WriteHeader(&tar.Header{Name: "bin/" + applet, Typeflag: tar.TypeSymlink, Linkname: "busybox"})
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// dockerCmd runs the docker CLI against the test's dockerd.
func dockerCmd(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, "docker", append([]string{"-H", dockerHost}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func docker(t *testing.T, args ...string) string {
	t.Helper()
	out, err := dockerCmd(args...)
	if err != nil {
		t.Fatalf("docker %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// dockerFails runs a docker command that must fail and returns its output.
func dockerFails(t *testing.T, args ...string) string {
	t.Helper()
	out, err := dockerCmd(args...)
	if err == nil {
		t.Fatalf("docker %s succeeded, want an error\n%s", strings.Join(args, " "), out)
	}
	return out
}

func needDocker(t *testing.T) {
	t.Helper()
	dockerOnce.Do(func() { stopDockerd = startDockerd(filepath.Join(engineDir, "docker")) })
	if dockerBroken != "" {
		t.Fatal(dockerBroken)
	}
	if dockerSkip != "" {
		t.Skip(dockerSkip)
	}
}

// env is one agent with a csi-loop-plugin, registered with Docker under
// a name of its own.
type env struct {
	t                          *testing.T
	dir, pool, conf, work, run string
	driver                     string
	socket                     string
	agent                      *exec.Cmd
	agentDone                  chan struct{}
	logs                       *os.File
	// serveArgs are more flags of csi-agent serve; activated, listening
	// sockets it is given as systemd would (LISTEN_FDS), by name.
	serveArgs []string
	activated map[string]*os.File
}

func newEnv(t *testing.T) *env {
	t.Helper()
	needDocker(t)
	e := newEnvFor(t)
	// Docker remembers volumes by name across drivers: forget this test's
	// once its containers are gone (cleanups run last first).
	t.Cleanup(func() {
		if out, err := dockerCmd("volume", "ls", "-q", "--filter", "driver="+e.driver); err == nil && out != "" {
			dockerCmd(append([]string{"volume", "rm", "-f"}, strings.Fields(out)...)...)
		}
	})
	return e
}

// newEnvFor makes an env whose agent is started once setups ran.
func newEnvFor(t *testing.T, setups ...func(*env)) *env {
	t.Helper()
	dir := testhelp.LeakCheckedDir(t)
	e := &env{t: t, dir: dir, pool: filepath.Join(dir, "pool"), conf: filepath.Join(dir, "conf"),
		work: filepath.Join(dir, "work"), run: filepath.Join(dir, "run")}
	e.socket = filepath.Join(e.run, "docker-plugin.sock")
	for _, setup := range setups {
		setup(e)
	}
	for _, d := range []string{e.pool, e.conf} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	logs, err := os.Create(filepath.Join(dir, "agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	e.logs = logs
	// An unmanaged plugin, so that the test owns its process.
	plugSock := filepath.Join(dir, "loop.sock")
	plugin := exec.Command(bins.loop, "--endpoint", "unix://"+plugSock, "--pool", e.pool, "--node-id", "node-1")
	plugin.Stderr = e.logs
	if err := plugin.Start(); err != nil {
		t.Fatal(err)
	}
	// Both services: its controller attaches the volumes.
	cfg, _ := json.Marshal(map[string]any{"type": "loop.test", "endpoints": []any{
		map[string]string{"csi_service": "CONTROLLER_SERVICE", "endpoint": plugSock},
		map[string]string{"csi_service": "NODE_SERVICE", "endpoint": plugSock},
	}})
	if err := os.WriteFile(filepath.Join(e.conf, "loop.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	driverOnce.Do(registerDriver)
	if driverErr != nil {
		t.Fatal(driverErr)
	}
	e.driver = driver
	t.Cleanup(func() {
		e.stopAgent()
		plugin.Process.Kill()
		plugin.Wait()
		if to, _ := os.Readlink(driverSocket()); to == e.socket {
			os.Remove(driverSocket())
		}
		// Mounts left behind fail the test in the leak check, which
		// runs after this: the log says why they stayed.
		if t.Failed() || len(mountsUnder(t, e.work)) > 0 {
			log, _ := os.ReadFile(e.logs.Name())
			t.Logf("agent and plugin log:\n%s", tail(log))
		}
		e.logs.Close()
	})
	e.startAgent()
	// Docker's requests to the driver go to this agent from now on.
	link := driverSocket() + ".new"
	os.Remove(link)
	if err := os.Symlink(e.socket, link); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(link, driverSocket()); err != nil {
		t.Fatal(err)
	}
	return e
}

// registerDriver registers the tests' volume plugin with Docker: driver,
// a spec file whose socket, driverSocket, is a symbolic link to the
// socket of the running test's agent. One name serves every test, since
// dockerd never forgets a volume driver it loaded: with a name per test,
// every docker volume ls, and every volume name dockerd does not know,
// asked each earlier test's dead driver, retrying for 15 s.
func registerDriver() {
	var rnd [6]byte
	rand.Read(rnd[:])
	driver = testDriver + hex.EncodeToString(rnd[:])
	if driverErr = os.MkdirAll(specDir, 0o755); driverErr != nil {
		return
	}
	driverErr = os.WriteFile(driverSpec(), []byte("unix://"+driverSocket()+"\n"), 0o644)
}

// driverSpec is the spec file of driver.
func driverSpec() string { return filepath.Join(specDir, driver+".spec") }

// driverSocket is driver's socket: a link to the socket of the running
// test's agent.
func driverSocket() string { return filepath.Join(engineDir, "docker-plugin.sock") }

// startAgent runs csi-agent serve and waits for its plugin socket.
func (e *env) startAgent() {
	e.t.Helper()
	cmd := exec.Command(bins.agent, append([]string{"serve", "--csi-plugin-config-dir", e.conf, "--work-dir", e.work, "--runtime-dir", e.run}, e.serveArgs...)...)
	if len(e.activated) > 0 {
		// As systemd passes sockets: from fd 3, named, for this pid
		// (the shell's, which execs the agent).
		cmd = exec.Command("sh", append([]string{"-c", `LISTEN_PID=$$ exec "$0" "$@"`}, cmd.Args...)...)
		var names []string
		for name, f := range e.activated {
			names = append(names, name)
			cmd.ExtraFiles = append(cmd.ExtraFiles, f)
		}
		cmd.Env = append(os.Environ(), "LISTEN_FDS="+strconv.Itoa(len(names)), "LISTEN_FDNAMES="+strings.Join(names, ":"))
	}
	cmd.Stdout, cmd.Stderr = e.logs, e.logs
	if err := cmd.Start(); err != nil {
		e.t.Fatal(err)
	}
	e.agent, e.agentDone = cmd, make(chan struct{})
	done := e.agentDone
	go func() { cmd.Wait(); close(done) }()
	c := dockerplugin.NewClient(e.socket)
	deadline := time.Now().Add(waitTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.List(ctx)
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("the agent's plugin socket does not answer: %v", err)
		}
		select {
		case <-done:
			e.t.Fatal("csi-agent serve exited at start")
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// stopAgent stops the agent with SIGTERM (a no-op if it is not running).
func (e *env) stopAgent() { e.signalAgent(syscall.SIGTERM) }

func (e *env) killAgent() { e.signalAgent(syscall.SIGKILL) }

func (e *env) signalAgent(sig syscall.Signal) {
	if e.agent == nil {
		return
	}
	e.agent.Process.Signal(sig)
	select {
	case <-e.agentDone:
	case <-time.After(waitTimeout):
		e.t.Errorf("the agent did not stop on %v", sig)
		e.agent.Process.Kill()
		<-e.agentDone
	}
	e.agent = nil
}

// cli runs csi-agent volume ... against this agent.
func (e *env) cli(args ...string) (string, error) {
	args = append(args, "--api-socket", filepath.Join(e.run, "agent.sock"))
	out, err := exec.Command(bins.agent, append([]string{"volume"}, args...)...).CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (e *env) inspect(name string) *agentv1.NamedVolume {
	e.t.Helper()
	out, err := e.cli("inspect", name)
	if err != nil {
		e.t.Fatalf("csi-agent volume inspect %s: %v\n%s", name, err, out)
	}
	v := &agentv1.NamedVolume{}
	if err := protojson.Unmarshal([]byte(out), v); err != nil {
		e.t.Fatalf("inspect output: %v\n%s", err, out)
	}
	return v
}

// loopVolume pre-provisions a loop volume and returns its image.
func (e *env) loopVolume(id string) string {
	e.t.Helper()
	out, err := exec.Command(bins.loop, "create-volume", "--pool", e.pool, "--name", id, "--size", "32MiB").CombinedOutput()
	if err != nil {
		e.t.Fatalf("create-volume: %v\n%s", err, out)
	}
	return filepath.Join(e.pool, id+".img")
}

// container runs a detached container that sleeps, removed at the end.
func (e *env) container(args ...string) string {
	e.t.Helper()
	id := docker(e.t, append(append([]string{"run", "-d", "--network", "none"}, args...), image, "sleep", "600")...)
	e.t.Cleanup(func() { dockerCmd("rm", "-f", id) })
	return id
}

// mountsOf is the number of engine mounts inspect reports.
func mountsOf(v *agentv1.NamedVolume) int { return len(v.GetEngineMountIds()) }

// publishedUnder lists the mounts of the agent's work dir (publish targets
// and engine binds).
func (e *env) publishedUnder() []*mountinfo.Info {
	ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(e.work))
	if err != nil {
		e.t.Fatal(err)
	}
	return ms
}

// debugfsCat reads a file of an unmounted ext4 image.
func debugfsCat(t *testing.T, img, path string) string {
	t.Helper()
	out, err := exec.Command("debugfs", "-R", "cat "+path, img).Output()
	if err != nil {
		t.Fatalf("debugfs cat %s: %v", path, err)
	}
	return string(out)
}

func TestDockerNamedVolume(t *testing.T) {
	e := newEnv(t)
	img := e.loopVolume("vol1")
	if out := docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "--opt", "fs_type=ext4", "data"); out != "data" {
		t.Fatalf("docker volume create said %q", out)
	}
	if out := docker(t, "volume", "inspect", "--format", "{{.Scope}}", "data"); out != "local" {
		t.Errorf("the volume's scope is %q, want local", out)
	}
	if out := docker(t, "volume", "ls", "--format", "{{.Driver}} {{.Name}}"); !strings.Contains(out, e.driver+" data") {
		t.Errorf("docker volume ls does not list the volume:\n%s", out)
	}
	writer := e.container("-v", "data:/data")
	docker(t, "exec", writer, "sh", "-c", "echo hello > /data/f")
	reader := e.container("-v", "data:/data:ro")
	if out := docker(t, "exec", reader, "cat", "/data/f"); out != "hello" {
		t.Errorf("the second container reads %q, want hello", out)
	}
	if out := dockerFails(t, "exec", reader, "touch", "/data/g"); !strings.Contains(out, "Read-only file system") {
		t.Errorf("writing through :ro: %s, want Read-only file system", out)
	}
	v := e.inspect("data")
	if mountsOf(v) != 2 || v.GetState() != "PUBLISHED" || v.GetContainers() != 2 {
		t.Errorf("with two containers, inspect says %v, want 2 mounts of a PUBLISHED volume with 2 users", v)
	}
	if out := dockerFails(t, "volume", "rm", "data"); !strings.Contains(out, "in use") {
		t.Errorf("docker volume rm of a volume in use: %s", out)
	}
	// docker cp mounts the volume again under the container's mount id,
	// and unmounts it after: the container keeps its mount.
	copied := filepath.Join(t.TempDir(), "f")
	docker(t, "cp", writer+":/data/f", copied)
	if b, err := os.ReadFile(copied); err != nil || string(b) != "hello\n" {
		t.Errorf("docker cp copied %q, %v", b, err)
	}
	if out := docker(t, "exec", writer, "cat", "/data/f"); out != "hello" {
		t.Errorf("after docker cp the writer reads %q", out)
	}
	if v := e.inspect("data"); mountsOf(v) != 2 || v.GetState() != "PUBLISHED" {
		t.Errorf("after docker cp, inspect says %v, want the 2 containers' mounts", v)
	}
	docker(t, "rm", "-f", writer)
	if v := e.inspect("data"); mountsOf(v) != 1 {
		t.Errorf("with one container left, inspect says %v", v)
	}
	docker(t, "rm", "-f", reader)
	if v := e.inspect("data"); mountsOf(v) != 0 || v.GetState() != "NOT_PUBLISHED" {
		t.Errorf("after the last container, inspect says %v, want no mounts, NOT_PUBLISHED", v)
	}
	if ms := e.publishedUnder(); len(ms) != 0 {
		t.Errorf("after the last container, still mounted: %s", ms[0].Mountpoint)
	}
	if got := debugfsCat(t, img, "/f"); got != "hello\n" {
		t.Errorf("the loop image holds %q, want hello", got)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.work, "engine-mounts")); len(ents) != 0 {
		t.Errorf("engine mount directories left: %v", ents)
	}
	docker(t, "volume", "rm", "data")
	if out, err := e.cli("ls"); err != nil || strings.Contains(out, "data") {
		t.Errorf("csi-agent volume ls after docker volume rm: %v\n%s", err, out)
	}
	// A reader-only definition is published read-only, whatever the
	// container asks for.
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "--opt", "access_mode=SINGLE_NODE_READER_ONLY", "shelf")
	out, err := dockerCmd("run", "--rm", "--network", "none", "-v", "shelf:/data", image, "sh", "-c", "cat /data/f && touch /data/g")
	if err == nil || !strings.Contains(out, "hello") || !strings.Contains(out, "Read-only file system") {
		t.Errorf("a reader-only volume mounted without :ro: %v\n%s\nwant the data readable and writes refused", err, out)
	}
}

func TestDockerAgentKilledWhileContainerHoldsVolume(t *testing.T) {
	e := newEnv(t)
	img := e.loopVolume("vol1")
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "data")
	c := e.container("-v", "data:/data")
	docker(t, "exec", c, "sh", "-c", "echo one > /data/f")
	e.killAgent()
	// The container keeps its volume while no agent runs.
	docker(t, "exec", c, "sh", "-c", "echo two >> /data/f")
	e.startAgent()
	v := e.inspect("data")
	if mountsOf(v) != 1 || v.GetState() != "PUBLISHED" {
		t.Fatalf("the restarted agent reports %v, want the container's mount of a PUBLISHED volume", v)
	}
	// A reconcile that does not say which mounts are live is refused, and
	// releases nothing.
	for _, args := range [][]string{{"reconcile", "--engine", "docker"}, {"reconcile", "--live-mount-ids", ""}} {
		if out, err := e.cli(args...); err == nil || !strings.Contains(out, "--engine and --live-mount-ids are required") {
			t.Errorf("csi-agent volume %q: %v %q, want it refused", args, err, out)
		}
	}
	// Another engine's reconcile (Podman knows no mount of Docker's)
	// releases nothing of Docker's: the mount was recorded as dockerd's.
	if out, err := e.cli("reconcile", "--engine", "podman", "--live-mount-ids", ""); err != nil || out != "" {
		t.Errorf("csi-agent volume reconcile --engine podman: %v %q, want nothing released", err, out)
	}
	if v := e.inspect("data"); mountsOf(v) != 1 {
		t.Fatalf("after the refused and the other engine's reconciles, inspect says %v", v)
	}
	// Reconciling with the engine's live mount ids keeps them.
	if out, err := e.cli("reconcile", "--engine", "docker", "--live-mount-ids", v.GetEngineMountIds()[0]); err != nil || out != "" {
		t.Errorf("csi-agent volume reconcile with the live mount: %v %q, want nothing released", err, out)
	}
	docker(t, "exec", c, "sh", "-c", "echo three >> /data/f")
	docker(t, "stop", "-t", "1", c)
	if ms := e.publishedUnder(); len(ms) != 0 {
		t.Errorf("after docker stop, still mounted: %s", ms[0].Mountpoint)
	}
	if v := e.inspect("data"); mountsOf(v) != 0 {
		t.Errorf("after docker stop, inspect says %v", v)
	}
	if got := debugfsCat(t, img, "/f"); got != "one\ntwo\nthree\n" {
		t.Errorf("the loop image holds %q", got)
	}
}

func TestDockerBadInput(t *testing.T) {
	e := newEnv(t)
	e.loopVolume("vol1")
	// Something mounted, which no bad call may disturb.
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "good")
	c := e.container("-v", "good:/data")
	long := strings.Repeat("x", 10000)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=v", "--opt", "colour=blue", "bad"}, `unknown option "colour"`},
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=v", "--opt", "size=1G", "bad"}, "options volume_id (an existing volume) and size (create one) exclude each other"},
		{[]string{"--opt", "volume_id=v", "bad"}, "option plugin is required"},
		{[]string{"--opt", "plugin=loop.test", "bad"}, "option volume_id is required"},
		{[]string{"--opt", "plugin=nope", "--opt", "volume_id=v", "bad"}, "option plugin=nope"},
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=" + long, "bad"}, "option volume_id is 10000 bytes"},
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=v", "a..b/c"}, "a..b/c"},
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=v", ".."}, `name ".." must start with a letter`},
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=v", "--opt", "context." + long + "=v", "bad"}, "option context.KEY is 10000 bytes"},
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=v", "--opt", long + "=v", "bad"}, "unknown option"},
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=v", "--opt", "stage_secret=../shadow", "bad"}, "option stage_secret"},
		{[]string{"--opt", "plugin=loop.test", "--opt", "volume_id=v", long}, "is 10000 bytes, longer than 128"},
	} {
		out := dockerFails(t, append([]string{"volume", "create", "-d", e.driver}, tc.args...)...)
		// Docker quotes the volume's name back (create NAME: ...); the
		// rest is short.
		if !strings.Contains(out, tc.want) || len(out)-len(tc.args[len(tc.args)-1]) > 2000 {
			t.Errorf("docker volume create %.80v: %.300s\nwant an error containing %q", tc.args, out, tc.want)
		}
	}
	// Docker answers a create of a name it has from its own records: the
	// definition stays (docs/engines.md says so).
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=other", "good")
	if opts := e.inspect("good").GetOptions(); opts["volume_id"] != "vol1" {
		t.Errorf("after a second docker volume create, the definition is %v, want volume_id vol1", opts)
	}
	// A volume id the plugin does not know: the Mount fails, and leaves
	// no directory behind.
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=missing", "ghost")
	if out := dockerFails(t, "run", "--rm", "--network", "none", "-v", "ghost:/data", image, "true"); !strings.Contains(out, "missing") {
		t.Errorf("mounting a volume the plugin does not have: %s", out)
	}
	// A volume id the plugin refuses as malformed.
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=../../etc/passwd", "escape")
	if out := dockerFails(t, "run", "--rm", "--network", "none", "-v", "escape:/data", image, "true"); !strings.Contains(out, `volume id "../../etc/passwd" contains a path separator`) {
		t.Errorf("mounting a volume id the plugin rejects: %s", out)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.work, "engine-mounts")); len(ents) != 2 {
		t.Errorf("engine mount entries %v, want the good volume's directory and record only", ents)
	}
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "--opt", "block=true", "raw")
	if out := dockerFails(t, "run", "--rm", "--network", "none", "-v", "raw:/data", image, "true"); !strings.Contains(out, "block volume") {
		t.Errorf("mounting a block volume: %s", out)
	}
	// The agent API keeps its callers off the engines' mounts: their ids
	// are refused, and a reconcile of the API's containers keeps them.
	api := filepath.Join(e.run, "agent.sock")
	if out, err := exec.Command(bins.agent, "cleanup", "--container", "engine+0123", "--api-socket", api).CombinedOutput(); err == nil || !strings.Contains(string(out), "container engines' volume mounts") {
		t.Errorf("cleanup of an engine container id: %v %s", err, out)
	}
	if out, err := exec.Command(bins.agent, "reconcile", "--live", "none", "--api-socket", api).CombinedOutput(); err != nil {
		t.Errorf("reconcile: %v %s", err, out)
	}
	if out := docker(t, "exec", c, "sh", "-c", "echo ok > /data/f && cat /data/f"); out != "ok" {
		t.Errorf("the mounted volume after the bad calls: %q", out)
	}
	if v := e.inspect("good"); mountsOf(v) != 1 || v.GetState() != "PUBLISHED" {
		t.Errorf("after the bad calls and a reconcile, inspect says %v", v)
	}
}

// setUpPodman imports the test image into podman storage of the tests'
// own, or sets podmanSkip or podmanBroken.
func setUpPodman(dir string) {
	switch {
	case os.Geteuid() != 0:
		podmanSkip = "needs root: runs podman containers"
		return
	case func() bool { _, err := exec.LookPath("podman"); return err != nil }():
		podmanBroken = "podman is not installed (make deps installs Debian's podman)"
		return
	}
	podmanRoot = dir
	img, err := busyboxTar()
	if err != nil {
		podmanBroken = "cannot make the test image: " + err.Error()
		return
	}
	conf := filepath.Join(dir, "containers.conf")
	if err = os.MkdirAll(dir, 0o700); err == nil {
		err = os.WriteFile(conf, []byte(podmanConf), 0o600)
	}
	if err != nil {
		podmanBroken = err.Error()
		return
	}
	c := podmanCommand(conf, "import", "-", image)
	c.Stdin = bytes.NewReader(img)
	if out, err := c.CombinedOutput(); err != nil {
		podmanSkip = fmt.Sprintf("podman does not work on this machine: import: %v: %s", err, tail(out))
	}
}

// podmanCleanUp unmounts what podman's storage left mounted.
func podmanCleanUp() {
	if podmanRoot == "" {
		return
	}
	podmanCommand(filepath.Join(podmanRoot, "containers.conf"), "rm", "--all", "--force", "--time", "0").Run()
	if ms, err := mountinfo.GetMounts(mountinfo.PrefixFilter(podmanRoot)); err == nil {
		for i := len(ms) - 1; i >= 0; i-- {
			syscall.Unmount(ms[i].Mountpoint, syscall.MNT_DETACH)
		}
	}
}

// podmanConf is the tests' containers.conf: runc (crun fails on hybrid
// cgroups), cgroupfs; volume plugins are added per test.
const podmanConf = `[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
`

// podmanCommand runs podman on the tests' storage with the config conf.
func podmanCommand(conf string, args ...string) *exec.Cmd {
	c := exec.Command("podman", append([]string{"--root", filepath.Join(podmanRoot, "root"), "--runroot", filepath.Join(podmanRoot, "runroot"),
		"--tmpdir", filepath.Join(podmanRoot, "tmp")}, args...)...)
	c.Env = append(os.Environ(), "CONTAINERS_CONF="+conf)
	return c
}

// podman runs a podman command with this test's config, which names the
// agent's socket as the volume plugin e.driver.
func (e *env) podman(args ...string) (string, error) {
	conf := filepath.Join(e.dir, "containers.conf")
	if _, err := os.Stat(conf); err != nil {
		// The shipped hook, run from this test's binary against this
		// test's agent.
		hooks := filepath.Join(e.dir, "hooks.d")
		shipped, err := os.ReadFile("../deploy/oci-hooks.d/csi-agent.json")
		if err != nil {
			return "", err
		}
		var hook map[string]any
		if err := json.Unmarshal(shipped, &hook); err != nil {
			return "", err
		}
		hook["hook"] = map[string]any{"path": bins.agent, "args": []string{"csi-agent", "oci-hook",
			"--api-socket", filepath.Join(e.run, "agent.sock")}}
		b, _ := json.Marshal(hook)
		if err := os.MkdirAll(hooks, 0o755); err != nil {
			return "", err
		}
		if err := os.WriteFile(filepath.Join(hooks, "csi-agent.json"), b, 0o644); err != nil {
			return "", err
		}
		c := strings.Replace(podmanConf, "[engine]\n", "[engine]\nhooks_dir = [\""+hooks+"\"]\n", 1) +
			"\n[engine.volume_plugins]\n" + e.driver + " = \"" + e.socket + "\"\n"
		if err := os.WriteFile(conf, []byte(c), 0o600); err != nil {
			return "", err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	c := podmanCommand(conf, args...)
	c = exec.CommandContext(ctx, c.Path, c.Args[1:]...)
	c.Env = append(os.Environ(), "CONTAINERS_CONF="+conf)
	out, err := c.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

func (e *env) mustPodman(args ...string) string {
	e.t.Helper()
	out, err := e.podman(args...)
	if err != nil {
		e.t.Fatalf("podman %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// podmanRunArgs start a container as this host allows.
var podmanRunArgs = []string{"run", "--network", "none", "--ulimit", "nofile=1024:4096", "--ulimit", "nproc=1024:4096"}

func newPodmanEnv(t *testing.T, setups ...func(*env)) *env {
	t.Helper()
	needPodman(t)
	return newEnvFor(t, setups...)
}

// needPodman sets Podman up for the tests, or fails or skips the test.
func needPodman(t *testing.T) {
	t.Helper()
	podmanOnce.Do(func() { setUpPodman(filepath.Join(engineDir, "podman")) })
	if podmanBroken != "" {
		t.Fatal(podmanBroken)
	}
	if podmanSkip != "" {
		t.Skip(podmanSkip)
	}
}

func TestPodmanNamedVolume(t *testing.T) {
	e := newPodmanEnv(t)
	img := e.loopVolume("vol1")
	if out, err := e.podman("volume", "create", "--driver", e.driver, "-o", "plugin=loop.test", "-o", "volume_id=vol1", "-o", "colour=blue", "bad"); err == nil || !strings.Contains(out, `unknown option "colour"`) {
		t.Errorf("podman volume create with an unknown option: %v %s", err, out)
	}
	e.mustPodman("volume", "create", "--driver", e.driver, "-o", "plugin=loop.test", "-o", "volume_id=vol1", "data")
	writer := e.mustPodman(append(podmanRunArgs, "-d", "-v", "data:/data", image, "sleep", "600")...)
	t.Cleanup(func() { e.podman("rm", "-f", "-t", "0", writer) })
	e.mustPodman("exec", writer, "sh", "-c", "echo hello > /data/f")
	reader := e.mustPodman(append(podmanRunArgs, "-d", "-v", "data:/data:ro", image, "sleep", "600")...)
	t.Cleanup(func() { e.podman("rm", "-f", "-t", "0", reader) })
	if out := e.mustPodman("exec", reader, "cat", "/data/f"); out != "hello" {
		t.Errorf("the second container reads %q, want hello", out)
	}
	if out, err := e.podman("exec", reader, "touch", "/data/g"); err == nil || !strings.Contains(out, "Read-only file system") {
		t.Errorf("writing through :ro: %v %s, want Read-only file system", err, out)
	}
	if v := e.inspect("data"); v.GetState() != "PUBLISHED" || mountsOf(v) != 1 {
		t.Errorf("with two containers, inspect says %v, want a PUBLISHED volume (Podman mounts it once for both)", v)
	}
	// Podman counts the containers itself and mounts once for both.
	if out := e.mustPodman("volume", "inspect", "--format", "{{.MountCount}}", "data"); out != "2" {
		t.Errorf("podman's mount count with two containers: %s, want 2", out)
	}
	if out, err := e.podman("volume", "rm", "data"); err == nil || !strings.Contains(out, "being used") {
		t.Errorf("podman volume rm of a volume in use: %v %s", err, out)
	}
	e.mustPodman("rm", "-f", "-t", "0", writer, reader)
	if ms := e.publishedUnder(); len(ms) != 0 {
		t.Errorf("after the last container, still mounted: %s", ms[0].Mountpoint)
	}
	if got := debugfsCat(t, img, "/f"); got != "hello\n" {
		t.Errorf("the loop image holds %q, want hello", got)
	}
	e.mustPodman("volume", "rm", "data")
	if _, err := os.Stat(filepath.Join(e.work, "named-volumes", "data.json")); err == nil {
		t.Error("podman volume rm left the definition")
	}
}

// The mounts annotation as typed, through Podman's hooks.d: no JSON, so
// Podman's CSV parsing of annotation values leaves it whole.
func TestPodmanHookMountsAnnotation(t *testing.T) {
	e := newPodmanEnv(t)
	img := e.loopVolume("vol1")
	// A reader-only volume must hold a filesystem already.
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", e.loopVolume("vol2")).CombinedOutput(); err != nil {
		t.Fatalf("mkfs: %v\n%s", err, out)
	}
	for _, def := range [][]string{{"data", "--volume-id", "vol1"}, {"logs", "--volume-id", "vol2", "--access-mode", "SINGLE_NODE_READER_ONLY"}} {
		// Named by the annotation: the operator allows it (the policy).
		if out, err := e.cli(append([]string{"create", def[0], "--plugin", "loop.test", "--fs-type", "ext4", "--allow-annotations"}, def[1:]...)...); err != nil {
			t.Fatalf("csi-agent volume create: %v\n%s", err, out)
		}
	}
	c := e.mustPodman(append(podmanRunArgs, "-d", "--annotation", "csi.csiagent.io/mounts=data:/data;logs:/logs", image, "sleep", "600")...)
	t.Cleanup(func() { e.podman("rm", "-f", "-t", "0", c) })
	e.mustPodman("exec", c, "sh", "-c", "echo hooked > /data/f")
	if out, err := e.podman("exec", c, "touch", "/logs/x"); err == nil || !strings.Contains(out, "Read-only file system") {
		t.Errorf("writing to a reader-only volume: %v %s, want Read-only file system", err, out)
	}
	// A second container shares the volume, read-only by the annotation.
	c2 := e.mustPodman(append(podmanRunArgs, "-d", "--annotation", "csi.csiagent.io/mounts=data:/data:ro", image, "sleep", "600")...)
	t.Cleanup(func() { e.podman("rm", "-f", "-t", "0", c2) })
	if out := e.mustPodman("exec", c2, "cat", "/data/f"); out != "hooked" {
		t.Errorf("the second container reads %q, want hooked", out)
	}
	if out, err := e.podman("exec", c2, "touch", "/data/g"); err == nil || !strings.Contains(out, "Read-only file system") {
		t.Errorf("writing through :ro: %v %s, want Read-only file system", err, out)
	}
	if v := e.inspect("data"); v.GetState() != "PUBLISHED" || v.GetContainers() != 2 {
		t.Errorf("with two containers, inspect says %v, want a PUBLISHED volume with 2 users", v)
	}
	if out, err := e.cli("rm", "data"); err == nil || !strings.Contains(out, "in use by 2 container(s)") {
		t.Errorf("csi-agent volume rm of a volume in use: %v %s", err, out)
	}
	e.mustPodman("stop", "-t", "0", c, c2)
	if ms := e.publishedUnder(); len(ms) != 0 {
		t.Errorf("after the container stopped, still mounted: %s", ms[0].Mountpoint)
	}
	if got := debugfsCat(t, img, "/f"); got != "hooked\n" {
		t.Errorf("the loop image holds %q", got)
	}
	out, err := e.podman(append(podmanRunArgs, "--rm", "--annotation", "csi.csiagent.io/mounts=nosuch:/data", image, "true")...)
	if err == nil || !strings.Contains(out, "no such named volume: nosuch") {
		t.Errorf("a container naming an unknown volume: %v %s", err, out)
	}
}

// TestReconcileScopedToItsEngine: with Docker and Podman using one agent
// at once, Docker's live mount ids reconcile Docker's mounts only (before,
// they released a running Podman container's volume), and a reconcile of
// the containers no manager named (runc's) never touches a Podman hook
// container (before, it cleaned one up, which then wrote into its own
// rootfs); the hook records Podman's containers as libpod's.
func TestReconcileScopedToItsEngine(t *testing.T) {
	e := newEnv(t)
	needPodman(t)
	for _, v := range []string{"vol1", "vol2", "vol3"} {
		e.loopVolume(v)
	}
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "fordocker")
	c := e.container("-v", "fordocker:/data")
	e.mustPodman("volume", "create", "--driver", e.driver, "-o", "plugin=loop.test", "-o", "volume_id=vol2", "forpodman")
	p1 := e.mustPodman(append(podmanRunArgs, "-d", "-v", "forpodman:/data", image, "sleep", "600")...)
	t.Cleanup(func() { e.podman("rm", "-f", "-t", "0", p1) })
	if out, err := e.cli("create", "hooked", "--plugin", "loop.test", "--volume-id", "vol3", "--fs-type", "ext4", "--allow-annotations"); err != nil {
		t.Fatalf("csi-agent volume create: %v\n%s", err, out)
	}
	p2 := e.mustPodman(append(podmanRunArgs, "-d", "--annotation", "csi.csiagent.io/mounts=hooked:/v", image, "sleep", "600")...)
	t.Cleanup(func() { e.podman("rm", "-f", "-t", "0", p2) })

	api := []string{"--api-socket", filepath.Join(e.run, "agent.sock")}
	agent := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(bins.agent, append(args, api...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("csi-agent %q: %v\n%s", args, err, out)
		}
		return strings.TrimSpace(string(out))
	}
	var list agentv1.ListContainersResponse
	if err := protojson.Unmarshal([]byte(agent("containers", "--output", "json")), &list); err != nil {
		t.Fatal(err)
	}
	managers := map[string]string{}
	for _, ct := range list.GetContainers() {
		managers[ct.GetContainerId()] = ct.GetManager()
	}
	if managers[p2] != "libpod" {
		t.Fatalf("the Podman hook container %s is recorded with manager %q, want libpod: %v", p2, managers[p2], managers)
	}

	dockerIDs := e.inspect("fordocker").GetEngineMountIds()
	if out, err := e.cli("reconcile", "--engine", "docker", "--live-mount-ids", strings.Join(dockerIDs, ",")); err != nil || out != "" {
		t.Errorf("Docker's reconcile: %v %q, want nothing released", err, out)
	}
	if out := agent("reconcile", "--live", ""); out != "" {
		t.Errorf("a reconcile of the containers of no manager: %q, want nothing cleaned up", out)
	}
	// A live list that misses a running container (here: podman ps of the
	// default storage, not the tests' own) does not take its volumes away:
	// a process is still in its mount namespace.
	out, err := exec.Command(bins.agent, append([]string{"reconcile", "--runtime", "podman"}, api...)...).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "FAILED "+p2+": container "+p2+": not cleaned up: it still runs: pid") {
		t.Errorf("a reconcile whose live list misses the running %s: %v %s; want it refused for it", p2, err, out)
	}
	for name, want := range map[string]int{"fordocker": 1, "forpodman": 1} {
		if v := e.inspect(name); mountsOf(v) != want || v.GetState() != "PUBLISHED" {
			t.Errorf("%s after the reconciles: %v", name, v)
		}
	}
	docker(t, "exec", c, "sh", "-c", "echo d > /data/f")
	e.mustPodman("exec", p1, "sh", "-c", "echo p > /data/f")
	e.mustPodman("exec", p2, "sh", "-c", "echo h > /v/f")
	if v := e.inspect("hooked"); v.GetState() != "PUBLISHED" || v.GetContainers() != 1 {
		t.Errorf("the hook container's volume after the reconciles: %v", v)
	}
}

// TestEnginesRemoveOnlyTheirOwnVolumes: Docker, Podman and csi-agent
// volume share one name space; docker volume rm of a volume Podman created
// is refused (it used to delete it, and Podman then failed), Docker may
// still use it, and Podman and root remove what is theirs.
func TestEnginesRemoveOnlyTheirOwnVolumes(t *testing.T) {
	e := newEnv(t)
	needPodman(t)
	e.loopVolume("vol1")
	e.loopVolume("vol2")
	e.mustPodman("volume", "create", "--driver", e.driver, "-o", "plugin=loop.test", "-o", "volume_id=vol1", "podmans")
	e.mustPodman(append(podmanRunArgs, "--rm", "-v", "podmans:/data", image, "sh", "-c", "echo kept > /data/f")...)
	if out, err := e.cli("create", "roots", "--plugin", "loop.test", "--volume-id", "vol2"); err != nil {
		t.Fatalf("csi-agent volume create: %v\n%s", err, out)
	}
	for name, want := range map[string]string{"podmans": "podman", "roots": "csi-agent"} {
		if got := e.inspect(name).GetCreator(); got != want {
			t.Errorf("%s's creator: %q, want %q", name, got, want)
		}
	}
	// Docker learns of the volume as a user would: docker volume ls, or a
	// create with the same options (no change). (A name Docker does not
	// know is looked for on every volume driver it ever loaded.)
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "podmans")
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol2", "roots")
	if out := dockerFails(t, "volume", "rm", "podmans"); !strings.Contains(out, "was created by podman, not docker") || !strings.Contains(out, "podman volume rm podmans") {
		t.Errorf("docker volume rm of Podman's volume: %s", out)
	}
	if out := dockerFails(t, "volume", "rm", "roots"); !strings.Contains(out, "was created by csi-agent") {
		t.Errorf("docker volume rm of root's volume: %s", out)
	}
	if out := docker(t, "run", "--rm", "--network", "none", "-v", "podmans:/data", image, "cat", "/data/f"); out != "kept" {
		t.Errorf("Docker reading Podman's volume: %q", out)
	}
	if out := e.mustPodman(append(podmanRunArgs, "--rm", "-v", "podmans:/data", image, "cat", "/data/f")...); strings.TrimSpace(out) != "kept" {
		t.Errorf("Podman reading its volume after Docker's refused rm: %q", out)
	}
	e.mustPodman("volume", "rm", "podmans")
	if out, err := e.cli("rm", "roots"); err != nil {
		t.Errorf("csi-agent volume rm of its own volume: %v\n%s", err, out)
	}
	if out, err := e.cli("ls"); err != nil || strings.Contains(out, "podmans") || strings.Contains(out, "roots") {
		t.Errorf("csi-agent volume ls after both removals: %v\n%s", err, out)
	}
}

// TestDockerNonRootWritesFreshVolume: a container run as 1000:1000 can
// write a fresh volume created with uid=1000 and gid=1000 (its root is
// given to them at the engine mount); without them it cannot (the root of
// a fresh filesystem is root's), as the README says.
func TestDockerNonRootWritesFreshVolume(t *testing.T) {
	e := newEnv(t)
	img := e.loopVolume("vol1")
	e.loopVolume("vol2")
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "--opt", "uid=1000", "--opt", "gid=1000", "owned")
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol2", "rootowned")
	if out := docker(t, "run", "--rm", "--network", "none", "-u", "1000:1000", "-v", "owned:/data", image, "sh", "-c", "echo mine > /data/f && cat /data/f"); out != "mine" {
		t.Errorf("the 1000:1000 container wrote %q", out)
	}
	if out := dockerFails(t, "run", "--rm", "--network", "none", "-u", "1000:1000", "-v", "rootowned:/data", image, "sh", "-c", "echo mine > /data/f"); !strings.Contains(out, "ermission denied") {
		t.Errorf("writing a fresh root-owned volume as 1000:1000: %s", out)
	}
	if got := debugfsCat(t, img, "/f"); got != "mine\n" {
		t.Errorf("the loop image holds %q", got)
	}
}

// TestDockerCallsWaitForAgentRestart: with the agent's sockets made by
// systemd (socket activation), a docker run -v while the agent restarts
// waits in the plugin socket's backlog and succeeds once the next agent
// serves. Before, the agent deleted its socket on shutdown and Docker
// stalled 15 s and failed.
func TestDockerCallsWaitForAgentRestart(t *testing.T) {
	needDocker(t)
	e := newEnvFor(t, func(e *env) {
		if err := os.MkdirAll(e.run, 0o755); err != nil {
			t.Fatal(err)
		}
		e.activated = map[string]*os.File{}
		for name, path := range map[string]string{"api": filepath.Join(e.run, "agent.sock"), "docker-plugin": e.socket} {
			lis, err := net.Listen("unix", path)
			if err != nil {
				t.Fatal(err)
			}
			f, err := lis.(*net.UnixListener).File()
			if err != nil {
				t.Fatal(err)
			}
			lis.(*net.UnixListener).SetUnlinkOnClose(false)
			lis.Close() // f keeps the socket listening, as systemd does
			t.Cleanup(func() { f.Close(); os.Remove(path) })
			e.activated[name] = f
		}
	})
	t.Cleanup(func() {
		if out, err := dockerCmd("volume", "ls", "-q", "--filter", "driver="+e.driver); err == nil && out != "" {
			dockerCmd(append([]string{"volume", "rm", "-f"}, strings.Fields(out)...)...)
		}
	})
	e.loopVolume("vol1")
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "data")
	e.stopAgent()
	if _, err := os.Stat(e.socket); err != nil {
		t.Fatalf("the stopped agent removed the socket systemd made: %v", err)
	}
	run := exec.Command("docker", "-H", dockerHost, "run", "--rm", "--network", "none", "-v", "data:/data", image, "sh", "-c", "echo waited > /data/f && cat /data/f")
	var out bytes.Buffer
	run.Stdout, run.Stderr = &out, &out
	if err := run.Start(); err != nil {
		t.Fatal(err)
	}
	// Docker's call to the plugin waits in the socket's backlog.
	deadline := time.Now().Add(waitTimeout)
	for !pendingConnection(t, e.socket) {
		if time.Now().After(deadline) {
			t.Fatalf("docker run made no call to the plugin socket while the agent was down: %s", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	e.startAgent()
	if err := run.Wait(); err != nil || strings.TrimSpace(out.String()) != "waited" {
		t.Fatalf("docker run during the agent's restart: %v\n%s", err, out.String())
	}
}

// pendingConnection reports whether the listening unix socket at path has
// a connection waiting to be accepted (ss's Recv-Q of a listener).
func pendingConnection(t *testing.T, path string) bool {
	t.Helper()
	out, err := exec.Command("ss", "-xlnH", "src", path).Output()
	if err != nil {
		t.Fatalf("ss: %v", err)
	}
	f := strings.Fields(string(out))
	return len(f) > 2 && f[2] != "0"
}

// TestPodmanStopWhileAgentDown: a Podman container given its volume by
// the hooks.d hook stops while the agent is down: poststop says the agent
// will clean it up and does not hold podman stop up, and the agent, back,
// cleans it up by itself (nothing is left in its mount namespace). Before,
// podman stop took 31 s and the container stayed PREPARED with its volume.
func TestPodmanStopWhileAgentDown(t *testing.T) {
	e := newPodmanEnv(t, func(e *env) { e.serveArgs = []string{"--resync-interval", "200ms"} })
	e.loopVolume("vol1")
	if out, err := e.cli("create", "data", "--plugin", "loop.test", "--volume-id", "vol1", "--fs-type", "ext4", "--allow-annotations"); err != nil {
		t.Fatalf("csi-agent volume create: %v\n%s", err, out)
	}
	c := e.mustPodman(append(podmanRunArgs, "-d", "--annotation", "csi.csiagent.io/mounts=data:/data", image, "sleep", "600")...)
	t.Cleanup(func() { e.podman("rm", "-f", "-t", "0", c) })
	e.mustPodman("exec", c, "sh", "-c", "echo hooked > /data/f")
	e.killAgent()
	start := time.Now()
	e.mustPodman("stop", "-t", "0", c)
	if took := time.Since(start); took > 20*time.Second {
		t.Errorf("podman stop with the agent down took %v", took)
	}
	e.startAgent()
	e.waitReleased("data", "the volume of the container stopped while the agent was down")
}

var enginePairs = flag.Int("engine-pairs", 2, "TestDockerRunOverhead: pairs of docker runs timed (make bench: 20)")

// TestDockerRunOverhead times docker run --rm -v NAME:/data … true through
// csiagent against the same with Docker's local driver binding the same
// mounted filesystem, alternating, and reports the median ratio. A
// holder container keeps the volume published, so what is timed is the
// plugin's per-container work (Mount, Unmount: a bind and its removal,
// each checkpointed).
func TestDockerRunOverhead(t *testing.T) {
	e := newEnv(t)
	e.loopVolume("vol1")
	docker(t, "volume", "create", "-d", e.driver, "--opt", "plugin=loop.test", "--opt", "volume_id=vol1", "data")
	e.container("-v", "data:/data")
	mp := e.inspect("data").GetMountpoint()
	local := "local-" + e.driver
	docker(t, "volume", "create", "--driver", "local", "--opt", "type=none", "--opt", "o=bind", "--opt", "device="+mp, local)
	t.Cleanup(func() { dockerCmd("volume", "rm", "-f", local) })
	timeRun := func(vol string) time.Duration {
		start := time.Now()
		docker(t, "run", "--rm", "--network", "none", "-v", vol+":/data", image, "true")
		return time.Since(start)
	}
	var ours, theirs, ratios []time.Duration
	for range *enginePairs {
		o, l := timeRun("data"), timeRun(local)
		ours, theirs = append(ours, o), append(theirs, l)
		ratios = append(ratios, time.Duration(float64(o)/float64(l)*1000))
	}
	median := func(d []time.Duration) time.Duration {
		s := slices.Clone(d)
		slices.Sort(s)
		return s[len(s)/2]
	}
	t.Logf("docker run --rm -v NAME:/data true, %d pairs: csi-agent median %v, local bind median %v, median ratio %.3f",
		*enginePairs, median(ours).Round(time.Millisecond), median(theirs).Round(time.Millisecond), float64(median(ratios))/1000)
}

// Named volumes can be given to csi-agent prepare (--mounts), as
// everywhere a volume is named.
func TestPrepareNamedVolume(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnvFor(t)
	img := e.loopVolume("vol1")
	if out, err := e.cli("create", "data", "--plugin", "loop.test", "--volume-id", "vol1", "--fs-type", "ext4"); err != nil {
		t.Fatalf("volume create: %v\n%s", err, out)
	}
	sandbox := filepath.Join(e.dir, "sandbox")
	if err := os.Mkdir(sandbox, 0o755); err != nil {
		t.Fatal(err)
	}
	api := []string{"--api-socket", filepath.Join(e.run, "agent.sock")}
	out, err := exec.Command(bins.agent, append([]string{"prepare", "--container", "c1", "--mounts", "data:data", "--sandbox", sandbox}, api...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("prepare --mounts: %v\n%s", err, out)
	}
	if err := os.WriteFile(filepath.Join(sandbox, "data", "f"), []byte("named\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(bins.agent, append([]string{"cleanup", "--container", "c1"}, api...)...).CombinedOutput(); err != nil {
		t.Fatalf("cleanup: %v\n%s", err, out)
	}
	if got := debugfsCat(t, img, "/f"); got != "named\n" {
		t.Errorf("the loop image holds %q", got)
	}
	out, err = exec.Command(bins.agent, append([]string{"prepare", "--container", "c2", "--mounts", "nosuch:data", "--sandbox", sandbox}, api...)...).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "no such named volume: nosuch") {
		t.Errorf("prepare --mounts of an unknown name: %v\n%s", err, out)
	}
}
