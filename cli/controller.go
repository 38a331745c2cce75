package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/csiagent/csiagent/internal/retrypolicy"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/volumegroup"
)

// Controller commands: group, replication, group-snapshot. The agent does
// the retrying (the specs' recovery tables); these commands print its
// progress on stderr as it streams it, and the result on stdout.

// ctrlGrace is added to the operation's --timeout for the CLI's own
// deadline, so that the agent's timeout, with its better message, fires
// first.
const ctrlGrace = 30 * time.Second

// ctrlFlags are the flags every controller command has.
type ctrlFlags struct {
	socket, output, plugin, secretsFile *string
	// pluginOptional: the agent finds the plugin (expand: the one that
	// publishes the volume here).
	pluginOptional               bool
	maxAttempts                  *uint
	backoff, maxBackoff, timeout *time.Duration
}

func addCtrlFlags(fs *pflag.FlagSet) *ctrlFlags {
	return &ctrlFlags{
		socket:      apiSocketFlag(fs),
		output:      outputFlag(fs),
		plugin:      fs.String("plugin", "", "the plugin's type, as 'csi-agent plugins' lists it (required)"),
		secretsFile: fs.String("secrets-file", "", "JSON file with an object of strings passed to the plugin as the request's secrets (never logged)"),
		maxAttempts: fs.Uint("max-attempts", retrypolicy.DefaultAttempts, fmt.Sprintf("calls of an RPC in all for errors the spec says to retry (1: no retries; at most %d)", retrypolicy.MaxAttempts)),
		backoff:     fs.Duration("backoff", retrypolicy.DefaultBackoff, "wait after the first failed call; doubles after each"),
		maxBackoff:  fs.Duration("max-backoff", retrypolicy.DefaultMaxBackoff, "longest wait between calls"),
		timeout:     fs.Duration("timeout", retrypolicy.DefaultTimeout, "bounds the whole operation, retries and waits for readiness included"),
	}
}

// ctrlCall is what a controller command's body gets.
type ctrlCall struct {
	e       *env
	name    string // e.g. "group create"
	output  string
	plugin  string
	secrets map[string]string
	retry   *agentv1.RetryPolicy
}

// withController declares the flags every controller command has and
// returns its body: it checks them, reads the secrets, connects to the
// agent and runs call.
func (e *env) withController(fs *pflag.FlagSet, call func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error, opts ...func(*ctrlFlags)) runFunc {
	f := addCtrlFlags(fs)
	for _, o := range opts {
		o(f)
	}
	return func(ctx context.Context, name string, _ []string) int {
		return e.controller(ctx, name, f, call)
	}
}

// withVolume is withController for a command on one volume published on
// this host: it also declares --volume and requires it.
func (e *env) withVolume(fs *pflag.FlagSet, call func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall, volume string) error, opts ...func(*ctrlFlags)) runFunc {
	volume := fs.String("volume", "", "the volume id (published on this host)")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		if *volume == "" {
			return usageError("--volume is required")
		}
		return call(ctx, client, c, *volume)
	}, opts...)
}

// pluginOptional is the option of a command whose plugin the agent can
// find itself.
func pluginOptional(f *ctrlFlags) { f.pluginOptional = true }

