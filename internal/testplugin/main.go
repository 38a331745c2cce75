package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log"
	"maps"
	"net"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"

	ekr "github.com/csiagent/csiagent/proto/encryptionkeyrotation"
	"github.com/csiagent/csiagent/proto/reclaimspace"
)

const (
	defaultName = "test.csi.csiagent.io"
	version     = "0.0.1"
	// gracePeriod bounds GracefulStop after SIGTERM; then the server
	// stops hard.
	gracePeriod = 5 * time.Second
	// envPrefix selects the extra environment variables reported on
	// stdout.
	envPrefix = "TESTPLUGIN_"
)

// Exit statuses.
const (
	exitOK      = 0
	exitServe   = 1
	exitUsage   = 2
	exitCrashed = 3
)

// config is what the flags ask for; see doc.go.
type config struct {
	name string
	// maxVolumes and topologyHost are NodeGetInfo's max_volumes_per_node
	// and accessible topology (topology.test.csiagent.io/host), if set.
	maxVolumes      int64
	topologyHost    string
	controller      bool
	reclaim         bool
	keyRotation     bool
	dataDir         string
	startDelay      time.Duration
	crashAfter      time.Duration
	exitImmediately bool
	probeNotReady   int
	probeFail       bool
	probeHang       bool
	probeFailFile   string
	hangInfo        bool
	reclaimHang     bool
	// requireStageSecrets and requirePublishSecrets map each key to
	// the value the call's secrets must hold.
	requireStageSecrets   map[string]string
	requirePublishSecrets map[string]string
	failStageFile         string
	failPublishFile       string
	liePublish            bool
	// targetMustExist: NodePublishVolume refuses a target that does not
	// exist (a plugin that is not CSI v1 compliant: Mesos's
	// target_path_exists).
	targetMustExist      bool
	publishMisbehaveFile string
}

// secretsFlag collects repeated KEY=VALUE arguments into m. A key given
// twice is reported after parsing, by key: the flag package's own errors
// would quote the value.
type secretsFlag struct {
	m   map[string]string
	dup []string
}

func (f *secretsFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return errors.New("want KEY=VALUE")
	}
	if _, seen := f.m[k]; seen {
		f.dup = append(f.dup, k)
	}
	f.m[k] = v
	return nil
}

// String lists the keys only.
func (f *secretsFlag) String() string {
	if f == nil {
		return ""
	}
	return strings.Join(slices.Sorted(maps.Keys(f.m)), ",")
}

