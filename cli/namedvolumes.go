package cli

import (
	"cmp"
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// volumeCallTimeout bounds one call of the volume commands.
const volumeCallTimeout = 30 * time.Second

// volumeCmd is csi-agent volume create|rm|inspect|ls|reconcile.
func (e *env) volumeCmd() *cobra.Command {
	return e.group("volume", "named CSI volumes for container engines: create, rm, inspect, ls, reconcile",
		"Named CSI volumes, as container engines use them (docker volume create -d csi-agent), the csi.csiagent.io/mounts\nannotation and prepare --mounts name them.",
		command("create NAME [flags]", "define a named volume: a pre-provisioned one (--volume-id), or a new one the plugin creates (--size)", cobra.ExactArgs(1), e.volumeCreateCmd),
		command("rm NAME [--delete]", "remove a named volume (refused while an engine or a container uses it); --delete deletes its backend volume too", cobra.ExactArgs(1), e.volumeRemoveCmd),
		command("inspect NAME", "show a named volume: its options, its state in the agent, the engines' mounts", cobra.ExactArgs(1), e.withVolumes(func(ctx context.Context, c agentv1.AgentClient, _ string, args []string) error {
			v, err := c.GetNamedVolume(ctx, &agentv1.GetNamedVolumeRequest{Name: args[0]})
			if err != nil {
				return err
			}
			return printJSON(e.stdout, v)
		})),
		command("ls [flags]", "list the named volumes", noArgs, e.withVolumes(e.volumeList)),
		command("reconcile [flags]", "release every engine mount whose mount id is not in --live-mount-ids", noArgs, e.volumeReconcileCmd),
	)
}

// deprecatedPluginSocketFlag accepts --docker-plugin-socket, which the
// clients no longer need (named volumes go through --api-socket), so that
// hooks and scripts written for earlier releases keep working.
func deprecatedPluginSocketFlag(fs *pflag.FlagSet) {
	fs.String("docker-plugin-socket", "", "")
	_ = fs.MarkDeprecated("docker-plugin-socket", "named volumes are looked up through --api-socket; drop it")
}

// withVolumes is withAgent with each call bounded by volumeCallTimeout.
func (e *env) withVolumes(call func(ctx context.Context, c agentv1.AgentClient, output string, args []string) error) func(*pflag.FlagSet) runFunc {
	return func(fs *pflag.FlagSet) runFunc {
		return e.withAgent(fs, func(ctx context.Context, c agentv1.AgentClient, output string, args []string) error {
			ctx, cancel := context.WithTimeout(ctx, volumeCallTimeout)
			defer cancel()
			return call(ctx, c, output, args)
		})
	}
}

// provisionTimeout bounds volume create and volume rm: CreateVolume and
// DeleteVolume may take minutes (a cloud disk, a copy from a snapshot).
const provisionTimeout = 5 * time.Minute

// withProvisioning is withAgent with each call bounded by --timeout.
func (e *env) withProvisioning(fs *pflag.FlagSet, call func(ctx context.Context, c agentv1.AgentClient, output string, args []string) error) runFunc {
	timeout := fs.Duration("timeout", provisionTimeout, "how long to wait for the agent (and the plugin's CreateVolume or DeleteVolume)")
	return e.withAgent(fs, func(ctx context.Context, c agentv1.AgentClient, output string, args []string) error {
		ctx, cancel := context.WithTimeout(ctx, *timeout)
		defer cancel()
		return call(ctx, c, output, args)
	})
}

func (e *env) volumeRemoveCmd(fs *pflag.FlagSet) runFunc {
	del := fs.Bool("delete", false, "delete the backend volume too (the plugin's DeleteVolume; refused while a container uses it); without it the backend volume is kept")
	secretsFile := fs.String("secrets-file", "", "with --delete: JSON file with an object of strings passed as DeleteVolume's secrets (never stored or logged)")
	return e.withProvisioning(fs, func(ctx context.Context, c agentv1.AgentClient, output string, args []string) error {
		req := &agentv1.RemoveNamedVolumeRequest{Name: args[0], DeleteVolume: *del}
		if *secretsFile != "" {
			if !*del {
				return usageError("--secrets-file is for --delete (DeleteVolume's secrets)")
			}
			s, err := readSecrets(*secretsFile)
			if err != nil {
				return err
			}
			req.Secrets = s
		}
		resp, err := c.RemoveNamedVolume(ctx, req)
		return printReply(e.stdout, output, resp, err, func() error {
			if *del {
				fmt.Fprintf(e.stdout, "%s (backend volume deleted)\n", args[0])
			} else {
				fmt.Fprintf(e.stdout, "%s (backend volume kept: --delete deletes it)\n", args[0])
			}
			return nil
		})
	})
}

func (e *env) volumeCreateCmd(fs *pflag.FlagSet) runFunc {
	opts := map[string]string{}
	str := func(key, usage string) {
		fs.Func(strings.ReplaceAll(key, "_", "-"), usage, func(v string) error { opts[key] = v; return nil })
	}
	str(namedvol.KeyPlugin, "the CSI plugin's type (required)")
	str(namedvol.KeyVolumeID, "a pre-provisioned volume's id (or --size: create one)")
	str(namedvol.KeySize, "create the volume (the plugin's CreateVolume, named csi-agent-NAME-HASH: a repeated create finds it again) with this capacity, e.g. 10GiB")
	str(namedvol.KeyFromSnapshot, "with --size: the new volume's content is this snapshot's (the plugin's snapshot id)")
	str(namedvol.KeyFromVolume, "with --size: the new volume is a clone of this volume (the plugin's volume id)")
	str(namedvol.KeyControllerPublishSecret, "ControllerPublish secret reference NAME/KEY in the agent's --secrets-dir (a plugin that attaches)")
	params := paramsFlag{}
	fs.Var(params, "param", "with --size: a CreateVolume parameter (KEY=VALUE, repeatable)")
	deleteOnRemove := fs.Bool("delete-on-remove", false, "with --size: an engine's removal (docker volume rm) deletes the backend volume too")
	secretsFile := fs.String("secrets-file", "", "with --size: JSON file with an object of strings passed as CreateVolume's secrets (never stored or logged)")
	str(namedvol.KeyFSType, "filesystem type of the mount capability")
	str(namedvol.KeyAccessMode, "CSI access mode (default SINGLE_NODE_WRITER; a READER_ONLY mode mounts read-only)")
	str(namedvol.KeyStageSecret, "NodeStage secret reference NAME/KEY in the agent's --secrets-dir")
	str(namedvol.KeyPublishSecret, "NodePublish secret reference NAME/KEY in the agent's --secrets-dir")
	str(namedvol.KeyUID, "with --gid: the user engine containers run as (docker run -u UID:GID); a fresh volume's root is given to them")
	str(namedvol.KeyGID, "with --uid: their group")
	block := fs.Bool("block", false, "a raw block volume (engines refuse to mount these)")
	allowAnnotations := fs.Bool("allow-annotations", false, "let containers name the volume in the "+MountsAnnotation+" annotation, which whoever may create a container (with CRI-O, a pod) can set (default: refused)")
	shareEngineMounts := fs.Bool("share-engine-mounts", false, "with --allow-annotations: let annotation users have the volume while engine mounts (docker run -v) hold it (default: refused)")
	flags := fs.StringArray("mount-flag", nil, "a mount flag (repeatable)")
	contextKV := fs.StringArray("context", nil, "a volume_context entry KEY=VALUE (repeatable)")
	return e.withProvisioning(fs, func(ctx context.Context, c agentv1.AgentClient, output string, args []string) error {
		for k, v := range params {
			opts[namedvol.ParamPrefix+k] = v
		}
		if *deleteOnRemove {
			opts[namedvol.KeyDeleteOnRemove] = "true"
		}
		var secrets map[string]string
		if *secretsFile != "" {
			s, err := readSecrets(*secretsFile)
			if err != nil {
				return err
			}
			secrets = s
		}
		if *block {
			opts[namedvol.KeyBlock] = "true"
		}
		if *allowAnnotations {
			opts[namedvol.KeyAllowAnnotations] = "true"
		}
		if *shareEngineMounts {
			opts[namedvol.KeyShareEngineMounts] = "true"
		}
		if len(*flags) > 0 {
			opts[namedvol.KeyMountFlags] = strings.Join(*flags, ",")
		}
		for _, kv := range *contextKV {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return usageError(fmt.Sprintf("--context %q: expected KEY=VALUE", kv))
			}
			opts[namedvol.ContextPrefix+k] = v
		}
		resp, err := c.CreateNamedVolume(ctx, &agentv1.CreateNamedVolumeRequest{Name: args[0], Options: opts, Secrets: secrets})
		return printReply(e.stdout, output, resp, err, func() error { fmt.Fprintln(e.stdout, args[0]); return nil })
	})
}