// controller runs a controller command's call with the flags f.
func (e *env) controller(ctx context.Context, name string, f *ctrlFlags, call func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error) int {
	fail := func(code int, err error) int {
		fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
		return code
	}
	if err := checkOutput(*f.output); err != nil {
		return fail(ExitUsage, err)
	}
	if *f.plugin == "" && !f.pluginOptional {
		return fail(ExitUsage, errors.New("--plugin is required: the plugin's type, as 'csi-agent plugins' lists it"))
	}
	switch {
	case *f.maxAttempts < 1 || *f.maxAttempts > retrypolicy.MaxAttempts:
		return fail(ExitUsage, fmt.Errorf("--max-attempts %d: between 1 and %d", *f.maxAttempts, retrypolicy.MaxAttempts))
	case *f.backoff < retrypolicy.MinBackoff:
		return fail(ExitUsage, fmt.Errorf("--backoff %v: at least %v", *f.backoff, retrypolicy.MinBackoff))
	case *f.maxBackoff < *f.backoff:
		return fail(ExitUsage, fmt.Errorf("--max-backoff %v: less than --backoff %v", *f.maxBackoff, *f.backoff))
	case *f.timeout <= 0 || *f.timeout > retrypolicy.MaxTimeout:
		return fail(ExitUsage, fmt.Errorf("--timeout %v: more than 0 and at most %v", *f.timeout, retrypolicy.MaxTimeout))
	}
	var secrets map[string]string
	if *f.secretsFile != "" {
		s, err := readSecrets(*f.secretsFile)
		if err != nil {
			return fail(ExitUsage, err)
		}
		secrets = s
	}
	c := &ctrlCall{e: e, name: name, output: *f.output, plugin: *f.plugin, secrets: secrets, retry: &agentv1.RetryPolicy{
		MaxAttempts: uint32(*f.maxAttempts), InitialBackoff: durationpb.New(*f.backoff),
		MaxBackoff: durationpb.New(*f.maxBackoff), Timeout: durationpb.New(*f.timeout),
	}}
	conn, err := grpc.NewClient("unix://"+*f.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return fail(ExitProblem, fmt.Errorf("connecting to the agent at %s: %w", *f.socket, err))
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, *f.timeout+ctrlGrace)
	defer cancel()
	if err := call(ctx, agentv1.NewControllerClient(conn), c); err != nil {
		var usage usageError
		if errors.As(err, &usage) {
			return fail(ExitUsage, err)
		}
		fmt.Fprintf(e.stderr, "%s: %s\n", name, apiError(*f.socket, err))
		return ExitProblem
	}
	return ExitOK
}

// readSecrets reads a --secrets-file: a JSON object of strings.
func readSecrets(path string) (map[string]string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--secrets-file: %w", err)
	}
	var m map[string]string
	if err := json.Unmarshal(b, &m); err != nil {
		// The decoder's error never quotes values, so no secret leaks.
		return nil, fmt.Errorf("--secrets-file %s: must be a JSON object whose values are strings: %v", path, err)
	}
	if m == nil {
		return nil, fmt.Errorf("--secrets-file %s: must be a JSON object whose values are strings, not null", path)
	}
	return m, nil
}

// nameFlag declares a create command's --name: the name of what it
// creates, which makes repeating it safe.
func nameFlag(fs *pflag.FlagSet, what string) *string {
	return fs.String("name", "", "the "+what+"'s name; repeating a create with the same name is safe (required)")
}

// paramsFlag collects repeated --param KEY=VALUE flags.
type paramsFlag map[string]string

func (p paramsFlag) String() string {
	var kv []string
	for _, k := range slices.Sorted(maps.Keys(p)) {
		kv = append(kv, k+"="+p[k])
	}
	return strings.Join(kv, ",")
}

func (p paramsFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return fmt.Errorf("%q: want KEY=VALUE", s)
	}
	if _, dup := p[k]; dup {
		return fmt.Errorf("%q: key %q given twice", s, k)
	}
	p[k] = v
	return nil
}

// Type is the value's name in -h.
func (p paramsFlag) Type() string { return "KEY=VALUE" }

func paramFlag(fs *pflag.FlagSet, what string) paramsFlag {
	p := paramsFlag{}
	fs.Var(p, "param", what+" (KEY=VALUE, repeatable)")
	return p
}

// params is p, or nil when empty.
func (p paramsFlag) params() map[string]string {
	if len(p) == 0 {
		return nil
	}
	return p
}

// splitIDs splits a comma-separated list of ids.
func splitIDs(flagName, s string) ([]string, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var ids []string
	for _, id := range strings.Split(s, ",") {
		id = strings.TrimSpace(id)
		if id == "" {
			return nil, usageError(fmt.Sprintf("--%s %q: an empty id", flagName, s))
		}
		ids = append(ids, id)
	}
	return ids, nil
}

// progressed is a reply message of the controller API.
type progressed[R any] interface {
	*R
	proto.Message
	GetProgress() *agentv1.Progress
}

