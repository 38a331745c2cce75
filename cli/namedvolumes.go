package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/namedvol"
)

// dockerPluginSocketName is the file in the runtime dir where csi-agent
// serve speaks Docker's volume plugin protocol unless told otherwise.
const dockerPluginSocketName = "docker-plugin.sock"

// volumeCallTimeout bounds one call of the volume commands.
const volumeCallTimeout = 30 * time.Second

// listFlag collects a repeated flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// runVolume dispatches csi-agent volume create|rm|inspect|ls.
func runVolume(ctx context.Context, e *env, args []string) int {
	subs := map[string]func(context.Context, *env, []string) int{
		"create": runVolumeCreate, "rm": runVolumeRemove, "inspect": runVolumeInspect, "ls": runVolumeList,
		"reconcile": runVolumeReconcile,
	}
	if len(args) == 0 || subs[args[0]] == nil {
		fmt.Fprintln(e.stderr, "usage: csi-agent volume create|rm|inspect|ls|reconcile [flags] [NAME]\n\nnamed CSI volumes, as container engines use them (docker volume create -d csi-agent)")
		return ExitUsage
	}
	return subs[args[0]](ctx, e, args[1:])
}

// withVolumes parses a volume command (NAME may come before or after the
// flags) and runs call with a client of the agent's plugin socket.
func withVolumes(ctx context.Context, e *env, fs *flag.FlagSet, args []string, wantName bool,
	call func(ctx context.Context, c *dockerplugin.Client, name string) error) int {
	socket := fs.String("docker-plugin-socket", filepath.Join(agent.DefaultRuntimeDir, dockerPluginSocketName), "the socket of the agent's serve --docker-plugin-socket")
	usage := ""
	if wantName {
		usage = "NAME"
	}
	var name string
	if wantName && len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		name, args = args[0], args[1:]
	}
	if code, done := e.parseFlags(fs, args, usage); done {
		return code
	}
	rest := fs.Args()
	if wantName && name == "" && len(rest) > 0 {
		name, rest = rest[0], rest[1:]
	}
	if (wantName && name == "") || len(rest) > 0 {
		fmt.Fprintf(e.stderr, "usage: csi-agent volume %s [flags] %s\n", fs.Name(), usage)
		return ExitUsage
	}
	ctx, cancel := context.WithTimeout(ctx, volumeCallTimeout)
	defer cancel()
	if err := call(ctx, dockerplugin.NewClient(*socket), name); err != nil {
		fmt.Fprintf(e.stderr, "csi-agent volume %s: %v\n", fs.Name(), err)
		return ExitProblem
	}
	return ExitOK
}

func runVolumeCreate(ctx context.Context, e *env, args []string) int {
	fs := flag.NewFlagSet("create", flag.ContinueOnError)
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
	var flags, contextKV listFlag
	fs.Var(&flags, "mount-flag", "a mount flag (repeatable)")
	fs.Var(&contextKV, "context", "a volume_context entry KEY=VALUE (repeatable)")
	return withVolumes(ctx, e, fs, args, true, func(ctx context.Context, c *dockerplugin.Client, name string) error {
		if *block {
			opts[namedvol.KeyBlock] = "true"
		}
		if len(flags) > 0 {
			opts[namedvol.KeyMountFlags] = strings.Join(flags, ",")
		}
		for _, kv := range contextKV {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return fmt.Errorf("--context %q: expected KEY=VALUE", kv)
			}
			opts[namedvol.ContextPrefix+k] = v
		}
		if err := c.Create(ctx, name, opts); err != nil {
			return err
		}
		fmt.Fprintln(e.stdout, name)
		return nil
	})
}

func runVolumeRemove(ctx context.Context, e *env, args []string) int {
	fs := flag.NewFlagSet("rm", flag.ContinueOnError)
	return withVolumes(ctx, e, fs, args, true, func(ctx context.Context, c *dockerplugin.Client, name string) error {
		return c.Remove(ctx, name)
	})
}

func runVolumeInspect(ctx context.Context, e *env, args []string) int {
	fs := flag.NewFlagSet("inspect", flag.ContinueOnError)
	return withVolumes(ctx, e, fs, args, true, func(ctx context.Context, c *dockerplugin.Client, name string) error {
		v, err := c.Get(ctx, name)
		if err != nil {
			return err
		}
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			return err
		}
		fmt.Fprintln(e.stdout, string(b))
		return nil
	})
}

func runVolumeList(ctx context.Context, e *env, args []string) int {
	fs := flag.NewFlagSet("ls", flag.ContinueOnError)
	output := outputFlag(fs)
	return withVolumes(ctx, e, fs, args, false, func(ctx context.Context, c *dockerplugin.Client, _ string) error {
		if err := checkOutput(*output); err != nil {
			return err
		}
		vols, err := c.List(ctx)
		if err != nil {
			return err
		}
		if *output == "json" {
			b, err := json.MarshalIndent(vols, "", "  ")
			if err != nil {
				return err
			}
			fmt.Fprintln(e.stdout, string(b))
			return nil
		}
		tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tPLUGIN\tVOLUME ID\tSTATE\tMOUNTS")
		for _, v := range vols {
			mounts, _ := v.Status["mounts"].([]any)
			opts, _ := v.Status[dockerplugin.StatusOptions].(map[string]any)
			fmt.Fprintf(tw, "%s\t%v\t%v\t%v\t%d\n", v.Name, opts[namedvol.KeyPlugin], opts[namedvol.KeyVolumeID], v.Status["state"], len(mounts))
		}
		return tw.Flush()
	})
}

func runVolumeReconcile(ctx context.Context, e *env, args []string) int {
	fs := flag.NewFlagSet("reconcile", flag.ContinueOnError)
	live := fs.String("live-mount-ids", "", "comma-separated mount ids the engines still use (Docker: MountPoints[].ID of each container's config.v2.json); every other engine mount is released")
	return withVolumes(ctx, e, fs, args, false, func(ctx context.Context, c *dockerplugin.Client, _ string) error {
		var ids []string
		if *live != "" {
			ids = strings.Split(*live, ",")
		}
		resp, err := c.Reconcile(ctx, ids)
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
