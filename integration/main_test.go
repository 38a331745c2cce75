package integration

import (
	"fmt"
	"os"
	"testing"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// bins are the real binaries the tests run, built once in TestMain.
var bins struct{ agent, loop, test string }

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	paths, remove, err := testhelp.BuildBinaries("github.com/csiagent/csiagent/cmd/csi-agent",
		"github.com/csiagent/csiagent/cmd/csi-loop-plugin", "github.com/csiagent/csiagent/internal/testplugin")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer remove()
	bins.agent, bins.loop, bins.test = paths[0], paths[1], paths[2]
	if engineDir, err = os.MkdirTemp("", "csidp"); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(engineDir)
	defer stopEngines()
	return m.Run()
}