// runOp runs one operation of the controller API: it calls method with
// req, prints the operation's progress on stderr as the agent streams it,
// and prints its result: as JSON with --output json, else with table.
func runOp[Req any, R any, P progressed[R]](ctx context.Context, c *ctrlCall, method func(context.Context, Req, ...grpc.CallOption) (grpc.ServerStreamingClient[R], error), req Req, table func(*R) error) error {
	stream, err := method(ctx, req)
	if err != nil {
		return err
	}
	var result *R
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if p := P(msg).GetProgress(); p != nil {
			fmt.Fprintf(c.e.stderr, "%s: %s\n", c.name, progressLine(p))
			continue
		}
		result = msg
	}
	if result == nil {
		return errors.New("the agent ended the operation without a result")
	}
	return printReply(c.e.stdout, c.output, P(result), nil, func() error { return table(result) })
}

// progressLine is one progress message for people.
func progressLine(p *agentv1.Progress) string {
	rpc := p.GetRpc()
	if i := strings.LastIndexByte(rpc, '/'); i >= 0 {
		rpc = rpc[i+1:]
	}
	in := p.GetRetryIn().AsDuration().Round(time.Millisecond)
	switch p.GetKind() {
	case agentv1.Progress_RETRY:
		line := fmt.Sprintf("%s failed (call %d of %d): %s: %s; calling again in %v", rpc, p.GetAttempt(), p.GetMaxAttempts(), p.GetCode(), oneLine(p.GetMessage()), in)
		if p.GetHint() != "" {
			line += " — " + p.GetHint()
		}
		return line
	case agentv1.Progress_NOT_READY:
		return fmt.Sprintf("%s (call %d); calling %s again in %v", p.GetMessage(), p.GetAttempt(), rpc, in)
	case agentv1.Progress_RESTART:
		return fmt.Sprintf("%s: %s: %s — %s", rpc, p.GetCode(), oneLine(p.GetMessage()), p.GetHint())
	default:
		return p.GetMessage()
	}
}

// Volume groups.

func (e *env) groupCmd() *cobra.Command {
	return e.group("group", "csi-addons volume groups: create, modify, delete, get, list",
		"Manage csi-addons volume groups on a plugin's controller (volumegroup.Controller).",
		command("create [flags]", "create a volume group (idempotent by --name)", noArgs, e.groupCreateCmd),
		command("modify [flags]", "set a volume group's members", noArgs, e.groupModifyCmd),
		command("delete [flags]", "delete a volume group and the volumes in it", noArgs, e.groupDeleteCmd),
		command("get [flags]", "show a volume group", noArgs, e.groupGetCmd),
		command("list [flags]", "list volume groups (every page, or one with --page)", noArgs, e.groupListCmd),
	)
}

// groupCreateCmd is csi-agent group create.
func (e *env) groupCreateCmd(fs *pflag.FlagSet) runFunc {
	groupName := nameFlag(fs, "group")
	volumes := fs.String("volumes", "", "comma-separated ids of existing volumes to put in the group")
	params := paramFlag(fs, "plugin parameter")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		if *groupName == "" {
			return usageError("--name is required")
		}
		ids, err := splitIDs("volumes", *volumes)
		if err != nil {
			return err
		}
		return runOp(ctx, c, client.CreateVolumeGroup, &agentv1.CreateVolumeGroupRequest{
			PluginName: c.plugin, Name: *groupName, Parameters: params.params(), VolumeIds: ids, Secrets: c.secrets, Retry: c.retry,
		}, c.printGroup)
	})
}

