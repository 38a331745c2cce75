package pluginconfig

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// TestParseGolden parses every file in testdata/valid (the two examples of
// the Mesos doc verbatim among them) and compares the normalised result,
// defaults filled in, with its .golden file.
func TestParseGolden(t *testing.T) {
	files, err := filepath.Glob("testdata/valid/*.json")
	if err != nil || len(files) < 5 {
		t.Fatalf("want at least 5 golden inputs, got %d (%v)", len(files), err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			info, err := Parse(data)
			if err != nil {
				t.Fatalf("Parse: %v", err)
			}
			got, err := json.MarshalIndent(info, "", "  ")
			if err != nil {
				t.Fatal(err)
			}
			got = append(got, '\n')
			golden := strings.TrimSuffix(f, ".json") + ".golden"
			if *update {
				if err := os.WriteFile(golden, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("%v (run go test -update to create it)", err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("normalised config differs from %s:\n got: %s\nwant: %s", golden, got, want)
			}
			// The normalised form parses to itself.
			again, err := Parse(got)
			if err != nil {
				t.Fatalf("reparse of normalised form: %v", err)
			}
			if again2, _ := json.Marshal(again); !bytes.Equal(compact(t, got), again2) {
				t.Errorf("normalising twice changed the config: %s", again2)
			}
		})
	}
}

func compact(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestParseDefaultsAndAccessors(t *testing.T) {
	info, err := Parse([]byte(`{"type":"t","containers":[{"services":["NODE_SERVICE","CONTROLLER_SERVICE"],"command":{"value":"run"}}]}`))
	if err != nil {
		t.Fatal(err)
	}
	if info.Name != "default" {
		t.Errorf("name = %q, want default", info.Name)
	}
	if !info.Containers[0].Command.UsesShell() {
		t.Error("shell should default to true")
	}
	if !info.Managed() {
		t.Error("a config with containers is managed")
	}
	if got := info.Services(); len(got) != 2 || got[0] != ControllerService || got[1] != NodeService {
		t.Errorf("Services() = %v", got)
	}
	un, err := Parse([]byte(`{"type":"t","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/run/x/../p.sock"}],"csiagent":{"csi_addons_endpoint":"/run//addons.sock"}}`))
	if err != nil {
		t.Fatal(err)
	}
	if un.Managed() || un.Endpoints[0].Endpoint != "unix:///run/p.sock" || un.Endpoints[0].SocketPath() != "/run/p.sock" {
		t.Errorf("unmanaged endpoint not normalised: %+v", un.Endpoints[0])
	}
	if got := un.Settings.CSIAddonsEndpoint; got != "unix:///run/addons.sock" {
		t.Errorf("csi_addons_endpoint not normalised: %q", got)
	}
}

// TestInvalidFiles loads each bad file from a real directory, next to a good
// one, and checks the exact error an operator sees.
func TestInvalidFiles(t *testing.T) {
	const node = `"containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"}}]`
	const unmanaged = `"endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/run/p.sock"}]`
	cases := []struct {
		name, content, want string
	}{
		{"not json", `{"type": "a",`, "not valid JSON: unexpected end of file"},
		{"syntax error position", "{\n  \"type\": \"a\"\n  \"name\": \"b\"\n}", "not valid JSON: expected ',' or '}' after an object member at byte offset 18 (line 3, column 3)"},
		{"empty file", "", "not valid JSON: the file is empty"},
		{"two objects", `{"type":"a",` + node + `} {}`, "more than one JSON value: text after the first at byte offset 82 (line 1, column 83); a config file holds one CSIPluginInfo object"},
		{"array", `[]`, "expected an object, got an array"},
		{"type missing", `{` + node + `}`, `type: required: the plugin type that volumes name as plugin_name, e.g. "org.example.csi"`},
		{"type with slash", `{"type":"a/b",` + node + `}`, `type: "a/b" has the character '/'; use letters, digits, '.', '_' and '-' (it is used as a directory name)`},
		{"type dotdot", `{"type":"..",` + node + `}`, `type: ".." is not allowed (it is used as a directory name)`},
		{"name too long", `{"type":"a","name":"` + strings.Repeat("n", 129) + `",` + node + `}`, "name: longer than 128 bytes"},
		{"type is number", `{"type":7,` + node + `}`, "type: expected a string, got number 7"},
		{"unknown field typo", `{"type":"a","target_path_rot":"/x",` + node + `}`, `target_path_rot: unknown field; did you mean "target_path_root"?`},
		{"unknown nested field", `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p","argumnets":["x"]}}]}`, `containers[0].command.argumnets: unknown field; did you mean "arguments"?`},
		{"unknown settings field", `{"type":"a",` + node + `,"csiagent":{"foo":1}}`, "csiagent.foo: unknown field; known fields: csi_addons_endpoint, csi_addons_services, key_rotation, reclaim_space"},
		{"unknown addon service", `{"type":"a",` + node + `,"csiagent":{"csi_addons_services":["reclaimspace.ReclaimSpaceNode","reclaim"]}}`, `csiagent.csi_addons_services[1]: "reclaim" is not a service csiagent uses (one of reclaimspace.ReclaimSpaceNode, reclaimspace.ReclaimSpaceController, encryptionkeyrotation.EncryptionKeyRotationController, volumegroup.Controller, replication.Controller, fence.FenceController, csi.v1.GroupController)`},
		{"addon service twice", `{"type":"a",` + node + `,"csiagent":{"csi_addons_services":["volumegroup.Controller","volumegroup.Controller"]}}`, `csiagent.csi_addons_services[1]: "volumegroup.Controller" is listed twice`},
		{"both containers and endpoints", `{"type":"a",` + node + `,"endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"/s"}]}`, "both containers and endpoints are set; a plugin is either managed (containers) or unmanaged (endpoints)"},
		{"neither", `{"type":"a"}`, "neither containers nor endpoints is set; a managed plugin needs containers, an unmanaged one endpoints"},
		{"no services", `{"type":"a","containers":[{"command":{"value":"p"}}]}`, "containers[0].services: required: list CONTROLLER_SERVICE and/or NODE_SERVICE"},
		{"unknown service", `{"type":"a","containers":[{"services":["NODE"],"command":{"value":"p"}}]}`, `containers[0].services[0]: unknown service "NODE"; expected CONTROLLER_SERVICE or NODE_SERVICE`},
		{"UNKNOWN service", `{"type":"a","containers":[{"services":["UNKNOWN","NODE_SERVICE"],"command":{"value":"p"}}]}`, "containers[0].services[0]: UNKNOWN is not a service; expected CONTROLLER_SERVICE or NODE_SERVICE"},
		{"no command", `{"type":"a","containers":[{"services":["NODE_SERVICE"]}]}`, "containers[0].command: required: the command that starts the plugin"},
		{"empty command", `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":" "}}]}`, "containers[0].command.value: required: the executable (shell: false) or shell command line (shell: true)"},
		{"shell as string", `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p","shell":"false"}}]}`, `containers[0].command.shell: expected true or false, got string "false"`},
		{"arguments with shell", `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p","arguments":["p","-v"]}}]}`, `containers[0].command.arguments: only used with "shell": false; with a shell, put the arguments in value`},
		{"no node service", `{"type":"a","containers":[{"services":["CONTROLLER_SERVICE"],"command":{"value":"p"}}]}`, "containers: no NODE_SERVICE: csiagent stages and publishes volumes through the node service, so one of the containers must serve it"},
		{"service served twice", `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"}},{"services":["NODE_SERVICE"],"command":{"value":"q"}}]}`, "containers[1].services[0]: NODE_SERVICE is already served by containers[0]; each service has one provider"},
		{"container image", `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"},"container":{"type":"DOCKER"}}]}`, "containers[0].container: container images are not supported: csiagent runs managed plugins as host processes from command"},
		{"secret env", `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p","environment":{"variables":[{"name":"K","type":"SECRET","secret":{}}]}}}]}`, `containers[0].command.environment.variables[0].type: "SECRET" is not supported; only VALUE variables are`},
		{"bad env name", `{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p","environment":{"variables":[{"name":"A=B","value":"x"}]}}}]}`, `containers[0].command.environment.variables[0].name: must be a non-empty name without '=' or NUL, got "A=B"`},
		{"relative endpoint", `{"type":"a","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"run/csi.sock"}]}`, `endpoints[0].endpoint: "run/csi.sock" must be an absolute socket path (unix:///path or /path)`},
		{"tcp endpoint", `{"type":"a","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"tcp://10.0.0.1:9000"}]}`, `endpoints[0].endpoint: "tcp://10.0.0.1:9000" is not a unix socket; only unix:// endpoints are supported`},
		{"endpoint without service", `{"type":"a","endpoints":[{"endpoint":"/s"}]}`, "endpoints[0].csi_service: required: CONTROLLER_SERVICE or NODE_SERVICE"},
		{"relative target_path_root", `{"type":"a",` + node + `,"target_path_root":"mnt"}`, `target_path_root: must be an absolute path, got "mnt"`},
		{"bad duration", `{"type":"a",` + node + `,"csiagent":{"reclaim_space":{"interval":"weekly"}}}`, `csiagent.reclaim_space.interval: expected a duration such as "10m" or "168h", got "weekly"`},
		{"zero timeout", `{"type":"a",` + node + `,"csiagent":{"reclaim_space":{"timeout":"0s"}}}`, `csiagent.reclaim_space.timeout: must be greater than 0 (set interval to "0" to disable reclaim)`},
		{"zero key rotation timeout", `{"type":"a",` + node + `,"csiagent":{"key_rotation":{"timeout":"0s"}}}`, `csiagent.key_rotation.timeout: must be greater than 0 (set interval to "0" to disable key rotation)`},
		{"fractional max_concurrent", `{"type":"a",` + node + `,"csiagent":{"reclaim_space":{"max_concurrent":1.5}}}`, "csiagent.reclaim_space.max_concurrent: expected an integer, got 1.5"},
		{"addons endpoint on a managed plugin", `{"type":"a",` + node + `,"csiagent":{"csi_addons_endpoint":"/run/a.sock"}}`,
			"csiagent.csi_addons_endpoint: for unmanaged plugins only: a managed plugin's command is told its csi-addons socket in $CSIADDONS_ENDPOINT"},
		{"addons endpoint not unix", `{"type":"a",` + unmanaged + `,"csiagent":{"csi_addons_endpoint":"tcp://h:1"}}`,
			`csiagent.csi_addons_endpoint: "tcp://h:1" is not a unix socket; only unix:// endpoints are supported`},
		{"addons endpoint relative", `{"type":"a",` + unmanaged + `,"csiagent":{"csi_addons_endpoint":"run/a.sock"}}`,
			`csiagent.csi_addons_endpoint: "run/a.sock" must be an absolute socket path (unix:///path or /path)`},
		{"addons endpoint is the CSI endpoint", `{"type":"a",` + unmanaged + `,"csiagent":{"csi_addons_endpoint":"unix:///run//p.sock"}}`,
			"csiagent.csi_addons_endpoint: unix:///run/p.sock is also a CSI endpoint; leave csi_addons_endpoint out when csi-addons is served on the CSI socket"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			writeFile(t, dir, "good.json", `{"type":"good",`+node+`}`)
			writeFile(t, dir, "bad.json", tc.content)
			set, err := Load(dir)
			if err != nil {
				t.Fatalf("Load: %v", err)
			}
			if len(set.Errors) != 1 {
				t.Fatalf("want 1 file error, got %v", set.Errors)
			}
			want := filepath.Join(dir, "bad.json") + ": " + tc.want
			if got := set.Errors[0].Error(); got != want {
				t.Errorf("error\n got: %s\nwant: %s", got, want)
			}
			if _, ok := set.Plugins["good"]; !ok || len(set.Plugins) != 1 {
				t.Errorf("the good file must load despite the bad one; plugins: %v", set.Plugins)
			}
		})
	}
}

func TestLoadDirectory(t *testing.T) {
	const node = `"containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"}}]`
	t.Run("empty directory is valid", func(t *testing.T) {
		set, err := Load(t.TempDir())
		if err != nil || len(set.Plugins) != 0 || len(set.Errors) != 0 {
			t.Fatalf("Load(empty) = %+v, %v", set, err)
		}
	})
	t.Run("missing directory is an error", func(t *testing.T) {
		_, err := Load(filepath.Join(t.TempDir(), "nope"))
		if err == nil || !strings.Contains(err.Error(), "reading plugin config directory") {
			t.Fatalf("want a directory error, got %v", err)
		}
	})
	t.Run("skips dotfiles and directories; follows symlinks", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, ".a.json.swp", "garbage")
		writeFile(t, dir, "..data", "garbage")
		if err := os.Mkdir(filepath.Join(dir, "sub"), 0o755); err != nil {
			t.Fatal(err)
		}
		other := t.TempDir()
		writeFile(t, other, "real.json", `{"type":"linked",`+node+`}`)
		if err := os.Symlink(filepath.Join(other, "real.json"), filepath.Join(dir, "linked.json")); err != nil {
			t.Fatal(err)
		}
		set, err := Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(set.Errors) != 0 || len(set.Plugins) != 1 || set.Plugins["linked"] == nil {
			t.Fatalf("got plugins %v, errors %v", set.Plugins, set.Errors)
		}
	})
	t.Run("dangling symlink is reported", func(t *testing.T) {
		dir := t.TempDir()
		if err := os.Symlink("/nonexistent/x.json", filepath.Join(dir, "x.json")); err != nil {
			t.Fatal(err)
		}
		set, err := Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(set.Errors) != 1 || !strings.Contains(set.Errors[0].Error(), "x.json: cannot read") {
			t.Fatalf("errors = %v", set.Errors)
		}
	})
	t.Run("oversized file", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "big.json", `{"type":"a","name":"`+strings.Repeat(" ", maxFileSize)+`"}`)
		set, _ := Load(dir)
		if len(set.Errors) != 1 || !strings.Contains(set.Errors[0].Error(), "larger than 1048576 bytes") {
			t.Fatalf("errors = %v", set.Errors)
		}
	})
	t.Run("duplicate type names both files", func(t *testing.T) {
		dir := t.TempDir()
		writeFile(t, dir, "a.json", `{"type":"dup",`+node+`}`)
		writeFile(t, dir, "b.json", `{"type":"dup","name":"other",`+node+`}`)
		set, err := Load(dir)
		if err != nil {
			t.Fatal(err)
		}
		if p := set.Plugins["dup"]; p == nil || p.File != filepath.Join(dir, "a.json") {
			t.Fatalf("the first file by name should win: %+v", set.Plugins)
		}
		want := filepath.Join(dir, "b.json") + `: type: "dup" is already defined in ` + filepath.Join(dir, "a.json") + "; each plugin type may be defined in one file only"
		if len(set.Errors) != 1 || set.Errors[0].Error() != want {
			t.Fatalf("errors = %v\nwant %s", set.Errors, want)
		}
	})
}

func writeFile(t *testing.T, dir, name, content string) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestLoadSkipsEditorCopies: an editor's backup ("a.json~") and autosave
// ("#a.json#") of a config are not read: they would define its type again
// (the first by name, "#a.json#", would even take it at a start).
func TestLoadSkipsEditorCopies(t *testing.T) {
	dir := t.TempDir()
	writeFile(t, dir, "a.json", pluginJSON("a", "v1"))
	writeFile(t, dir, "a.json~", pluginJSON("a", "backup"))
	writeFile(t, dir, "#a.json#", pluginJSON("a", "autosave"))
	set, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(set.Errors) > 0 || len(set.Plugins) != 1 || set.Plugins["a"].File != filepath.Join(dir, "a.json") {
		t.Fatalf("plugins %v, errors %v; want a from a.json alone", set.Plugins, set.Errors)
	}
}
