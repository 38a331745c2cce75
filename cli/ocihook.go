package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// VolumesAnnotation is the OCI annotation that lists a container's CSI
// volumes: a JSON list of Mesos Volume objects.
const VolumesAnnotation = "csi.csiagent.io/volumes"

// MountsAnnotation lists a container's named volumes as
// NAME:/path[:ro][;NAME:/path[:ro]...]: no JSON, so that it survives
// engines that parse annotation values as CSV (podman run --annotation).
const MountsAnnotation = "csi.csiagent.io/mounts"

// DefaultHookTimeout bounds a hook's whole run, waiting for the agent
// included.
const DefaultHookTimeout = 60 * time.Second

// ociState is the container state a runtime passes to hooks on stdin.
type ociState struct {
	ID          string            `json:"id"`
	Status      string            `json:"status"`
	Pid         int               `json:"pid"`
	Bundle      string            `json:"bundle"`
	Annotations map[string]string `json:"annotations"`
}

// ociHookStages are the hook's stages: the OCI hooks it is written for.
var ociHookStages = []string{"create-runtime", "poststop"}

// ociHookCmd is csi-agent oci-hook create-runtime|poststop. It prints one
// line on stderr and exits 1 on failure, which makes runc fail the
// container's start (createRuntime) cleanly.
func (e *env) ociHookCmd() *cobra.Command {
	cmd := command("oci-hook [flags] [create-runtime|poststop]", "OCI runtime hook: create-runtime prepares, poststop cleans up",
		func(_ *cobra.Command, args []string) error {
			if len(args) > 1 || (len(args) == 1 && !slices.Contains(ociHookStages, args[0])) {
				return fmt.Errorf("expected create-runtime, poststop or nothing (the stage follows from the container's status), got %q", args)
			}
			return nil
		}, e.ociHookFlags)
	cmd.ValidArgs = ociHookStages
	cmd.Long = "The OCI runtime hook: add it to a bundle's config.json as createRuntime (args: csi-agent oci-hook create-runtime)\n" +
		"and poststop (args: csi-agent oci-hook poststop). It reads the container state on stdin. Without a stage it takes\n" +
		"it from the state's status (creating: create-runtime; stopped: poststop), so that one hooks.d file serves both."
	return cmd
}

// ociHookFlags declares the hook's flags and returns its body.
func (e *env) ociHookFlags(fs *pflag.FlagSet) runFunc {
	socket := apiSocketFlag(fs)
	timeout := fs.Duration("timeout", DefaultHookTimeout, "give up after this long (waiting for the agent included)")
	pluginSocket := dockerPluginSocketFlag(fs, "the agent's --docker-plugin-socket, where the named volumes of "+MountsAnnotation+" are looked up")
	return func(ctx context.Context, name string, args []string) int {
		stage := ""
		if len(args) == 1 {
			stage = args[0]
		}
		return e.ociHook(ctx, name, stage, *socket, *pluginSocket, *timeout)
	}
}

// ociHook runs the hook's stage ("": the one the container's status
// says).
func (e *env) ociHook(ctx context.Context, name, stage, socket, pluginSocket string, timeout time.Duration) int {
	fail := func(err error) int {
		fmt.Fprintf(e.stderr, "%s: %v\n", strings.TrimSpace(name+" "+stage), err)
		return ExitProblem
	}
	st, err := readOCIState(e.stdin)
	if err != nil {
		return fail(err)
	}
	if stage == "" {
		switch st.Status {
		case "creating", "created":
			stage = "create-runtime"
		case "stopped":
			stage = "poststop"
		default:
			return fail(fmt.Errorf("container status %q: expected creating (createRuntime) or stopped (poststop); name the stage", st.Status))
		}
	}
	raw, hasVolumes := st.Annotations[VolumesAnnotation]
	mounts, hasMounts := st.Annotations[MountsAnnotation]
	if !hasVolumes && !hasMounts {
		return ExitOK // no CSI volumes: nothing to do
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	client, closeConn, err := dialAgent(socket)
	if err != nil {
		return fail(err)
	}
	defer closeConn()
	// Hooks may run while the agent restarts: wait for it, within the
	// timeout.
	wait := grpc.WaitForReady(true)
	if stage == "poststop" {
		if _, err := client.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: st.ID}, wait); err != nil {
			return fail(hookError(socket, err))
		}
		return ExitOK
	}
	var vols []*agentv1.Volume
	if hasVolumes {
		if vols, err = parseVolumes([]byte(raw)); err != nil {
			return fail(fmt.Errorf("annotation %s: %w", VolumesAnnotation, err))
		}
	}
	if hasMounts {
		named, err := namedVolumes(ctx, pluginSocket, mounts)
		if err != nil {
			return fail(fmt.Errorf("annotation %s: %w", MountsAnnotation, err))
		}
		vols = append(vols, named...)
	}
	rootfs, user, err := readBundle(st.Bundle)
	if err != nil {
		return fail(err)
	}
	_, err = client.Prepare(ctx, &agentv1.PrepareRequest{ContainerId: st.ID, Volumes: vols, Rootfs: rootfs, Pid: int32(st.Pid), User: user}, wait)
	if err != nil {
		return fail(hookError(socket, err))
	}
	return ExitOK
}

