package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/volumestats"
)

// Bounds of the metrics HTTP server: a scrape is small and local, so a
// slow or stuck client is cut off rather than allowed to hold a
// connection.
const (
	metricsReadHeaderTimeout = 5 * time.Second
	metricsReadTimeout       = 10 * time.Second
	metricsWriteTimeout      = 30 * time.Second
	metricsIdleTimeout       = time.Minute
	// metricsGatherTimeout bounds one scrape's collection (below the
	// write timeout, so the client gets a 503 rather than a cut
	// connection).
	metricsGatherTimeout = 20 * time.Second
	// metricsMaxInFlight scrapes at once; more get 503.
	metricsMaxInFlight = 4
)

// latencyBuckets are the histogram buckets, in seconds, of plugin RPCs
// and API calls: from a quick Probe to a node step that runs into its
// deadline (--node-rpc-timeout, 2 min) or a reclaim (--reclaim-timeout,
// 10 min).
func latencyBuckets() []float64 {
	return []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}
}

// metrics is the agent's Prometheus registry and the instruments updated
// on the hot path (gRPC interceptors). Everything else is read from the
// agent's state at scrape time by stateCollector.
type metrics struct {
	reg         *prometheus.Registry
	rpcTotal    *prometheus.CounterVec
	rpcDuration *prometheus.HistogramVec
	apiTotal    *prometheus.CounterVec
	apiDuration *prometheus.HistogramVec
	repairs     *prometheus.CounterVec
	// keyRotations counts scheduled EncryptionKeyRotate calls.
	keyRotations *prometheus.CounterVec

	mu   sync.Mutex
	addr net.Addr // bound address while serving
}

func newMetrics(a *Agent) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		rpcTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "csi_agent_csi_rpc_total",
			Help: "RPCs the agent made to CSI plugins (CSI and csi-addons services), by plugin type, RPC name and gRPC status code.",
		}, []string{"plugin", "method", "code"}),
		rpcDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "csi_agent_csi_rpc_duration_seconds",
			Help:    "Latency of RPCs the agent made to CSI plugins, by plugin type and RPC name.",
			Buckets: latencyBuckets(),
		}, []string{"plugin", "method"}),
		apiTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "csi_agent_api_requests_total",
			Help: "Finished calls of the agent API (unary and streaming), by method and gRPC status code.",
		}, []string{"method", "code"}),
		apiDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "csi_agent_api_request_duration_seconds",
			Help:    "Latency of unary agent API calls (Prepare, Cleanup, ...), by method.",
			Buckets: latencyBuckets(),
		}, []string{"method"}),
		repairs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "csi_agent_volume_repairs_total",
			Help: "Repairs of published volumes whose target path was found not mounted (republished, re-bound into containers), by plugin type and result (repaired, failed).",
		}, []string{"plugin", "result"}),
		keyRotations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "csi_agent_scheduled_key_rotations_total",
			Help: "Scheduled csi-addons EncryptionKeyRotate calls (retries included), by plugin type and gRPC status code.",
		}, []string{"plugin", "code"}),
	}
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		m.rpcTotal, m.rpcDuration, m.apiTotal, m.apiDuration, m.repairs, m.keyRotations,
		newStateCollector(a),
		clusterCollector{a.clusterStats},
		volumestats.NewCollector(a.stats),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "csi_agent_checkpoint_writes_total",
			Help: "Checkpoint writes of volumes and containers (a checksummed version in a free slot of the record: visible at once, durable with the next commit round).",
		}, func() float64 { w, _, _ := a.iso.CheckpointStats(); return float64(w) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "csi_agent_checkpoint_fsyncs_total",
			Help: "fsync calls of checkpoint commit rounds; one round makes every change since the previous one durable.",
		}, func() float64 { _, f, _ := a.iso.CheckpointStats(); return float64(f) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "csi_agent_records_corrupt_total",
			Help: "Record files found corrupt at start (torn, damaged, or holding another record's frame): each kept under <work-dir>/corrupt/, its container quarantined or its volume rebuilt.",
		}, func() float64 { return float64(a.iso.CorruptRecords()) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "csi_agent_removals_failed_total",
			Help: "Removals after a cleanup's answer that failed: a torn-down volume's mount directories that something was mounted or written in since (left in place; with claims no record names them any more), or a record (the next start finishes its cleanup). The log's error says which.",
		}, func() float64 { return float64(a.iso.RemovalsFailed()) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "csi_agent_checkpoint_pending",
			Help: "Checkpoint changes (writes, removals) visible but not yet durable, and removals of the records and volume directories a cleanup left that are not made yet.",
		}, func() float64 { _, _, p := a.iso.CheckpointStats(); return float64(p) }),
	)
	return m
}

// clientInterceptor counts and times every unary RPC on a connection to
// the plugin of type plugin. (CSI's only streaming RPCs, the snapshot
// metadata service, are not called by the agent.)
func (m *metrics) clientInterceptor(plugin string) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, fullMethod string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		start := time.Now()
		err := invoker(ctx, fullMethod, req, reply, cc, opts...)
		method := methodName(fullMethod)
		m.rpcDuration.WithLabelValues(plugin, method).Observe(time.Since(start).Seconds())
		m.rpcTotal.WithLabelValues(plugin, method, codeOf(err)).Inc()
		return err
	}
}

