package cli

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/csiagent/csiagent/controllerops"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// Snapshots: csi-agent snapshot create, ls, rm. The agent keeps them in
// its catalogue (package snapcat), so ls and rm take the name given at
// create, never a plugin's id.

func (e *env) snapshotCmd() *cobra.Command {
	return e.group("snapshot", "CSI snapshots of one volume: create, ls, rm",
		"Take CSI snapshots (csi.v1.Controller CreateSnapshot) of one volume; the agent records each under its name (ls lists group snapshots too).",
		command("create [flags]", "snapshot a named volume, or a volume id of --plugin (idempotent by --name), waiting until ready unless --no-wait", noArgs, e.snapshotCreateCmd),
		command("ls [flags]", "list the snapshots and group snapshots the agent took", noArgs, e.snapshotLsCmd),
		command("rm NAME [flags]", "delete a snapshot at its plugin and from the catalogue", cobra.ExactArgs(1), e.snapshotRmCmd),
	)
}

// snapshotCreateCmd is csi-agent snapshot create.
func (e *env) snapshotCreateCmd(fs *pflag.FlagSet) runFunc {
	snapName := nameFlag(fs, "snapshot")
	volume := fs.String("volume", "", "the named volume ('csi-agent volume ls'), or with --plugin a volume id (required)")
	noWait := fs.Bool("no-wait", false, "return once the snapshot is cut, even if not ready to use yet")
	params := paramFlag(fs, "plugin parameter")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		if *snapName == "" || *volume == "" {
			return usageError("--name and --volume are required")
		}
		req := &agentv1.CreateSnapshotRequest{PluginName: c.plugin, Name: *snapName, Parameters: params.params(), Secrets: c.secrets, Retry: c.retry, NoWait: *noWait}
		if c.plugin == "" {
			req.NamedVolume = *volume
		} else {
			req.SourceVolumeId = *volume
		}
		return runOp(ctx, c, client.CreateSnapshot, req, func(r *agentv1.SnapshotReply) error {
			return c.printSnapshots(r.GetSnapshot())
		})
	}, pluginOptional)
}

// snapshotLsCmd is csi-agent snapshot ls.
func (e *env) snapshotLsCmd(fs *pflag.FlagSet) runFunc {
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		list, err := client.ListSnapshots(ctx, &agentv1.ListSnapshotsRequest{})
		return printReply(c.e.stdout, c.output, list, err, func() error { return c.printSnapshots(list.GetSnapshots()...) })
	}, pluginOptional)
}

// snapshotRmCmd is csi-agent snapshot rm NAME.
func (e *env) snapshotRmCmd(fs *pflag.FlagSet) runFunc {
	f := addCtrlFlags(fs)
	pluginOptional(f)
	return func(ctx context.Context, name string, args []string) int {
		return e.controller(ctx, name, f, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
			return runOp(ctx, c, client.DeleteSnapshot, &agentv1.DeleteSnapshotRequest{PluginName: c.plugin, Name: args[0], Secrets: c.secrets, Retry: c.retry},
				c.printDone("snapshot %s deleted", args[0]))
		})
	}
}

// printSnapshots prints catalogue entries as a table: a group's members
// as SOURCE=SNAPSHOT pairs.
func (c *ctrlCall) printSnapshots(entries ...*agentv1.SnapshotEntry) error {
	tw := newTable(c.e.stdout, "NAME\tKIND\tPLUGIN\tSOURCE\tSNAPSHOT\tSIZE\tREADY\tCREATED")
	for _, s := range entries {
		source := strings.Join(s.GetSourceVolumeIds(), ",")
		switch {
		case s.GetNamedVolume() != "":
			source = s.GetNamedVolume() + " (" + source + ")"
		case s.GetContainerId() != "":
			source = "container " + s.GetContainerId()
		}
		id := s.GetSnapshotId()
		if s.GetKind() == "group" {
			var members []string
			for _, v := range slices.Sorted(maps.Keys(s.GetMembers())) {
				members = append(members, v+"="+s.GetMembers()[v])
			}
			id = s.GetGroupSnapshotId() + " [" + strings.Join(members, " ") + "]"
		}
		ready := fmt.Sprint(s.GetReadyToUse())
		if s.GetInterrupted() {
			id, ready = "-", "interrupted: run create again"
		}
		size, created := "-", "-"
		if s.GetSizeBytes() > 0 {
			size = bytesHuman(s.GetSizeBytes())
		}
		if s.GetCreationTime() != nil {
			created = s.GetCreationTime().AsTime().Local().Format(time.DateTime)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.GetName(), s.GetKind(), s.GetPluginName(), source, id, size, ready, created)
	}
	return tw.Flush()
}

// freezeTimeoutFlag is group-snapshot create's --freeze-timeout.
func freezeTimeoutFlag(fs *pflag.FlagSet) *time.Duration {
	return fs.Duration("freeze-timeout", controllerops.DefaultFreezeTimeout,
		"with --container: the longest the container's filesystems stay frozen (they are thawed then whatever happens)")
}

// freezeTimeout is the request's freeze_timeout: set with --container.
func freezeTimeout(container string, d time.Duration) *durationpb.Duration {
	if container == "" {
		return nil
	}
	return durationpb.New(d)
}