// maxOCIState bounds the container state a hook reads from stdin.
const maxOCIState = 1 << 20

// readOCIState decodes the container state a runtime passes on stdin.
func readOCIState(r io.Reader) (ociState, error) {
	var st ociState
	if err := json.NewDecoder(io.LimitReader(r, maxOCIState)).Decode(&st); err != nil {
		return ociState{}, fmt.Errorf("reading the container state from stdin: %w", err)
	}
	return st, nil
}

func hookError(socket string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) || status.Code(err) == codes.DeadlineExceeded {
		return fmt.Errorf("no answer from the agent at %s in time: %s", socket, status.Convert(err).Message())
	}
	return errors.New(apiError(socket, err))
}

// readBundle reads root.path (a relative path is relative to the bundle)
// and process.user from the bundle's config.json. user is "UID:GID" for a
// container that runs as another user than root, else "".
func readBundle(bundle string) (rootfs, user string, _ error) {
	if !filepath.IsAbs(bundle) {
		return "", "", fmt.Errorf("bundle %q is not an absolute path", bundle)
	}
	b, err := os.ReadFile(filepath.Join(bundle, "config.json"))
	if err != nil {
		return "", "", fmt.Errorf("reading the bundle's config.json: %w", err)
	}
	var cfg struct {
		Root struct {
			Path string `json:"path"`
		} `json:"root"`
		Process struct {
			User struct {
				UID uint32 `json:"uid"`
				GID uint32 `json:"gid"`
			} `json:"user"`
		} `json:"process"`
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		return "", "", fmt.Errorf("parsing %s: %w", filepath.Join(bundle, "config.json"), err)
	}
	if cfg.Root.Path == "" {
		return "", "", errors.New("the bundle's config.json has no root.path")
	}
	if u := cfg.Process.User; u.UID != 0 || u.GID != 0 {
		user = fmt.Sprintf("%d:%d", u.UID, u.GID)
	}
	if filepath.IsAbs(cfg.Root.Path) {
		return filepath.Clean(cfg.Root.Path), user, nil
	}
	return filepath.Join(bundle, cfg.Root.Path), user, nil
}

// namedVolumes reads named mounts NAME:PATH[:ro];... (the mounts
// annotation, prepare --mounts) and looks the names up in the agent; the
// agent checks the paths as any container path.
func namedVolumes(ctx context.Context, socket, value string) ([]*agentv1.Volume, error) {
	c := dockerplugin.NewClient(socket)
	var out []*agentv1.Volume
	for i, m := range strings.Split(value, ";") {
		parts := strings.Split(m, ":")
		ro := false
		if len(parts) == 3 && parts[2] == "ro" {
			ro, parts = true, parts[:2]
		}
		if len(parts) != 2 || parts[0] == "" || parts[1] == "" {
			return nil, fmt.Errorf("mount %d %q: expected NAME:PATH or NAME:PATH:ro", i+1, namedvol.Clip(m))
		}
		d, err := c.Definition(ctx, parts[0])
		if err != nil {
			return nil, fmt.Errorf("mount %d: %w", i+1, err)
		}
		if d.Block {
			return nil, fmt.Errorf("mount %d: volume %s is a block volume; name it in %s instead", i+1, d.Name, VolumesAnnotation)
		}
		out = append(out, d.Volume(parts[1], ro))
	}
	return out, nil
}
