package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/pflag"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/agent"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// apiTimeout bounds each CLI call to the agent.
const apiTimeout = 30 * time.Second

// apiSocketFlag registers --api-socket for client commands.
func apiSocketFlag(fs *pflag.FlagSet) *string {
	return fs.String("api-socket", agent.DefaultRuntimeDir+"/agent.sock", "the agent API socket")
}

// dialAgent connects to the agent's API socket.
func dialAgent(socket string) (agentv1.AgentClient, func(), error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			// Each call gets apiTimeout; waits (--wait) have their own.
			ctx, cancel := context.WithTimeout(ctx, apiTimeout)
			defer cancel()
			return invoker(ctx, method, req, reply, cc, opts...)
		}))
	if err != nil {
		return nil, nil, fmt.Errorf("connecting to the agent at %s: %w", socket, err)
	}
	return agentv1.NewAgentClient(conn), func() { conn.Close() }, nil
}

// apiError makes a gRPC error one readable line.
func apiError(socket string, err error) string {
	st := status.Convert(err)
	if strings.Contains(st.Message(), "connect: no such file or directory") || strings.Contains(st.Message(), "connection refused") {
		return fmt.Sprintf("cannot reach the agent at %s: is csi-agent serve running?", socket)
	}
	if strings.Contains(st.Message(), "connect: permission denied") {
		return fmt.Sprintf("may not connect to the agent at %s: only root and members of the agent's --api-group may", socket)
	}
	return fmt.Sprintf("%s: %s", st.Code(), st.Message())
}

// printJSON writes m as indented JSON with the proto field names
// (snake_case, as in Mesos's JSON) and stable spacing.
func printJSON(w io.Writer, m proto.Message) error {
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
	if err != nil {
		return err
	}
	var out bytes.Buffer
	if err := json.Indent(&out, b, "", "  "); err != nil {
		return err
	}
	out.WriteByte('\n')
	_, err = out.WriteTo(w)
	return err
}

// printReply prints the reply of a call that returned err (nothing if
// err is not nil: it returns err): as JSON with --output json, else with
// table.
func printReply(w io.Writer, output string, reply proto.Message, err error, table func() error) error {
	switch {
	case err != nil:
		return err
	case output == "json":
		return printJSON(w, reply)
	default:
		return table()
	}
}

// newTable starts a table on w with its header (columns separated by
// tabs); the caller writes the rows and flushes it.
func newTable(w io.Writer, header string) *tabwriter.Writer {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, header)
	return tw
}

// pluginsCmd is csi-agent plugins [TYPE].
func (e *env) pluginsCmd(fs *pflag.FlagSet) runFunc {
	wait := fs.Duration("wait", 0, "first wait up to this long for the agent to start and every plugin (or TYPE) to be READY; exit 1 if they are not")
	return e.withAgent(fs, func(ctx context.Context, client agentv1.AgentClient, output string, args []string) error {
		typ := ""
		if len(args) == 1 {
			typ = args[0]
		}
		if *wait > 0 {
			if err := waitReady(ctx, client, typ, *wait); err != nil {
				return err
			}
		}
		if typ != "" {
			resp, err := client.GetPlugin(ctx, &agentv1.GetPluginRequest{Type: typ})
			return printReply(e.stdout, output, resp.GetPlugin(), err, func() error {
				printPluginDetail(e.stdout, resp.GetPlugin())
				return nil
			})
		}
		resp, err := client.ListPlugins(ctx, &agentv1.ListPluginsRequest{})
		return printReply(e.stdout, output, resp, err, func() error {
			printPluginTable(e.stdout, resp)
			return nil
		})
	})
}

func stateName(s agentv1.PluginState) string {
	return strings.TrimPrefix(s.String(), "PLUGIN_STATE_")
}

func printPluginTable(w io.Writer, resp *agentv1.ListPluginsResponse) {
	tw := newTable(w, "TYPE\tNAME\tKIND\tSTATE\tSERVICES\tPID\tRESTARTS\tPLUGIN\tERROR")
	for _, p := range resp.GetPlugins() {
		kind := "unmanaged"
		if p.GetManaged() {
			kind = "managed"
		}
		for _, in := range p.GetInstances() {
			pid := "-"
			if in.GetPid() != 0 {
				pid = fmt.Sprint(in.GetPid())
				if in.GetAdopted() {
					pid += " (adopted)"
				}
			}
			plugin := in.GetPluginName()
			if in.GetVendorVersion() != "" {
				plugin += " " + in.GetVendorVersion()
			}
			errText := in.GetLastError()
			if p.GetConfigError() != "" {
				errText = "config: " + p.GetConfigError()
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\n", p.GetType(), p.GetName(), kind, stateName(in.GetState()),
				serviceList(in.GetServices()), pid, in.GetRestarts(), orDash(plugin), orDash(oneLine(errText)))
		}
	}
	tw.Flush()
	for _, ce := range resp.GetConfigErrors() {
		fmt.Fprintf(w, "INVALID %s: %s\n", ce.GetFile(), ce.GetError())
	}
}

func serviceList(s []string) string {
	out := make([]string, len(s))
	for i, x := range s {
		out[i] = strings.ToLower(strings.TrimSuffix(x, "_SERVICE"))
	}
	return strings.Join(out, ",")
}

func oneLine(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > 100 {
		s = s[:100] + "…"
	}
	return s
}

