package cgroup

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// fakeRoot lays out the root of a cgroup2 tree: cgroup.controllers (unless
// controllers is "<missing>") and an empty cgroup.subtree_control.
func fakeRoot(t *testing.T, controllers string) string {
	t.Helper()
	root := t.TempDir()
	if controllers != "<missing>" {
		write(t, filepath.Join(root, "cgroup.controllers"), controllers+"\n")
	}
	write(t, filepath.Join(root, "cgroup.subtree_control"), "")
	return root
}

func write(t *testing.T, path, content string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func read(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "<missing>"
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

const allControllers = "cpuset cpu io memory hugetlb pids rdma misc"

func TestDetect(t *testing.T) {
	tests := []struct {
		name        string
		controllers string
		parent      string
		setup       func(t *testing.T, root string)
		wantParent  string
		want        map[string]string // path under root -> content
	}{
		{
			name:        "default parent",
			controllers: allControllers,
			wantParent:  "csi-agent",
			want: map[string]string{
				"cgroup.subtree_control":           "+cpu +memory",
				"csi-agent/cgroup.subtree_control": "+cpu +memory",
			},
		},
		{
			name:        "already enabled at the root",
			controllers: allControllers,
			setup: func(t *testing.T, root string) {
				write(t, filepath.Join(root, "cgroup.subtree_control"), "cpu io memory pids\n")
			},
			wantParent: "csi-agent",
			want: map[string]string{
				"cgroup.subtree_control":           "cpu io memory pids\n",
				"csi-agent/cgroup.subtree_control": "+cpu +memory",
			},
		},
		{
			name:        "partly enabled",
			controllers: allControllers,
			setup: func(t *testing.T, root string) {
				write(t, filepath.Join(root, "cgroup.subtree_control"), "memory pids\n")
			},
			wantParent: "csi-agent",
			want:       map[string]string{"cgroup.subtree_control": "+cpu"},
		},
		{
			name:        "nested parent",
			controllers: "cpu memory",
			parent:      "plugins.slice/csi",
			wantParent:  "plugins.slice/csi",
			want: map[string]string{
				"cgroup.subtree_control":                   "+cpu +memory",
				"plugins.slice/cgroup.subtree_control":     "+cpu +memory",
				"plugins.slice/csi/cgroup.subtree_control": "+cpu +memory",
			},
		},
		{
			name:        "existing parent, as on every agent restart",
			controllers: "cpu memory",
			setup: func(t *testing.T, root string) {
				write(t, filepath.Join(root, "cgroup.subtree_control"), "cpu memory\n")
				write(t, filepath.Join(root, "csi-agent", "cgroup.subtree_control"), "cpu memory\n")
				write(t, filepath.Join(root, "csi-agent", "plugin-a", "cpu.max"), "1000 100000\n")
			},
			wantParent: "csi-agent",
			want: map[string]string{
				"cgroup.subtree_control":           "cpu memory\n",
				"csi-agent/cgroup.subtree_control": "cpu memory\n",
				"csi-agent/plugin-a/cpu.max":       "1000 100000\n",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := fakeRoot(t, tt.controllers)
			if tt.setup != nil {
				tt.setup(t, root)
			}
			m, err := Detect(Config{Root: root, Parent: tt.parent})
			if err != nil {
				t.Fatal(err)
			}
			if got, want := m.Parent(), filepath.Join(root, tt.wantParent); got != want {
				t.Errorf("Parent() = %s, want %s", got, want)
			}
			if m.Root() != root {
				t.Errorf("Root() = %s, want %s", m.Root(), root)
			}
			for rel, want := range tt.want {
				if got := read(t, filepath.Join(root, rel)); got != want {
					t.Errorf("%s = %q, want %q", rel, got, want)
				}
			}
		})
	}
}

func TestDetectUnsupported(t *testing.T) {
	tests := []struct {
		name        string
		controllers string
		setup       func(t *testing.T, root string)
		wantMsg     string // ROOT stands for the fake root
	}{
		{
			name:        "hybrid host",
			controllers: "hugetlb",
			wantMsg:     "cgroup v2 limits unsupported: cgroup v2 at ROOT lacks the cpu, memory controllers (it has: hugetlb)",
		},
		{
			name:        "no memory controller",
			controllers: "cpu io pids",
			wantMsg:     "lacks the memory controller (it has: cpu, io, pids)",
		},
		{
			name:        "no controllers at all",
			controllers: "",
			wantMsg:     "lacks the cpu, memory controllers (it has: none)",
		},
		{
			name:        "not cgroup v2",
			controllers: "<missing>",
			wantMsg:     "ROOT is not a cgroup v2 hierarchy",
		},
		{
			name:        "parent is a file",
			controllers: allControllers,
			setup: func(t *testing.T, root string) {
				write(t, filepath.Join(root, "csi-agent"), "")
			},
			wantMsg: "cannot create the parent cgroup: ROOT/csi-agent exists and is not a cgroup",
		},
		{
			name:        "subtree_control not writable",
			controllers: allControllers,
			setup: func(t *testing.T, root string) {
				if err := os.Mkdir(filepath.Join(root, "csi-agent"), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.Mkdir(filepath.Join(root, "csi-agent", "cgroup.subtree_control"), 0o755); err != nil {
					t.Fatal(err)
				}
			},
			wantMsg: "csi-agent/cgroup.subtree_control",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := fakeRoot(t, tt.controllers)
			if tt.setup != nil {
				tt.setup(t, root)
			}
			m, err := Detect(Config{Root: root})
			if !errors.Is(err, ErrUnsupported) {
				t.Fatalf("Detect = %v, %v; want ErrUnsupported", m, err)
			}
			if want := strings.ReplaceAll(tt.wantMsg, "ROOT", root); !strings.Contains(err.Error(), want) {
				t.Errorf("error %q\ndoes not say %q", err, want)
			}
		})
	}
}

func TestDetectInvalidParent(t *testing.T) {
	for _, parent := range []string{"../up", "/abs", "a//b", "a/b/", "a/./b", "sp ace", "a/..", ".."} {
		t.Run(parent, func(t *testing.T) {
			root := fakeRoot(t, allControllers)
			_, err := Detect(Config{Root: root, Parent: parent})
			if !errors.Is(err, ErrInvalidName) || errors.Is(err, ErrUnsupported) {
				t.Fatalf("Detect(Parent %q) = %v; want ErrInvalidName only", parent, err)
			}
			entries, _ := os.ReadDir(root)
			if len(entries) != 2 {
				t.Errorf("Detect wrote into the tree: %v", entries)
			}
		})
	}
}

// TestDetectHost runs Detect against this host's real cgroup2 mount. On a
// hybrid host (cpu and memory bound to cgroup v1, as on the CI host) it
// must say so; on a unified host with the controllers it must succeed.
func TestDetectHost(t *testing.T) {
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup2"))
	if err != nil {
		t.Fatal(err)
	}
	if len(mounts) == 0 {
		_, err := Detect(Config{})
		if !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "no cgroup2 filesystem is mounted") {
			t.Fatalf("Detect without cgroup2 = %v", err)
		}
		return
	}
	mnt := mounts[0].Mountpoint
	for _, m := range mounts {
		if m.Mountpoint == preferredMount {
			mnt = m.Mountpoint
		}
	}
	have := strings.Fields(read(t, filepath.Join(mnt, "cgroup.controllers")))
	missing := without(controllers(), have)
	if len(missing) > 0 {
		_, err := Detect(Config{})
		if !errors.Is(err, ErrUnsupported) {
			t.Fatalf("Detect = %v; want ErrUnsupported (cgroup v2 at %s has only %v)", err, mnt, have)
		}
		want := fmt.Sprintf("cgroup v2 at %s lacks the %s controller", mnt, strings.Join(missing, ", "))
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q\ndoes not say %q", err, want)
		}
		t.Logf("as expected on this host: %v", err)
		return
	}
	if os.Geteuid() != 0 || testing.Short() {
		t.Skip("cgroup v2 here has cpu and memory; Detect would create a cgroup, which needs root (skipped under -short; make test runs it)")
	}
	parent := fmt.Sprintf("csiagent-test-%d", os.Getpid())
	m, err := Detect(Config{Parent: parent})
	if err != nil {
		t.Fatalf("Detect on a host whose cgroup v2 has cpu and memory: %v", err)
	}
	t.Cleanup(func() { _ = os.Remove(m.Parent()) })
	if got := read(t, filepath.Join(m.Parent(), "cgroup.subtree_control")); !strings.Contains(got, "cpu") || !strings.Contains(got, "memory") {
		t.Errorf("%s/cgroup.subtree_control = %q, want cpu and memory", m.Parent(), got)
	}
}

