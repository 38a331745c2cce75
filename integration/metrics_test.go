package integration

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// scraped is one scrape of /metrics, parsed.
type scraped struct {
	t    *testing.T
	fams map[string]*dto.MetricFamily
}

// scrape fetches and parses the agent's /metrics over HTTP.
func (h *harness) scrape() scraped {
	h.t.Helper()
	addr := h.a.MetricsAddr()
	if addr == "" {
		h.t.Fatal("MetricsAddr is empty: the metrics server is not running")
	}
	// No keep-alive: no client connection outlives the test (goleak).
	client := &http.Client{Timeout: waitTimeout, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Get("http://" + addr + "/metrics")
	if err != nil {
		h.t.Fatalf("scraping: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		h.t.Fatalf("scraping: %s", resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		h.t.Fatalf("parsing the scrape: %v", err)
	}
	return scraped{t: h.t, fams: fams}
}

// find returns the samples of metric name whose labels include want.
func (s scraped) find(name string, want map[string]string) []*dto.Metric {
	var out []*dto.Metric
	for _, m := range s.fams[name].GetMetric() {
		have := map[string]string{}
		for _, lp := range m.GetLabel() {
			have[lp.GetName()] = lp.GetValue()
		}
		ok := true
		for k, v := range want {
			if have[k] != v {
				ok = false
			}
		}
		if ok {
			out = append(out, m)
		}
	}
	return out
}

// value is the value of the one sample of a counter or gauge with exactly
// these labels; a missing sample fails the test.
func (s scraped) value(name string, labels map[string]string) float64 {
	s.t.Helper()
	ms := s.find(name, labels)
	if len(ms) != 1 || len(ms[0].GetLabel()) != len(labels) {
		s.t.Fatalf("%s%v: %d samples, want 1 (family: %v)", name, labels, len(ms), s.fams[name])
	}
	m := ms[0]
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	}
	s.t.Fatalf("%s%v is neither a counter nor a gauge", name, labels)
	return 0
}

// count is a counter's value, 0 when its sample does not exist yet (a
// labelled counter appears at its first increment).
func (s scraped) count(name string, labels map[string]string) float64 {
	s.t.Helper()
	if len(s.find(name, labels)) == 0 {
		return 0
	}
	return s.value(name, labels)
}

// observations is a histogram's sample count with these labels (0 when
// none yet).
func (s scraped) observations(name string, labels map[string]string) uint64 {
	s.t.Helper()
	var n uint64
	for _, m := range s.find(name, labels) {
		n += m.GetHistogram().GetSampleCount()
	}
	return n
}

// sum adds the gauges of name whose labels include these.
func (s scraped) sum(name string, labels map[string]string) float64 {
	var v float64
	for _, m := range s.find(name, labels) {
		v += m.GetGauge().GetValue()
	}
	return v
}

func (s scraped) expectType(name string, typ dto.MetricType) {
	s.t.Helper()
	f := s.fams[name]
	if f == nil {
		s.t.Errorf("metric %s is missing", name)
		return
	}
	if f.GetType() != typ {
		s.t.Errorf("metric %s is a %v, want %v", name, f.GetType(), typ)
	}
}

func rpcLabels(plugin, method, code string) map[string]string {
	return map[string]string{"plugin": plugin, "method": method, "code": code}
}

func metricsConfig(h *harness) agent.Config {
	cfg := fastConfig(h)
	cfg.MetricsAddress = "127.0.0.1:0"
	return cfg
}

// TestMetricsPlugins: plugin readiness, restarts, info, config errors,
// plugin RPCs and API calls, scraped over HTTP from a running agent; the
// server goes away with the agent.
func TestMetricsPlugins(t *testing.T) {
	h := newHarness(t)
	h.writeConfig("good.json", testPluginConfig("good", "--max-volumes-per-node=5"))
	h.writeConfig("crashy.json", testPluginConfig("crashy", "--exit-immediately"))
	h.writeConfig("bad.json", `{"type":"bad","containers":[]}`)
	h.start(metricsConfig(h))
	if addr := h.a.MetricsAddr(); !strings.HasPrefix(addr, "127.0.0.1:") || strings.HasSuffix(addr, ":0") {
		t.Fatalf("MetricsAddr = %q, want the bound 127.0.0.1 port", addr)
	}
	h.waitPlugin("good", "ready", ready)
	h.waitPlugin("crashy", "restarted twice", func(p *agentv1.Plugin) bool {
		return p != nil && len(p.Instances) == 1 && p.Instances[0].Restarts >= 2
	})

	api := h.api()
	if _, err := api.ListPlugins(context.Background(), &agentv1.ListPluginsRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := api.GetPlugin(context.Background(), &agentv1.GetPluginRequest{}); err == nil {
		t.Fatal("GetPlugin without a type succeeded")
	}

	s := h.scrape()
	for name, typ := range map[string]dto.MetricType{
		"csi_agent_plugin_ready":                 dto.MetricType_GAUGE,
		"csi_agent_plugin_restarts_total":        dto.MetricType_COUNTER,
		"csi_agent_plugin_info":                  dto.MetricType_GAUGE,
		"csi_agent_plugin_max_volumes_per_node":  dto.MetricType_GAUGE,
		"csi_agent_config_errors":                dto.MetricType_GAUGE,
		"csi_agent_csi_rpc_total":                dto.MetricType_COUNTER,
		"csi_agent_csi_rpc_duration_seconds":     dto.MetricType_HISTOGRAM,
		"csi_agent_api_requests_total":           dto.MetricType_COUNTER,
		"csi_agent_api_request_duration_seconds": dto.MetricType_HISTOGRAM,
		"csi_agent_volumes":                      dto.MetricType_GAUGE,
		"csi_agent_containers":                   dto.MetricType_GAUGE,
		"csi_agent_reclaim_runs_total":           dto.MetricType_COUNTER,
		"csi_agent_reclaim_freed_bytes":          dto.MetricType_GAUGE,
		"go_goroutines":                          dto.MetricType_GAUGE,
		"process_start_time_seconds":             dto.MetricType_GAUGE,
		"process_resident_memory_bytes":          dto.MetricType_GAUGE,
	} {
		s.expectType(name, typ)
	}

	t.Run("plugins", func(t *testing.T) {
		s := scraped{t: t, fams: s.fams}
		if v := s.value("csi_agent_plugin_ready", map[string]string{"plugin": "good"}); v != 1 {
			t.Errorf("good: ready = %v, want 1", v)
		}
		if v := s.value("csi_agent_plugin_ready", map[string]string{"plugin": "crashy"}); v != 0 {
			t.Errorf("crashy: ready = %v, want 0", v)
		}
		if v := s.value("csi_agent_plugin_restarts_total", map[string]string{"plugin": "crashy"}); v < 2 {
			t.Errorf("crashy: restarts = %v, want >= 2", v)
		}
		if v := s.value("csi_agent_plugin_restarts_total", map[string]string{"plugin": "good"}); v != 0 {
			t.Errorf("good: restarts = %v, want 0", v)
		}
		if v := s.value("csi_agent_plugin_info", map[string]string{"plugin": "good", "name": "good", "version": "0.0.1"}); v != 1 {
			t.Errorf("good: info = %v, want 1", v)
		}
		if v := s.value("csi_agent_plugin_max_volumes_per_node", map[string]string{"plugin": "good"}); v != 5 {
			t.Errorf("good: max volumes per node = %v, want 5 (its NodeGetInfo)", v)
		}
		if ms := s.find("csi_agent_plugin_info", map[string]string{"plugin": "crashy"}); len(ms) != 0 {
			t.Errorf("crashy was never discovered, yet has info %v", ms)
		}
		if v := s.value("csi_agent_config_errors", map[string]string{}); v != 1 {
			t.Errorf("config errors = %v, want 1 (bad.json)", v)
		}
	})

	t.Run("plugin RPCs", func(t *testing.T) {
		s := scraped{t: t, fams: s.fams}
		for _, method := range []string{"Probe", "GetPluginInfo", "GetPluginCapabilities", "NodeGetCapabilities", "NodeGetInfo"} {
			if v := s.count("csi_agent_csi_rpc_total", rpcLabels("good", method, "OK")); v < 1 {
				t.Errorf("good: %s OK counted %v times, want >= 1", method, v)
			}
			if n := s.observations("csi_agent_csi_rpc_duration_seconds", map[string]string{"plugin": "good", "method": method}); n < 1 {
				t.Errorf("good: %s timed %d times, want >= 1", method, n)
			}
		}
		// Discovery asks for the csi-addons identity, which testplugin
		// does not serve: the code label carries the answer.
		if v := s.count("csi_agent_csi_rpc_total", rpcLabels("good", "GetIdentity", "Unimplemented")); v != 1 {
			t.Errorf("good: GetIdentity Unimplemented counted %v times, want 1", v)
		}
		// It never calls a service whose calls may act to find out.
		if v := s.count("csi_agent_csi_rpc_total", rpcLabels("good", "NodeReclaimSpace", "Unimplemented")); v != 0 {
			t.Errorf("good: NodeReclaimSpace called %v times by discovery", v)
		}
	})

	t.Run("API", func(t *testing.T) {
		s := scraped{t: t, fams: s.fams}
		if v := s.count("csi_agent_api_requests_total", map[string]string{"method": "ListPlugins", "code": "OK"}); v != 1 {
			t.Errorf("ListPlugins OK = %v, want 1", v)
		}
		if v := s.count("csi_agent_api_requests_total", map[string]string{"method": "GetPlugin", "code": "InvalidArgument"}); v != 1 {
			t.Errorf("GetPlugin InvalidArgument = %v, want 1", v)
		}
		if n := s.observations("csi_agent_api_request_duration_seconds", map[string]string{"method": "ListPlugins"}); n != 1 {
			t.Errorf("ListPlugins timed %d times, want 1", n)
		}
	})

	t.Run("idle state", func(t *testing.T) {
		s := scraped{t: t, fams: s.fams}
		// Zeros rather than missing series for known plugins and phases.
		if v := s.value("csi_agent_volumes", map[string]string{"plugin": "good", "state": "PUBLISHED"}); v != 0 {
			t.Errorf("good: published volumes = %v", v)
		}
		if v := s.value("csi_agent_containers", map[string]string{"phase": "PREPARED"}); v != 0 {
			t.Errorf("prepared containers = %v", v)
		}
		for _, outcome := range []string{"success", "failure"} {
			if v := s.value("csi_agent_reclaim_runs_total", map[string]string{"plugin": "good", "outcome": outcome}); v != 0 {
				t.Errorf("good: reclaim %s = %v", outcome, v)
			}
		}
	})

	// Restarts only grow while the config stays.
	before := s.value("csi_agent_plugin_restarts_total", map[string]string{"plugin": "crashy"})
	h.waitPlugin("crashy", "restarted again", func(p *agentv1.Plugin) bool {
		return float64(p.Instances[0].Restarts) > before
	})
	if after := h.scrape().value("csi_agent_plugin_restarts_total", map[string]string{"plugin": "crashy"}); after <= before {
		t.Errorf("crashy: restarts %v after %v", after, before)
	}

	// The server stops with the agent.
	addr := h.a.MetricsAddr()
	h.stop()
	if got := h.a.MetricsAddr(); got != "" {
		t.Errorf("MetricsAddr after stop = %q, want empty", got)
	}
	conn, err := net.DialTimeout("tcp", addr, time.Second)
	if err == nil {
		conn.Close()
		t.Errorf("metrics address %s still accepts connections after the agent stopped", addr)
	} else if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("dialing %s after stop: %v, want connection refused", addr, err)
	}
}

// TestMetricsAddress: metrics are off by default; a bad or busy address
// fails clearly, before the agent serves anything.
func TestMetricsAddress(t *testing.T) {
	t.Run("off by default", func(t *testing.T) {
		h := newHarness(t)
		h.start(fastConfig(h))
		if addr := h.a.MetricsAddr(); addr != "" {
			t.Errorf("MetricsAddr = %q without MetricsAddress", addr)
		}
	})
	t.Run("no port", func(t *testing.T) {
		h := newHarness(t)
		cfg := fastConfig(h)
		cfg.MetricsAddress = "localhost"
		_, err := agent.New(cfg)
		if err == nil || !strings.Contains(err.Error(), `--metrics-address "localhost"`) {
			t.Errorf("New: %v, want a --metrics-address error", err)
		}
	})
	t.Run("in use", func(t *testing.T) {
		h := newHarness(t)
		busy, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer busy.Close()
		cfg := fastConfig(h)
		cfg.MetricsAddress = busy.Addr().String()
		a, err := agent.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		err = a.Run(ctx)
		want := fmt.Sprintf("--metrics-address %s: ", busy.Addr())
		if err == nil || !strings.Contains(err.Error(), want) || !errors.Is(err, syscall.EADDRINUSE) {
			t.Errorf("Run: %v, want %q... address already in use", err, want)
		}
	})
}

// TestMetricsVolumes: volume, container, RPC, API and reclaim metrics
// follow a real Prepare, reclaim and Cleanup with csi-loop-plugin.
func TestMetricsVolumes(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "vol1")
	h.start(metricsConfig(h))
	h.waitPlugin("loop", "ready", ready)

	nodeRPCs := []string{"NodeStageVolume", "NodePublishVolume", "NodeUnpublishVolume", "NodeUnstageVolume", "NodeReclaimSpace"}
	rpcs := func(s scraped) map[string]float64 {
		out := map[string]float64{}
		for _, m := range nodeRPCs {
			out[m] = s.count("csi_agent_csi_rpc_total", rpcLabels("loop", m, "OK"))
		}
		return out
	}
	// diff is how many OK calls of each node RPC happened in between.
	diff := func(before, after map[string]float64) map[string]float64 {
		out := map[string]float64{}
		for m := range after {
			if d := after[m] - before[m]; d != 0 {
				out[m] = d
			}
		}
		return out
	}
	expect := func(what string, got map[string]float64, want map[string]float64) {
		t.Helper()
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("%s: OK node RPCs %v, want %v", what, got, want)
		}
	}

	s0 := h.scrape()
	if v := s0.sum("csi_agent_volumes", map[string]string{"plugin": "loop"}); v != 0 {
		t.Fatalf("volumes before Prepare = %v", v)
	}

	sb := h.dir("sandbox")
	h.mustPrepare("c1", sb, "", volumeSpec{plugin: "loop", id: "vol1", path: "data"})
	s1 := h.scrape()
	if v := s1.value("csi_agent_volumes", map[string]string{"plugin": "loop", "state": "PUBLISHED"}); v != 1 {
		t.Errorf("after Prepare: published volumes = %v, want 1", v)
	}
	if v := s1.sum("csi_agent_volumes", map[string]string{"plugin": "loop"}); v != 1 {
		t.Errorf("after Prepare: volumes = %v, want 1", v)
	}
	if v := s1.value("csi_agent_containers", map[string]string{"phase": "PREPARED"}); v != 1 {
		t.Errorf("after Prepare: prepared containers = %v, want 1", v)
	}
	expect("Prepare", diff(rpcs(s0), rpcs(s1)), map[string]float64{"NodeStageVolume": 1, "NodePublishVolume": 1})
	if v := s1.count("csi_agent_api_requests_total", map[string]string{"method": "Prepare", "code": "OK"}); v != 1 {
		t.Errorf("api Prepare OK = %v, want 1", v)
	}
	if n := s1.observations("csi_agent_api_request_duration_seconds", map[string]string{"method": "Prepare"}); n != 1 {
		t.Errorf("api Prepare timed %d times, want 1", n)
	}
	if n := s1.observations("csi_agent_csi_rpc_duration_seconds", map[string]string{"plugin": "loop", "method": "NodeStageVolume"}); n != 1 {
		t.Errorf("NodeStageVolume timed %d times, want 1", n)
	}

	msgs, err := h.reclaimNow(&agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}})
	if err != nil || len(msgs) != 2 || msgs[1].GetSummary().GetVolumes() != 1 {
		t.Fatalf("reclaim: %v, %v", msgs, err)
	}
	s2 := h.scrape()
	expect("reclaim", diff(rpcs(s1), rpcs(s2)), map[string]float64{"NodeReclaimSpace": 1})
	if v := s2.value("csi_agent_reclaim_runs_total", map[string]string{"plugin": "loop", "outcome": "success"}); v != 1 {
		t.Errorf("reclaim successes = %v, want 1", v)
	}
	if v := s2.value("csi_agent_reclaim_runs_total", map[string]string{"plugin": "loop", "outcome": "failure"}); v != 0 {
		t.Errorf("reclaim failures = %v, want 0", v)
	}
	freed := s2.value("csi_agent_reclaim_freed_bytes", map[string]string{"plugin": "loop"})
	if want := msgs[1].GetSummary().GetBytesFreed(); freed != float64(want) {
		t.Errorf("reclaim freed bytes = %v, want %d as the summary says", freed, want)
	}
	if v := s2.count("csi_agent_api_requests_total", map[string]string{"method": "ReclaimSpace", "code": "OK"}); v != 1 {
		t.Errorf("api ReclaimSpace OK = %v, want 1", v)
	}

	h.mustCleanup("c1")
	s3 := h.scrape()
	if v := s3.sum("csi_agent_volumes", map[string]string{"plugin": "loop"}); v != 0 {
		var states []string
		for _, m := range s3.find("csi_agent_volumes", map[string]string{"plugin": "loop"}) {
			if m.GetGauge().GetValue() != 0 {
				states = append(states, m.String())
			}
		}
		sort.Strings(states)
		t.Errorf("after Cleanup: volumes = %v (%v), want none", v, states)
	}
	if v := s3.sum("csi_agent_containers", nil); v != 0 {
		t.Errorf("after Cleanup: containers = %v, want 0", v)
	}
	expect("Cleanup", diff(rpcs(s2), rpcs(s3)), map[string]float64{"NodeUnpublishVolume": 1, "NodeUnstageVolume": 1})
	if v := s3.count("csi_agent_api_requests_total", map[string]string{"method": "Cleanup", "code": "OK"}); v != 1 {
		t.Errorf("api Cleanup OK = %v, want 1", v)
	}
	h.assertClean(pool)
}
