package mount_test

import (
	"io"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// zombieLeaderEnv makes this test binary, started with it set, a process
// whose main thread exits (SYS_EXIT: that thread only) once it reads a
// byte from stdin, while its other threads run on until killed.
const zombieLeaderEnv = "CSIAGENT_TEST_ZOMBIE_LEADER"

func init() {
	if os.Getenv(zombieLeaderEnv) == "" {
		return
	}
	// init runs on the main thread, locked to it.
	go func() {
		for {
			time.Sleep(time.Hour) // keeps the process, on other threads
		}
	}()
	var b [1]byte
	_, _ = os.Stdin.Read(b[:])
	unix.RawSyscall(unix.SYS_EXIT, 0, 0, 0)
}

// A process whose main thread has exited while another runs has no
// /proc/PID/ns/mnt, but its namespace is in use: NamespacesInUse finds it
// through its threads (a container whose init did so is still running).
func TestNamespacesInUseZombieLeader(t *testing.T) {
	testhelp.NeedRoot(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), zombieLeaderEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	pid := cmd.Process.Pid
	var ns uint64
	deadline := time.Now().Add(10 * time.Second)
	for {
		// Its own namespace once it has started (CLONE_NEWNS at clone).
		if ns, err = mount.MountNamespace(pid); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if _, err := io.WriteString(stdin, "x"); err != nil {
		t.Fatal(err)
	}
	for {
		if _, err := mount.MountNamespace(pid); err != nil {
			break // the main thread is gone
		}
		if time.Now().After(deadline) {
			t.Fatal("the helper's main thread did not exit")
		}
		time.Sleep(10 * time.Millisecond)
	}
	inUse, err := mount.NamespacesInUse()
	if err != nil {
		t.Fatal(err)
	}
	if got, ok := inUse[ns]; !ok || got != pid {
		t.Fatalf("NamespacesInUse()[%d] = %d, %v; want pid %d (its threads still run)", ns, got, ok, pid)
	}
}