// groupModifyCmd is csi-agent group modify.
func (e *env) groupModifyCmd(fs *pflag.FlagSet) runFunc {
	id := fs.String("id", "", "the volume group id (required)")
	volumes := fs.String("volumes", "", "comma-separated ids of every volume the group is to have: others are removed")
	removeAll := fs.Bool("remove-all", false, "remove every volume from the group (instead of --volumes)")
	params := paramFlag(fs, "plugin parameter")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		ids, err := splitIDs("volumes", *volumes)
		switch {
		case err != nil:
			return err
		case *id == "":
			return usageError("--id is required")
		case len(ids) == 0 && !*removeAll:
			return usageError("give --volumes (the members afterwards) or --remove-all")
		case len(ids) > 0 && *removeAll:
			return usageError("--volumes and --remove-all exclude each other")
		}
		return runOp(ctx, c, client.ModifyVolumeGroup, &agentv1.ModifyVolumeGroupRequest{
			PluginName: c.plugin, VolumeGroupId: *id, VolumeIds: ids, RemoveAll: *removeAll, Parameters: params.params(), Secrets: c.secrets, Retry: c.retry,
		}, c.printGroup)
	})
}

// groupDeleteCmd is csi-agent group delete.
func (e *env) groupDeleteCmd(fs *pflag.FlagSet) runFunc {
	id := fs.String("id", "", "the volume group id (required)")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		if *id == "" {
			return usageError("--id is required")
		}
		return runOp(ctx, c, client.DeleteVolumeGroup, &agentv1.DeleteVolumeGroupRequest{PluginName: c.plugin, VolumeGroupId: *id, Secrets: c.secrets, Retry: c.retry},
			c.printDone("volume group %s deleted", *id))
	})
}

// groupGetCmd is csi-agent group get.
func (e *env) groupGetCmd(fs *pflag.FlagSet) runFunc {
	id := fs.String("id", "", "the volume group id (required)")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		if *id == "" {
			return usageError("--id is required")
		}
		return runOp(ctx, c, client.GetVolumeGroup, &agentv1.GetVolumeGroupRequest{PluginName: c.plugin, VolumeGroupId: *id, Secrets: c.secrets, Retry: c.retry}, c.printGroup)
	})
}

// groupListCmd is csi-agent group list.
func (e *env) groupListCmd(fs *pflag.FlagSet) runFunc {
	maxEntries := fs.Int("max-entries", 0, "page size asked of the plugin (0: the plugin decides)")
	token := fs.String("starting-token", "", "start at this page token (from an earlier --page listing)")
	page := fs.Bool("page", false, "list one page only and print the next page's token")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		if *maxEntries < 0 || *maxEntries > 1<<31-1 {
			return usageError(fmt.Sprintf("--max-entries %d: must not be negative", *maxEntries))
		}
		return runOp(ctx, c, client.ListVolumeGroups, &agentv1.ListVolumeGroupsRequest{
			PluginName: c.plugin, MaxEntries: int32(*maxEntries), StartingToken: *token, AllPages: !*page, Secrets: c.secrets, Retry: c.retry,
		}, func(res *agentv1.ListVolumeGroupsReply) error {
			if err := c.printGroups(res.GetVolumeGroups()...); err != nil {
				return err
			}
			if res.GetNextToken() != "" {
				fmt.Fprintf(c.e.stdout, "next page: --starting-token %s\n", res.GetNextToken())
			}
			return nil
		})
	})
}

// printDone is a table function for an operation whose result is only
// done: it prints the line the format makes of args.
func (c *ctrlCall) printDone(format string, args ...any) func(*agentv1.OperationReply) error {
	return func(*agentv1.OperationReply) error {
		fmt.Fprintf(c.e.stdout, format+"\n", args...)
		return nil
	}
}

// printGroup prints a reply's volume group as a table.
func (c *ctrlCall) printGroup(res *agentv1.VolumeGroupReply) error {
	return c.printGroups(res.GetVolumeGroup())
}

// printGroups prints volume groups as a table.
func (c *ctrlCall) printGroups(groups ...*volumegroup.VolumeGroup) error {
	tw := newTable(c.e.stdout, "VOLUME GROUP\tVOLUMES\tCONTEXT")
	for _, g := range groups {
		var vols []string
		for _, v := range g.GetVolumes() {
			vols = append(vols, v.GetVolumeId())
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\n", g.GetVolumeGroupId(), orDash(strings.Join(vols, ",")), orDash(paramsFlag(g.GetVolumeGroupContext()).String()))
	}
	return tw.Flush()
}

// Replication.

// replicationVerb is one replication subcommand.
type replicationVerb struct {
	force, wait, params bool
	// call is the API method, e.g. agentv1.ControllerClient.PromoteVolume.
	call func(agentv1.ControllerClient, context.Context, *agentv1.ReplicationRequest, ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.ReplicationReply], error)
	done string // past tense for the table output
}

