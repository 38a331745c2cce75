package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// withAgent declares a client command's --api-socket and --output and
// returns its body: it connects to the agent and runs call (each of its
// unary calls is bounded by apiTimeout).
func (e *env) withAgent(fs *pflag.FlagSet, call func(ctx context.Context, client agentv1.AgentClient, output string, args []string) error) runFunc {
	socket := apiSocketFlag(fs)
	output := outputFlag(fs)
	return func(ctx context.Context, name string, args []string) int {
		if err := checkOutput(*output); err != nil {
			fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
			return ExitUsage
		}
		client, closeConn, err := dialAgent(*socket)
		if err != nil {
			fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
			return ExitProblem
		}
		defer closeConn()
		if err := call(ctx, client, *output, args); err != nil {
			var usage usageError
			if errors.As(err, &usage) {
				fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
				return ExitUsage
			}
			fmt.Fprintf(e.stderr, "%s: %s\n", name, apiError(*socket, err))
			return ExitProblem
		}
		return ExitOK
	}
}

// usageError is a command-line mistake found after flag parsing.
type usageError string

func (u usageError) Error() string { return string(u) }

// prepareCmd is csi-agent prepare.
func (e *env) prepareCmd(fs *pflag.FlagSet) runFunc {
	id := fs.String("container", "", "container id (required)")
	file := fs.String("volumes", "", "JSON file: a list of Mesos Volume objects (- for stdin)")
	mounts := fs.String("mounts", "", "named volumes, NAME:PATH[:ro][;NAME:PATH[:ro]...] (see csi-agent volume)")
	deprecatedPluginSocketFlag(fs)
	rootfs := fs.String("rootfs", "", "the container's root filesystem on the host")
	sandbox := fs.String("sandbox", "", "the container's sandbox on the host (relative container paths)")
	user := fs.String("user", "", "user that created mount point directories are given to")
	return e.withAgent(fs, func(ctx context.Context, client agentv1.AgentClient, output string, _ []string) error {
		if *id == "" || (*file == "" && *mounts == "") {
			return usageError("--container, and --volumes or --mounts, are required")
		}
		var vols []*agentv1.Volume
		var named []*agentv1.NamedMount
		if *file != "" {
			var data []byte
			var err error
			if *file == "-" {
				data, err = io.ReadAll(e.stdin)
			} else {
				data, err = os.ReadFile(*file)
			}
			if err != nil {
				return usageError(err.Error())
			}
			if vols, err = parseVolumes(data); err != nil {
				return usageError(fmt.Sprintf("%s: %v", *file, err))
			}
		}
		if *mounts != "" {
			var err error
			if named, err = parseNamedMounts(*mounts); err != nil {
				return usageError(fmt.Sprintf("--mounts: %v", err))
			}
		}
		resp, err := client.Prepare(ctx, &agentv1.PrepareRequest{ContainerId: *id, Volumes: vols, NamedMounts: named, Rootfs: *rootfs, Sandbox: *sandbox, User: *user})
		return printReply(e.stdout, output, resp, err, func() error {
			printMounts(e, resp.GetMounts())
			return nil
		})
	})
}

func printMounts(e *env, mounts []*agentv1.ContainerMount) {
	tw := newTable(e.stdout, "PLUGIN\tVOLUME\tMODE\tCONTAINER PATH\tMOUNT POINT\tPUBLISHED AT")
	for _, m := range mounts {
		mode := "RW"
		if m.GetReadonly() {
			mode = "RO"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", m.GetPluginName(), m.GetVolumeId(), mode, m.GetContainerPath(), m.GetMountPoint(), m.GetHostPath())
	}
	tw.Flush()
}

// cleanupCmd is csi-agent cleanup.
func (e *env) cleanupCmd(fs *pflag.FlagSet) runFunc {
	id := fs.String("container", "", "container id (or give it as the argument)")
	force := fs.Bool("force", false, "finish even where a volume's plugin fails its teardown (see README)")
	return e.withAgent(fs, func(ctx context.Context, client agentv1.AgentClient, _ string, rest []string) error {
		switch {
		case len(rest) > 1 || (len(rest) == 1 && *id != ""):
			return usageError("give the container id once: --container ID or ID")
		case len(rest) == 1:
			*id = rest[0]
		case *id == "":
			return usageError("a container id is required: --container ID or ID")
		}
		_, err := client.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: *id, Force: *force})
		return err
	})
}