func main() {
	os.Exit(run(os.Args, os.Stdout, os.Stderr))
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	stageSecrets := &secretsFlag{m: map[string]string{}}
	publishSecrets := &secretsFlag{m: map[string]string{}}
	fs := flag.NewFlagSet("testplugin", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.name, "name", defaultName, "plugin name reported by GetPluginInfo")
	fs.Int64Var(&c.maxVolumes, "max-volumes-per-node", 0, "NodeGetInfo's max_volumes_per_node (0: none)")
	fs.StringVar(&c.topologyHost, "topology-host", "", "NodeGetInfo's accessible topology: "+topologyKey+"=`VALUE`")
	fs.BoolVar(&c.controller, "controller", false, "advertise CONTROLLER_SERVICE and serve ControllerGetCapabilities")
	fs.BoolVar(&c.reclaim, "reclaim", false, "serve csi-addons reclaimspace.ReclaimSpaceNode")
	fs.BoolVar(&c.keyRotation, "key-rotation", false, "serve csi-addons encryptionkeyrotation.EncryptionKeyRotationController")
	fs.StringVar(&c.dataDir, "data-dir", "", "serve node stage/publish with bind mounts of `DIR`/<volume id> (root only)")
	fs.DurationVar(&c.startDelay, "start-delay", 0, "sleep this long before listening (slow start)")
	fs.DurationVar(&c.crashAfter, "crash-after", 0, "exit with status 3 after serving this long")
	fs.BoolVar(&c.exitImmediately, "exit-immediately", false, "exit with status 3 at start (crash loop)")
	fs.IntVar(&c.probeNotReady, "probe-not-ready", 0, "the first `N` Probe calls that would succeed report ready=false")
	fs.BoolVar(&c.probeFail, "probe-fail", false, "Probe fails with Unavailable")
	fs.BoolVar(&c.probeHang, "probe-hang", false, "Probe blocks until its context ends")
	fs.StringVar(&c.probeFailFile, "probe-fail-file", "", "Probe fails with Unavailable while `FILE` exists")
	fs.BoolVar(&c.hangInfo, "hang-info", false, "GetPluginInfo blocks until its context ends")
	fs.BoolVar(&c.reclaimHang, "reclaim-hang", false, "NodeReclaimSpace (of a named volume) blocks until its context ends")
	fs.Var(stageSecrets, "require-stage-secret", "NodeStageVolume fails with Unauthenticated unless its secrets map `KEY=VALUE` (repeatable)")
	fs.Var(publishSecrets, "require-publish-secret", "NodePublishVolume fails with Unauthenticated unless its secrets map `KEY=VALUE` (repeatable)")
	fs.StringVar(&c.failStageFile, "fail-stage-file", "", "NodeStageVolume fails while `FILE` exists, with the gRPC code named in it (empty: Internal)")
	fs.StringVar(&c.failPublishFile, "fail-publish-file", "", "NodePublishVolume fails while `FILE` exists, with the gRPC code named in it (empty: Internal)")
	fs.BoolVar(&c.liePublish, "lie-publish", false, "NodePublishVolume reports success without mounting anything")
	fs.BoolVar(&c.targetMustExist, "target-must-exist", false, "NodePublishVolume fails with FailedPrecondition when target_path does not exist (the CO must make it)")
	fs.StringVar(&c.publishMisbehaveFile, "publish-misbehave-file", "", "while `FILE` exists, NodePublishVolume misbehaves as it says: hang, die, oversized, malformed or lie")
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: CSI_ENDPOINT=unix:///path testplugin [flags] [args...]\n\n"+
			"A deliberately misbehaving CSI plugin for csiagent's tests. On start it prints a JSON line\n"+
			"(argv, CSI_ENDPOINT, MESOS_AGENT_ID, TESTPLUGIN_* env, pid, ppid, pgid, uid, gid, cwd, cgroup)\n"+
			"to stdout and logs every RPC to stderr. SIGTERM stops it gracefully (exit 0).\n"+
			"Probe checks --probe-hang, --probe-fail, --probe-fail-file, --probe-not-ready in that order.\n"+
			"Node volume calls need --data-dir; NodeStageVolume and NodePublishVolume check the request,\n"+
			"then --fail-*-file, then --require-*-secret, then (publish) --lie-publish.\n"+
			"A --fail-*-file holds a code name (Unavailable, UNAVAILABLE, InvalidArgument, ...) or number.\n\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if c.probeNotReady < 0 || c.startDelay < 0 || c.crashAfter < 0 {
		return config{}, errors.New("--probe-not-ready, --start-delay and --crash-after must not be negative")
	}
	for _, f := range []struct {
		name string
		*secretsFlag
	}{{"--require-stage-secret", stageSecrets}, {"--require-publish-secret", publishSecrets}} {
		if len(f.dup) > 0 {
			return config{}, fmt.Errorf("%s: key %s given twice", f.name, f.dup[0])
		}
	}
	c.requireStageSecrets, c.requirePublishSecrets = stageSecrets.m, publishSecrets.m
	return c, nil
}