func (e *env) replicationCmd() *cobra.Command {
	verb := func(use, short string, v replicationVerb) *cobra.Command {
		return command(use+" [flags]", short, noArgs, func(fs *pflag.FlagSet) runFunc { return e.replicationVerbCmd(fs, v) })
	}
	return e.group("replication", "csi-addons replication: enable, disable, promote, demote, resync, info",
		"Run csi-addons replication on a plugin's controller (replication.Controller) for a volume or a volume group.",
		verb("enable", "enable replication", replicationVerb{params: true, done: "replication enabled", call: agentv1.ControllerClient.EnableReplication}),
		verb("disable", "disable replication", replicationVerb{params: true, done: "replication disabled", call: agentv1.ControllerClient.DisableReplication}),
		verb("promote", "promote to primary", replicationVerb{params: true, force: true, done: "promoted", call: agentv1.ControllerClient.PromoteVolume}),
		verb("demote", "demote to secondary", replicationVerb{params: true, force: true, done: "demoted", call: agentv1.ControllerClient.DemoteVolume}),
		verb("resync", "resync, waiting until ready (unless --no-wait)", replicationVerb{params: true, force: true, wait: true, done: "resynced", call: agentv1.ControllerClient.ResyncVolume}),
		verb("info", "show the health and the last sync: status, time, duration, bytes", replicationVerb{call: agentv1.ControllerClient.GetReplicationInfo}),
		verb("destination", "show the peer's volume (or group and volumes) replicating this one", replicationVerb{call: agentv1.ControllerClient.GetReplicationDestination}),
	)
}

// replicationVerbCmd is csi-agent replication VERB.
func (e *env) replicationVerbCmd(fs *pflag.FlagSet, v replicationVerb) runFunc {
	volume := fs.String("volume", "", "the volume id (this or --group is required)")
	group := fs.String("group", "", "the volume group id (this or --volume is required)")
	replicationID := fs.String("replication-id", "", "which replication of the volume, for plugins that keep several")
	var force, noWait *bool
	var params paramsFlag
	if v.force {
		force = fs.Bool("force", false, "force the operation (the plugin decides what that means)")
	}
	if v.wait {
		noWait = fs.Bool("no-wait", false, "return after the first successful call even if the volume is not ready yet")
	}
	if v.params {
		params = paramFlag(fs, "plugin parameter")
	}
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		req := &agentv1.ReplicationRequest{PluginName: c.plugin, ReplicationId: *replicationID, Parameters: params.params(), Secrets: c.secrets, Retry: c.retry}
		what := ""
		switch {
		case (*volume == "") == (*group == ""):
			return usageError("give exactly one of --volume and --group")
		case *volume != "":
			req.Source, what = &agentv1.ReplicationRequest_VolumeId{VolumeId: *volume}, "volume "+*volume
		default:
			req.Source, what = &agentv1.ReplicationRequest_VolumeGroupId{VolumeGroupId: *group}, "volume group "+*group
		}
		if force != nil {
			req.Force = *force
		}
		if noWait != nil {
			req.NoWait = *noWait
		}
		method := func(ctx context.Context, req *agentv1.ReplicationRequest, opts ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.ReplicationReply], error) {
			return v.call(client, ctx, req, opts...)
		}
		return runOp(ctx, c, method, req, func(res *agentv1.ReplicationReply) error { return c.printReplication(v, what, res) })
	})
}