// volumeList lists every named volume, a page at a time.
func (e *env) volumeList(ctx context.Context, c agentv1.AgentClient, output string, _ []string) error {
	all := &agentv1.ListNamedVolumesResponse{}
	req := &agentv1.ListNamedVolumesRequest{}
	for {
		page, err := c.ListNamedVolumes(ctx, req)
		if err != nil {
			return err
		}
		all.Volumes = append(all.Volumes, page.GetVolumes()...)
		if page.GetNext() == "" {
			break
		}
		if page.GetNext() <= req.StartingAfter {
			return fmt.Errorf("listing named volumes: the page after %q ends at %q, not later", req.StartingAfter, page.GetNext())
		}
		req.StartingAfter = page.GetNext()
	}
	return printReply(e.stdout, output, all, nil, func() error {
		tw := newTable(e.stdout, "NAME\tPLUGIN\tVOLUME ID\tSTATE\tMOUNTS\tCREATOR")
		for _, v := range all.GetVolumes() {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", v.GetName(), v.GetOptions()[namedvol.KeyPlugin], v.GetOptions()[namedvol.KeyVolumeID], v.GetState(), len(v.GetEngineMountIds()), cmp.Or(v.GetCreator(), "-"))
		}
		return tw.Flush()
	})
}

func (e *env) volumeReconcileCmd(fs *pflag.FlagSet) runFunc {
	engine := fs.String("engine", "", "whose mounts: docker, podman, or other (engines the agent did not recognise, and mounts recorded before it told engines apart) (required)")
	live := fs.StringSlice("live-mount-ids", nil, "mount ids the engine still uses (Docker: MountPoints[].ID of each container's config.v2.json); every other mount of --engine is released (required; '' releases them all)")
	return e.withVolumes(func(ctx context.Context, c agentv1.AgentClient, output string, _ []string) error {
		// Without the list, every engine mount would be released from
		// under its running containers; without the engine, another
		// engine's too.
		if !fs.Changed("live-mount-ids") || *engine == "" {
			return usageError("--engine and --live-mount-ids are required: the engine (docker, podman, other) and the mount ids it still uses ('' releases every mount of the engine)")
		}
		resp, err := c.ReconcileEngineMounts(ctx, &agentv1.ReconcileEngineMountsRequest{Engine: *engine, LiveMountIds: *live})
		if err := printReply(e.stdout, output, resp, err, func() error {
			for _, r := range resp.GetReleased() {
				fmt.Fprintln(e.stdout, "released", r)
			}
			for m, msg := range resp.GetFailed() {
				fmt.Fprintf(e.stdout, "failed %s: %s\n", m, msg)
			}
			return nil
		}); err != nil {
			return err
		}
		if n := len(resp.GetFailed()); n > 0 {
			return fmt.Errorf("%d engine mount(s) could not be released", n)
		}
		return nil
	})(fs)
}