func printPluginDetail(w io.Writer, p *agentv1.Plugin) {
	tw := tabwriter.NewWriter(w, 0, 4, 1, ' ', 0)
	kv := func(k, v string) { fmt.Fprintf(tw, "%s:\t%s\n", k, orDash(v)) }
	kv("Type", p.GetType())
	kv("Name", p.GetName())
	kv("Config file", p.GetConfigFile())
	kv("Managed", fmt.Sprint(p.GetManaged()))
	kv("State", stateName(p.GetState()))
	kv("Config error", p.GetConfigError())
	if c := p.GetCapacity(); c != nil {
		switch {
		case c.GetError() != "":
			kv("Capacity", "unknown: "+c.GetError())
		case c.GetMaximumVolumeBytes() > 0:
			kv("Capacity", fmt.Sprintf("%s available, volumes of at most %s", bytesHuman(c.GetAvailableBytes()), bytesHuman(c.GetMaximumVolumeBytes())))
		default:
			kv("Capacity", bytesHuman(c.GetAvailableBytes())+" available")
		}
	}
	if rc := p.GetReclaim(); rc != nil {
		sched := "scheduled"
		if !rc.GetScheduled() {
			sched = "not scheduled: " + rc.GetReason()
		}
		kv("Reclaim", fmt.Sprintf("%s; %d run(s), %d failure(s), %s freed", sched, rc.GetRuns(), rc.GetFailures(), bytesHuman(rc.GetBytesReclaimed())))
		kv("Reclaim last error", rc.GetLastError())
		if ids := rc.GetUnsupportedVolumes(); len(ids) > 0 {
			kv("Reclaim unsupported", strings.Join(ids, ", ")+" (Unimplemented: cannot discard; retried when the plugin changes)")
		}
	}
	for i, in := range p.GetInstances() {
		fmt.Fprintf(tw, "Instance %d:\t\n", i)
		kv("  Services", strings.Join(in.GetServices(), ", "))
		kv("  Endpoint", in.GetEndpoint())
		kv("  State", fmt.Sprintf("%s since %s", stateName(in.GetState()), in.GetStateSince().AsTime().Local().Format(time.RFC3339)))
		if p.GetManaged() {
			kv("  PID", fmt.Sprintf("%d (adopted: %v)", in.GetPid(), in.GetAdopted()))
			kv("  Restarts", fmt.Sprint(in.GetRestarts()))
		}
		if in.GetNextStart() != nil {
			kv("  Next start", in.GetNextStart().AsTime().Local().Format(time.RFC3339))
		}
		kv("  Plugin", strings.TrimSpace(in.GetPluginName()+" "+in.GetVendorVersion()))
		kv("  Plugin capabilities", strings.Join(in.GetPluginCapabilities(), ", "))
		kv("  Node capabilities", strings.Join(in.GetNodeCapabilities(), ", "))
		if cc := in.GetControllerCapabilities(); len(cc) > 0 {
			kv("  Controller capabilities", strings.Join(cc, ", "))
		}
		kv("  Node ID", in.GetNodeId())
		if topo := in.GetAccessibleTopology(); len(topo) > 0 {
			var segs []string
			for _, k := range slices.Sorted(maps.Keys(topo)) {
				segs = append(segs, k+"="+topo[k])
			}
			kv("  Topology", strings.Join(segs, ", "))
		}
		if n := in.GetMaxVolumesPerNode(); n > 0 {
			kv("  Max volumes per node", fmt.Sprint(n))
		}
		kv("  csi-addons services", strings.Join(in.GetAddonsServices(), ", "))
		if ep := in.GetAddonsEndpoint(); ep != "" {
			kv("  csi-addons endpoint", strings.TrimSpace(ep+" "+parens(in.GetAddonsIdentity()))+" (csi-addons services; csi.v1.* on Endpoint)")
		}
		kv("  Last error", in.GetLastError())
	}
	tw.Flush()
}

// waitReady follows WatchPlugins until every plugin (or the one of type
// typ) is READY, for at most d.
func waitReady(ctx context.Context, client agentv1.AgentClient, typ string, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	// WaitForReady: the agent may still be starting.
	stream, err := client.WatchPlugins(ctx, &agentv1.ListPluginsRequest{}, grpc.WaitForReady(true))
	if err != nil {
		return fmt.Errorf("watching plugins: %w", err)
	}
	var pending []string
	for {
		resp, err := stream.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("not ready after %v: %s", d, strings.Join(pending, "; "))
			}
			return fmt.Errorf("watching plugins: %s", status.Convert(err).Message())
		}
		pending = pending[:0]
		found := typ == ""
		for _, p := range resp.GetPlugins() {
			if typ != "" && p.GetType() != typ {
				continue
			}
			found = true
			if p.GetState() != agentv1.PluginState_PLUGIN_STATE_READY {
				msg := p.GetType() + " is " + stateName(p.GetState())
				for _, in := range p.GetInstances() {
					if in.GetLastError() != "" {
						msg += " (" + oneLine(in.GetLastError()) + ")"
						break
					}
				}
				pending = append(pending, msg)
			}
		}
		if !found {
			pending = append(pending, "no plugin of type "+typ)
		}
		if len(pending) == 0 {
			return nil
		}
	}
}

// parens is "(s)", or "" for an empty s.
func parens(s string) string {
	if s == "" {
		return ""
	}
	return "(" + s + ")"
}