// serverInterceptor counts and times unary API calls. It runs before
// authorization, so refused callers are counted (PermissionDenied).
func (m *metrics) serverInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := handler(ctx, req)
	method := methodName(info.FullMethod)
	m.apiDuration.WithLabelValues(method).Observe(time.Since(start).Seconds())
	m.apiTotal.WithLabelValues(method, codeOf(err)).Inc()
	return resp, err
}

// serverStreamInterceptor counts streaming API calls when they end. Their
// duration is not observed: a watch lasts as long as its client wants.
func (m *metrics) serverStreamInterceptor(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	err := handler(srv, ss)
	m.apiTotal.WithLabelValues(methodName(info.FullMethod), codeOf(err)).Inc()
	return err
}

// methodName is the RPC name of "/package.Service/Method". RPC names are
// unique across the CSI and csi-addons services the agent calls (CSI
// prefixes them: NodeGetCapabilities, ControllerGetCapabilities, ...).
func methodName(fullMethod string) string {
	for i := len(fullMethod) - 1; i >= 0; i-- {
		if fullMethod[i] == '/' {
			return fullMethod[i+1:]
		}
	}
	return fullMethod
}

// codeOf is the gRPC status code a call ended with, as its client sees it
// (a bare context error becomes Canceled or DeadlineExceeded, any other
// non-status error Unknown).
func codeOf(err error) string {
	s, ok := status.FromError(err)
	if !ok {
		s = status.FromContextError(err)
	}
	return s.Code().String()
}

// MetricsAddr is the address the metrics server listens on ("" when
// Config.MetricsAddress is empty or Run has not started it): with port 0
// in the config, the port the kernel picked.
func (a *Agent) MetricsAddr() string {
	a.metrics.mu.Lock()
	defer a.metrics.mu.Unlock()
	if a.metrics.addr == nil {
		return ""
	}
	return a.metrics.addr.String()
}

// startMetrics serves /metrics on Config.MetricsAddress, if set. The
// returned stop shuts the server down gracefully (in-flight scrapes get
// the shutdown timeout) and waits for it. A listen error is returned; a
// later serving error is logged, as it should not take volumes down.
func (a *Agent) startMetrics(context.Context) (stop func(), err error) {
	if a.cfg.MetricsAddress == "" {
		return func() {}, nil
	}
	lis, err := net.Listen("tcp", a.cfg.MetricsAddress)
	if err != nil {
		return nil, fmt.Errorf("--metrics-address %s: %w", a.cfg.MetricsAddress, err)
	}
	errLog := slog.NewLogLogger(a.log.Handler(), slog.LevelError)
	handler := promhttp.InstrumentMetricHandler(a.metrics.reg, promhttp.HandlerFor(a.metrics.reg, promhttp.HandlerOpts{
		ErrorLog:            errLog,
		ErrorHandling:       promhttp.ContinueOnError,
		MaxRequestsInFlight: metricsMaxInFlight,
		Timeout:             metricsGatherTimeout,
	}))
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", handler)
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: metricsReadHeaderTimeout,
		ReadTimeout:       metricsReadTimeout,
		WriteTimeout:      metricsWriteTimeout,
		IdleTimeout:       metricsIdleTimeout,
		MaxHeaderBytes:    16 << 10,
		ErrorLog:          errLog,
	}
	a.metrics.mu.Lock()
	a.metrics.addr = lis.Addr()
	a.metrics.mu.Unlock()
	a.log.Info("serving metrics", "address", "http://"+lis.Addr().String()+"/metrics")
	stopServer := a.serveHTTP(srv, lis, "metrics")
	return func() {
		stopServer()
		a.metrics.mu.Lock()
		a.metrics.addr = nil
		a.metrics.mu.Unlock()
	}, nil
}

// stateCollector reads plugins, volumes, containers and reclaim totals
// from the agent at scrape time, so that nothing on the hot path has to
// keep gauges in step with the state.
type stateCollector struct {
	a *Agent

	pluginReady, pluginRestarts, pluginInfo, configErrors *prometheus.Desc
	volumes, containers                                   *prometheus.Desc
	reclaimRuns, reclaimFreed                             *prometheus.Desc
	maxVolumes                                            *prometheus.Desc
}

var _ prometheus.Collector = (*stateCollector)(nil)

