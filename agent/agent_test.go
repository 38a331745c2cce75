package agent

import (
	"strings"
	"testing"
)

// TestNewRefusesBadConfig: a config the daemon cannot run with is refused
// by New, naming what is wrong, before anything is created.
func TestNewRefusesBadConfig(t *testing.T) {
	dir := t.TempDir()
	good := func() Config {
		return Config{ConfigDir: dir + "/plugins.d", WorkDir: dir + "/work", RuntimeDir: dir + "/run", NodeID: "node-1", APIGroup: -1}
	}
	for _, c := range []struct {
		name   string
		change func(*Config)
		want   string
	}{
		{"relative work dir", func(c *Config) { c.WorkDir = "work" }, `--work-dir "work": must be an absolute path`},
		{"relative runtime dir", func(c *Config) { c.RuntimeDir = "run" }, `--runtime-dir "run": must be an absolute path`},
		{"relative config dir", func(c *Config) { c.ConfigDir = "plugins.d" }, `--csi-plugin-config-dir "plugins.d": must be an absolute path`},
		{"no node id", func(c *Config) { c.NodeID = "" }, "node id is empty"},
		{"metrics address without a port", func(c *Config) { c.MetricsAddress = "localhost" }, `--metrics-address "localhost"`},
		{"debug address without a port", func(c *Config) { c.DebugAddress = "127.0.0.1" }, `--debug-address "127.0.0.1"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := good()
			c.change(&cfg)
			if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("New: %v, want an error with %q", err, c.want)
			}
		})
	}
	a, err := New(good())
	if err != nil {
		t.Fatalf("New with a good config: %v", err)
	}
	if a.cfg.APISocket != dir+"/run/agent.sock" || a.cfg.ShutdownTimeout != DefaultShutdownTimeout || a.cfg.ReclaimMaxConcurrent != DefaultReclaimMaxConcurrent {
		t.Errorf("defaults not set: socket %q, shutdown %v, reclaims %d", a.cfg.APISocket, a.cfg.ShutdownTimeout, a.cfg.ReclaimMaxConcurrent)
	}
}
