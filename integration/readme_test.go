package integration

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
)

// TestReadmeWalkthrough runs README.md's ```sh blocks as typed, in order,
// each with "bash -e", in a mount namespace of its own whose /run, /tmp,
// /usr/local/bin, /etc and /var/lib are private (a fresh host's, as far as
// csiagent, Docker and Podman can tell), with the repository as working
// directory. A block is marked by an HTML comment on the line before it:
//
//	<!-- walkthrough: systemd start -->  the test runs the installed unit's
//	                                     ExecStart instead (no systemd here)
//	<!-- walkthrough: systemd stop -->   the test stops that agent instead
//	<!-- walkthrough: docker -->         run against a dockerd the test starts
//	<!-- walkthrough: podman -->         run with Podman set up for this host
//	<!-- walkthrough: fails -->          must exit non-zero
//
// An engine that cannot start on this machine skips its blocks, saying why;
// one that is not installed fails the test (make deps installs it).
func TestReadmeWalkthrough(t *testing.T) {
	testhelp.NeedRoot(t)
	blocks, err := testhelp.ReadmeBlocks("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	repo, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	ns := newWalkthroughNS(t, repo)
	var agent *exec.Cmd
	engines := map[string]string{} // engine -> why it cannot run here ("" it can)
	for _, b := range blocks {
		where := fmt.Sprintf("README.md:%d", b.Line)
		switch b.Mark {
		case "fleet":
			t.Logf("%s: run by integration/fleet's TestReadmeManyHosts (a fleet on etcd)", where)
			continue
		case "systemd start":
			agent = ns.startAgent(t)
			continue
		case "systemd stop":
			ns.stopAgent(t, agent)
			agent = nil
			continue
		case "docker", "podman":
			why, ok := engines[b.Mark]
			if !ok {
				why = ns.setUpEngine(t, b.Mark)
				engines[b.Mark] = why
			}
			if why != "" {
				t.Logf("%s: skipped: %s", where, why)
				continue
			}
		}
		out, err := ns.runBlock(t, repo, b)
		switch {
		case b.Mark == "fails" && err == nil:
			t.Fatalf("%s: succeeded, but the README says it fails:\n%s\n%s", where, b.Text, out)
		case b.Mark != "fails" && err != nil:
			t.Fatalf("%s: %v:\n%s\noutput:\n%s\nagent log:\n%s", where, err, b.Text, out, ns.log("agent.log"))
		}
		t.Logf("%s: ok\n%s", where, out)
	}
	if agent != nil {
		t.Fatal("README.md leaves the agent running: a block marked \"systemd stop\" is missing")
	}
}

// walkthroughNS is a mount namespace held open by a process of its own.
type walkthroughNS struct {
	holder *exec.Cmd
	nsID   string // the namespace's /proc/PID/ns/mnt link
	dir    string // on the host: logs, scripts, the private /var/lib dirs
}

// walkthroughSetUp makes the namespace's private directories: /etc, /usr
// and /var/lib are overlays whose changes stay in a tmpfs (the host's files
// read through; csiagent's, Docker's and Podman's own state and config
// removed or replaced by empty directories on the host's disk, since
// container storage does not work on overlayfs), /usr/local/bin, /run and
// /tmp are empty tmpfs (but for the checkout, $2, if it is below /tmp).
const walkthroughSetUp = `set -eu
dir=$1
mkdir -p "$dir/scratch"
mount -t tmpfs -o mode=0700 walkthrough "$dir/scratch"
for d in etc usr var/lib; do
	n=$(echo "$d" | tr / -)
	mkdir -p "$dir/scratch/$n-up" "$dir/scratch/$n-work"
	mount -t overlay overlay -o "lowerdir=/$d,upperdir=$dir/scratch/$n-up,workdir=$dir/scratch/$n-work" "/$d"
done
mount -t tmpfs -o mode=0755 tmpfs /usr/local/bin
rm -rf /etc/csi-agent /etc/docker/plugins /etc/containers/containers.conf.d /etc/systemd/system/csi-agent.service
for d in csi-agent csi-loop docker containers; do
	rm -rf "/var/lib/$d"
	mkdir -p "/var/lib/$d" "$dir/varlib/$d"
	mount --bind "$dir/varlib/$d" "/var/lib/$d"
done
mount -t tmpfs -o mode=0755 tmpfs /run
# A checkout under /tmp (CI's clone) stays where it is, through /run.
repo=$2
mkdir /run/.repo
mount --bind "$repo" /run/.repo
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p "$repo"
mount --bind /run/.repo "$repo"
umount /run/.repo
rmdir /run/.repo
echo ready
exec sleep infinity
`

func newWalkthroughNS(t *testing.T, repo string) *walkthroughNS {
	t.Helper()
	ns := &walkthroughNS{dir: t.TempDir()}
	holder := exec.Command("unshare", "--mount", "--propagation", "private", "bash", "-c", walkthroughSetUp, "setup", ns.dir, repo)
	out, err := holder.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	holder.Stderr = &stderr
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	ns.holder = holder
	t.Cleanup(func() { ns.tearDown(t) })
	ready := make(chan error, 1)
	go func() {
		line, err := bufio.NewReader(out).ReadString('\n')
		if err == nil && line != "ready\n" {
			err = fmt.Errorf("said %q", line)
		}
		ready <- err
	}()
	select {
	case err := <-ready:
		if err != nil {
			t.Fatalf("setting up the namespace: %v: %s", err, stderr.String())
		}
	case <-time.After(waitTimeout):
		t.Fatalf("setting up the namespace took over %v: %s", waitTimeout, stderr.String())
	}
	if ns.nsID, err = os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", holder.Process.Pid)); err != nil {
		t.Fatal(err)
	}
	return ns
}

