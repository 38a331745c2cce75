package supervisor

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/bootid"
	"github.com/csiagent/csiagent/internal/proclog"
	"github.com/csiagent/csiagent/internal/unixsock"
	"github.com/csiagent/csiagent/pluginconfig"
)

const (
	// terminateTimeout is how long a plugin process group gets between
	// SIGTERM and SIGKILL.
	terminateTimeout = 10 * time.Second
	// killWait bounds the wait for a plugin process to exit after its
	// SIGKILL (one stuck in uninterruptible sleep, on a hung disk or
	// NFS server, does not exit).
	killWait = 5 * time.Second
	// MaxSocketPath is the longest path a unix socket address holds.
	MaxSocketPath = unixsock.MaxPath
	// pluginPath is the PATH of plugin processes, which do not inherit the
	// agent's environment.
	pluginPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
)

// processRecord is what the agent persists about a plugin process it
// launched, so that a later agent can adopt it.
type processRecord struct {
	PID int `json:"pid"`
	// StartTicks is field 22 of /proc/<pid>/stat: with BootID it tells a
	// recycled pid from the process we launched.
	StartTicks uint64    `json:"start_ticks"`
	BootID     string    `json:"boot_id"`
	ConfigHash string    `json:"config_hash"`
	Socket     string    `json:"socket"`
	StartedAt  time.Time `json:"started_at"`
}

// process is a running plugin process, launched or adopted.
type process struct {
	pid     int
	adopted bool
	// exited is closed when the process has exited; err then says how.
	exited chan struct{}
	err    error
	// release frees what watching the process holds (the pidfd of an
	// adopted process); safe to call more than once.
	release func()
}

// launchSpec is everything needed to launch one managed plugin container.
type launchSpec struct {
	container  pluginconfig.Container
	socket     string
	addons     string // the csi-addons socket offered in $CSIADDONS_ENDPOINT
	nodeID     string
	dir        string // the instance's state directory
	runtimeDir string // holds the socket's directory
	logDir     string
	logPrefix  string
	configHash string
	cgroupFD   int // -1: none
}