func fakeManager(t *testing.T) *Manager {
	t.Helper()
	m, err := Detect(Config{Root: fakeRoot(t, allControllers)})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestPrepare(t *testing.T) {
	tests := []struct {
		name          string
		setup         func(t *testing.T, leaf string)
		limits        Limits
		cpuMax, memMx string
	}{
		{
			name:   "new cgroup with limits",
			limits: Limits{CPUQuota: 50000, MemoryBytes: 64 << 20},
			cpuMax: "50000 100000", memMx: "67108864",
		},
		{
			name:   "new cgroup without limits",
			cpuMax: "max 100000", memMx: "max",
		},
		{
			name: "existing cgroup without processes is reused",
			setup: func(t *testing.T, leaf string) {
				write(t, filepath.Join(leaf, "cgroup.procs"), "")
				write(t, filepath.Join(leaf, "cpu.max"), "1000 100000\n")
				write(t, filepath.Join(leaf, "memory.max"), "4096\n")
			},
			limits: Limits{CPUQuota: 200000},
			cpuMax: "200000 100000", memMx: "max",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := fakeManager(t)
			leaf := filepath.Join(m.Parent(), "org.example.plugin:default:container-0")
			if tt.setup != nil {
				tt.setup(t, leaf)
			}
			dir, err := m.Prepare("org.example.plugin:default:container-0", tt.limits)
			if err != nil {
				t.Fatal(err)
			}
			defer dir.Close()
			if got := read(t, filepath.Join(leaf, "cpu.max")); got != tt.cpuMax {
				t.Errorf("cpu.max = %q, want %q", got, tt.cpuMax)
			}
			if got := read(t, filepath.Join(leaf, "memory.max")); got != tt.memMx {
				t.Errorf("memory.max = %q, want %q", got, tt.memMx)
			}
			// The descriptor is the leaf's directory.
			var fst, st unix.Stat_t
			if err := unix.Fstat(int(dir.Fd()), &fst); err != nil {
				t.Fatal(err)
			}
			if err := unix.Stat(leaf, &st); err != nil {
				t.Fatal(err)
			}
			if fst.Ino != st.Ino || fst.Dev != st.Dev || fst.Mode&unix.S_IFMT != unix.S_IFDIR {
				t.Errorf("descriptor is not the directory %s", leaf)
			}
			if fl, err := unix.FcntlInt(dir.Fd(), unix.F_GETFD, 0); err != nil || fl&unix.FD_CLOEXEC == 0 {
				t.Errorf("F_GETFD = %#x, %v; want FD_CLOEXEC", fl, err)
			}
		})
	}
}