// command runs name in the namespace, in its root directory, with a PATH
// as on a fresh host plus the directory of the go that runs this test
// (make install builds).
func (ns *walkthroughNS) command(ctx context.Context, name string, args ...string) *exec.Cmd {
	return ns.commandIn(ctx, "/", name, args...)
}

// commandIn is command in the working directory wd.
func (ns *walkthroughNS) commandIn(ctx context.Context, wd, name string, args ...string) *exec.Cmd {
	c := exec.CommandContext(ctx, "nsenter", append([]string{"--mount=/proc/" + strconv.Itoa(ns.holder.Process.Pid) + "/ns/mnt", "--wd=" + wd, "--", name}, args...)...)
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	if goBin, err := exec.LookPath("go"); err == nil {
		path += ":" + filepath.Dir(goBin)
	}
	c.Env = append(os.Environ(), "PATH="+path, "HOME=/root")
	c.WaitDelay = 5 * time.Second
	return c
}

// blockTimeout bounds one README block (make install may compile).
const blockTimeout = 4 * time.Minute

func (ns *walkthroughNS) runBlock(t *testing.T, repo string, b testhelp.ReadmeBlock) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), blockTimeout)
	defer cancel()
	c := ns.commandIn(ctx, repo, "bash", "-e", "-o", "pipefail", "-c", b.Text)
	out, err := c.CombinedOutput()
	if ctx.Err() != nil {
		err = fmt.Errorf("did not finish within %v: %w", blockTimeout, err)
	}
	return string(out), err
}

// log returns the tail of a log file the test wrote.
func (ns *walkthroughNS) log(name string) string {
	b, _ := os.ReadFile(filepath.Join(ns.dir, name))
	return tail(b)
}

// startAgent does what "systemctl enable --now csi-agent" does: the
// installed unit's ExecStart with its UMask, waiting for the API.
func (ns *walkthroughNS) startAgent(t *testing.T) *exec.Cmd {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	unit, err := ns.command(ctx, "cat", "/etc/systemd/system/csi-agent.service").Output()
	if err != nil {
		t.Fatalf("the installed unit: %v", err)
	}
	var execStart, umask string
	for _, line := range strings.Split(string(unit), "\n") {
		if v, ok := strings.CutPrefix(line, "ExecStart="); ok {
			execStart = v
		}
		if v, ok := strings.CutPrefix(line, "UMask="); ok {
			umask = v
		}
	}
	if execStart == "" || umask == "" {
		t.Fatalf("the installed unit has no ExecStart or UMask:\n%s", unit)
	}
	logf, err := os.Create(filepath.Join(ns.dir, "agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	agent := ns.command(context.Background(), "bash", "-c", "umask "+umask+" && exec "+execStart)
	agent.Stdout, agent.Stderr = logf, logf
	if err := agent.Start(); err != nil {
		t.Fatal(err)
	}
	logf.Close()
	return agent
}

// stopAgent does what "systemctl disable --now csi-agent" does: SIGTERM to
// the main process, which must exit within the unit's TimeoutStopSec (30s).
func (ns *walkthroughNS) stopAgent(t *testing.T, agent *exec.Cmd) {
	t.Helper()
	if agent == nil {
		t.Fatal("README.md stops the agent before starting it")
	}
	agent.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- agent.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("the agent exited with %v on SIGTERM:\n%s", err, ns.log("agent.log"))
		}
	case <-time.After(30 * time.Second):
		agent.Process.Kill()
		<-done
		t.Fatalf("the agent did not stop within 30s of SIGTERM:\n%s", ns.log("agent.log"))
	}
}