// volumesCmd is csi-agent volumes.
func (e *env) volumesCmd(fs *pflag.FlagSet) runFunc {
	refresh := fs.Bool("refresh-stats", false, "poll the published volumes' usage and health now rather than show the last poll")
	return e.withAgent(fs, func(ctx context.Context, client agentv1.AgentClient, output string, _ []string) error {
		resp, err := client.ListVolumes(ctx, &agentv1.ListVolumesRequest{RefreshStats: *refresh})
		return printReply(e.stdout, output, resp, err, func() error {
			tw := newTable(e.stdout, "PLUGIN\tVOLUME\tSTATE\tCONTAINERS\tUSE\tCONDITION\tLAST RECLAIM\tNEXT RECLAIM\tNEXT KEY ROTATION\tLAST REPAIR\tTARGET\tERROR")
			for _, v := range resp.GetVolumes() {
				use, cond := statsCells(v.GetStats())
				state := v.GetState().String()
				if v.GetAttached() {
					state += " (attached)"
				}
				if v.GetPending() != "" {
					state += " (pending)"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", v.GetPluginName(), v.GetVolumeId(), state,
					orDash(strings.Join(v.GetContainers(), ",")), use, cond, reclaimCell(v.GetLastReclaim()), timeCell(v.GetNextReclaim()),
					timeCell(v.GetNextKeyRotation()), orDash(oneLine(v.GetLastRepair())), v.GetTargetPath(), orDash(oneLine(cmp.Or(v.GetLastError(), v.GetPending()))))
			}
			return tw.Flush()
		})
	})
}

// timeCell is a scheduled time in local time, "-" when unset.
func timeCell(t *timestamppb.Timestamp) string {
	if t == nil {
		return "-"
	}
	return t.AsTime().Local().Format(time.DateTime)
}

// statsCells summarises a volume's last stats poll: use ("42% of 1.0
// GiB", or the size alone) and condition ("ok", "ABNORMAL: ...").
func statsCells(s *agentv1.VolumeStats) (use, cond string) {
	switch {
	case s == nil:
		return "-", "-"
	case s.GetError() != "":
		return "-", "poll failed: " + oneLine(s.GetError())
	}
	use, cond = "-", "-"
	if s.GetBytesKnown() && s.GetCapacityBytes() > 0 {
		use = bytesHuman(s.GetCapacityBytes())
		if s.GetUsedBytes() > 0 || s.GetAvailableBytes() > 0 {
			use = fmt.Sprintf("%d%% of %s", s.GetUsedBytes()*100/s.GetCapacityBytes(), use)
		}
	}
	if s.GetHealthKnown() {
		cond = "ok"
		if s.GetAbnormal() {
			cond = "ABNORMAL: " + oneLine(s.GetCondition())
		}
	}
	return use, cond
}

// reclaimCell summarises a reclaim result: when, and bytes freed or why
// not.
func reclaimCell(r *agentv1.ReclaimResult) string {
	if r == nil {
		return "-"
	}
	when := r.GetStart().AsTime().Local().Format(time.DateTime)
	if r.GetCode() != "" {
		return when + " " + r.GetCode()
	}
	if r.GetPreUsage() < 0 || r.GetPostUsage() < 0 {
		return when + " ok"
	}
	return when + " freed " + bytesHuman(r.GetBytesReclaimed())
}

// bytesHuman prints a byte count in binary units, keeping the sign.
func bytesHuman(n int64) string {
	sign := ""
	if n < 0 {
		sign, n = "-", -n
	}
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%s%d B", sign, n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%s%.1f %ciB", sign, float64(n)/float64(div), "KMGTPE"[exp])
}

