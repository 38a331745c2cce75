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
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/isolator"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// VolumesAnnotation is the OCI annotation that lists a container's CSI
// volumes: a JSON list of Mesos Volume objects.
const VolumesAnnotation = "csi.csiagent.io/volumes"

// DefaultHookTimeout bounds a hook's whole run, waiting for the agent
// included.
const DefaultHookTimeout = 60 * time.Second

// ociState is the container state a runtime passes to hooks on stdin.
type ociState struct {
	ID          string            `json:"id"`
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
	cmd := command("oci-hook [flags] create-runtime|poststop", "OCI runtime hook: create-runtime prepares, poststop cleans up",
		func(_ *cobra.Command, args []string) error {
			if len(args) != 1 || !slices.Contains(ociHookStages, args[0]) {
				return fmt.Errorf("expected create-runtime or poststop, got %q", args)
			}
			return nil
		}, e.ociHookFlags)
	cmd.ValidArgs = ociHookStages
	cmd.Long = "The OCI runtime hook: add it to a bundle's config.json as createRuntime (args: csi-agent oci-hook create-runtime)\n" +
		"and poststop (args: csi-agent oci-hook poststop). It reads the container state on stdin."
	return cmd
}

// ociHookFlags declares the hook's flags and returns its body.
func (e *env) ociHookFlags(fs *pflag.FlagSet) runFunc {
	socket := apiSocketFlag(fs)
	timeout := fs.Duration("timeout", DefaultHookTimeout, "give up after this long (waiting for the agent included)")
	return func(ctx context.Context, name string, args []string) int {
		return e.ociHook(ctx, name+" "+args[0], args[0], *socket, *timeout)
	}
}

// ociHook runs the hook's stage.
func (e *env) ociHook(ctx context.Context, name, stage, socket string, timeout time.Duration) int {
	fail := func(err error) int {
		fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
		return ExitProblem
	}
	st, err := readOCIState(e.stdin)
	if err != nil {
		return fail(err)
	}
	raw, ok := st.Annotations[VolumesAnnotation]
	if !ok {
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
	vols, err := isolator.ParseVolumes([]byte(raw))
	if err != nil {
		return fail(fmt.Errorf("annotation %s: %w", VolumesAnnotation, err))
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
