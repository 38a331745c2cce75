package integration

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// bins are the real binaries the tests run, built once in TestMain.
var bins struct{ agent, loop, test string }

// binsEnv hands bins to a test binary a test runs.
const binsEnv = "CSIAGENT_TEST_BINS"

// binsEnvValue is binsEnv's value for this process's bins.
func binsEnvValue() string {
	return binsEnv + "=" + strings.Join([]string{bins.agent, bins.loop, bins.test}, string(os.PathListSeparator))
}

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	if b := os.Getenv(binsEnv); b != "" {
		// A test binary run by a test (the crash-state workload): the
		// binaries are its parent's.
		paths := strings.Split(b, string(os.PathListSeparator))
		if len(paths) != 3 {
			fmt.Fprintf(os.Stderr, "%s=%q: want three paths\n", binsEnv, b)
			return 1
		}
		bins.agent, bins.loop, bins.test = paths[0], paths[1], paths[2]
		return m.Run()
	}
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
