package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/namedvol"
)

// dockerPluginSocketName is the file in the runtime dir where csi-agent
// serve speaks Docker's volume plugin protocol unless told otherwise.
const dockerPluginSocketName = "docker-plugin.sock"

// volumeCallTimeout bounds one call of the volume commands.
const volumeCallTimeout = 30 * time.Second

// dockerPluginSocketFlag registers --docker-plugin-socket of a client.
func dockerPluginSocketFlag(fs *pflag.FlagSet, usage string) *string {
	return fs.String("docker-plugin-socket", filepath.Join(agent.DefaultRuntimeDir, dockerPluginSocketName), usage)
}

// volumeCmd is csi-agent volume create|rm|inspect|ls|reconcile.
func (e *env) volumeCmd() *cobra.Command {
	return e.group("volume", "named CSI volumes for container engines: create, rm, inspect, ls, reconcile",
		"Named CSI volumes, as container engines use them (docker volume create -d csi-agent). The commands talk to the\nagent's --docker-plugin-socket.",
		command("create NAME [flags]", "define a named volume", cobra.ExactArgs(1), e.volumeCreateCmd),
		command("rm NAME", "remove a named volume (refused while an engine or a container uses it)", cobra.ExactArgs(1), e.volumeNameCmd(func(ctx context.Context, c *dockerplugin.Client, name string) error {
			return c.Remove(ctx, name)
		})),
		command("inspect NAME", "show a named volume: its options, its state in the agent, the engines' mounts", cobra.ExactArgs(1), e.volumeNameCmd(func(ctx context.Context, c *dockerplugin.Client, name string) error {
			v, err := c.Get(ctx, name)
			if err != nil {
				return err
			}
			return e.printIndented(v)
		})),
		command("ls [flags]", "list the named volumes", noArgs, e.volumeListCmd),
		command("reconcile [flags]", "release every engine mount whose mount id is not in --live-mount-ids", noArgs, e.volumeReconcileCmd),
	)
}

// withVolumes declares --docker-plugin-socket and runs call with a client
// of it, within volumeCallTimeout.
func (e *env) withVolumes(fs *pflag.FlagSet, call func(ctx context.Context, c *dockerplugin.Client, args []string) error) runFunc {
	socket := dockerPluginSocketFlag(fs, "the socket of the agent's serve --docker-plugin-socket")
	return func(ctx context.Context, name string, args []string) int {
		ctx, cancel := context.WithTimeout(ctx, volumeCallTimeout)
		defer cancel()
		if err := call(ctx, dockerplugin.NewClient(*socket), args); err != nil {
			fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
			var usage usageError
			if errors.As(err, &usage) {
				return ExitUsage
			}
			return ExitProblem
		}
		return ExitOK
	}
}

// volumeNameCmd is a command on one NAME with no flags of its own.
func (e *env) volumeNameCmd(call func(ctx context.Context, c *dockerplugin.Client, name string) error) func(*pflag.FlagSet) runFunc {
	return func(fs *pflag.FlagSet) runFunc {
		return e.withVolumes(fs, func(ctx context.Context, c *dockerplugin.Client, args []string) error {
			return call(ctx, c, args[0])
		})
	}
}

func (e *env) printIndented(v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	fmt.Fprintln(e.stdout, string(b))
	return nil
}

func (e *env) volumeCreateCmd(fs *pflag.FlagSet) runFunc {
	opts := map[string]string{}
	str := func(key, usage string) {
		fs.Func(strings.ReplaceAll(key, "_", "-"), usage, func(v string) error { opts[key] = v; return nil })
	}
	str(namedvol.KeyPlugin, "the CSI plugin's type (required)")
	str(namedvol.KeyVolumeID, "the pre-provisioned volume's id (required)")
	str(namedvol.KeyFSType, "filesystem type of the mount capability")
	str(namedvol.KeyAccessMode, "CSI access mode (default SINGLE_NODE_WRITER; a READER_ONLY mode mounts read-only)")
	str(namedvol.KeyStageSecret, "NodeStage secret reference NAME/KEY in the agent's --secrets-dir")
	str(namedvol.KeyPublishSecret, "NodePublish secret reference NAME/KEY in the agent's --secrets-dir")
	block := fs.Bool("block", false, "a raw block volume (engines refuse to mount these)")
	allowAnnotations := fs.Bool("allow-annotations", false, "let containers name the volume in the "+MountsAnnotation+" annotation, which whoever may create a container (with CRI-O, a pod) can set (default: refused)")
	shareEngineMounts := fs.Bool("share-engine-mounts", false, "with --allow-annotations: let annotation users have the volume while engine mounts (docker run -v) hold it (default: refused)")
	flags := fs.StringArray("mount-flag", nil, "a mount flag (repeatable)")
	contextKV := fs.StringArray("context", nil, "a volume_context entry KEY=VALUE (repeatable)")
	return e.withVolumes(fs, func(ctx context.Context, c *dockerplugin.Client, args []string) error {
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
		if err := c.Create(ctx, args[0], opts); err != nil {
			return err
		}
		fmt.Fprintln(e.stdout, args[0])
		return nil
	})
}

func (e *env) volumeListCmd(fs *pflag.FlagSet) runFunc {
	output := outputFlag(fs)
	return e.withVolumes(fs, func(ctx context.Context, c *dockerplugin.Client, _ []string) error {
		if err := checkOutput(*output); err != nil {
			return err
		}
		vols, err := c.List(ctx)
		if err != nil {
			return err
		}
		if *output == "json" {
			return e.printIndented(vols)
		}
		tw := newTable(e.stdout, "NAME\tPLUGIN\tVOLUME ID\tSTATE\tMOUNTS")
		for _, v := range vols {
			mounts, _ := v.Status["mounts"].([]any)
			opts, _ := v.Status[dockerplugin.StatusOptions].(map[string]any)
			fmt.Fprintf(tw, "%s\t%v\t%v\t%v\t%d\n", v.Name, opts[namedvol.KeyPlugin], opts[namedvol.KeyVolumeID], v.Status["state"], len(mounts))
		}
		return tw.Flush()
	})
}

func (e *env) volumeReconcileCmd(fs *pflag.FlagSet) runFunc {
	live := fs.StringSlice("live-mount-ids", nil, "mount ids the engines still use (Docker: MountPoints[].ID of each container's config.v2.json); every other engine mount is released (required; '' releases them all)")
	return e.withVolumes(fs, func(ctx context.Context, c *dockerplugin.Client, _ []string) error {
		// Without the list, every engine mount would be released from
		// under its running containers.
		if !fs.Changed("live-mount-ids") {
			return usageError("--live-mount-ids is required: the mount ids the engines still use ('' releases every engine mount)")
		}
		resp, err := c.Reconcile(ctx, *live)
		if err != nil {
			return err
		}
		for _, r := range resp.Released {
			fmt.Fprintln(e.stdout, "released", r)
		}
		for m, msg := range resp.Failed {
			fmt.Fprintf(e.stdout, "failed %s: %s\n", m, msg)
		}
		if len(resp.Failed) > 0 {
			return fmt.Errorf("%d engine mount(s) could not be released", len(resp.Failed))
		}
		return nil
	})
}
