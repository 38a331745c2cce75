package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// VolumesAnnotation is the OCI annotation that lists a container's CSI
// volumes: a JSON list of Mesos Volume objects.
const VolumesAnnotation = "csi.csiagent.io/volumes"

// MountsAnnotation lists a container's named volumes as
// NAME:/path[:ro][;NAME:/path[:ro]...]: no JSON, so that it survives
// engines that parse annotation values as CSV (podman run --annotation).
const MountsAnnotation = namedvol.MountsAnnotation

// ManagerAnnotation names the container manager that created a container
// (Podman: libpod; CRI-O: cri-o); the hook passes it with the prepare, so
// that a reconcile with another manager's live list never touches it.
const ManagerAnnotation = "io.container.manager"

// ErrAnnotationRefused marks what the hook's annotation policy refuses:
// annotations are set by whoever may create a container (with CRI-O, a
// pod), so they reach only what the operator allowed.
var ErrAnnotationRefused = namedvol.ErrAnnotationRefused

// hookPolicy is what the operator lets annotations reach.
type hookPolicy struct {
	// allowReferenceSecrets lets the volumes annotation name REFERENCE
	// secrets, which the agent resolves from its --secrets-dir: secrets
	// that are the operator's, not the annotation writer's.
	allowReferenceSecrets bool
}

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
		"it from the state's status (creating: create-runtime; stopped: poststop), so that one hooks.d file serves both.\n\n" +
		"Annotations are set by whoever may create a container (with CRI-O, a pod), so the hook lets them reach only what\n" +
		"the operator allowed: a named volume in " + MountsAnnotation + " only if it was created with --allow-annotations\n" +
		"(docker: --opt allow_annotations=true), and not while engine mounts hold it unless also --share-engine-mounts;\n" +
		"REFERENCE secrets (resolved from the agent's --secrets-dir) in " + VolumesAnnotation + " only with\n" +
		"--allow-reference-secrets. VALUE secrets an annotation carries are its writer's own and always allowed."
	return cmd
}

// ociHookFlags declares the hook's flags and returns its body.
func (e *env) ociHookFlags(fs *pflag.FlagSet) runFunc {
	socket := apiSocketFlag(fs)
	timeout := fs.Duration("timeout", DefaultHookTimeout, "give up after this long (waiting for the agent included)")
	deprecatedPluginSocketFlag(fs)
	allowRefs := fs.Bool("allow-reference-secrets", false, "let "+VolumesAnnotation+" name REFERENCE secrets of the agent's --secrets-dir (default: refused; whoever may set the annotation could use any of them)")
	return func(ctx context.Context, name string, args []string) int {
		stage := ""
		if len(args) == 1 {
			stage = args[0]
		}
		return e.ociHook(ctx, name, stage, *socket, *timeout, hookPolicy{allowReferenceSecrets: *allowRefs})
	}
}

// ociHook runs the hook's stage ("": the one the container's status
// says).
func (e *env) ociHook(ctx context.Context, name, stage, socket string, timeout time.Duration, policy hookPolicy) int {
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
	if stage == "poststop" && !reachable(socket, min(poststopAgentWait, timeout)) {
		// Its processes are gone: the agent, back, finds nothing left
		// in its mount namespace and cleans it up itself. Holding the
		// runtime's stop up for it would help nobody.
		fmt.Fprintf(e.stderr, "%s poststop: the agent at %s does not answer; it cleans container %s up itself once it is back\n", name, socket, st.ID)
		return ExitOK
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
		if !policy.allowReferenceSecrets {
			if err := refuseReferenceSecrets(vols); err != nil {
				return fail(fmt.Errorf("annotation %s: %w", VolumesAnnotation, err))
			}
		}
	}
	var named []*agentv1.NamedMount
	if hasMounts {
		if named, err = parseNamedMounts(mounts); err != nil {
			return fail(fmt.Errorf("annotation %s: %w", MountsAnnotation, err))
		}
	}
	b, err := readBundle(st.Bundle)
	if err != nil {
		return fail(err)
	}
	// The agent resolves the names and applies the annotation policy.
	resp, err := client.Prepare(ctx, &agentv1.PrepareRequest{ContainerId: st.ID, Volumes: vols, NamedMounts: named, NamedMountsFromAnnotation: true,
		Rootfs: b.rootfs, Pid: int32(st.Pid), User: b.user, Manager: st.Annotations[ManagerAnnotation]}, wait)
	if err != nil {
		return fail(hookError(socket, err))
	}
	if err := checkDevices(resp.GetMounts(), b.devices); err != nil {
		// The container could not open its block volume: undone, and
		// the container is not created.
		if _, cerr := client.Cleanup(ctx, &agentv1.CleanupRequest{ContainerId: st.ID}, wait); cerr != nil {
			err = fmt.Errorf("%w; undoing the prepare: %s", err, hookError(socket, cerr))
		}
		return fail(err)
	}
	return ExitOK
}

