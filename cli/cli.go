package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/csiagent/csiagent/internal/version"
)

// Exit codes of Main.
const (
	ExitOK      = 0
	ExitProblem = 1
	ExitUsage   = 2
)

// command is one subcommand.
type command struct {
	summary string
	run     func(ctx context.Context, e *env, args []string) int
}

// env is what a command writes to.
type env struct {
	stdout, stderr io.Writer
}

func commands() map[string]command {
	return map[string]command{
		"check-config":   {"validate a plugin config directory and list its plugins", runCheckConfig},
		"plugins":        {"list the agent's plugins, or show one", runPlugins},
		"prepare":        {"give a container its CSI volumes", runPrepare},
		"cleanup":        {"take a container's CSI volumes away", runCleanup},
		"volumes":        {"list the volumes the agent tracks", runVolumes},
		"containers":     {"list the containers that have volumes", runContainers},
		"reconcile":      {"clean up every container not in --live", runReconcile},
		"reclaim":        {"reclaim free space of volumes now (csi-addons ReclaimSpace)", runReclaim},
		"group":          {"csi-addons volume groups: create, modify, delete, get, list", runGroup},
		"replication":    {"csi-addons replication: enable, disable, promote, demote, resync, info", runReplication},
		"group-snapshot": {"CSI group snapshots: create, get, delete", runGroupSnapshot},
		"fence":          {"csi-addons network fencing: cut networks off a plugin's storage (--list: the fenced ones)", runFence},
		"unfence":        {"csi-addons network fencing: give fenced networks their access back", runUnfence},
		"keyrotate":      {"csi-addons encryption key rotation of a volume published here", runKeyRotate},
		"expand":         {"grow a published volume on the node (NodeExpandVolume) after the backend grew it", runExpand},
		"oci-hook":       {"OCI runtime hook: create-runtime prepares, poststop cleans up", runOCIHook},
		"serve":          {"run the agent daemon", runServe},
		"version":        {"print the version", runVersion},
	}
}

// Main runs the command named by args[0] with the rest of args.
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	e := &env{stdout: stdout, stderr: stderr}
	cmds := commands()
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(stdout, cmds)
		if len(args) == 0 {
			return ExitUsage
		}
		return ExitOK
	}
	c, ok := cmds[args[0]]
	if !ok {
		fmt.Fprintf(stderr, "csi-agent: unknown command %q\n", args[0])
		usage(stderr, cmds)
		return ExitUsage
	}
	return c.run(ctx, e, args[1:])
}

func usage(w io.Writer, cmds map[string]command) {
	names := make([]string, 0, len(cmds))
	for n := range cmds {
		names = append(names, n)
	}
	sort.Strings(names)
	fmt.Fprintln(w, "usage: csi-agent COMMAND [flags]\n\ncommands:")
	for _, n := range names {
		fmt.Fprintf(w, "  %-14s %s\n", n, cmds[n].summary)
	}
	fmt.Fprintln(w, "\nRun 'csi-agent COMMAND -h' for a command's flags.")
}

// parseFlags parses a command's flags, printing usage on error. It returns
// the exit code to use when the command must stop (done is true).
func (e *env) parseFlags(fs *flag.FlagSet, args []string, argsUsage string) (code int, done bool) {
	fs.SetOutput(e.stderr)
	fs.Usage = func() {
		fmt.Fprintf(e.stderr, "usage: csi-agent %s [flags] %s\n", fs.Name(), argsUsage)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return ExitOK, true
		}
		return ExitUsage, true
	}
	return ExitOK, false
}

// outputFlag registers the --output flag shared by listing commands.
func outputFlag(fs *flag.FlagSet) *string {
	return fs.String("output", "table", "output format: table or json")
}

func checkOutput(format string) error {
	switch format {
	case "table", "json":
		return nil
	}
	return fmt.Errorf("--output %q: expected table or json", format)
}

func runVersion(_ context.Context, e *env, args []string) int {
	fs := flag.NewFlagSet("version", flag.ContinueOnError)
	if code, done := e.parseFlags(fs, args, ""); done {
		return code
	}
	fmt.Fprintln(e.stdout, "csi-agent", version.Version)
	return ExitOK
}

// orDash prints "-" for an empty cell.
func orDash(s string) string {
	if strings.TrimSpace(s) == "" {
		return "-"
	}
	return s
}
