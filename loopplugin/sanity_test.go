package loopplugin

import (
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	"github.com/csiagent/csiagent/internal/testhelp"
)

// TestSanity runs the kubernetes-csi sanity suite (identity, controller and
// node) against the plugin over its unix socket, once with mount access and
// once with block access, on real loop devices and mounts. Ginkgo allows one
// RunSpecs per process, so both runs are registered in one suite.
func TestSanity(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelWarn)
	var contexts []*sanity.TestContext
	for _, accessType := range []string{"mount", "block"} {
		cfg := sanity.NewTestConfig()
		cfg.Address = "unix://" + e.sock
		cfg.TargetPath = filepath.Join(e.dir, accessType+"-target")
		cfg.StagingPath = filepath.Join(e.dir, accessType+"-staging")
		cfg.TestVolumeAccessType = accessType
		cfg.TestVolumeSize = 64 << 20 // sparse either way; keeps mkfs quick
		ginkgo.Describe("access type "+accessType, func() {
			contexts = append(contexts, sanity.GinkgoTest(&cfg))
		})
	}
	gomega.RegisterFailHandler(ginkgo.Fail)
	suite, reporter := ginkgo.GinkgoConfiguration()
	reporter.Succinct = true
	reporter.NoColor = true
	ginkgo.RunSpecs(t, "CSI sanity: loop plugin", suite, reporter)
	for _, sc := range contexts {
		sc.Finalize()
	}
}