// run is the whole plugin; it returns the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	logger := log.New(stderr, "testplugin: ", 0)
	cfg, err := parseFlags(args[1:], stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		logger.Print(err)
		return exitUsage
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	if err := json.NewEncoder(stdout).Encode(describeSelf(args)); err != nil {
		logger.Printf("write start line: %v", err)
	}
	if cfg.exitImmediately {
		logger.Print("exiting with status 3 (--exit-immediately)")
		return exitCrashed
	}
	socket, err := socketPath(os.Getenv("CSI_ENDPOINT"))
	if err != nil {
		logger.Print(err)
		return exitUsage
	}

	if cfg.startDelay > 0 {
		logger.Printf("waiting %v before listening (--start-delay)", cfg.startDelay)
		select {
		case <-time.After(cfg.startDelay):
		case sig := <-sigs:
			logger.Printf("%v during the start delay; exiting", sig)
			return exitOK
		}
	}
	if err := removeStale(socket); err != nil {
		logger.Print(err)
		return exitUsage
	}
	lis, err := net.Listen("unix", socket)
	if err != nil {
		logger.Print(err)
		return exitServe
	}

	p := newPlugin(cfg, logger)
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(p.logRPC), grpc.ForceServerCodecV2(p.codec))
	csi.RegisterIdentityServer(srv, p)
	// What it serves (the optional services vary with its flags) is
	// listed by gRPC server reflection, as a CO's discovery reads it.
	reflection.Register(srv)
	csi.RegisterNodeServer(srv, p)
	if cfg.controller {
		csi.RegisterControllerServer(srv, p)
	}
	if cfg.reclaim {
		reclaimspace.RegisterReclaimSpaceNodeServer(srv, p)
	}
	if cfg.keyRotation {
		ekr.RegisterEncryptionKeyRotationControllerServer(srv, p)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	logger.Printf("serving on %s pid %d", socket, os.Getpid())

	var crash <-chan time.Time
	if cfg.crashAfter > 0 {
		crash = time.After(cfg.crashAfter)
	}
	select {
	case sig := <-sigs:
		logger.Printf("%v: stopping", sig)
	case <-crash:
		// Like a real crash: no graceful stop, the socket stays.
		logger.Print("crashing with status 3 (--crash-after)")
		return exitCrashed
	case err := <-served:
		logger.Printf("serve: %v", err)
		return exitServe
	}

	p.stop() // fails the calls that hang on purpose
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(gracePeriod):
		logger.Printf("graceful stop took longer than %v; stopping hard", gracePeriod)
		srv.Stop()
	}
	if err := os.Remove(socket); err != nil && !errors.Is(err, fs.ErrNotExist) {
		logger.Printf("remove socket: %v", err)
	}
	logger.Print("stopped")
	return exitOK
}

// socketPath turns CSI_ENDPOINT into a socket path.
func socketPath(endpoint string) (string, error) {
	path := endpoint
	switch {
	case endpoint == "":
		return "", errors.New("CSI_ENDPOINT is not set")
	case strings.HasPrefix(endpoint, "unix://"):
		path = strings.TrimPrefix(endpoint, "unix://")
	case strings.HasPrefix(endpoint, "unix:"):
		path = strings.TrimPrefix(endpoint, "unix:")
	case strings.Contains(endpoint, "://"):
		return "", fmt.Errorf("CSI_ENDPOINT %q: only unix sockets are served", endpoint)
	}
	if path == "" {
		return "", fmt.Errorf("CSI_ENDPOINT %q has no path", endpoint)
	}
	return path, nil
}

// removeStale removes a socket left at path by an earlier instance. Anything
// else at path is an error.
func removeStale(path string) error {
	st, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if st.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket; not removing it", path)
	}
	return os.Remove(path)
}

// self is the JSON line written to stdout at start.
type self struct {
	Argv   []string          `json:"argv"`
	Env    map[string]string `json:"env"`
	PID    int               `json:"pid"`
	PPID   int               `json:"ppid"`
	PGID   int               `json:"pgid"`
	UID    int               `json:"uid"`
	GID    int               `json:"gid"`
	Cwd    string            `json:"cwd"`
	Cgroup string            `json:"cgroup"`
}

func describeSelf(argv []string) self {
	s := self{
		Argv: maskSecrets(argv),
		Env:  map[string]string{},
		PID:  os.Getpid(),
		PPID: os.Getppid(),
		UID:  os.Getuid(),
		GID:  os.Getgid(),
	}
	s.PGID, _ = syscall.Getpgid(0)
	s.Cwd, _ = os.Getwd()
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		if k == "CSI_ENDPOINT" || k == "MESOS_AGENT_ID" || strings.HasPrefix(k, envPrefix) {
			s.Env[k] = v
		}
	}
	if b, err := os.ReadFile("/proc/self/cgroup"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if path, ok := strings.CutPrefix(line, "0::"); ok {
				s.Cgroup = path
			}
		}
	}
	return s
}

// maskSecrets returns argv with the VALUE of each --require-*-secret
// KEY=VALUE replaced by ***: the start line shows which secrets are
// required, not what they are.
func maskSecrets(argv []string) []string {
	out := slices.Clone(argv)
	mask := func(kv string) string {
		if k, _, ok := strings.Cut(kv, "="); ok {
			return k + "=***"
		}
		return kv
	}
	for i := 1; i < len(out); i++ {
		name, value, hasValue := strings.Cut(strings.TrimLeft(out[i], "-"), "=")
		if !strings.HasPrefix(out[i], "-") || name != "require-stage-secret" && name != "require-publish-secret" {
			continue
		}
		if hasValue {
			out[i] = out[i][:len(out[i])-len(value)] + mask(value)
		} else if i+1 < len(out) {
			i++
			out[i] = mask(out[i])
		}
	}
	return out
}