func TestPrepareErrors(t *testing.T) {
	tests := []struct {
		name    string
		cgroup  string
		setup   func(t *testing.T, parent string)
		wantErr error
		wantMsg string
		after   map[string]string // path under the parent -> content
	}{
		{
			name:   "cgroup in use",
			cgroup: "busy",
			setup: func(t *testing.T, parent string) {
				write(t, filepath.Join(parent, "busy", "cgroup.procs"), "123\n456\n")
				write(t, filepath.Join(parent, "busy", "cpu.max"), "1000 100000\n")
			},
			wantErr: ErrInUse,
			wantMsg: "holds pids 123 456",
			after:   map[string]string{"busy/cpu.max": "1000 100000\n"},
		},
		{
			name:   "a file in the way",
			cgroup: "file",
			setup: func(t *testing.T, parent string) {
				write(t, filepath.Join(parent, "file"), "")
			},
			wantErr: ErrInvalidName,
			wantMsg: "exists and is not a cgroup",
		},
		{
			name:   "limits cannot be written to an existing cgroup",
			cgroup: "broken",
			setup: func(t *testing.T, parent string) {
				if err := os.MkdirAll(filepath.Join(parent, "broken", "memory.max"), 0o755); err != nil {
					t.Fatal(err)
				}
			},
			wantMsg: "set limits of broken",
			after:   map[string]string{"broken/cpu.max": "max 100000"}, // left in place: not created by Prepare
		},
	}
	for _, name := range []string{"", ".", "..", "a/b", "../up", "sp ace", "new\nline", strings.Repeat("x", 256)} {
		tests = append(tests, struct {
			name    string
			cgroup  string
			setup   func(t *testing.T, parent string)
			wantErr error
			wantMsg string
			after   map[string]string
		}{name: fmt.Sprintf("invalid name %.20q", name), cgroup: name, wantErr: ErrInvalidName})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m := fakeManager(t)
			if tt.setup != nil {
				tt.setup(t, m.Parent())
			}
			dir, err := m.Prepare(tt.cgroup, Limits{})
			if err == nil {
				dir.Close()
				t.Fatal("Prepare succeeded")
			}
			if tt.wantErr != nil && !errors.Is(err, tt.wantErr) {
				t.Errorf("err = %v, want %v", err, tt.wantErr)
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("error %q does not say %q", err, tt.wantMsg)
			}
			for rel, want := range tt.after {
				if got := read(t, filepath.Join(m.Parent(), rel)); got != want {
					t.Errorf("%s = %q, want %q", rel, got, want)
				}
			}
		})
	}
}