// printReplication prints the result of a replication verb on what (e.g.
// "volume ID"): the replication info or the destination as a table, else
// a line.
func (c *ctrlCall) printReplication(v replicationVerb, what string, res *agentv1.ReplicationReply) error {
	switch {
	case res.GetInfo() != nil:
		in := res.GetInfo()
		tw := newTable(c.e.stdout, "SOURCE\tSTATUS\tLAST SYNC\tDURATION\tBYTES\tMESSAGE")
		last, dur, bytes := "-", "-", "-"
		if in.GetLastSyncTime() != nil {
			last = in.GetLastSyncTime().AsTime().Local().Format(time.DateTime)
		}
		if in.GetLastSyncDuration() != nil {
			dur = in.GetLastSyncDuration().AsDuration().String()
		}
		if in.GetLastSyncBytes() > 0 {
			bytes = bytesHuman(in.GetLastSyncBytes())
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", what, cmp.Or(in.GetStatus(), "UNKNOWN"), last, dur, bytes, cmp.Or(in.GetStatusMessage(), "-"))
		return tw.Flush()
	case res.GetDestination() != nil:
		d := res.GetDestination()
		tw := newTable(c.e.stdout, "SOURCE\tDESTINATION")
		if d.GetVolumeId() != "" {
			fmt.Fprintf(tw, "%s\tvolume %s\n", what, d.GetVolumeId())
		} else {
			fmt.Fprintf(tw, "%s\tvolume group %s\n", what, d.GetVolumeGroupId())
			for _, src := range slices.Sorted(maps.Keys(d.GetVolumeIds())) {
				fmt.Fprintf(tw, "  volume %s\tvolume %s\n", src, d.GetVolumeIds()[src])
			}
		}
		return tw.Flush()
	case v.wait && !res.GetReady():
		fmt.Fprintf(c.e.stdout, "%s: resync started, not ready yet (check again with '%s' without --no-wait)\n", what, c.name)
	default:
		fmt.Fprintf(c.e.stdout, "%s: %s\n", what, v.done)
	}
	return nil
}

// Group snapshots.

func (e *env) groupSnapshotCmd() *cobra.Command {
	return e.group("group-snapshot", "CSI group snapshots: create, get, delete",
		"Take CSI group snapshots on a plugin's controller (csi.v1.GroupController): crash-consistent snapshots of several volumes at once.",
		command("create [flags]", "snapshot volumes, or a container's volumes frozen (--container), together (idempotent by --name), waiting until ready unless --no-wait", noArgs, e.groupSnapshotCreateCmd),
		command("get [flags]", "show a group snapshot", noArgs, e.groupSnapshotGetCmd),
		command("delete [flags]", "delete a group snapshot and its snapshots", noArgs, e.groupSnapshotDeleteCmd),
	)
}

// groupSnapshotCreateCmd is csi-agent group-snapshot create.
func (e *env) groupSnapshotCreateCmd(fs *pflag.FlagSet) runFunc {
	snapName := nameFlag(fs, "group snapshot")
	volumes := fs.String("volumes", "", "comma-separated ids of the volumes to snapshot together (this or --container)")
	container := fs.String("container", "", "snapshot every volume the agent gave this container, its filesystems frozen meanwhile (this or --volumes; --plugin is then the volumes')")
	freeze := freezeTimeoutFlag(fs)
	noWait := fs.Bool("no-wait", false, "return once the snapshot is cut, even if not ready to use yet")
	params := paramFlag(fs, "plugin parameter")
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		ids, err := splitIDs("volumes", *volumes)
		switch {
		case err != nil:
			return err
		case *snapName == "" || (len(ids) == 0) == (*container == ""):
			return usageError("--name and one of --volumes and --container are required")
		case c.plugin == "" && *container == "":
			return usageError("--plugin is required with --volumes")
		}
		return runOp(ctx, c, client.CreateGroupSnapshot, &agentv1.CreateGroupSnapshotRequest{
			PluginName: c.plugin, Name: *snapName, SourceVolumeIds: ids, Parameters: params.params(), Secrets: c.secrets, Retry: c.retry, NoWait: *noWait,
			ContainerId: *container, FreezeTimeout: freezeTimeout(*container, *freeze),
		}, c.printGroupSnapshot)
	}, pluginOptional)
}

// groupSnapshotRef is get's and delete's flags: the name it was created
// with, or the plugin's ids.
type groupSnapshotRef struct{ name, id, snapshotIDs *string }

