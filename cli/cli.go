package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/internal/version"
)

// Exit codes of Main.
const (
	ExitOK      = 0
	ExitProblem = 1
	ExitUsage   = 2
)

// env is what a command reads from and writes to.
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
}

// exitCode ends a command that has already said what went wrong.
type exitCode int

func (c exitCode) Error() string { return fmt.Sprintf("exit status %d", int(c)) }

// runFunc is a command's body, after its flags are parsed: name is its
// path (e.g. "csi-agent group create") for messages, args its positional
// arguments. It prints its own errors and returns the exit code.
type runFunc func(ctx context.Context, name string, args []string) int

// command makes a command: setup declares its flags and returns its body.
func command(use, short string, args cobra.PositionalArgs, setup func(fs *pflag.FlagSet) runFunc) *cobra.Command {
	cmd := &cobra.Command{Use: use, Short: short, Args: args}
	run := setup(cmd.Flags())
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if code := run(cmd.Context(), cmd.CommandPath(), args); code != ExitOK {
			return exitCode(code)
		}
		return nil
	}
	return cmd
}

// group makes a command whose only job is to hold subcommands: run
// without one, it prints its help on stderr and exits 2; "help" prints it
// on stdout.
func (e *env) group(use, short, long string, subs ...*cobra.Command) *cobra.Command {
	cmd := &cobra.Command{Use: use, Short: short, Long: long, RunE: func(cmd *cobra.Command, args []string) error {
		switch {
		case len(args) == 1 && args[0] == "help":
			return cmd.Help()
		case len(args) > 0:
			return fmt.Errorf("unknown subcommand %q", args[0])
		}
		cmd.SetOut(e.stderr)
		if err := cmd.Help(); err != nil {
			return err
		}
		return exitCode(ExitUsage)
	}}
	cmd.AddCommand(subs...)
	return cmd
}

// noArgs refuses positional arguments: every value is given by a flag.
func noArgs(_ *cobra.Command, args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("unexpected arguments %q: every value is given by a flag (see -h)", args)
	}
	return nil
}

// newRoot is the whole command tree.
func (e *env) newRoot() *cobra.Command {
	root := e.group("csi-agent", "csi-agent: per-host CSI volume agent",
		"csi-agent runs CSI plugins on a host and gives containers their volumes.\nRun 'csi-agent COMMAND --help' for a command's flags.")
	root.AddCommand(
		command("check-config [flags] [DIR]", "validate a plugin config directory (default: serve's, "+agent.DefaultConfigDir+") and list its plugins", cobra.MaximumNArgs(1), e.checkConfigCmd),
		command("plugins [flags] [TYPE]", "list the agent's plugins, or show one", cobra.MaximumNArgs(1), e.pluginsCmd),
		command("prepare [flags]", "give a container its CSI volumes", noArgs, e.prepareCmd),
		command("cleanup [flags] [ID]", "take a container's CSI volumes away", cobra.ArbitraryArgs, e.cleanupCmd),
		command("volumes [flags]", "list the volumes the agent tracks", noArgs, e.volumesCmd),
		command("containers [flags]", "list the containers that have volumes", noArgs, e.containersCmd),
		e.volumeCmd(),
		e.clusterCmd(),
		command("reconcile [flags]", "clean up every container not in --live", noArgs, e.reconcileCmd),
		command("reclaim [flags]", "reclaim free space of volumes now (csi-addons ReclaimSpace)", noArgs, e.reclaimCmd),
		e.groupCmd(),
		e.replicationCmd(),
		e.groupSnapshotCmd(),
		e.snapshotCmd(),
		command("fence [flags]", "csi-addons network fencing: cut networks off a plugin's storage (--list: the fenced ones)", noArgs, e.fenceCmd),
		command("unfence [flags]", "csi-addons network fencing: give fenced networks their access back", noArgs, e.unfenceCmd),
		command("keyrotate [flags]", "csi-addons encryption key rotation of a volume published here", noArgs, e.keyRotateCmd),
		command("expand [flags]", "grow a published volume on the node (NodeExpandVolume) after the backend grew it", noArgs, e.expandCmd),
		e.ociHookCmd(),
		command("serve [flags]", "run the agent daemon", noArgs, e.serveCmd),
		command("version", "print the version", noArgs, func(*pflag.FlagSet) runFunc {
			return func(context.Context, string, []string) int {
				fmt.Fprintln(e.stdout, "csi-agent", version.Version)
				return ExitOK
			}
		}),
	)
	root.SilenceErrors, root.SilenceUsage = true, true
	root.SetOut(e.stdout)
	root.SetErr(e.stderr)
	// Made now, not at Execute, so that the tree is whole for tests; after
	// SetOut, which the completion command captures.
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	return root
}

// Main runs the command line args (without the program name).
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return (&env{stdin: os.Stdin, stdout: stdout, stderr: stderr}).run(ctx, args)
}

func (e *env) run(ctx context.Context, args []string) int {
	root := e.newRoot()
	if cmd, _, err := root.Find(args); err == nil {
		args = doubleDashLongFlags(cmd, args)
	}
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	var code exitCode
	switch {
	case err == nil:
		return ExitOK
	case errors.As(err, &code):
		return int(code)
	}
	// cobra's own: an unknown command or flag, a bad flag value, wrong
	// positional arguments.
	fmt.Fprintf(e.stderr, "%s: %v\nRun '%s --help' for usage.\n", cmd.CommandPath(), err, cmd.CommandPath())
	return ExitUsage
}

// doubleDashLongFlags rewrites -name to --name for each long flag of cmd
// (up to "--"): the command line was parsed by Go's flag package before,
// which took both, and scripts may still use one dash.
func doubleDashLongFlags(cmd *cobra.Command, args []string) []string {
	cmd.InitDefaultHelpFlag()
	out := make([]string, len(args))
	copy(out, args)
	for i, a := range out {
		if a == "--" {
			break
		}
		if len(a) < 3 || a[0] != '-' || a[1] == '-' {
			continue
		}
		name, _, _ := strings.Cut(a[1:], "=")
		if cmd.Flags().Lookup(name) != nil || cmd.InheritedFlags().Lookup(name) != nil {
			out[i] = "-" + a
		}
	}
	return out
}

// outputFlag registers the --output flag shared by listing commands.
func outputFlag(fs *pflag.FlagSet) *string {
	return fs.String("output", "table", "output format: table or json")
}

func checkOutput(format string) error {
	switch format {
	case "table", "json":
		return nil
	}
	return fmt.Errorf("--output %q: expected table or json", format)
}

// orDash prints "-" for an empty cell.
func orDash(s string) string {
	if strings.TrimSpace(s) == "" {
		return "-"
	}
	return s
}
