package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/csiagent/csiagent/internal/bytesize"
	buildversion "github.com/csiagent/csiagent/internal/version"
	"github.com/csiagent/csiagent/loopplugin"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	log := slog.New(slog.NewTextHandler(stderr, nil))
	cmd := "serve"
	if len(args) > 0 && (args[0] == "create-volume" || args[0] == "delete-volume") {
		cmd, args = args[0], args[1:]
	}
	fs := flag.NewFlagSet("csi-loop-plugin "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	pool := fs.String("pool", "", "directory that holds the volume images")
	var err error
	switch cmd {
	case "create-volume":
		name := fs.String("name", "", "volume name (the volume id)")
		size := fs.String("size", "1GiB", "volume size, e.g. 512MiB, 10GiB")
		if err = parse(fs, args); err == nil {
			err = createVolume(*pool, *name, *size, stdout)
		}
	case "delete-volume":
		name := fs.String("name", "", "volume name (the volume id)")
		if err = parse(fs, args); err == nil {
			err = deleteVolume(*pool, *name)
		}
	default:
		var cfg loopplugin.Config
		endpoint := fs.String("endpoint", os.Getenv("CSI_ENDPOINT"), "unix socket to serve on: unix:///path or a path (default $CSI_ENDPOINT)")
		fs.StringVar(&cfg.NodeID, "node-id", "", "node id for NodeGetInfo (default $MESOS_AGENT_ID, else the host name)")
		fs.StringVar(&cfg.Name, "name", loopplugin.DefaultName, "plugin name for GetPluginInfo")
		fs.BoolVar(&cfg.NodeOnly, "node-only", false, "node-only mode: no PUBLISH_UNPUBLISH_VOLUME, NodeStageVolume attaches the image itself (for a CO that never calls ControllerPublishVolume); default: ControllerPublishVolume attaches it and hands the device over in the publish_context")
		fs.BoolVar(&cfg.SharedPool, "shared-pool", false, "the pool is on storage every node reaches (NFS, a cluster filesystem): MULTI_NODE_READER_ONLY is offered too, each node attaching the image read-only; writers stay one node at a time, which the CO must ensure (csi-agent does with --cluster-etcd-endpoints). Needs --node-only")
		fs.Int64Var(&cfg.MaxVolumesPerNode, "max-volumes-per-node", 0, "NodeGetInfo's max_volumes_per_node: how many of its volumes the CO may have staged on this node (0: no limit)")
		fs.StringVar(&cfg.ReplicaPool, "replica-pool", "", "pool directory replicated volumes are copied to (csi-addons replication; optional)")
		addons := fs.String("csi-addons-endpoint", "", "also serve csi-addons (with its identity service) on this unix socket, as ceph-csi does (e.g. $CSIADDONS_ENDPOINT, which csi-agent sets for managed plugins)")
		version := fs.Bool("version", false, "print the version and exit")
		if err = parse(fs, args); err != nil {
			break
		}
		if *version {
			fmt.Fprintf(stdout, "csi-loop-plugin %s (CSI vendor_version %s)\n", buildversion.Version, loopplugin.Version)
			return 0
		}
		cfg.Pool, cfg.Logger = *pool, log
		if cfg.NodeID == "" {
			cfg.NodeID = os.Getenv("MESOS_AGENT_ID")
		}
		if cfg.NodeID == "" {
			cfg.NodeID, err = os.Hostname()
		}
		if err == nil {
			err = serve(cfg, *endpoint, *addons)
		}
	}
	switch {
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		return 2
	case err != nil:
		log.Error(cmd+" failed", "error", err)
		return 1
	}
	return 0
}

var errUsage = errors.New("usage")

func parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return errUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "unexpected arguments: %q\n", fs.Args())
		return errUsage
	}
	return nil
}

func serve(cfg loopplugin.Config, endpoint, addons string) error {
	if endpoint == "" {
		return errors.New("no endpoint: set --endpoint or CSI_ENDPOINT")
	}
	p, err := loopplugin.New(cfg)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return p.Serve(ctx, endpoint, addons)
}

func createVolume(pool, name, size string, stdout io.Writer) error {
	p, err := loopplugin.OpenPool(pool)
	if err != nil {
		return err
	}
	n, err := bytesize.Parse(size)
	if err != nil {
		return err
	}
	v, err := p.CreateExact(name, n)
	if err != nil {
		return err
	}
	fmt.Fprintln(stdout, v.ID)
	return nil
}

func deleteVolume(pool, name string) error {
	p, err := loopplugin.OpenPool(pool)
	if err != nil {
		return err
	}
	return p.Delete(name)
}