func groupSnapshotRefFlags(fs *pflag.FlagSet) groupSnapshotRef {
	return groupSnapshotRef{
		name:        fs.String("name", "", "the name it was created with (the agent's catalogue has its plugin and ids)"),
		id:          fs.String("id", "", "the group snapshot id (without --name; needs --plugin)"),
		snapshotIDs: fs.String("snapshot-ids", "", "comma-separated ids of the group's snapshots, as create printed them (with --id)"),
	}
}

// check returns the snapshot ids of an --id reference.
func (r groupSnapshotRef) check(plugin string) ([]string, error) {
	ids, err := splitIDs("snapshot-ids", *r.snapshotIDs)
	switch {
	case err != nil:
		return nil, err
	case *r.name != "" && (*r.id != "" || len(ids) > 0 || plugin != ""):
		return nil, usageError("--name takes no --id, --snapshot-ids or --plugin: the catalogue has them")
	case *r.name == "" && (*r.id == "" || len(ids) == 0 || plugin == ""):
		return nil, usageError("--name, or --plugin, --id and --snapshot-ids, are required")
	}
	return ids, nil
}

// what names the reference in messages.
func (r groupSnapshotRef) what() string { return cmp.Or(*r.name, *r.id) }

// groupSnapshotGetCmd is csi-agent group-snapshot get.
func (e *env) groupSnapshotGetCmd(fs *pflag.FlagSet) runFunc {
	ref := groupSnapshotRefFlags(fs)
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		ids, err := ref.check(c.plugin)
		if err != nil {
			return err
		}
		return runOp(ctx, c, client.GetGroupSnapshot, &agentv1.GetGroupSnapshotRequest{PluginName: c.plugin, Name: *ref.name, GroupSnapshotId: *ref.id, SnapshotIds: ids, Secrets: c.secrets, Retry: c.retry},
			c.printGroupSnapshot)
	}, pluginOptional)
}

// groupSnapshotDeleteCmd is csi-agent group-snapshot delete.
func (e *env) groupSnapshotDeleteCmd(fs *pflag.FlagSet) runFunc {
	ref := groupSnapshotRefFlags(fs)
	return e.withController(fs, func(ctx context.Context, client agentv1.ControllerClient, c *ctrlCall) error {
		ids, err := ref.check(c.plugin)
		if err != nil {
			return err
		}
		return runOp(ctx, c, client.DeleteGroupSnapshot, &agentv1.DeleteGroupSnapshotRequest{PluginName: c.plugin, Name: *ref.name, GroupSnapshotId: *ref.id, SnapshotIds: ids, Secrets: c.secrets, Retry: c.retry},
			c.printDone("group snapshot %s deleted", ref.what()))
	}, pluginOptional)
}

// printGroupSnapshot prints a reply's group snapshot and its snapshots as
// tables.
func (c *ctrlCall) printGroupSnapshot(res *agentv1.GroupSnapshotReply) error {
	gs := res.GetGroupSnapshot()
	created := "-"
	if gs.GetCreationTime() != nil {
		created = gs.GetCreationTime().AsTime().Local().Format(time.DateTime)
	}
	tw := newTable(c.e.stdout, "GROUP SNAPSHOT\tREADY\tCREATED\tSNAPSHOTS")
	fmt.Fprintf(tw, "%s\t%t\t%s\t%d\n", gs.GetGroupSnapshotId(), gs.GetReadyToUse(), created, len(gs.GetSnapshots()))
	fmt.Fprintln(tw, "")
	fmt.Fprintln(tw, "SNAPSHOT\tSOURCE VOLUME\tSIZE\tREADY")
	var ids []string
	for _, s := range gs.GetSnapshots() {
		size := "-"
		if s.GetSizeBytes() > 0 {
			size = bytesHuman(s.GetSizeBytes())
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%t\n", s.GetSnapshotId(), s.GetSourceVolumeId(), size, s.GetReadyToUse())
		ids = append(ids, s.GetSnapshotId())
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(ids) > 0 {
		fmt.Fprintf(c.e.stdout, "\nget or delete it with --name (the name it was created with), or with --plugin and: --id %s --snapshot-ids %s\n", gs.GetGroupSnapshotId(), strings.Join(ids, ","))
	}
	return nil
}