// reclaimCmd is csi-agent reclaim.
func (e *env) reclaimCmd(fs *pflag.FlagSet) runFunc {
	volume := fs.String("volume", "", "reclaim this volume id")
	plugin := fs.String("plugin", "", "the volume's plugin type (needed when the id is ambiguous, and with --offline)")
	containerID := fs.String("container", "", "reclaim every volume of this container")
	all := fs.Bool("all", false, "reclaim every published volume")
	offline := fs.Bool("offline", false, "call ControllerReclaimSpace for --plugin/--volume, a volume not published on this host")
	secretsFile := fs.String("secrets-file", "", "with --offline: JSON file with an object of strings passed as the request's secrets (never logged)")
	params := paramFlag(fs, "with --offline: a parameter of the request")
	return e.withAgent(fs, func(ctx context.Context, client agentv1.AgentClient, output string, _ []string) error {
		req := &agentv1.ReclaimSpaceRequest{Offline: *offline, Parameters: params.params()}
		if *secretsFile != "" {
			secrets, err := readSecrets(*secretsFile)
			if err != nil {
				return usageError(err.Error())
			}
			req.Secrets = secrets
		}
		n := 0
		if *volume != "" {
			n++
			req.Target = &agentv1.ReclaimSpaceRequest_Volume{Volume: &agentv1.VolumeRef{PluginName: *plugin, VolumeId: *volume}}
		}
		if *containerID != "" {
			n++
			req.Target = &agentv1.ReclaimSpaceRequest_ContainerId{ContainerId: *containerID}
		}
		if *all {
			n++
			req.Target = &agentv1.ReclaimSpaceRequest_All{All: true}
		}
		switch {
		case n != 1:
			return usageError("name exactly one of --volume, --container or --all")
		case *offline && (*volume == "" || *plugin == ""):
			return usageError("--offline needs --plugin and --volume")
		case !*offline && (req.Secrets != nil || req.Parameters != nil):
			return usageError("--secrets-file and --param are for --offline (ControllerReclaimSpace)")
		}
		stream, err := client.ReclaimSpace(ctx, req)
		if err != nil {
			return err
		}
		for {
			msg, err := stream.Recv()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return err
			}
			if output == "json" {
				if err := printJSON(e.stdout, msg); err != nil {
					return err
				}
				continue
			}
			if s := msg.GetSummary(); s != nil {
				fmt.Fprintf(e.stdout, "%d volume(s), %s freed, %d failure(s)\n", s.GetVolumes(), bytesHuman(s.GetBytesFreed()), s.GetFailures())
				if s.GetFailures() > 0 {
					return fmt.Errorf("%d reclaim(s) failed", s.GetFailures())
				}
				continue
			}
			r := msg.GetResult()
			line := fmt.Sprintf("%s/%s: ", msg.GetVolume().GetPluginName(), msg.GetVolume().GetVolumeId())
			switch {
			case r.GetCode() != "":
				line += r.GetCode() + ": " + r.GetOutcome()
			case r.GetPreUsage() >= 0 && r.GetPostUsage() >= 0:
				line += fmt.Sprintf("freed %s (%s -> %s in use)", bytesHuman(r.GetBytesReclaimed()), bytesHuman(r.GetPreUsage()), bytesHuman(r.GetPostUsage()))
			default:
				line += "ok (the plugin reported no usage)"
			}
			fmt.Fprintln(e.stdout, line)
		}
	})
}

