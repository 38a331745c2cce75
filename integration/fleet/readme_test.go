package fleet

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// TestReadmeManyHosts runs README.md's blocks marked "walkthrough:
// fleet" (the README walkthrough, on one host, leaves them to this test)
// as typed, in order, on node-b of a fleet in the state the README
// describes: node-a died holding the claim on a volume its container
// "web" uses. Each block runs with "bash -e" in a mount namespace of its
// own whose /run/csi-agent is node-b's runtime dir, so that csi-agent
// finds node-b's agent at its default socket, with the built csi-agent
// first in PATH.
func TestReadmeManyHosts(t *testing.T) {
	blocks, err := testhelp.ReadmeBlocks("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	var fleetBlocks []testhelp.ReadmeBlock
	for _, b := range blocks {
		if b.Mark == "fleet" {
			fleetBlocks = append(fleetBlocks, b)
		}
	}
	if len(fleetBlocks) == 0 {
		t.Fatal("README.md has no block marked \"walkthrough: fleet\"")
	}
	f := newFleet(t, 3)
	f.createVolume("db")
	a, b := f.hosts[0], f.hosts[1]
	a.mustPrepare("web", volume("db", rwo))
	a.kill()
	f.waitFor("node-a listed down", func() bool { return !b.alive("node-a") })
	path := filepath.Dir(bins.agent) + ":" + os.Getenv("PATH")
	for _, blk := range fleetBlocks {
		script := "mount -t tmpfs tmpfs /run && mkdir /run/csi-agent && mount --bind " + b.run + " /run/csi-agent && exec bash -e -o pipefail -c \"$0\""
		cmd := exec.Command("unshare", "--mount", "--propagation", "private", "bash", "-e", "-c", script, blk.Text)
		cmd.Env = append(os.Environ(), "PATH="+path)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("README.md:%d: %v\n%s\noutput:\n%s", blk.Line, err, blk.Text, out)
		}
		t.Logf("README.md:%d: ok\n%s", blk.Line, out)
		if !strings.Contains(blk.Text, "cluster nodes") {
			continue
		}
		for _, want := range []string{"node-a", "node-b", "node-c"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("README.md:%d: csi-agent cluster nodes does not list %s:\n%s", blk.Line, want, out)
			}
		}
	}
	if got := b.holders("db"); got != "" {
		t.Errorf("after the README's release, volume db is held by %q", got)
	}
	// node-a comes back (it was not in fact down: on one machine its
	// mounts stayed) and its container leaves; then node-b gets the
	// volume.
	a.start()
	a.mustCleanup("web")
	b.mustPrepare("web", volume("db", rwo))
	b.mustCleanup("web")
}