func TestRemove(t *testing.T) {
	m := fakeManager(t)
	// A fake cgroup is an empty directory: real cgroupfs lets rmdir remove
	// a cgroup with its interface files, a plain directory does not.
	if err := os.Mkdir(filepath.Join(m.Parent(), "gone"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name    string
		cgroup  string
		wantErr error
	}{
		{"existing", "gone", nil},
		{"already removed", "gone", nil},
		{"never existed", "never", nil},
		{"invalid name", "../csi-agent", ErrInvalidName},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := m.Remove(c.cgroup)
			if c.wantErr == nil && err != nil || c.wantErr != nil && !errors.Is(err, c.wantErr) {
				t.Fatalf("Remove(%q) = %v, want %v", c.cgroup, err, c.wantErr)
			}
		})
	}
	if _, err := os.Stat(filepath.Join(m.Parent(), "gone")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("cgroup still there: %v", err)
	}
}

// TestCloneIntoCgroup checks on the real kernel what the fake tree cannot:
// that the descriptor of a leaf created by the Manager puts a child into
// the cgroup at birth, and that a cgroup with a live process is reported in
// use by Remove and by Prepare's reuse check. It uses the host's cgroup2
// mount without controllers, so it runs on hybrid hosts too.
func TestCloneIntoCgroup(t *testing.T) {
	testhelp.NeedRoot(t)
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup2"))
	if err != nil {
		t.Fatal(err)
	}
	if len(mounts) == 0 {
		t.Skip("no cgroup2 filesystem is mounted")
	}
	mnt := mounts[0].Mountpoint
	parentName := fmt.Sprintf("csiagent-test-%d", os.Getpid())
	m := &Manager{root: mnt, parent: filepath.Join(mnt, parentName), logger: slog.New(slog.DiscardHandler)}
	if err := os.Mkdir(m.parent, dirPerm); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.Remove(m.parent); err != nil {
			t.Errorf("remove test cgroup: %v", err)
		}
	})

	openLeaf := func(name string) *os.File {
		t.Helper()
		path, _, err := m.leaf(name)
		if err != nil {
			t.Fatal(err)
		}
		dir, err := openDir(path)
		if err != nil {
			t.Fatal(err)
		}
		return dir
	}
	startIn := func(dir *os.File, cmd *exec.Cmd) {
		t.Helper()
		cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(dir.Fd())}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
	}

	// A child born in the leaf sees itself there.
	dir := openLeaf("child")
	var out bytes.Buffer
	cat := exec.Command("/bin/cat", "/proc/self/cgroup")
	cat.Stdout = &out
	startIn(dir, cat)
	dir.Close()
	if err := cat.Wait(); err != nil {
		t.Fatal(err)
	}
	if want := "0::/" + parentName + "/child\n"; !strings.Contains(out.String(), want) {
		t.Errorf("/proc/self/cgroup of the child:\n%s\nwant a line %q", out.String(), want)
	}

	// A live process keeps the cgroup in use.
	dir = openLeaf("child") // reused: empty again
	held := exec.Command("/bin/cat")
	stdin, err := held.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	startIn(dir, held)
	dir.Close()
	if err := m.Remove("child"); !errors.Is(err, ErrInUse) || !errors.Is(err, unix.EBUSY) {
		t.Errorf("Remove with a live process = %v, want ErrInUse and EBUSY", err)
	}
	if _, _, err := m.leaf("child"); !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), fmt.Sprint(held.Process.Pid)) {
		t.Errorf("reusing a cgroup with a live process = %v, want ErrInUse naming pid %d", err, held.Process.Pid)
	}
	stdin.Close()
	if err := held.Wait(); err != nil {
		t.Fatal(err)
	}
	if err := m.Remove("child"); err != nil {
		t.Errorf("Remove after the process exited: %v", err)
	}
	if err := m.Remove("child"); err != nil {
		t.Errorf("Remove again: %v", err)
	}
}