// configHash identifies what a plugin process was launched with: a change
// means the process must be rolled.
func configHash(c pluginconfig.Container, socket, nodeID string) string {
	b, _ := json.Marshal(struct {
		C      pluginconfig.Container
		Socket string
		NodeID string
	}{c, socket, nodeID})
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// commandLine turns a Mesos CommandInfo into a path and argv: with shell,
// /bin/sh -c value; without, value is looked up like execlp and arguments
// is the whole argv.
func commandLine(cmd *pluginconfig.Command) (path string, argv []string, err error) {
	if cmd.UsesShell() {
		return "/bin/sh", []string{"/bin/sh", "-c", cmd.Value}, nil
	}
	path = cmd.Value
	if !strings.Contains(path, "/") {
		if path, err = lookPath(cmd.Value); err != nil {
			return "", nil, err
		}
	}
	argv = cmd.Arguments
	if len(argv) == 0 {
		argv = []string{cmd.Value}
	}
	return path, argv, nil
}

// lookPath finds an executable in the plugins' PATH, not the agent's.
func lookPath(name string) (string, error) {
	for _, dir := range filepath.SplitList(pluginPath) {
		p := filepath.Join(dir, name)
		if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("command %q not found in %s", name, pluginPath)
}

// launch starts a plugin process in its own process group, with stdout and
// stderr going straight to log files, so that it outlives the agent.
func launch(spec launchSpec) (*process, *processRecord, error) {
	cmd := spec.container.Command
	path, argv, err := commandLine(cmd)
	if err != nil {
		return nil, nil, err
	}
	env := []string{"PATH=" + pluginPath}
	if cmd.Environment != nil {
		for _, v := range cmd.Environment.Variables {
			env = append(env, v.Name+"="+v.Value)
		}
	}
	env = append(env, "CSI_ENDPOINT=unix://"+spec.socket)
	if spec.addons != "" {
		env = append(env, "CSIADDONS_ENDPOINT=unix://"+spec.addons)
	}
	for _, s := range spec.container.Services {
		if s == pluginconfig.NodeService {
			env = append(env, "MESOS_AGENT_ID="+spec.nodeID)
		}
	}
	attr := &syscall.SysProcAttr{Setpgid: true}
	dir := spec.dir
	if cmd.User != "" {
		cred, err := credential(cmd.User)
		if err != nil {
			return nil, nil, err
		}
		attr.Credential = cred
		if err := giveSocketDir(spec.runtimeDir, filepath.Dir(spec.socket), cred); err != nil {
			return nil, nil, fmt.Errorf("command.user %q: %w", cmd.User, err)
		}
		// The state directory is the agent's (the process record must not
		// be the plugin's to forge), and Go changes directory after
		// setuid: start in /, as systemd does.
		dir = "/"
	}
	if spec.cgroupFD >= 0 {
		attr.UseCgroupFD, attr.CgroupFD = true, spec.cgroupFD
	}
	stdout, err := proclog.Open(filepath.Join(spec.logDir, spec.logPrefix+".stdout.log"))
	if err != nil {
		return nil, nil, fmt.Errorf("opening plugin log: %w", err)
	}
	defer stdout.Close()
	stderr, err := proclog.Open(filepath.Join(spec.logDir, spec.logPrefix+".stderr.log"))
	if err != nil {
		return nil, nil, fmt.Errorf("opening plugin log: %w", err)
	}
	defer stderr.Close()
	c := &exec.Cmd{Path: path, Args: argv, Env: env, Dir: dir, Stdout: stdout, Stderr: stderr, SysProcAttr: attr}
	if err := c.Start(); err != nil {
		return nil, nil, fmt.Errorf("starting %s: %w", path, err)
	}
	p := &process{pid: c.Process.Pid, exited: make(chan struct{}), release: func() {}}
	go func() {
		p.err = exitError(c.Wait())
		close(p.exited)
	}()
	rec := &processRecord{PID: p.pid, BootID: bootID(), ConfigHash: spec.configHash, Socket: spec.socket, StartedAt: time.Now().UTC()}
	if st, err := readStat(p.pid); err == nil {
		rec.StartTicks = st.startTicks
	}
	return p, rec, nil
}

func exitError(err error) error {
	if err == nil {
		return errors.New("exited with status 0")
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return fmt.Errorf("killed by signal %s", ws.Signal())
		}
		return fmt.Errorf("exited with status %d", ee.ExitCode())
	}
	return err
}

// giveSocketDir gives the directory the plugin creates its socket in to
// the plugin's user, and lets every user search (not list) the directories
// from root down to it, so the user can reach it whatever umask made them.
func giveSocketDir(root, dir string, cred *syscall.Credential) error {
	if rel, err := filepath.Rel(root, dir); err != nil || rel == "." || rel == ".." || strings.HasPrefix(rel, "../") {
		return fmt.Errorf("socket directory %s is not below %s", dir, root)
	}
	if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
		return fmt.Errorf("giving the socket directory to the user: %w", err)
	}
	for d := filepath.Dir(dir); ; d = filepath.Dir(d) {
		st, err := os.Stat(d)
		if err != nil {
			return fmt.Errorf("reaching the socket directory: %w", err)
		}
		if err := os.Chmod(d, st.Mode().Perm()|0o011); err != nil {
			return fmt.Errorf("reaching the socket directory: %w", err)
		}
		if d == root {
			return nil
		}
	}
}

