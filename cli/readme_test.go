package cli

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// TestREADMECommands: every csi-agent command line the README shows
// (and the hooks of the example bundle it points to) parses. Synopses (the CLI reference, inline `csi-agent ...` spans) name
// existing commands and flags, with values where flags take them and the
// positional arguments their command accepts; examples (shell blocks, the
// OCI hook's args) parse exactly as written. So the docs cannot drift
// from the binary.
func TestREADMECommands(t *testing.T) {
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	e := &env{stdin: strings.NewReader(""), stdout: io.Discard, stderr: io.Discard}

	// The CLI reference's rows are whole synopses; elsewhere a span may
	// just name a command.
	rows := 0
	for _, m := range regexp.MustCompile("(?m)(^\\| )?`(csi-agent(?: [^`]*)?)`").FindAllStringSubmatch(readme, -1) {
		row := m[1] != ""
		if row {
			rows++
		}
		for _, words := range expandAlternatives(strings.Fields(strings.ReplaceAll(m[2], `\|`, "|"))[1:]) {
			if err := checkSynopsis(e.newRoot(), words, row); err != nil {
				t.Errorf("README: `%s` (as %q): %v", m[2], words, err)
			}
		}
	}
	if rows < 15 {
		t.Fatalf("found only %d rows of the CLI reference in the README: did its format change?", rows)
	}

	var examples [][]string
	for _, block := range regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(readme, -1) {
		for _, line := range strings.Split(block[1], "\n") {
			if strings.HasPrefix(line, "csi-agent ") {
				examples = append(examples, strings.Fields(line)[1:])
			}
		}
	}
	hooks := regexp.MustCompile(`"args": (\[[^\]]*\])`).FindAllStringSubmatch(readme, -1)
	if len(hooks) != 2 {
		t.Fatalf("found %d hook args in the README, want 2 (createRuntime and poststop)", len(hooks))
	}
	for _, h := range hooks {
		var argv []string
		if err := json.Unmarshal([]byte(h[1]), &argv); err != nil || len(argv) == 0 || argv[0] != "csi-agent" {
			t.Fatalf("hook args %s: %v", h[1], err)
		}
		examples = append(examples, argv[1:])
	}
	// The example bundle the README points to.
	var bundle struct {
		Hooks map[string][]struct {
			Args []string `json:"args"`
		} `json:"hooks"`
	}
	if b, err := os.ReadFile("../testdata/oci-bundle/config.json"); err != nil || json.Unmarshal(b, &bundle) != nil {
		t.Fatalf("reading the example bundle: %v", err)
	}
	for _, stage := range []string{"createRuntime", "poststop"} {
		if len(bundle.Hooks[stage]) != 1 || len(bundle.Hooks[stage][0].Args) == 0 {
			t.Fatalf("the example bundle has no %s hook", stage)
		}
		examples = append(examples, bundle.Hooks[stage][0].Args[1:])
	}
	for _, args := range examples {
		root := e.newRoot()
		cmd, rest, err := root.Find(args)
		if err == nil {
			err = cmd.ParseFlags(rest)
		}
		if err == nil {
			err = cmd.ValidateArgs(cmd.Flags().Args())
		}
		if err != nil || !cmd.Runnable() {
			t.Errorf("README example `csi-agent %s` does not parse: %v", strings.Join(args, " "), err)
		}
	}
}

// expandAlternatives makes one word list per choice of each a|b word
// (a lone | between flags stays: checkSynopsis skips it).
func expandAlternatives(words []string) [][]string {
	out := [][]string{nil}
	for _, w := range words {
		alts := []string{w}
		if w != "|" && strings.Contains(w, "|") {
			alts = strings.Split(w, "|")
		}
		var next [][]string
		for _, prefix := range out {
			for _, a := range alts {
				next = append(next, append(slices.Clone(prefix), a))
			}
		}
		out = next
	}
	return out
}

// checkSynopsis checks one synopsis: subcommand words, then --flags (each
// taking the next word as its value unless boolean) and placeholders for
// positional arguments, whose number is checked if whole is set or any is
// given. Brackets, ellipses, lone | and [flags] are notation.
func checkSynopsis(root *cobra.Command, words []string, whole bool) error {
	cmd := root
	var positionals []string
	for i := 0; i < len(words); i++ {
		w := strings.Trim(words[i], "[]…")
		switch {
		case w == "" || w == "|" || w == "flags":
			continue
		case len(positionals) == 0 && !strings.HasPrefix(w, "-") && cmd.HasSubCommands():
			sub, _, err := cmd.Find([]string{w})
			if err != nil || sub == cmd {
				return errors.New("no command " + cmd.CommandPath() + " " + w)
			}
			cmd = sub
		case strings.HasPrefix(w, "--"):
			name, _, hasValue := strings.Cut(w[2:], "=")
			cmd.InitDefaultHelpFlag()
			f := cmd.Flags().Lookup(name)
			if f == nil {
				return errors.New(cmd.CommandPath() + " has no flag --" + name)
			}
			if f.NoOptDefVal == "" && !hasValue {
				if i++; i >= len(words) {
					return errors.New("--" + name + " needs a value")
				}
			}
		default:
			positionals = append(positionals, w)
		}
	}
	if (whole || len(positionals) > 0) && cmd != root && !cmd.HasSubCommands() {
		return cmd.ValidateArgs(positionals)
	}
	return nil
}