// containersCmd is csi-agent containers.
func (e *env) containersCmd(fs *pflag.FlagSet) runFunc {
	return e.withAgent(fs, func(ctx context.Context, client agentv1.AgentClient, output string, _ []string) error {
		resp, err := client.ListContainers(ctx, &agentv1.ListContainersRequest{})
		return printReply(e.stdout, output, resp, err, func() error {
			tw := newTable(e.stdout, "CONTAINER\tPHASE\tMANAGER\tVOLUMES\tERROR")
			for _, c := range resp.GetContainers() {
				var vols []string
				for _, m := range c.GetMounts() {
					vols = append(vols, m.GetVolumeId()+"→"+m.GetContainerPath())
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", c.GetContainerId(), c.GetPhase(), orDash(c.GetManager()), orDash(strings.Join(vols, " ")), orDash(oneLine(c.GetLastError())))
			}
			return tw.Flush()
		})
	})
}

// reconcileCmd is csi-agent reconcile.
func (e *env) reconcileCmd(fs *pflag.FlagSet) runFunc {
	live := fs.String("live", "", "comma-separated ids of the containers still running; every other container of --manager is cleaned up (required unless --runtime; '' cleans them all up)")
	manager := fs.String("manager", "", "the container manager whose containers these are (the io.container.manager annotation: libpod, cri-o); default: containers no manager named")
	runtime := fs.String("runtime", "", "take the live containers from this runtime's state instead of --live: runc (its --root) or podman (manager libpod)")
	root := fs.String("root", "/run/runc", "with --runtime runc: runc's --root")
	return e.withAgent(fs, func(ctx context.Context, client agentv1.AgentClient, output string, _ []string) error {
		req := &agentv1.ReconcileRequest{Manager: *manager}
		switch {
		case *runtime != "" && (fs.Changed("live") || fs.Changed("manager")):
			return usageError("--runtime takes the live containers and their manager from the runtime: not with --live or --manager")
		case *runtime != "":
			ids, m, err := runtimeLive(ctx, *runtime, *root)
			if err != nil {
				return err
			}
			req.LiveContainerIds, req.Manager = ids, m
		case !fs.Changed("live"):
			// Without the list, every container would be cleaned up from
			// under its runtime.
			return usageError("--live (the ids of the containers still running; '' cleans up every container of --manager) or --runtime is required")
		default:
			for _, id := range strings.Split(*live, ",") {
				if id = strings.TrimSpace(id); id != "" {
					req.LiveContainerIds = append(req.LiveContainerIds, id)
				}
			}
		}
		resp, err := client.Reconcile(ctx, req)
		return printReply(e.stdout, output, resp, err, func() error {
			for _, id := range resp.GetCleanedUp() {
				fmt.Fprintln(e.stdout, "cleaned up", id)
			}
			for id, why := range resp.GetFailed() {
				fmt.Fprintf(e.stdout, "FAILED %s: %s\n", id, why)
			}
			if len(resp.GetFailed()) > 0 {
				return fmt.Errorf("%d container(s) could not be cleaned up", len(resp.GetFailed()))
			}
			return nil
		})
	})
}

// runtimeListTimeout bounds asking a runtime for its containers.
const runtimeListTimeout = 30 * time.Second

// runtimeLive asks a runtime which of its containers are not stopped, and
// says whose manager they are: runc's (runc list at root) are no
// manager's, Podman's (podman ps) libpod's. A runtime that cannot answer
// is an error: nothing is reconciled on a guess.
func runtimeLive(ctx context.Context, runtime, root string) (ids []string, manager string, err error) {
	ctx, cancel := context.WithTimeout(ctx, runtimeListTimeout)
	defer cancel()
	var cmd *exec.Cmd
	switch runtime {
	case "runc":
		cmd = exec.CommandContext(ctx, "runc", "--root", root, "list", "--format", "json")
	case "podman":
		cmd, manager = exec.CommandContext(ctx, "podman", "ps", "--all", "--no-trunc", "--format", "json"), "libpod"
	default:
		return nil, "", usageError(fmt.Sprintf("--runtime %q: runc or podman", runtime))
	}
	out, err := cmd.Output()
	if err != nil {
		var stderr string
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			stderr = strings.TrimSpace(string(ee.Stderr))
		}
		return nil, "", fmt.Errorf("asking %s for its containers: %w %s", runtime, err, stderr)
	}
	// runc list: [{"id", "status"}] or null; podman ps: [{"Id", "State"}].
	var cs []map[string]any
	if err := json.Unmarshal(out, &cs); err != nil {
		return nil, "", fmt.Errorf("reading %s's containers: %w", runtime, err)
	}
	idKey, stateKey := "id", "status"
	if runtime == "podman" {
		idKey, stateKey = "Id", "State"
	}
	for _, c := range cs {
		id, _ := c[idKey].(string)
		state, _ := c[stateKey].(string)
		if id == "" || state == "" {
			return nil, "", fmt.Errorf("reading %s's containers: an entry without %s or %s: %v", runtime, idKey, stateKey, c)
		}
		if state != "stopped" && state != "exited" {
			ids = append(ids, id)
		}
	}
	return ids, manager, nil
}
