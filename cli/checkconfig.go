package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/spf13/pflag"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/pluginconfig"
	"github.com/csiagent/csiagent/supervisor"
)

// checkReport is check-config's JSON output.
type checkReport struct {
	Dir     string         `json:"dir"`
	Plugins []checkPlugin  `json:"plugins"`
	Errors  []checkFileErr `json:"errors"`
}

type checkPlugin struct {
	File     string                   `json:"file"`
	Type     string                   `json:"type"`
	Name     string                   `json:"name"`
	Managed  bool                     `json:"managed"`
	Services []pluginconfig.Service   `json:"services"`
	Config   *pluginconfig.PluginInfo `json:"config"`
}

type checkFileErr struct {
	File  string `json:"file"`
	Error string `json:"error"`
}

// checkConfigCmd is csi-agent check-config [DIR]: by default the
// directory serve watches by default.
func (e *env) checkConfigCmd(fs *pflag.FlagSet) runFunc {
	output := outputFlag(fs)
	runtimeDir := fs.String("runtime-dir", agent.DefaultRuntimeDir, "serve's --runtime-dir, under which managed plugins' sockets go (checked to fit a unix socket address)")
	return func(ctx context.Context, name string, args []string) int {
		if err := checkOutput(*output); err != nil {
			fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
			return ExitUsage
		}
		dir := agent.DefaultConfigDir
		if len(args) == 1 {
			dir = args[0]
		}
		return e.checkConfig(ctx, name, dir, *runtimeDir, *output)
	}
}

// checkConfig validates the plugin config directory dir, and what serve
// with runtimeDir would find when launching its managed plugins
// (supervisor.CheckLaunch). It stops as soon as ctx ends (SIGINT,
// SIGTERM), even while a file is being read.
func (e *env) checkConfig(ctx context.Context, name, dir, runtimeDir, output string) int {
	set, err := pluginconfig.LoadContext(ctx, dir)
	if err != nil {
		fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
		return ExitProblem
	}
	report := checkReport{Dir: dir, Plugins: []checkPlugin{}, Errors: []checkFileErr{}}
	for _, p := range set.Sorted() {
		report.Plugins = append(report.Plugins, checkPlugin{
			File: p.File, Type: p.Info.Type, Name: p.Info.Name, Managed: p.Info.Managed(),
			Services: p.Info.Services(), Config: p.Info,
		})
	}
	for _, fe := range set.Errors {
		report.Errors = append(report.Errors, checkFileErr{File: fe.File, Error: fe.Err.Error()})
	}
	for _, p := range set.Sorted() {
		if err := supervisor.CheckLaunch(p, runtimeDir); err != nil {
			report.Errors = append(report.Errors, checkFileErr{File: p.File, Error: "cannot launch: " + strings.ReplaceAll(err.Error(), "\n", "; ")})
		}
	}
	if output == "json" {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		enc.SetEscapeHTML(false)
		if err := enc.Encode(report); err != nil {
			fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
			return ExitProblem
		}
	} else {
		printCheckTable(e, set, report)
	}
	if len(report.Errors) > 0 {
		return ExitProblem
	}
	return ExitOK
}

func printCheckTable(e *env, set *pluginconfig.Set, r checkReport) {
	tw := newTable(e.stdout, "FILE\tTYPE\tNAME\tKIND\tSERVICES\tRUNS / ENDPOINTS")
	for _, p := range set.Sorted() {
		kind, runs := "unmanaged", endpoints(p.Info)
		if p.Info.Managed() {
			kind, runs = "managed", commandsOf(p.Info)
		}
		var svcs []string
		for _, s := range p.Info.Services() {
			svcs = append(svcs, string(s))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", filepath.Base(p.File), p.Info.Type, p.Info.Name, kind, strings.Join(svcs, ","), orDash(runs))
	}
	tw.Flush()
	for _, fe := range r.Errors {
		fmt.Fprintf(e.stdout, "INVALID %s: %s\n", fe.File, fe.Error)
	}
	fmt.Fprintf(e.stdout, "%d plugin(s), %d invalid file(s) in %s\n", len(r.Plugins), len(r.Errors), r.Dir)
}

func endpoints(p *pluginconfig.PluginInfo) string {
	var out []string
	for _, ep := range p.Endpoints {
		out = append(out, fmt.Sprintf("%s=%s", serviceShort(ep.CSIService), ep.Endpoint))
	}
	return strings.Join(out, " ")
}

func commandsOf(p *pluginconfig.PluginInfo) string {
	var out []string
	for _, c := range p.Containers {
		cmd := c.Command.Value
		if !c.Command.UsesShell() {
			cmd = strings.Join(append([]string{c.Command.Value}, c.Command.Arguments[min(1, len(c.Command.Arguments)):]...), " ")
		}
		out = append(out, cmd)
	}
	return strings.Join(out, " | ")
}

func serviceShort(s pluginconfig.Service) string {
	return strings.ToLower(strings.TrimSuffix(string(s), "_SERVICE"))
}
