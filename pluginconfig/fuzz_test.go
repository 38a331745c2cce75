package pluginconfig

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// FuzzParse feeds arbitrary bytes to the loader. It must never panic, and
// whatever it accepts must be safe to use (type and name as path
// components, unix endpoints) and stable (normalising twice changes
// nothing).
func FuzzParse(f *testing.F) {
	files, _ := filepath.Glob("testdata/valid/*.json")
	for _, name := range files {
		data, err := os.ReadFile(name)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	for _, s := range []string{
		`{"type":"a","endpoints":[{"csi_service":2,"endpoint":"unix:///x"}]}`,
		`{"type":"..","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p"}}]}`,
		`{"type":"a","containers":[{"services":["NODE_SERVICE"],"command":{"value":"p","shell":false,"arguments":[]}}],"csiagent":{"reclaim_space":{"interval":"1h","max_concurrent":3}}}`,
		`[1,2,{"type":null}]`, `{"type":"a","name":"\u002f"}`, ``, `null`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		info, err := Parse(data)
		if err != nil {
			if info != nil {
				t.Fatal("Parse returned a config with an error")
			}
			return
		}
		for _, c := range []string{info.Type, info.Name} {
			if c == "" || c == "." || c == ".." || strings.ContainsAny(c, "/\x00") {
				t.Fatalf("accepted unsafe path component %q", c)
			}
		}
		if !info.Serves(NodeService) {
			t.Fatal("accepted a plugin without a node service")
		}
		for _, e := range info.Endpoints {
			if !strings.HasPrefix(e.Endpoint, "unix:///") {
				t.Fatalf("endpoint not normalised: %q", e.Endpoint)
			}
		}
		out, err := json.Marshal(info)
		if err != nil {
			t.Fatalf("marshal accepted config: %v", err)
		}
		again, err := Parse(out)
		if err != nil {
			t.Fatalf("normalised form %s does not parse: %v", out, err)
		}
		if !info.Equal(again) {
			again2, _ := json.Marshal(again)
			t.Fatalf("normalising twice changed the config:\n%s\n%s", out, again2)
		}
	})
}