// poststopAgentWait is how long poststop waits (at most its --timeout) for
// an agent that does not accept connections (restarting without systemd's
// socket) before leaving the cleanup to it.
const poststopAgentWait = 5 * time.Second

// reachable reports whether something accepts connections on the unix
// socket at path within wait (systemd's socket accepts into its backlog
// while the agent restarts: reachable).
func reachable(path string, wait time.Duration) bool {
	deadline := time.Now().Add(wait)
	for {
		c, err := net.DialTimeout("unix", path, max(time.Until(deadline), 100*time.Millisecond))
		if err == nil {
			c.Close()
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(100 * time.Millisecond)
	}
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

// bundle is what the hook reads of a bundle's config.json.
type bundle struct {
	rootfs string // root.path, absolute
	user   string // "UID:GID" for a container that runs as another user than root, else ""
	// linux.resources.devices: the container's device cgroup rules.
	devices []deviceRule
}

// readBundle reads root.path (a relative path is relative to the bundle),
// process.user and linux.resources.devices from the bundle's config.json.
func readBundle(dir string) (bundle, error) {
	if !filepath.IsAbs(dir) {
		return bundle{}, fmt.Errorf("bundle %q is not an absolute path", dir)
	}
	b, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return bundle{}, fmt.Errorf("reading the bundle's config.json: %w", err)
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
		Linux struct {
			Resources struct {
				Devices []deviceRule `json:"devices"`
			} `json:"resources"`
		} `json:"linux"`
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		return bundle{}, fmt.Errorf("parsing %s: %w", filepath.Join(dir, "config.json"), err)
	}
	if cfg.Root.Path == "" {
		return bundle{}, errors.New("the bundle's config.json has no root.path")
	}
	out := bundle{rootfs: cfg.Root.Path, devices: cfg.Linux.Resources.Devices}
	if u := cfg.Process.User; u.UID != 0 || u.GID != 0 {
		out.user = fmt.Sprintf("%d:%d", u.UID, u.GID)
	}
	if filepath.IsAbs(out.rootfs) {
		out.rootfs = filepath.Clean(out.rootfs)
	} else {
		out.rootfs = filepath.Join(dir, out.rootfs)
	}
	return out, nil
}

// refuseReferenceSecrets fails on the first REFERENCE secret anywhere in
// vols (by volume index, then field path): the agent would resolve it from
// its --secrets-dir, where the secrets are the operator's.
func refuseReferenceSecrets(vols []*agentv1.Volume) error {
	for i, v := range vols {
		var refs []string
		referenceSecrets(v.ProtoReflect(), "", &refs)
		if len(refs) > 0 {
			sort.Strings(refs)
			return fmt.Errorf("volumes[%d]: secret %s is a REFERENCE, resolved from the agent's --secrets-dir: %w (an annotation may carry VALUE secrets of its own; the operator allows references by adding --allow-reference-secrets to the hook's args in its hooks.d file)", i, refs[0], ErrAnnotationRefused)
		}
	}
	return nil
}

// referenceSecrets appends to refs the REFERENCE secrets in m, each as
// its field path and reference: every Secret, wherever the message holds
// one (node stage, node publish, any secrets map added later).
func referenceSecrets(m protoreflect.Message, path string, refs *[]string) {
	if s, ok := m.Interface().(*agentv1.Secret); ok {
		if s.GetType() == agentv1.Secret_REFERENCE {
			r := s.GetReference()
			*refs = append(*refs, fmt.Sprintf("%s (%s/%s)", path, namedvol.Clip(r.GetName()), namedvol.Clip(r.GetKey())))
		}
		return
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		name := string(fd.Name())
		if path != "" {
			name = path + "." + name
		}
		switch {
		case fd.IsMap():
			if fd.MapValue().Message() == nil {
				return true
			}
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				referenceSecrets(mv.Message(), name+"["+strconv.Quote(namedvol.Clip(k.String()))+"]", refs)
				return true
			})
		case fd.IsList():
			if fd.Message() == nil {
				return true
			}
			for j := range v.List().Len() {
				referenceSecrets(v.List().Get(j).Message(), fmt.Sprintf("%s[%d]", name, j), refs)
			}
		case fd.Message() != nil:
			referenceSecrets(v.Message(), name, refs)
		}
		return true
	})
}

// parseNamedMounts parses NAME:PATH[:ro][;...] (the mounts annotation,
// prepare --mounts) into the API's named mounts; the agent looks the
// names up.
func parseNamedMounts(value string) ([]*agentv1.NamedMount, error) {
	ms, err := namedvol.ParseMounts(value)
	if err != nil {
		return nil, err
	}
	out := make([]*agentv1.NamedMount, 0, len(ms))
	for _, m := range ms {
		out = append(out, &agentv1.NamedMount{Name: m.Name, ContainerPath: m.ContainerPath, Readonly: m.ReadOnly})
	}
	return out, nil
}
