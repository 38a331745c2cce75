package mount_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	"github.com/csiagent/csiagent/mount"
)

// TestCloneTreeNosuidNodev: a container mount (CloneTree, then MoveTree)
// is nosuid and nodev, its submounts too, even when the source is neither;
// a device node bound as a file (a block volume) is nosuid but not nodev,
// so it still opens.
func TestCloneTreeNosuidNodev(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	src, sub, root := filepath.Join(base, "src"), filepath.Join(base, "src", "sub"), filepath.Join(base, "rootfs")
	for _, d := range []string{src, root} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// The source allows setuid and devices: the clone must not.
	if err := mount.Mount("tmpfs", src, "tmpfs", []string{"size=1m"}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unmountAll(t, src) })
	if err := os.Mkdir(sub, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := mount.Mount("tmpfs", sub, "tmpfs", []string{"size=1m"}); err != nil {
		t.Fatal(err)
	}
	// /dev/null's numbers, on the source's tmpfs.
	null := filepath.Join(src, "null")
	if err := unix.Mknod(null, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	for _, opt := range []string{"nosuid", "nodev"} {
		if m, _, _ := mount.Lookup(src); m == nil || mount.HasOption(m.Options, opt) {
			t.Fatalf("source mount %+v: want it without %s", m, opt)
		}
	}

	for _, ro := range []bool{false, true} {
		h, target := resolve(t, root, map[bool]string{false: "/rw", true: "/ro"}[ro], mount.Directory)
		tree, err := mount.CloneTree(src, ro)
		if err != nil {
			t.Fatal(err)
		}
		err = mount.MoveTree(tree, h)
		tree.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range []string{target, filepath.Join(target, "sub")} {
			m, ok, err := mount.Lookup(p)
			if err != nil || !ok {
				t.Fatalf("%s: Lookup = %v, %v", p, ok, err)
			}
			for _, opt := range []string{"nosuid", "nodev"} {
				if !mount.HasOption(m.Options, opt) {
					t.Errorf("container mount %s (read-only %v): options %q lack %s", p, ro, m.Options, opt)
				}
			}
			if mount.HasOption(m.Options, "ro") != ro {
				t.Errorf("container mount %s: options %q, want read-only %v", p, m.Options, ro)
			}
		}
		// nodev: the device node in the volume does not open.
		if f, err := os.OpenFile(filepath.Join(target, "null"), os.O_WRONLY, 0); err == nil {
			f.Close()
			t.Errorf("a device node in a container mount opened: the mount is not nodev")
		}
		unmountAll(t, target)
	}

	// A block volume: the device node itself is the clone's root.
	h, target := resolve(t, root, "/dev/vol", mount.File)
	tree, err := mount.CloneTree(null, false)
	if err != nil {
		t.Fatal(err)
	}
	err = mount.MoveTree(tree, h)
	tree.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer unmountAll(t, target)
	m, ok, err := mount.Lookup(target)
	if err != nil || !ok {
		t.Fatalf("%s: Lookup = %v, %v", target, ok, err)
	}
	if !mount.HasOption(m.Options, "nosuid") || mount.HasOption(m.Options, "nodev") {
		t.Errorf("block volume mount: options %q, want nosuid without nodev", m.Options)
	}
	f, err := os.OpenFile(target, os.O_WRONLY, 0)
	if err != nil {
		t.Fatalf("the bound device node does not open: %v", err)
	}
	if _, err := f.Write([]byte("x")); err != nil {
		t.Errorf("writing to the bound device: %v", err)
	}
	f.Close()
}

// TestCloneTreePrivate: a container mount of a shared source (every mount
// on a host whose / is shared) is private: it joins no peer group, and a
// mount made beneath it (by a container with CAP_SYS_ADMIN) reaches neither
// the source nor another container's copy, nor does one made beneath the
// source reach the copies. Before, the copies were the source's peers.
func TestCloneTreePrivate(t *testing.T) {
	testhelp.NeedRoot(t)
	base := testhelp.LeakCheckedDir(t)
	src, root := filepath.Join(base, "src"), filepath.Join(base, "rootfs")
	mkdirs(t, src, root)
	mountTmpfs(t, src)
	t.Cleanup(func() { unmountAll(t, src) })
	must(t, unix.Mount("", src, "", unix.MS_SHARED, ""))
	mkdirs(t, filepath.Join(src, "sub"))

	var copies []string
	for _, name := range []string{"/a", "/b"} {
		h, target := resolve(t, root, name, mount.Directory)
		tree, err := mount.CloneTree(src, false)
		must(t, err)
		err = mount.MoveTree(tree, h)
		tree.Close()
		must(t, err)
		t.Cleanup(func() { unmountAll(t, target) })
		m, ok, err := mount.Lookup(target)
		if err != nil || !ok {
			t.Fatalf("%s: Lookup = %v, %v", target, ok, err)
		}
		if strings.Contains(m.Optional, "shared:") || strings.Contains(m.Optional, "master:") {
			t.Errorf("container mount %s: propagation %q, want private", target, m.Optional)
		}
		copies = append(copies, target)
	}
	// A container mounts beneath its copy.
	mountTmpfs(t, filepath.Join(copies[0], "sub"))
	for _, p := range []string{filepath.Join(src, "sub"), filepath.Join(copies[1], "sub")} {
		if ok, err := mount.IsMountPoint(p); err != nil || ok {
			t.Errorf("a mount beneath one container's copy shows at %s (%v, %v)", p, ok, err)
		}
	}
	unmountAll(t, filepath.Join(copies[0], "sub"))
	// The host mounts beneath the source.
	mountTmpfs(t, filepath.Join(src, "sub"))
	for _, p := range copies {
		if ok, err := mount.IsMountPoint(filepath.Join(p, "sub")); err != nil || ok {
			t.Errorf("a mount beneath the source shows in the copy %s (%v, %v)", p, ok, err)
		}
	}
}