func credential(name string) (*syscall.Credential, error) {
	u, err := user.Lookup(name)
	if err != nil {
		return nil, fmt.Errorf("command.user: %w", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("command.user %q: uid %q: %w", name, u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("command.user %q: gid %q: %w", name, u.Gid, err)
	}
	cred := &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	if ids, err := u.GroupIds(); err == nil {
		for _, g := range ids {
			if n, err := strconv.ParseUint(g, 10, 32); err == nil {
				cred.Groups = append(cred.Groups, uint32(n))
			}
		}
	}
	return cred, nil
}

// adopt takes over a plugin process that an earlier agent launched, when
// it is the very process recorded (same boot, pid and start time).
// Otherwise it says why not. Whether its config is current is the caller's
// question.
func adopt(rec *processRecord) (*process, error) {
	if rec.BootID != bootID() {
		return nil, errors.New("launched before the last reboot")
	}
	st, err := readStat(rec.PID)
	if err != nil || st.startTicks != rec.StartTicks || st.state == 'Z' || st.state == 'X' {
		return nil, errors.New("no longer running")
	}
	fd, err := unix.PidfdOpen(rec.PID, unix.PIDFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("watching pid %d: %w", rec.PID, err)
	}
	// Re-check after opening the pidfd: the pid cannot be recycled under
	// an open pidfd, so a match now means the fd is our process.
	if st2, err := readStat(rec.PID); err != nil || st2.startTicks != rec.StartTicks {
		unix.Close(fd)
		return nil, errors.New("no longer running")
	}
	p := &process{pid: rec.PID, adopted: true, exited: make(chan struct{})}
	f := os.NewFile(uintptr(fd), "pidfd")
	p.release = sync.OnceFunc(func() { f.Close() })
	go func() {
		err := waitReadable(f)
		if err == nil {
			p.err = errors.New("exited (adopted process: status unknown)")
		} else {
			p.err = err
		}
		close(p.exited)
	}()
	return p, nil
}

// waitReadable blocks until a pidfd signals exit, or returns an error when
// the file is closed.
func waitReadable(f *os.File) error {
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	return rc.Read(func(fd uintptr) bool {
		// false: not yet; the runtime's poller waits for readability and
		// calls again.
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, _ := unix.Poll(fds, 0)
		return n > 0
	})
}

// terminate stops a plugin's whole process group: SIGTERM, then SIGKILL
// after terminateTimeout (at once when ctx ends). It returns when the
// process has exited, true, or killWait after its SIGKILL, false: it is
// stuck (uninterruptible sleep), and goes when the kernel lets it.
func terminate(ctx context.Context, p *process) bool {
	select {
	case <-p.exited:
	default:
		signalGroup(p.pid, unix.SIGTERM)
		t := time.NewTimer(terminateTimeout)
		defer t.Stop()
		exited := false
		select {
		case <-p.exited:
			exited = true
		case <-t.C:
		case <-ctx.Done():
		}
		if !exited {
			signalGroup(p.pid, unix.SIGKILL)
			k := time.NewTimer(killWait)
			defer k.Stop()
			select {
			case <-p.exited:
			case <-k.C:
				return false
			}
		}
	}
	// Children the plugin left in its group go too. The group id cannot
	// be reused while any member lives, so this reaches no one else.
	_ = unix.Kill(-p.pid, unix.SIGKILL)
	return true
}

// signalGroup signals the process group the plugin leads, or just the
// process if it has left its group (never another group).
func signalGroup(pid int, sig unix.Signal) {
	if pgid, err := unix.Getpgid(pid); err == nil && pgid == pid {
		_ = unix.Kill(-pid, sig)
		return
	}
	_ = unix.Kill(pid, sig)
}

type procStat struct {
	state      byte
	startTicks uint64
}

// readStat reads a process's state and start time from /proc/<pid>/stat.
func readStat(pid int) (procStat, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return procStat{}, err
	}
	// The command name may hold spaces and parentheses: fields start after
	// the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return procStat{}, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	ticks, err := strconv.ParseUint(f[19], 10, 64) // field 22 overall
	if err != nil {
		return procStat{}, fmt.Errorf("malformed /proc/%d/stat: %w", pid, err)
	}
	return procStat{state: f[0][0], startTicks: ticks}, nil
}

// StartTicks is when process pid started (clock ticks since boot): with
// the pid, it names one process, whatever reuses the pid later.
func StartTicks(pid int) (uint64, error) {
	st, err := readStat(pid)
	return st.startTicks, err
}

// bootID is this boot's id, "" if unreadable (a record then never
// matches: its process is not adopted).
func bootID() string {
	id, _ := bootid.Current()
	return id
}

func readRecord(root, path string) (*processRecord, error) {
	b, _, err := atomicfile.ReadRecord(root, path)
	if err != nil {
		return nil, err
	}
	var rec processRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	return &rec, nil
}