// setUpEngine starts dockerd, or configures Podman, in the namespace as
// this host allows, with a local busybox image. It returns why the engine
// cannot run here ("" when it can); an engine not installed fails the test.
func (ns *walkthroughNS) setUpEngine(t *testing.T, engine string) string {
	t.Helper()
	bin := map[string]string{"docker": "dockerd", "podman": "podman"}[engine]
	if _, err := exec.LookPath(bin); err != nil {
		t.Fatalf("%s is not installed (make deps installs it)", bin)
	}
	img, err := busyboxTar()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	var load *exec.Cmd
	switch engine {
	case "docker":
		if why := ns.startDockerd(t); why != "" {
			return why
		}
		load = ns.command(ctx, "docker", "import", "-", "busybox")
	case "podman":
		// This host: no systemd, crun fails on its hybrid cgroups, low
		// default limits. The walkthrough's drop-in is installed by
		// make install next to this one.
		host := "[engine]\nruntime = \"runc\"\ncgroup_manager = \"cgroupfs\"\nevents_logger = \"file\"\n" +
			"[containers]\ndefault_ulimits = [\"nofile=1024:4096\", \"nproc=1024:4096\"]\n"
		c := ns.command(ctx, "bash", "-c", `mkdir -p /etc/containers/containers.conf.d && cat > /etc/containers/containers.conf.d/00-walkthrough-host.conf`)
		c.Stdin = strings.NewReader(host)
		if out, err := c.CombinedOutput(); err != nil {
			t.Fatalf("configuring podman: %v: %s", err, out)
		}
		load = ns.command(ctx, "podman", "import", "-", "docker.io/library/busybox:latest")
	}
	load.Stdin = bytes.NewReader(img)
	if out, err := load.CombinedOutput(); err != nil {
		return fmt.Sprintf("%s does not work on this machine: importing an image: %v: %s", engine, err, tail(out))
	}
	return ""
}

// startDockerd starts dockerd with its default paths (private to the
// namespace) and no network set-up, and waits for it.
func (ns *walkthroughNS) startDockerd(t *testing.T) string {
	t.Helper()
	logf, err := os.Create(filepath.Join(ns.dir, "dockerd.log"))
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	d := ns.command(context.Background(), "dockerd", "--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver=vfs")
	d.Stdout, d.Stderr = logf, logf
	if err := d.Start(); err != nil {
		return "dockerd cannot start: " + err.Error()
	}
	exited := make(chan struct{})
	go func() { d.Wait(); close(exited) }()
	t.Cleanup(func() {
		d.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(waitTimeout):
			d.Process.Kill()
			<-exited
		}
	})
	deadline := time.Now().Add(waitTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		out, err := ns.command(ctx, "docker", "version").CombinedOutput()
		cancel()
		if err == nil {
			return ""
		}
		if time.Now().After(deadline) {
			return fmt.Sprintf("dockerd does not start on this machine: %v: %s\n%s", err, out, ns.log("dockerd.log"))
		}
		select {
		case <-exited:
			return "dockerd exited at start: " + ns.log("dockerd.log")
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// tearDown kills every process in the namespace (the agent, the plugins
// it left running, the engines), which ends the namespace and its mounts,
// and fails the test for a loop device left backed by one of its files.
func (ns *walkthroughNS) tearDown(t *testing.T) {
	// Killed until none is left: a process may fork while they are.
	for range 10 {
		ps := ns.processes()
		if len(ps) == 0 {
			break
		}
		for _, p := range ps {
			syscall.Kill(p, syscall.SIGKILL)
		}
	}
	ns.holder.Process.Kill()
	ns.holder.Wait()
	// The last unmounts of the namespace's filesystems run after its last
	// process is gone, and autoclear loop devices detach after them.
	deadline := time.Now().Add(waitTimeout)
	for {
		left, err := loopdev.List(ns.dir)
		if err != nil {
			t.Error(err)
			return
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, d := range left {
				t.Errorf("left attached: %s -> %s", d.Path, d.BackingFile)
				_ = loopdev.Detach(d.Device, d.BackingFile)
			}
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// processes returns the pids of the processes in the namespace but the
// holder.
func (ns *walkthroughNS) processes() []int {
	entries, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == ns.holder.Process.Pid {
			continue
		}
		if id, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/mnt", pid)); err == nil && id == ns.nsID {
			out = append(out, pid)
		}
	}
	return out
}