func newStateCollector(a *Agent) *stateCollector {
	return &stateCollector{
		a: a,
		pluginReady: prometheus.NewDesc("csi_agent_plugin_ready",
			"1 when every instance of the plugin is READY (probed and discovered), else 0.",
			[]string{"plugin"}, nil),
		pluginRestarts: prometheus.NewDesc("csi_agent_plugin_restarts_total",
			"Restarts of the plugin's managed processes since the agent began supervising its current config (a config change or agent restart resets it).",
			[]string{"plugin"}, nil),
		pluginInfo: prometheus.NewDesc("csi_agent_plugin_info",
			"Always 1: the name and vendor version the plugin's instances report in GetPluginInfo.",
			[]string{"plugin", "name", "version"}, nil),
		configErrors: prometheus.NewDesc("csi_agent_config_errors",
			"Files in the plugin config directory that are invalid and not (or no longer) applied.",
			nil, nil),
		volumes: prometheus.NewDesc("csi_agent_volumes",
			"Volumes the agent tracks, by plugin type and state (PUBLISHED: in use by containers).",
			[]string{"plugin", "state"}, nil),
		containers: prometheus.NewDesc("csi_agent_containers",
			"Containers with volumes, by phase.",
			[]string{"phase"}, nil),
		reclaimRuns: prometheus.NewDesc("csi_agent_reclaim_runs_total",
			"Finished reclaim-space runs (scheduled and on demand) since the agent started, by plugin type and outcome (success or failure).",
			[]string{"plugin", "outcome"}, nil),
		maxVolumes: prometheus.NewDesc("csi_agent_plugin_max_volumes_per_node",
			"The volumes the plugin allows published on this node (NodeGetInfo max_volumes_per_node; 0: no limit), which the agent enforces.",
			[]string{"plugin"}, nil),
		// A gauge, not a counter: a run where usage grew counts negative.
		reclaimFreed: prometheus.NewDesc("csi_agent_reclaim_freed_bytes",
			"Net bytes freed by successful reclaim-space runs since the agent started (usage before minus after, summed): a gauge because a run during which usage grew subtracts.",
			[]string{"plugin"}, nil),
	}
}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.pluginReady, c.pluginRestarts, c.pluginInfo, c.configErrors, c.volumes, c.containers, c.reclaimRuns, c.reclaimFreed, c.maxVolumes} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	plugins, fileErrs := c.a.snapshot()
	ch <- prometheus.MustNewConstMetric(c.configErrors, prometheus.GaugeValue, float64(len(fileErrs)))

	// Every state of every known plugin, zeros included, so that a series
	// drops to 0 rather than vanishing.
	volumes := map[[2]string]int{}
	for _, p := range plugins {
		for _, state := range statev1.VolumeCheckpoint_State_name {
			if state != statev1.VolumeCheckpoint_UNKNOWN.String() {
				volumes[[2]string{p.GetType(), state}] = 0
			}
		}
	}
	for _, v := range c.a.iso.ListVolumes() {
		volumes[[2]string{v.Plugin, v.State.String()}]++
	}
	for k, n := range volumes {
		ch <- prometheus.MustNewConstMetric(c.volumes, prometheus.GaugeValue, float64(n), k[0], k[1])
	}

	phases := map[string]int{}
	for _, phase := range statev1.ContainerCheckpoint_Phase_name {
		if phase != statev1.ContainerCheckpoint_PHASE_UNKNOWN.String() {
			phases[phase] = 0
		}
	}
	for _, ct := range c.a.iso.ListContainers() {
		phases[ct.Phase.String()]++
	}
	for phase, n := range phases {
		ch <- prometheus.MustNewConstMetric(c.containers, prometheus.GaugeValue, float64(n), phase)
	}

	for _, p := range plugins {
		typ := p.GetType()
		readyVal := 0.0
		if p.GetState() == agentv1.PluginState_PLUGIN_STATE_READY {
			readyVal = 1
		}
		ch <- prometheus.MustNewConstMetric(c.pluginReady, prometheus.GaugeValue, readyVal, typ)
		var restarts uint64
		var maxVolumes int64
		infos := map[[2]string]bool{}
		for _, in := range p.GetInstances() {
			restarts += uint64(in.GetRestarts())
			maxVolumes = max(maxVolumes, in.GetMaxVolumesPerNode())
			// Known once the instance has been discovered.
			if in.GetPluginName() != "" {
				infos[[2]string{in.GetPluginName(), in.GetVendorVersion()}] = true
			}
		}
		ch <- prometheus.MustNewConstMetric(c.pluginRestarts, prometheus.CounterValue, float64(restarts), typ)
		ch <- prometheus.MustNewConstMetric(c.maxVolumes, prometheus.GaugeValue, float64(maxVolumes), typ)
		for k := range infos {
			ch <- prometheus.MustNewConstMetric(c.pluginInfo, prometheus.GaugeValue, 1, typ, k[0], k[1])
		}
		// The snapshot carries the scheduler's Totals for the plugin.
		t := p.GetReclaim()
		ch <- prometheus.MustNewConstMetric(c.reclaimRuns, prometheus.CounterValue, float64(t.GetRuns()-t.GetFailures()), typ, "success")
		ch <- prometheus.MustNewConstMetric(c.reclaimRuns, prometheus.CounterValue, float64(t.GetFailures()), typ, "failure")
		ch <- prometheus.MustNewConstMetric(c.reclaimFreed, prometheus.GaugeValue, float64(t.GetBytesReclaimed()), typ)
	}
}
